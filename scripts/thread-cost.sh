#!/usr/bin/env bash
# What each of the server's threads costs per decision: context switches (voluntary:
# it slept; involuntary: it was preempted) and CPU µs, read from /proc/PID/task/*/
# before and after one run of nrtxn-bench against a fresh server. Threads are grouped
# by name. The way to see where the wake-ups of a decision go (a hand-off between
# threads that sleeps is one or two switches) and to compare a change with its
# predecessor (NRTXN_BIN).
#
#   scripts/thread-cost.sh [SCENARIO] [SECONDS]      (defaults: hot-sales 6)
#
# A 1-second warm-up run comes first and is not counted. The measure is a window inside
# the run, from 1.5 s after it starts to 0.5 s before its end: neither the load before
# it nor the check after it (nor, on fire-and-forget, the polls of every key that count
# what was decided) is counted. Decisions in the window: the run's throughput times the
# window's length. The data dir is a fresh folder under /tmp, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
scenario=${1:-hot-sales}
secs=${2:-6}
[ "$secs" -ge 4 ] || { echo "thread-cost.sh: SECONDS must be at least 4 (the window is 2 s shorter)" >&2; exit 2; }
target_dir=${CARGO_TARGET_DIR:-target}
[ -n "${NRTXN_BIN:-}" ] || cargo build --release --quiet -p nrtxn -p nrtxn-bench
nrtxn=${NRTXN_BIN:-$target_dir/release/nrtxn}
bench=$target_dir/release/nrtxn-bench
d=$(mktemp -d /tmp/nrtxn-threads.XXXXXX)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2> /dev/null; rm -rf "$d"' EXIT
RUST_LOG=warn "$nrtxn" serve --listen 127.0.0.1:0 --data-dir "$d/data" > "$d/out" 2> "$d/log" &
pid=$!
for _ in $(seq 200); do grep -q "listening on" "$d/out" 2> /dev/null && break; sleep 0.05; done
base=$(sed -n 's/^nrtxn listening on //p' "$d/out")
[ -n "$base" ] || { cat "$d/log" >&2; exit 1; }
# One line per thread: id, name, voluntary and involuntary switches, CPU ticks.
snap() {
  for t in /proc/"$pid"/task/*; do
    printf '%s %s %s %s\n' "${t##*/}" "$(tr ' ' '_' < "$t/comm")" \
      "$(awk '/^voluntary_ctxt/ {v = $2} /^nonvoluntary_ctxt/ {n = $2} END {print v, n}' "$t/status")" \
      "$(awk '{print $14 + $15}' "$t/stat")"
  done
}
"$bench" run --target "$base" --system nrtxn --scenario "$scenario" --duration 1 > /dev/null 2>&1
"$bench" run --target "$base" --system nrtxn --scenario "$scenario" --duration "$secs" \
  --json "$d/run.json" > /dev/null 2> "$d/bench.err" &
bench_pid=$!
sleep 1.5
t0=$(date +%s.%N)
snap > "$d/before"
sleep $((secs - 2))
snap > "$d/after"
t1=$(date +%s.%N)
wait "$bench_pid" || { cat "$d/bench.err" >&2; exit 1; }
python3 - "$d/before" "$d/after" "$d/run.json" "$(getconf CLK_TCK)" "$t0" "$t1" << 'PY'
import collections, json, sys
def load(path):
    return {row[0]: row for row in (line.split() for line in open(path))}
before, after = load(sys.argv[1]), load(sys.argv[2])
run, hz = json.load(open(sys.argv[3])), float(sys.argv[4])
n = run["throughput_rps"] * (float(sys.argv[6]) - float(sys.argv[5]))
by_name = collections.defaultdict(lambda: [0, 0, 0.0, 0])
for tid, row in after.items():
    if tid not in before:
        continue
    was = before[tid]
    t = by_name[row[1]]
    t[0] += int(row[2]) - int(was[2])
    t[1] += int(row[3]) - int(was[3])
    t[2] += (float(row[4]) - float(was[4])) / hz * 1e6
    t[3] += 1
print(f"{run['scenario']}: {run['throughput_rps']:.0f} decisions/s, {n:.0f} in the window")
print(f"{'thread':18} {'count':>5} {'voluntary':>10} {'preempted':>10} {'CPU us':>7}  (per decision)")
total = [0.0, 0.0, 0.0]
for name, (v, nv, cpu, k) in sorted(by_name.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
    total = [total[0] + v, total[1] + nv, total[2] + cpu]
    if (v + nv) / n >= 0.001 or cpu / n >= 0.1:
        print(f"{name:18} {k:>5} {v / n:10.3f} {nv / n:10.3f} {cpu / n:7.1f}")
print(f"{'all':18} {'':>5} {total[0] / n:10.3f} {total[1] / n:10.3f} {total[2] / n:7.1f}")
PY
