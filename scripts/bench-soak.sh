#!/usr/bin/env bash
# Memory over a long open-loop run: does the server's memory stay flat under a steady
# load below its peak? Starts the release server on the embedded default (fresh data
# dir), drives `nrtxn-bench run` open loop at RATE requests/s for SECONDS, samples the
# server's resident memory (VmRSS) every 10 s, and prints the samples, then the first,
# last and largest after the first minute (warm-up: caches and the outcome cache fill).
#   scripts/bench-soak.sh [rate=22000] [seconds=600] [scenario=hot]
# Writes the samples to bench/results/soak.csv (elapsed_s,rss_mb) and the run's result
# line to bench/results/soak.json.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-22000}
secs=${2:-600}
scenario=${3:-hot}
cargo build --release --quiet -p nrtxn -p nrtxn-bench
dir=$(mktemp -d)
RUST_LOG=warn ./target/release/nrtxn serve --listen 127.0.0.1:0 --data-dir "$dir/data" \
  > "$dir/out" 2> "$dir/err" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do grep -q listening "$dir/out" && break; sleep 0.1; done
base=$(sed -n 's/^nrtxn listening on //p' "$dir/out")
[ -n "$base" ] || { cat "$dir/err"; exit 1; }
mkdir -p bench/results
csv=bench/results/soak.csv
echo "elapsed_s,rss_mb" > "$csv"
./target/release/nrtxn-bench run --target "$base" --system nrtxn --scenario "$scenario" \
  --rate "$rate" --duration "$secs" --server-pid "$pid" --json bench/results/soak.json \
  > "$dir/run.out" 2> "$dir/run.err" &
runner=$!
start=$(date +%s)
while kill -0 $runner 2> /dev/null; do
  rss=$(awk '/^VmRSS/ { printf "%.1f", $2 / 1024 }' "/proc/$pid/status")
  echo "$(( $(date +%s) - start )),$rss" >> "$csv"
  sleep 10
done
wait $runner || { tail -5 "$dir/run.err"; exit 1; }
echo "open loop at $rate/s for ${secs}s, $scenario: server RSS every 10 s (MB):"
tail -n +2 "$csv" | tr '\n' ' '; echo
awk -F, 'NR > 1 && $1 >= 60 { if (!first) first = $2; last = $2; if ($2 > max) max = $2 }
  END { printf "after the first minute: first %.1f MB, last %.1f MB, max %.1f MB\n", first, last, max }' "$csv"
tail -1 "$dir/run.err"
