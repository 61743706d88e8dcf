#!/usr/bin/env bash
# Time to start on a big embedded journal: a release server takes the batch route's load
# (10,000 items) for SECONDS, is killed (SIGKILL), and is started again: once as it is
# (the views hold nearly everything; the log's tail is checked and replayed), and once
# with the views deleted (every record of the log read, checked and replayed).
# The log keeps its segments for the key window (7 days by default), so the whole log is
# there to replay. NRTXN_SEGMENT_MB sets the segment size (default: the server's, 64): a
# start reads the newest segment whole to index it, so a larger one starts slower.
#   scripts/recovery-time.sh [seconds=200]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-200}
cargo build --release --quiet -p nrtxn -p nrtxn-bench
dir=$(mktemp -d)
trap 'pkill -f "$dir/data" 2>/dev/null || true; rm -rf "$dir"' EXIT
start() { # prints the seconds until the server listens
  local t0=$(date +%s.%N)
  RUST_LOG=warn ./target/release/nrtxn serve --listen 127.0.0.1:0 --data-dir "$dir/data" \
    ${NRTXN_SEGMENT_MB:+--journal-segment-mb "$NRTXN_SEGMENT_MB"} > "$dir/out" 2> "$dir/err" &
  pid=$!
  echo "$pid" > "$dir/pid"
  until grep -q listening "$dir/out"; do
    kill -0 "$pid" 2>/dev/null || { cat "$dir/err" >&2; exit 1; }
    sleep 0.05
  done
  echo "$(date +%s.%N) - $t0" | bc
}
stop() { # SIGTERM, and wait until the process is gone
  local p; p=$(cat "$dir/pid"); kill -TERM "$p"
  while kill -0 "$p" 2>/dev/null; do sleep 0.1; done
}
start > /dev/null
base=$(sed -n 's/^nrtxn listening on //p' "$dir/out")
./target/release/nrtxn-bench run --target "$base" --system nrtxn --scenario batch \
  --stock 1000000000 --duration "$secs" > "$dir/bench.json"
decisions=$(curl -s "$base/metrics" | awk '/^nrtxn_decisions_total/ { s += $2 } END { print s }')
kill -KILL "$pid"; wait "$pid" 2>/dev/null || true
log=$(du -sb "$dir/data/journal" | cut -f1)
views=$(du -sb "$dir/data/nrtxn.db" | cut -f1)
echo "journal: $decisions decisions, log $log bytes, views $views bytes"
t=$(start); stop
echo "start after SIGKILL: ${t} s"
rm -f "$dir/data/nrtxn.db" "$dir/data/nrtxn.db-wal" "$dir/data/nrtxn.db-shm"
t=$(start); stop
echo "start with the views deleted (every record replayed): ${t} s"
