#!/usr/bin/env bash
# Flash-sale benchmark: nrtxn and the systems users would pick instead (Redis + Lua,
# PostgreSQL row locking, and the HTTP ceiling), every system through every scenario,
# on this machine, in one run. Writes bench/results/latest.json, docs/benchmarks.md and
# docs/benchmarks.svg.
#
#   scripts/bench.sh [--quick]
#
# --quick: 4 s per run (about 4 minutes in all once built); without it 20 s per run,
# plus a uniform spread run and an open-loop hot run per system. `orders` (issue 15:
# orders of 2 to 5 lines, Zipf items) runs right after `hot`, so that the report shows
# orders/s beside hot's decisions/s from the same run; postgres-row has no orders
# (bench/README.md says why) and skips it. `flash-open` (issue 29, nrtxn only: the
# opening of a sale on a sale window, about 10 s) runs right after `hot` too, its section
# appended to docs/benchmarks.md.
#
# Redis (Debian's redis-server, installed if missing) runs with appendonly no and no
# RDB saves: NOT durable. PostgreSQL 15 (Debian's packages) runs from a fresh initdb in
# a temporary folder with fsync=on and synchronous_commit=on: durable, like nrtxn.
# Everything listens on 127.0.0.1 and is stopped at the end, whatever the outcome.
#
# Environment: NRTXN_BIN uses that nrtxn binary instead of building it; CARGO_TARGET_DIR
# as for cargo; NRTXN_BENCH_REDIS_PORT (16379), NRTXN_BENCH_PG_PORT (15432);
# NRTXN_BENCH_OPEN_RATE (10000 jobs/s, the open-loop run of the full mode).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: scripts/bench.sh [--quick]" >&2; exit 2 ;;
esac
if [ $quick = 1 ]; then secs=4; else secs=20; fi
conns=64
batch_conns=8
redis_port=${NRTXN_BENCH_REDIS_PORT:-16379}
pg_port=${NRTXN_BENCH_PG_PORT:-15432}
open_rate=${NRTXN_BENCH_OPEN_RATE:-10000}
pg_bin=/usr/lib/postgresql/15/bin
started=$(date +%s)

log() { echo "bench.sh: $*" >&2; }

# Prints its arguments as a shell command line, quoting those that need it.
quoted() {
  local a out=""
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+="$a "; else out+="'$a' "; fi
  done
  echo "${out% }"
}

# --- tools -------------------------------------------------------------------------
if ! command -v redis-server > /dev/null; then
  log "installing redis-server (Debian)"
  apt-get update -qq && apt-get install -y -qq redis-server > /dev/null
fi
if [ ! -x "$pg_bin/postgres" ]; then
  log "installing postgresql-15 (Debian)"
  apt-get update -qq && apt-get install -y -qq postgresql-15 > /dev/null
fi
id postgres > /dev/null 2>&1 || { log "user postgres is missing (PostgreSQL refuses to run as root)"; exit 1; }

target_dir=${CARGO_TARGET_DIR:-$root/target}
if [ -n "${NRTXN_BIN:-}" ]; then
  log "building nrtxn-bench (release); nrtxn from NRTXN_BIN=$NRTXN_BIN"
  cargo build --release --quiet -p nrtxn-bench
  nrtxn=$NRTXN_BIN
else
  log "building nrtxn and nrtxn-bench (release)"
  cargo build --release --quiet -p nrtxn -p nrtxn-bench
  nrtxn=$target_dir/release/nrtxn
fi
bench=$target_dir/release/nrtxn-bench
[ -x "$nrtxn" ] || { log "no nrtxn binary at $nrtxn"; exit 1; }

# --- services ----------------------------------------------------------------------
tmp=$(mktemp -d /tmp/nrtxn-bench.XXXXXX)
chmod 755 "$tmp"
server_pid=""
redis_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2> /dev/null && wait "$server_pid" 2> /dev/null
  [ -n "$redis_pid" ] && kill "$redis_pid" 2> /dev/null && wait "$redis_pid" 2> /dev/null
  if [ -f "$tmp/pg/postmaster.pid" ]; then
    runuser -u postgres -- "$pg_bin/pg_ctl" -D "$tmp/pg" -m fast -w stop > /dev/null 2>&1 || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

log "starting Redis on 127.0.0.1:$redis_port (appendonly no, no saves: not durable)"
redis-server --bind 127.0.0.1 --port "$redis_port" --appendonly no --save '' \
  --dir "$tmp" --logfile "$tmp/redis.log" > /dev/null 2>&1 &
redis_pid=$!
for _ in $(seq 50); do redis-cli -p "$redis_port" ping > /dev/null 2>&1 && break; sleep 0.1; done
redis-cli -p "$redis_port" ping > /dev/null || { log "Redis did not start"; cat "$tmp/redis.log" >&2; exit 1; }

log "starting PostgreSQL 15 on 127.0.0.1:$pg_port (fresh initdb, fsync=on, synchronous_commit=on)"
mkdir "$tmp/pg" && chown postgres "$tmp/pg"
runuser -u postgres -- "$pg_bin/initdb" -D "$tmp/pg" -U postgres --auth=trust > "$tmp/initdb.log" 2>&1 \
  || { cat "$tmp/initdb.log" >&2; exit 1; }
pg_opts="-c listen_addresses=127.0.0.1 -c port=$pg_port -c unix_socket_directories=$tmp/pg"
pg_opts="$pg_opts -c fsync=on -c synchronous_commit=on -c max_connections=100 -c shared_buffers=256MB"
runuser -u postgres -- "$pg_bin/pg_ctl" -D "$tmp/pg" -l "$tmp/pg/server.log" -w -o "$pg_opts" start > /dev/null \
  || { cat "$tmp/pg/server.log" >&2; exit 1; }
pg_url="host=127.0.0.1 port=$pg_port user=postgres dbname=postgres"

declare -A durability=(
  [nrtxn]="durable: embedded checksummed log (one durable write per group commit: O_DIRECT and O_DSYNC, or write + fdatasync), SQLite views derived from it; a 202 only once the request is written"
  [redis-lua]="NOT durable: Redis with appendonly no and no RDB saves; an acknowledged sale is lost if Redis stops"
  [postgres-row]="durable: PostgreSQL 15, fsync=on, synchronous_commit=on (each COMMIT waits for its WAL flush)"
  [ceiling]="no state: parses and answers, stores nothing"
)

# --- runs --------------------------------------------------------------------------
mkdir -p "$tmp/runs" bench/results docs
commands=$tmp/commands.txt
: > "$commands"
failed=0
run_no=0

# start_server SYSTEM SCENARIO: starts the system's HTTP server, sets server_pid and base.
start_server() {
  local system=$1 scenario=$2 out="$tmp/server.out"
  : > "$out"
  local cmd
  case $system in
    nrtxn) cmd=("$nrtxn" serve --listen 127.0.0.1:0 --data-dir "$tmp/data-$scenario-$run_no") ;;
    redis-lua) cmd=("$bench" peer --kind redis-lua --listen 127.0.0.1:0 --redis-url "redis://127.0.0.1:$redis_port/") ;;
    postgres-row) cmd=("$bench" peer --kind postgres-row --listen 127.0.0.1:0 --pg-url "$pg_url") ;;
    ceiling) cmd=("$bench" peer --kind ceiling --listen 127.0.0.1:0) ;;
  esac
  RUST_LOG=warn "${cmd[@]}" > "$out" 2> "$tmp/server.err" &
  server_pid=$!
  base=""
  for _ in $(seq 200); do
    base=$(sed -n 's/^.*listening on //p' "$out" | head -1)
    [ -n "$base" ] && break
    kill -0 "$server_pid" 2> /dev/null || break
    sleep 0.05
  done
  [ -n "$base" ] || { log "$system did not start"; cat "$tmp/server.err" >&2; exit 1; }
  if [ "$system" = nrtxn ]; then
    for _ in $(seq 100); do curl -sf "$base/readyz" > /dev/null && break; sleep 0.05; done
  fi
  echo "$(quoted "${cmd[@]}") &" | sed "s#$tmp#\$TMP#g; s#$nrtxn #nrtxn #; s#$bench #nrtxn-bench #" >> "$commands"
}

stop_server() {
  kill "$server_pid" 2> /dev/null || true
  wait "$server_pid" 2> /dev/null || true
  server_pid=""
}

# bench_run SYSTEM SCENARIO [extra flags...]
bench_run() {
  local system=$1 scenario=$2
  shift 2
  run_no=$((run_no + 1))
  start_server "$system" "$scenario"
  local c=$conns
  [ "$scenario" = batch ] && c=$batch_conns
  local args=(run --target "$base" --system "$system" --scenario "$scenario" --connections "$c"
    --duration "$secs" --server-pid "$server_pid" "$@")
  [ "$system" = ceiling ] && args+=(--no-check)
  echo "nrtxn-bench $(quoted "${args[@]}")" | sed "s#--server-pid $server_pid#--server-pid \$SERVER_PID#" >> "$commands"
  local out
  out=$(printf '%s/runs/%02d-%s-%s.json' "$tmp" "$run_no" "$system" "$scenario")
  local status=0
  # nrtxn-bench prints its summary on stderr; the JSON goes to $out.
  "$bench" "${args[@]}" --durability "${durability[$system]}" --json "$out" > /dev/null || status=$?
  stop_server
  if [ $status -ne 0 ]; then
    failed=$((failed + 1))
    log "$system $scenario: nrtxn-bench exited $status"
  fi
}

# flash_open: the opening of a sale on nrtxn's sale windows (issue 29; nrtxn only, the
# peers have no windows), on a fresh server: about 10 s.
flash_open() {
  run_no=$((run_no + 1))
  start_server nrtxn flash-open
  local args=(flash-open --target "$base" --connections "$conns")
  echo "nrtxn-bench $(quoted "${args[@]}")" >> "$commands"
  "$bench" "${args[@]}" --json "$tmp/flash-open.json" --markdown "$tmp/flash-open.md" > /dev/null \
    || { failed=$((failed + 1)); log "nrtxn flash-open: nrtxn-bench failed"; }
  stop_server
}

for scenario in hot orders hot-sales spread mixed fire-and-forget batch; do
  for system in nrtxn redis-lua postgres-row ceiling; do
    [ "$scenario" = orders ] && [ "$system" = postgres-row ] && continue
    bench_run "$system" "$scenario"
  done
  # In the same run as hot, as the issue asks.
  [ "$scenario" = hot ] && flash_open
done
if [ $quick = 0 ]; then
  for system in nrtxn redis-lua postgres-row ceiling; do
    bench_run "$system" spread --uniform
    bench_run "$system" hot --rate "$open_rate" --stock 1000000000
  done
fi

invocation="scripts/bench.sh"
[ $quick = 1 ] && invocation="scripts/bench.sh --quick"
{
  echo "# $invocation: each system's server is started fresh for each run (\$TMP is a temporary folder),"
  echo "# Redis and PostgreSQL once for all; the load generator runs on the same machine."
  echo "# Each run also gets --durability TEXT (the table above) and --json FILE (gathered by the last command)."
  echo "redis-server --bind 127.0.0.1 --port $redis_port --appendonly no --save ''"
  echo "initdb -D \$TMP/pg -U postgres --auth=trust && pg_ctl -D \$TMP/pg -o \"$pg_opts\" start" | sed "s#$tmp#\$TMP#g"
  cat "$commands"
  echo "nrtxn-bench report --runs \$TMP/runs --results bench/results/latest.json --markdown docs/benchmarks.md --svg docs/benchmarks.svg"
} > "$tmp/commands.md.txt"
"$bench" report --runs "$tmp/runs" --results bench/results/latest.json \
  --markdown docs/benchmarks.md --svg docs/benchmarks.svg \
  --commands "$tmp/commands.md.txt" --invocation "$invocation"
if [ -s "$tmp/flash-open.md" ]; then
  cat "$tmp/flash-open.md" >> docs/benchmarks.md
  cp "$tmp/flash-open.json" bench/results/flash-open.json
fi
log "wrote bench/results/latest.json, docs/benchmarks.md, docs/benchmarks.svg in $(( $(date +%s) - started )) s"
if [ $failed -gt 0 ]; then
  log "$failed runs failed (their correctness check or the run itself): see docs/benchmarks.md"
  exit 1
fi
