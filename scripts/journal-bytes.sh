#!/usr/bin/env bash
# Disk bytes per decision of the embedded journal: the log alone, and the whole data dir
# (log, views with their indexes, keys), after a run of nrtxn-bench against the release
# server, for three mixes: `hot` (sales on one item), `spread` (10,000 items) and
# `soldout` (one item with 1,000 units, so nearly every decision is a refusal).
#   scripts/journal-bytes.sh [seconds=8]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-8}
cargo build --release --quiet -p nrtxn -p nrtxn-bench
printf '| mix | decisions | refusals | log bytes/decision | data dir bytes/decision |\n|---|---|---|---|---|\n'
for mix in hot spread soldout; do
  dir=$(mktemp -d)
  # One segment for the whole run, so none is retired while it is measured.
  RUST_LOG=warn ./target/release/nrtxn serve --listen 127.0.0.1:0 --data-dir "$dir/data" \
    --journal-segment-mb 1024 > "$dir/out" 2> "$dir/err" &
  pid=$!
  for _ in $(seq 100); do grep -q listening "$dir/out" && break; sleep 0.1; done
  base=$(sed -n 's/^nrtxn listening on //p' "$dir/out")
  case $mix in
    hot) args=(--scenario hot --stock 1000000000) ;;
    spread) args=(--scenario spread) ;;
    soldout) args=(--scenario hot --stock 1000) ;;
  esac
  ./target/release/nrtxn-bench run --target "$base" --system nrtxn "${args[@]}" \
    --connections 64 --duration "$secs" > "$dir/bench.json"
  metrics=$(curl -s "$base/metrics")
  decisions=$(awk '/^nrtxn_decisions_total/ { s += $2 } END { print s }' <<< "$metrics")
  ok=$(awk '/^nrtxn_decisions_total\{status="ok"\}/ { print $2 }' <<< "$metrics")
  kill -TERM "$pid"; wait "$pid" || true
  log=$(du -sb "$dir/data/journal" | cut -f1)
  all=$(du -sb "$dir/data" | cut -f1)
  printf '| %s | %d | %d | %d | %d |\n' "$mix" "$decisions" "$((decisions - ok))" \
    "$((log / decisions))" "$((all / decisions))"
  rm -rf "$dir"
done
