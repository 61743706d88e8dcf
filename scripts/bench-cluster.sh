#!/usr/bin/env bash
# Kafka + MongoDB benchmark on one or two nodes (same group, same database), against the
# test servers of scripts/services.sh (started if not running): decrements on 20 items,
# respond=true or fire-and-forget, driven by one wrk per node with half the connections
# each. Reports per node throughput and latency, the share of decisions each node's
# processors made, and journal writes per decision. NRTXN_BENCH_SERVER_FLAGS adds server
# flags (e.g. --shards 2).
#   scripts/bench-cluster.sh [nodes=1|2] [respond|forget] [connections=64] [seconds=15]
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=${1:-1}
mode=${2:-respond}
conns=${3:-64}
secs=${4:-15}
[ "$nodes" = 1 ] || [ "$nodes" = 2 ] || { echo "nodes: 1 or 2" >&2; exit 2; }
case $mode in respond) respond=true ;; forget) respond=false ;; *) echo "mode: respond or forget" >&2; exit 2 ;; esac
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
scripts/services.sh start > /dev/null
cargo build --release --quiet
run="bench$(date +%s)-$$"
dir=$(mktemp -d)
pids=()
# The test MongoDB server (secantus) slows down as its stored data grows: the run's
# database is dropped at the end.
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  .services/venv/bin/python -c "import pymongo; pymongo.MongoClient('mongodb://127.0.0.1:${NRTXN_MONGO_PORT:-27018}/?directConnection=true').drop_database('$run')" || true
  [ -z "${NRTXN_BENCH_KEEP:-}" ] && rm -rf "$dir"; [ -z "${NRTXN_BENCH_KEEP:-}" ] || echo "kept $dir"
}
trap cleanup EXIT
bases=()
for n in $(seq 0 $((nodes - 1))); do
  # shellcheck disable=SC2086 # flags are meant to split
  RUST_LOG=${RUST_LOG:-warn} ./target/release/nrtxn serve --listen 127.0.0.1:0 --data-dir "$dir/data$n" \
    --kafka-brokers "127.0.0.1:${NRTXN_KAFKA_PORT:-19092}" --kafka-requests-topic "$run" \
    --kafka-responses-topic "$run.responses" --kafka-group "$run" --kafka-partitions 8 \
    --mongo-uri "mongodb://127.0.0.1:${NRTXN_MONGO_PORT:-27018}/$run?directConnection=true" \
    --node-id "$n" ${NRTXN_BENCH_SERVER_FLAGS:-} > "$dir/out$n" 2> "$dir/err$n" &
  pids+=($!)
  for _ in $(seq 100); do grep -q listening "$dir/out$n" && break; sleep 0.1; done
  base=$(sed -n 's/^nrtxn listening on //p' "$dir/out$n")
  [ -n "$base" ] || { cat "$dir/err$n"; exit 1; }
  for _ in $(seq 900); do curl -sf "$base/readyz" > /dev/null && break; sleep 0.1; done
  bases+=("$base")
done
# After the last join's rebalance every node is ready again.
for base in "${bases[@]}"; do
  for _ in $(seq 900); do curl -sf "$base/readyz" > /dev/null && break; sleep 0.1; done
done
items=$(seq 0 19 | sed 's/.*/{"item":"i&","stock":1000000000}/' | paste -sd,)
# /readyz is up once a reader has partitions; the others may still be joining, and a
# load waits for every item's owner: retried (a load sets absolute stock, so a repeat
# changes nothing).
for _ in $(seq 30); do
  curl -sf -XPUT "${bases[0]}/v1/shops/flash/items" -H "content-type: application/json" -d "{\"items\":[$items]}" > /dev/null && break
  sleep 1
done
metric() { # sum of a metric's samples on every node
  for base in "${bases[@]}"; do curl -s "$base/metrics"; done |
    awk -v m="$1" 'index($1, m) == 1 { s += $2 } END { printf "%d", s }'
}
before=$(metric nrtxn_decisions_total)
echo "$nodes node(s), $mode, wrk: $conns connections in all, ${secs}s, decrements on 20 items"
start=$(date +%s.%N)
for n in $(seq 0 $((nodes - 1))); do
  NRTXN_BENCH_RESPOND=$respond NRTXN_BENCH_TAG="n$n" wrk -t1 -c$((conns / nodes)) \
    -d"${secs}s" --latency -s bench/cluster.lua "${bases[$n]}" > "$dir/wrk$n" &
  wpids[n]=$!
done
for n in $(seq 0 $((nodes - 1))); do wait "${wpids[$n]}"; done
sent=0
for n in $(seq 0 $((nodes - 1))); do
  echo "--- node $n (${bases[$n]})"
  grep -E "Requests/sec|^p50|answered" "$dir/wrk$n"
  sent=$((sent + $(sed -n 's/^answered \([0-9]*\).*/\1/p' "$dir/wrk$n")))
done
# Fire-and-forget: wait until every accepted request is decided.
for _ in $(seq 600); do
  [ $(($(metric nrtxn_decisions_total) - before)) -ge "$sent" ] && break
  sleep 0.1
done
end=$(date +%s.%N)
decided=$(($(metric nrtxn_decisions_total) - before))
echo "--- all nodes"
awk -v d="$decided" -v s="$start" -v e="$end" \
  'BEGIN { printf "decided %d in %.1f s: %.0f decisions/s\n", d, e - s, d / (e - s) }'
for n in $(seq 0 $((nodes - 1))); do
  d=$(curl -s "${bases[$n]}/metrics" | awk 'index($1, "nrtxn_decisions_total") == 1 { s += $2 } END { printf "%d", s }')
  echo "node $n processors decided $d ($(awk -v a="$d" -v b="$(metric nrtxn_decisions_total)" 'BEGIN { printf "%.0f", 100 * a / b }')%, loads included)"
done
wsecs=$(for base in "${bases[@]}"; do curl -s "$base/metrics"; done |
  awk 'index($1, "nrtxn_journal_write_seconds_sum") == 1 { s += $2 } END { printf "%.3f", s }')
writes=$(metric nrtxn_journal_txn_entries_count)
awk -v w="$writes" -v s="$wsecs" 'BEGIN { printf "journal write mean %.1f ms\n", 1000 * s / w }'
entries=$(metric nrtxn_journal_txn_entries_sum)
awk -v w="$writes" -v e="$entries" -v d="$(metric nrtxn_decisions_total)" 'BEGIN {
  printf "journal writes %d for %d decisions: 1 per %.1f; mean %.1f entries per write\n", w, d, d / w, e / w }'
