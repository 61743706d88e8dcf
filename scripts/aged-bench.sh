#!/usr/bin/env bash
# A scenario against a server whose log already holds many sealed segments, as one that
# has run for days does (the key window keeps 7 days of segments). The server starts
# fresh with small segments (`--journal-segment-mb`, default 1), the `batch` scenario
# fills it for PREFILL seconds (10 s seals about 60 to 80 segments of 1 MiB), then
# SCENARIO runs for SECONDS. Prints the segments on disk and the scenario's line.
#
#   scripts/aged-bench.sh [SCENARIO] [SECONDS] [PREFILL] [SEGMENT_MB]   (hot-sales 6 10 1)
#
# NRTXN_BIN picks another nrtxn binary (to compare a change with its predecessor). The
# data dir is a fresh folder under /tmp, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
scenario=${1:-hot-sales}
secs=${2:-6}
prefill=${3:-10}
segment_mb=${4:-1}
target_dir=${CARGO_TARGET_DIR:-target}
[ -n "${NRTXN_BIN:-}" ] || cargo build --release --quiet -p nrtxn -p nrtxn-bench
nrtxn=${NRTXN_BIN:-$target_dir/release/nrtxn}
bench=$target_dir/release/nrtxn-bench
d=$(mktemp -d /tmp/nrtxn-aged.XXXXXX)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2> /dev/null; rm -rf "$d"' EXIT
RUST_LOG=warn "$nrtxn" serve --listen 127.0.0.1:0 --data-dir "$d/data" \
    --journal-segment-mb "$segment_mb" > "$d/out" 2> "$d/log" &
pid=$!
for _ in $(seq 200); do grep -q "listening on" "$d/out" 2> /dev/null && break; sleep 0.05; done
base=$(sed -n 's/^nrtxn listening on //p' "$d/out")
[ -n "$base" ] || { cat "$d/log" >&2; exit 1; }
if [ "$prefill" != 0 ]; then
    "$bench" run --target "$base" --system nrtxn --scenario batch --duration "$prefill" > /dev/null 2>&1
fi
echo "segments: $(find "$d/data/journal" -name '*.log' | wc -l)"
"$bench" run --target "$base" --system nrtxn --scenario "$scenario" --duration "$secs" 2>&1 | tail -1
