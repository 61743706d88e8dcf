#!/usr/bin/env bash
# Compares two nrtxn builds on one scenario in alternating pairs, the way to see a change's
# cost on a noisy machine: each pair starts a fresh server of build A, runs the scenario,
# then the same for build B; it prints each run and, at the end, the median ratio B/A of
# decisions/s and of the server's CPU per decision (utime + stime from /proc/PID/stat).
# Both are read over a window inside each run, from 1.5 s after it starts to 0.5 s
# before its end, with the decisions from the server's `nrtxn_decisions_total` (journal
# entries: on orders, about nine per order; on batch, one per entry): the benchmark's
# load before the window and its check after it (on fire-and-forget, a poll of every
# key) are not counted.
#
#   scripts/pair-bench.sh OLD_NRTXN NEW_NRTXN [SCENARIO] [CONNECTIONS] [PAIRS]
#
# Defaults: hot, 64 connections, 6 pairs of 6 s runs. NRTXN_BENCH names the nrtxn-bench
# binary (default: target/release/nrtxn-bench, built if missing). Servers listen on
# 127.0.0.1 and each run's data dir is removed after it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  echo "usage: scripts/pair-bench.sh OLD_NRTXN NEW_NRTXN [SCENARIO] [CONNECTIONS] [PAIRS]" >&2
  exit 2
fi
old=$1 new=$2 scenario=${3:-hot} conns=${4:-64} pairs=${5:-6}
bench=${NRTXN_BENCH:-target/release/nrtxn-bench}
[ -x "$bench" ] || cargo build --release --quiet -p nrtxn-bench
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# The server's decisions so far, from its metrics.
decisions() {
  curl -sf "$1/metrics" | awk '/^nrtxn_decisions_total/ { n += $2 } END { print n + 0 }'
}

# One run: LABEL BINARY; appends "LABEL decisions/s cpu_us_per_decision" to $out.
run() {
  local label=$1 bin=$2 d pid base bench_pid c0 c1 n0 n1 t0 t1
  d=$(mktemp -d)
  "$bin" serve --listen 127.0.0.1:0 --data-dir "$d/data" > "$d/out" 2> "$d/log" &
  pid=$!
  for _ in $(seq 200); do grep -q "listening on" "$d/out" 2> /dev/null && break; sleep 0.05; done
  base=$(sed -n 's/^nrtxn listening on //p' "$d/out")
  "$bench" run --target "$base" --system nrtxn --scenario "$scenario" --connections "$conns" \
    --duration 6 --no-check > /dev/null 2> "$d/bench.err" &
  bench_pid=$!
  sleep 1.5
  c0=$(awk '{print $14 + $15}' "/proc/$pid/stat") n0=$(decisions "$base") t0=$(date +%s.%N)
  sleep 4
  c1=$(awk '{print $14 + $15}' "/proc/$pid/stat") n1=$(decisions "$base") t1=$(date +%s.%N)
  if ! wait "$bench_pid"; then
    cat "$d/bench.err" >&2
    kill "$pid"
    exit 1
  fi
  kill "$pid"
  wait "$pid" 2> /dev/null || true
  python3 - "$label" "$c0" "$c1" "$n0" "$n1" "$t0" "$t1" "$(getconf CLK_TCK)" >> "$out" << 'EOF'
import sys
label, c0, c1, n0, n1, t0, t1, hz = sys.argv[1:9]
n = max(1.0, float(n1) - float(n0))
cpu_us = (float(c1) - float(c0)) / float(hz) * 1e6
print(label, round(n / (float(t1) - float(t0))), round(cpu_us / n, 2))
EOF
  tail -1 "$out"
  rm -rf "$d"
}

for _ in $(seq "$pairs"); do
  run old "$old"
  run new "$new"
done
python3 - "$out" "$scenario" << 'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
for col, name in ((1, "decisions/s"), (2, "server CPU per decision")):
    a = [float(r[col]) for r in rows if r[0] == "old"]
    b = [float(r[col]) for r in rows if r[0] == "new"]
    ratios = sorted(y / x for x, y in zip(a, b))
    print(f"{sys.argv[2]}: {name}: new/old median {statistics.median(ratios):.3f} "
          f"(from {ratios[0]:.3f} to {ratios[-1]:.3f}, {len(ratios)} pairs)")
EOF
