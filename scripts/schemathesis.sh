#!/usr/bin/env bash
# Runs schemathesis (property-based tests generated from the OpenAPI contract) against
# a real server: `nrtxn serve` on a fresh data dir with an admin key, so unauthenticated
# and wrongly authenticated calls must be refused too. Prints schemathesis' summary (the
# number of cases it generated and what failed); exits non-zero on any failure.
#   scripts/schemathesis.sh [MAX_EXAMPLES]     (default 30 per operation)
# NRTXN_BIN: the binary (default target/debug/nrtxn). schemathesis is installed, pinned,
# into .services/st-venv (git-ignored) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
examples=${1:-30}
bin=${NRTXN_BIN:-target/debug/nrtxn}
[ -x "$bin" ] || cargo build -q --bin nrtxn
venv=.services/st-venv
version=4.32.5
if ! "$venv/bin/st" --version 2>/dev/null | grep -q "$version"; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "schemathesis==$version"
fi
tmp=$(mktemp -d)
server=""
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$tmp"' EXIT
key=$("$bin" keys create --role admin --data-dir "$tmp/data" | grep -o 'nrtxn_[A-Za-z0-9_]*' | head -n1)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$bin" serve --listen "127.0.0.1:$port" --data-dir "$tmp/data" > "$tmp/server.out" 2> "$tmp/server.log" &
server=$!
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/readyz" > /dev/null && break
  sleep 0.1
done
# The stream never ends: it has its own test (tests/stream.rs).
"$venv/bin/st" run "http://127.0.0.1:$port/openapi.json" \
  -H "Authorization: Bearer $key" \
  --checks all --exclude-operation-id streamEvents \
  --max-examples "$examples" --seed 1 -w 2 --max-response-time 5 \
  --no-color
