#!/usr/bin/env bash
# What one decision costs the server: CPU µs and context switches per request, measured
# with `perf stat` on the server process (all its threads) while nrtxn-bench drives one
# scenario against it. The HTTP ceiling (a server that parses and answers, and stores
# nothing) is measured the same way, in the same sitting, so the two can be compared.
#
#   scripts/path-cost.sh [--scenario hot-sales] [--duration 8] [--runs 2] [--systems "nrtxn ceiling"]
#
# The measure is a window inside the run: from 1.5 s after the benchmark starts (its
# items loaded, the loop running) to 0.5 s before its end, so neither the load before
# it nor the check after it (nor, on fire-and-forget, the polls of every key that count
# what was decided) is counted. Requests in the window: the run's throughput times the
# window's length.
# Prints one line per run: system, scenario, requests/s, CPU µs per request (and its
# user and kernel parts, from /proc), context switches per request. The nrtxn server keeps its data in a fresh folder under /tmp
# (on disk, as a user's would be). Everything listens on loopback and is stopped at the
# end. NRTXN_BIN picks another nrtxn binary (to compare a change with its predecessor).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

scenario=hot-sales
secs=8
runs=2
systems="nrtxn ceiling"
while [ $# -gt 0 ]; do
  case $1 in
    --scenario) scenario=$2; shift 2 ;;
    --duration) secs=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --systems) systems=$2; shift 2 ;;
    *) echo "usage: scripts/path-cost.sh [--scenario S] [--duration SECS] [--runs N] [--systems \"nrtxn ceiling\"]" >&2; exit 2 ;;
  esac
done
command -v perf > /dev/null || { echo "path-cost.sh: perf is not installed" >&2; exit 1; }
[ "$secs" -ge 4 ] || { echo "path-cost.sh: --duration must be at least 4 (the window is 2 s shorter)" >&2; exit 2; }
window=$((secs - 2))

target_dir=${CARGO_TARGET_DIR:-$root/target}
if [ -z "${NRTXN_BIN:-}" ]; then
  cargo build --release --quiet -p nrtxn -p nrtxn-bench
fi
nrtxn=${NRTXN_BIN:-$target_dir/release/nrtxn}
bench=$target_dir/release/nrtxn-bench
tmp=$(mktemp -d /tmp/nrtxn-cost.XXXXXX)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2> /dev/null && wait "$pid" 2> /dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

stock=()
# `hot` with stock far beyond what a run can sell, for a bench without `hot-sales`.
[ -n "${NRTXN_COST_STOCK:-}" ] && stock=(--stock "$NRTXN_COST_STOCK")

for run in $(seq "$runs"); do
  for system in $systems; do
    case $system in
      nrtxn) cmd=("$nrtxn" serve --listen 127.0.0.1:0 --data-dir "$tmp/data-$run") ;;
      ceiling) cmd=("$bench" peer --kind ceiling --listen 127.0.0.1:0) ;;
      *) echo "path-cost.sh: unknown system $system" >&2; exit 2 ;;
    esac
    RUST_LOG=warn "${cmd[@]}" > "$tmp/out" 2> "$tmp/err" &
    pid=$!
    base=""
    for _ in $(seq 200); do
      base=$(sed -n 's/^.*listening on //p' "$tmp/out" | head -1)
      [ -n "$base" ] && break
      sleep 0.05
    done
    [ -n "$base" ] || { cat "$tmp/err" >&2; exit 1; }
    for _ in $(seq 100); do curl -sf "$base/readyz" > /dev/null 2>&1 && break; sleep 0.05; done
    check=()
    [ "$system" = ceiling ] && check=(--no-check)
    "$bench" run --target "$base" --system "$system" --scenario "$scenario" "${stock[@]}" \
      --duration "$secs" --json "$tmp/run.json" "${check[@]}" > /dev/null 2> "$tmp/bench.err" &
    bench_pid=$!
    sleep 1.5
    read -r -a before < <(cut -d' ' -f14,15 "/proc/$pid/stat")
    t0=$(date +%s.%N)
    perf stat -x, -e task-clock,context-switches -p "$pid" -o "$tmp/perf" -- sleep "$window"
    t1=$(date +%s.%N)
    read -r -a after < <(cut -d' ' -f14,15 "/proc/$pid/stat")
    wait "$bench_pid" || { cat "$tmp/bench.err" >&2; exit 1; }
    ticks=$(getconf CLK_TCK)
    kill "$pid"
    wait "$pid" 2> /dev/null || true
    pid=""
    python3 - "$tmp/perf" "$tmp/run.json" "$system" "$scenario" "$t0" "$t1" \
      $(( (after[0] - before[0]) * 1000000 / ticks )) $(( (after[1] - before[1]) * 1000000 / ticks )) << 'EOF'
import json, sys
perf, run, system, scenario = sys.argv[1:5]
window_s = float(sys.argv[6]) - float(sys.argv[5])
user_us, sys_us = int(sys.argv[7]), int(sys.argv[8])
vals = {}
for line in open(perf):
    parts = line.strip().split(",")
    if len(parts) > 2 and parts[0] and parts[0][0].isdigit():
        vals[parts[2]] = float(parts[0])
r = json.load(open(run))
n = r["throughput_rps"] * window_s
print(f"{system:8} {scenario:10} {r['throughput_rps']:>9.0f}/s  cpu {vals['task-clock'] * 1000 / n:6.1f} us/req"
      f" (user {user_us / n:5.1f}, kernel {sys_us / n:5.1f})"
      f"  cs {vals['context-switches'] / n:5.2f}/req  ({n:.0f} in the window, p99 {r['p99_ms']:.1f} ms"
      + (f", {r['entries_per_sync']} entries/sync" if r.get("entries_per_sync") else "") + ")")
EOF
  done
done
