#!/usr/bin/env bash
# HTTP benchmark: respond=true decrements on one hot item through the real server,
# driven by wrk (Debian's package) with N connections. The server runs on the embedded
# default unless NRTXN_BENCH_SERVER_FLAGS adds flags (e.g. --kafka-brokers, --mongo-uri
# against the test servers of scripts/services.sh).
#   scripts/bench-http.sh [connections=64] [seconds=20]
set -euo pipefail
cd "$(dirname "$0")/.."
conns=${1:-64}
secs=${2:-20}
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
cargo build --release --quiet
dir=$(mktemp -d)
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
# shellcheck disable=SC2086 # flags are meant to split
RUST_LOG=warn ./target/release/nrtxn serve --listen 127.0.0.1:0 --data-dir "$dir/data" \
  ${NRTXN_BENCH_SERVER_FLAGS:-} > "$dir/out" 2> "$dir/err" &
pid=$!
for _ in $(seq 100); do grep -q listening "$dir/out" && break; sleep 0.1; done
base=$(sed -n 's/^nrtxn listening on //p' "$dir/out")
[ -n "$base" ] || { cat "$dir/err"; exit 1; }
# Ready means recovered and, with Kafka, the reader pool has its partitions.
for _ in $(seq 900); do curl -sf "$base/readyz" > /dev/null && break; sleep 0.1; done
curl -sf -XPUT "$base/v1/shops/flash/items" -H "content-type: application/json" \
  -d '{"items":[{"item":"hot","stock":1000000000}]}' > /dev/null
echo "wrk: $conns connections, 2 threads, ${secs}s, respond=true decrements on one hot item"
wrk -t2 -c"$conns" -d"${secs}s" --latency -s bench/txn.lua "$base"
item=$(curl -s "$base/v1/shops/flash/items/hot")
echo "server: $item"
relayed() { curl -s "$base/metrics" | awk '/^nrtxn_events_relayed_total/ { print $2 }'; }
if [[ " ${NRTXN_BENCH_SERVER_FLAGS:-} " == *" --kafka-brokers "* ]]; then
  # The outbox relay: how far behind the journal it was when the load stopped, and how
  # long it took to publish the rest (the hot item's seq counts its events).
  events=$(sed 's/.*"seq":\([0-9]*\).*/\1/' <<< "$item")
  behind=$((events - $(relayed)))
  start=$(date +%s%N)
  until [ "$(relayed)" -ge "$events" ]; do sleep 0.01; done
  echo "relay: $events events, $behind unpublished when the load stopped, all published $(( ($(date +%s%N) - start) / 1000000 )) ms later"
fi
curl -s "$base/metrics" | awk -v secs="$secs" '
  /^nrtxn_batch_entries_(sum|count)/ { b[$1] = $2 }
  /^nrtxn_journal_txn_entries_(sum|count)/ { t[$1] = $2 }
  # Where the time of a request goes: nrtxn_stage_seconds{stage}, and the journal stage from
  # nrtxn_journal_write_seconds (one durable journal transaction).
  /^nrtxn_stage_seconds_(sum|count)\{/ {
    match($1, /stage="[a-z]+"/)
    stage = substr($1, RSTART + 7, RLENGTH - 8)
    if ($1 ~ /_sum/) sum[stage] = $2; else cnt[stage] = $2
  }
  /^nrtxn_journal_write_seconds_sum / { sum["journal"] = $2 }
  /^nrtxn_journal_write_seconds_count / { cnt["journal"] = $2 }
  END {
    printf "processor batches %d, mean %.1f entries; journal transactions %d, mean %.1f entries\n",
      b["nrtxn_batch_entries_count"], b["nrtxn_batch_entries_sum"] / b["nrtxn_batch_entries_count"],
      t["nrtxn_journal_txn_entries_count"], t["nrtxn_journal_txn_entries_sum"] / t["nrtxn_journal_txn_entries_count"]
    if (cnt["total"] == 0) exit
    total = sum["total"] / cnt["total"]
    printf "%-8s %9s %9s %7s  %s\n", "stage", "observed", "mean ms", "share", "per"
    n = split("produce consume screen journal reply total", order, " ")
    per["produce"] = "request"; per["consume"] = "request"; per["screen"] = "batch that read"
    per["journal"] = "journal transaction"; per["reply"] = "request"; per["total"] = "request"
    rest = total
    for (i = 1; i <= n; i++) {
      s = order[i]
      if (cnt[s] == 0) continue
      mean = sum[s] / cnt[s]
      printf "%-8s %9d %9.3f %6.1f%%  %s\n", s, cnt[s], mean * 1000, 100 * mean / total, per[s]
      # produce lies inside consume, which starts at the timestamp the producer set.
      if (s != "produce" && s != "total") rest -= mean
    }
    printf "%-8s %9s %9.3f %6.1f%%  %s\n", "other", "", rest * 1000, 100 * rest / total,
      "total minus consume, screen, journal, reply (produce lies inside consume)"
    # One writer makes the transactions one after the other: when they add up to about
    # the length of the load, a batch also waits for the one before it, in other.
    printf "journal: %d transactions took %.1f s in all, for %d s of load (one writer, one at a time)\n",
      cnt["journal"], sum["journal"], secs
  }'
