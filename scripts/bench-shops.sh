#!/usr/bin/env bash
# A multi-shop load driven by another tool than nrtxn-bench: wrk (Debian's package,
# installed if missing) sends respond=true decrements spread uniformly over SHOPS shops
# of ITEMS items each (bench/shops.lua), 64 connections, 2 threads, against nrtxn on the
# embedded default and then against the HTTP ceiling (nrtxn-bench's `peer --kind
# ceiling`: parses and answers, stores nothing), in turn, ROUNDS times. Any answer other
# than 2xx counts as a failure. Prints each run (requests/s, the server's CPU µs per
# request from /proc, failures) and the median ratio nrtxn / ceiling.
#
#   scripts/bench-shops.sh [shops=100] [items=100] [seconds=10] [rounds=2]
#
# NRTXN_BIN names the nrtxn binary (default: the release build, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
shops=${1:-100} items=${2:-100} secs=${3:-10} rounds=${4:-2}
command -v wrk > /dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
bin=${NRTXN_BIN:-target/release/nrtxn}
[ -x "$bin" ] || cargo build --release --quiet -p nrtxn
[ -x target/release/nrtxn-bench ] || cargo build --release --quiet -p nrtxn-bench
dir=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2> /dev/null; rm -rf "$dir"' EXIT

# One run: SYSTEM; appends "SYSTEM requests/s cpu_us_per_request failures" to $dir/runs.
run() {
  local system=$1 base t0 t1 rps
  rm -rf "$dir/data"
  if [ "$system" = nrtxn ]; then
    RUST_LOG=warn "$bin" serve --listen 127.0.0.1:0 --data-dir "$dir/data" > "$dir/out" 2> "$dir/err" &
  else
    target/release/nrtxn-bench peer --kind ceiling --listen 127.0.0.1:0 > "$dir/out" 2> "$dir/err" &
  fi
  pid=$!
  for _ in $(seq 100); do grep -q "listening on" "$dir/out" 2> /dev/null && break; sleep 0.1; done
  base=$(grep -o 'http://[0-9.:]*' "$dir/out" | head -1)
  [ -n "$base" ] || { cat "$dir/err"; exit 1; }
  for _ in $(seq 300); do curl -sf "$base/readyz" > /dev/null && break; sleep 0.1; done
  # The items, one PUT per shop.
  for s in $(seq "$shops"); do
    seq "$items" | awk -v ORS= 'BEGIN { print "{\"items\":[" }
      { if (NR > 1) print ","; printf "{\"item\":\"i%d\",\"stock\":1000000000}", $1 }
      END { print "]}" }' |
      curl -sf -XPUT "$base/v1/shops/s$s/items" -H "content-type: application/json" \
        --data-binary @- > /dev/null
  done
  t0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  SHOPS=$shops ITEMS=$items wrk -t2 -c64 -d"${secs}s" -s bench/shops.lua "$base" > "$dir/wrk"
  t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  kill "$pid"
  wait "$pid" 2> /dev/null || true
  pid=
  rps=$(awk '/^Requests\/sec/ { print $2 }' "$dir/wrk")
  python3 - "$system" "$rps" "$t0" "$t1" "$(getconf CLK_TCK)" "$secs" "$(cat "$dir/wrk")" \
    >> "$dir/runs" << 'PY'
import re, sys
system, rps, t0, t1, hz, secs, out = sys.argv[1:8]
rps = float(rps)
cpu_us = (float(t1) - float(t0)) / float(hz) * 1e6 / max(1.0, rps * float(secs))
m = re.search(r"non-2xx (\d+), socket errors (\d+); p50 ([\d.]+) ms, p99 ([\d.]+) ms", out)
print(system, round(rps), round(cpu_us, 1), int(m[1]) + int(m[2]), m[3], m[4])
PY
  tail -1 "$dir/runs" | awk '{ printf "%-8s %8s requests/s  %6s µs CPU/request  failures %s  p50 %s ms  p99 %s ms\n", $1, $2, $3, $4, $5, $6 }'
}

echo "wrk: 64 connections, 2 threads, ${secs}s; $shops shops x $items items, uniform"
for _ in $(seq "$rounds"); do
  run nrtxn
  run ceiling
done
python3 - "$dir/runs" << 'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
a = [float(r[1]) for r in rows if r[0] == "nrtxn"]
b = [float(r[1]) for r in rows if r[0] == "ceiling"]
fails = sum(int(r[3]) for r in rows if r[0] == "nrtxn")
ratios = sorted(x / y for x, y in zip(a, b))
print(f"nrtxn / ceiling: median {statistics.median(ratios):.2f} "
      f"(from {ratios[0]:.2f} to {ratios[-1]:.2f}, {len(ratios)} pairs); nrtxn failures {fails}")
PY
