#!/usr/bin/env python3
"""nrtxn's fault campaign (issue 14), run by scripts/faults.sh.

Each case breaks a real server on purpose, then reconciles what callers were told with
what the server holds (CASES lists them, with the module of each):

- sigkill: cycles of concurrent mixed load (sales respond=true and false, returns,
  batches, holds with short TTLs, confirms and cancels), a SIGKILL at a random moment,
  and a restart.
- sigterm: the same with SIGTERM; every exit must be 0.
- corruption: a clean data dir, then for each of its files a byte flipped and, apart,
  the file cut to half: the server refuses to start with a message, or starts with
  exactly the acknowledged state.
- overload: 2,000 connections in a burst (nrtxn-bench): 429s, peak RSS, time back to
  normal latency.
- log-ends (faults_log.py): the log's tail cut or deleted after acknowledged writes,
  older segments cut, deleted or flipped: refused with a message, or the acknowledged
  state, and damage the start does not read is reported by the full read after it.
- disk-full (faults_disk.py): the data dir on a small tmpfs, filled under load.
- memory (faults_memory.py): each bound that grows with input driven to it and past it.
- cluster (faults_cluster.py): two nodes on Kafka and MongoDB; the broker, the database
  and a node killed, a node stalled.

Reconciliation, after each case: every 200 or 202 answer polls the same (a 202 polls
decided); each item's events are gapless and replay to its stock and reserved at every
seq; no key is applied twice; every `ok` sale answered is in its item's events once;
holds pending at a kill have ended (expired) after the restart; a sample of answered keys
resubmitted gets the same outcome.

Standard library only; everything listens on 127.0.0.1 and is stopped at the end.
Prints one JSON line per case (and writes them to --json).
"""

import argparse
import http.client
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ITEMS = [f"i{n}" for n in range(8)]
STOCK = 400
SHOP = "faults"


class Server:
    """`nrtxn serve` on a data dir, on a free loopback port; `env`: settings of its own,
    as the `NRTXN_*` environment variables every flag has."""

    def __init__(self, binary, data_dir, log_path, env=None):
        self.binary, self.data_dir, self.log_path = binary, data_dir, log_path
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.proc, self.port = None, None

    def start(self, wait_ready=True):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", self.data_dir],
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "RUST_LOG": "warn", **self.env},
        )
        line = b""
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if b"listening on" in line:
                self.port = int(line.strip().rsplit(b":", 1)[1])
                break
        if self.port is None:
            code = self.proc.wait(timeout=60)
            return code
        # Drain stdout so the server never blocks on it.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        if wait_ready:
            deadline = time.time() + 120
            while time.time() < deadline:
                status, _ = call(self.port, "GET", "/readyz", timeout=2)
                if status == 200:
                    return None
                if self.proc.poll() is not None:
                    return self.proc.returncode
                time.sleep(0.05)
            raise RuntimeError("server not ready within 120 s")
        return None

    def kill(self, sig):
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return "hung"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.kill(signal.SIGTERM)


def call(port, method, path, body=None, timeout=15):
    """(status, parsed JSON or None); status None when the connection failed."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, None if body is None else json.dumps(body), headers)
        res = conn.getresponse()
        data = res.read()
        conn.close()
        try:
            return res.status, json.loads(data) if data else None
        except ValueError:
            return res.status, None
    except (OSError, http.client.HTTPException):
        return None, None


class Book:
    """What callers were told, shared by the load threads."""

    def __init__(self):
        self.lock = threading.Lock()
        # key -> {"body", "route", "http", "status"} for every transaction sent.
        self.txns = {}
        # hold id -> {"body", "http", "status"}; and the endings asked for.
        self.holds = {}
        self.sent = 0
        self.http_5xx = []
        # Load thread tag -> whether its last request found no server.
        self.last_failed = {}

    def record(self, kind, key, entry):
        with self.lock:
            getattr(self, kind)[key] = entry
            self.sent += 1
            if entry["http"] is not None and entry["http"] >= 500:
                self.http_5xx.append((key, entry["http"]))


def load_thread(port_ref, book, stop, tag, seed):
    rnd = random.Random(seed)
    n = 0
    held = []
    while not stop.is_set():
        port = port_ref[0]
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
            status, ans = call(port, "POST", f"/v1/shops/{SHOP}/txns", body)
            book.record("txns", key, {"body": body, "http": status, "answer": ans})
            book.last_failed[tag] = status is None
        elif r < 0.7:
            entries = []
            for j in range(5):
                e = {"seller": "f", "item": rnd.choice(ITEMS), "qty": 1, "request_id": f"{key}.{j}"}
                if rnd.random() < 0.3:
                    e["op"] = "increment"
                if rnd.random() < 0.3:
                    e["respond"] = False
                entries.append(e)
            status, ans = call(port, "POST", f"/v1/shops/{SHOP}/txns/batch", {"txns": entries})
            results = (ans or {}).get("results") if status == 200 else None
            for j, e in enumerate(entries):
                answer = results[j] if results and j < len(results) else None
                book.record("txns", e["request_id"], {"body": e, "http": status if answer else None, "answer": answer})
        elif r < 0.85:
            body = {"item": item, "qty": rnd.randint(1, 2), "ttl_ms": rnd.randint(200, 1500), "request_id": key}
            status, ans = call(port, "POST", f"/v1/shops/{SHOP}/holds", body)
            book.record("holds", key, {"body": body, "http": status, "answer": ans})
            if status == 200 and ans and ans.get("status") == "held":
                held.append(key)
        elif held:
            hold_id = held.pop(rnd.randrange(len(held)))
            end = rnd.choice(["confirm", "cancel"])
            status, ans = call(port, "POST", f"/v1/shops/{SHOP}/holds/{hold_id}/{end}", {})
            with book.lock:
                book.sent += 1
                if status is not None and status >= 500:
                    book.http_5xx.append((hold_id, status))
        # A server being killed or restarted refuses connections at once: no spinning.
        time.sleep(0.05 if book.last_failed.get(tag) else rnd.random() * 0.002)


def run_load(port_ref, book, seconds, cycle, threads=12):
    stop = threading.Event()
    workers = [
        threading.Thread(target=load_thread, args=(port_ref, book, stop, f"c{cycle}w{t}", cycle * 100 + t))
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    time.sleep(seconds)
    return stop, workers


def events_of(port, item):
    out, after = [], 0
    while True:
        status, page = call(port, "GET", f"/v1/shops/{SHOP}/items/{item}/events?after={after}&limit=1000")
        if status != 200:
            raise RuntimeError(f"events of {item}: {status}")
        evs = page["events"]
        out.extend(evs)
        if len(evs) < 1000:
            return out
        after = evs[-1]["seq"]


def reconcile(port, book, rnd):
    """Counts of what does not hold: lost, doubled, wrong."""
    lost, doubled, wrong, notes = 0, 0, 0, []
    # Holds answered `held` have all ended by now (their TTLs are at most 1.5 s).
    time.sleep(2.5)
    for hold_id, h in book.holds.items():
        if h["http"] == 200 and h["answer"] and h["answer"].get("status") == "held":
            status, ans = call(port, "GET", f"/v1/shops/{SHOP}/holds/{hold_id}")
            if status != 200:
                lost += 1
                notes.append(f"hold {hold_id} answered held, reads {status}")
            elif ans["status"] == "held":
                wrong += 1
                notes.append(f"hold {hold_id} still held past its expiry")
    # Every answered transaction polls the same (a 202 polls decided).
    for key, t in book.txns.items():
        if t["http"] not in (200, 202) or not t["answer"]:
            continue
        told = t["answer"].get("status")
        for _ in range(100):
            status, ans = call(port, "GET", f"/v1/shops/{SHOP}/txns/{key}")
            if status != 202:
                break
            time.sleep(0.1)
        if status != 200:
            lost += 1
            notes.append(f"{key} answered {told}, polls {status}")
        elif told not in ("accepted",) and ans["status"] != told:
            wrong += 1
            notes.append(f"{key} answered {told}, polls {ans['status']}")
        else:
            t["decided"] = ans
    # Each item's events: gapless, replaying to the state at every seq; no key twice.
    seen = {}
    for item in ITEMS:
        stock = reserved = 0
        evs = events_of(port, item)
        for i, e in enumerate(evs):
            if (e["seq"], e["prev_seq"]) != (i + 1, i):
                wrong += 1
                notes.append(f"{item}: event {i + 1} has seq {e['seq']}")
                break
            if e["status"] == "ok":
                kind, qty = e["kind"], e["qty"]
                if kind == "load":
                    stock = e["stock_after"]
                elif kind == "decrement":
                    stock -= qty
                elif kind in ("increment", "adjust"):
                    stock += qty
                elif kind == "hold":
                    stock, reserved = stock - qty, reserved + qty
                elif kind == "confirm":
                    reserved -= qty
                elif kind in ("release", "expire"):
                    stock, reserved = stock + qty, reserved - qty
            if (e["stock_after"], e["reserved_after"]) != (stock, reserved) or stock < 0 or reserved < 0:
                wrong += 1
                notes.append(f"{item} seq {e['seq']}: {e['stock_after']}/{e['reserved_after']}, replay {stock}/{reserved}")
                stock, reserved = e["stock_after"], e["reserved_after"]
            k = e.get("request_key")
            if k:
                if k in seen:
                    doubled += 1
                    notes.append(f"{k} applied twice ({seen[k]} and {item} seq {e['seq']})")
                seen[k] = f"{item} seq {e['seq']}"
        status, view = call(port, "GET", f"/v1/shops/{SHOP}/items/{item}")
        if status != 200 or (view["stock"], view["reserved"]) != (stock, reserved):
            wrong += 1
            notes.append(f"{item} reads {view}, its events replay to {stock}/{reserved}")
    # Every decided key is in its item's events (a refusal of an unknown item has none).
    for key, t in book.txns.items():
        d = t.get("decided")
        if d and d.get("seq") is not None and key not in seen:
            lost += 1
            notes.append(f"{key} decided {d['status']} at seq {d['seq']}, not in the events")
    # A sample of decided keys, resubmitted: the original outcome, nothing applied.
    decided = [k for k, t in book.txns.items() if t.get("decided")]
    for key in rnd.sample(decided, min(200, len(decided))):
        status, ans = call(port, "POST", f"/v1/shops/{SHOP}/txns", dict(book.txns[key]["body"], respond=True))
        first = book.txns[key]["decided"]
        if status != 200 or (ans["status"], ans.get("seq")) != (first["status"], first.get("seq")):
            doubled += 1
            notes.append(f"{key} resubmitted: {status} {ans}, first {first['status']} seq {first.get('seq')}")
    return lost, doubled, wrong, notes


def load_items(port):
    status, _ = call(port, "PUT", f"/v1/shops/{SHOP}/items", {"items": [{"item": i, "stock": STOCK} for i in ITEMS]})
    if status != 200:
        raise RuntimeError(f"load: {status}")


def kill_cycles(binary, work, cycles, sig, rnd):
    data = os.path.join(work, f"data-{sig.name}")
    log = os.path.join(work, f"server-{sig.name}.log")
    server = Server(binary, data, log)
    server.start()
    port_ref = [server.port]
    load_items(server.port)
    book = Book()
    exits, started = [], time.time()
    for cycle in range(cycles):
        stop, workers = run_load(port_ref, book, rnd.uniform(0.5, 2.5), cycle)
        exits.append(server.kill(sig))
        stop.set()
        for w in workers:
            w.join()
        code = server.start()
        if code is not None:
            raise RuntimeError(f"restart after {sig.name} failed: exit {code}; see {log}")
        port_ref[0] = server.port
    lost, doubled, wrong, notes = reconcile(server.port, book, rnd)
    server.stop()
    bad_exits = [e for e in exits if e != (0 if sig == signal.SIGTERM else -signal.SIGKILL)]
    if bad_exits:
        wrong += len(bad_exits)
        notes.append(f"exits {exits}")
    answered = sum(1 for t in book.txns.values() if t["http"] in (200, 202)) + sum(
        1 for h in book.holds.values() if h["http"] == 200
    )
    if book.http_5xx:
        notes.append(f"{len(book.http_5xx)} answers 5xx (during kills), e.g. {book.http_5xx[:3]}")
    return {
        "case": sig.name.lower(),
        "cycles": cycles,
        "tried": book.sent,
        "answered": answered,
        "lost": lost,
        "doubled": doubled,
        "wrong": wrong,
        "exits": sorted(set(str(e) for e in exits)),
        "seconds": round(time.time() - started, 1),
        "notes": notes[:20],
    }


def flip_bit(path, rnd):
    """Flips one bit of one byte of the file at `path`, both chosen by `rnd`."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        at = rnd.randrange(size)
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << rnd.randrange(8))]))


def corruption(binary, work, rnd, quick=False):
    """A clean data dir with acknowledged traffic; each file damaged two ways in a copy."""
    base = os.path.join(work, "data-clean")
    server = Server(binary, base, os.path.join(work, "server-clean.log"))
    server.start()
    load_items(server.port)
    book = Book()
    stop, workers = run_load([server.port], book, 1.5, 0, threads=6)
    stop.set()
    for w in workers:
        w.join()
    time.sleep(2.0)  # holds end, fire-and-forget requests are decided
    acked = {}
    for key, t in book.txns.items():
        if t["http"] in (200, 202):
            status, ans = call(server.port, "GET", f"/v1/shops/{SHOP}/txns/{key}")
            if status == 200:
                acked[key] = (ans["status"], ans.get("seq"))
    items = {}
    for item in ITEMS:
        _, view = call(server.port, "GET", f"/v1/shops/{SHOP}/items/{item}")
        items[item] = (view["stock"], view["reserved"], view["seq"])
    server.stop()
    files = sorted(
        os.path.relpath(os.path.join(d, f), base)
        for d, _, fs in os.walk(base)
        for f in fs
        if f != "LOCK"
    )
    tried = refused = refused_at_read = same = wrong = 0
    notes = []
    for rel in files:
        # The log's records are all checksummed: one flip says what a flip does. An
        # SQLite file is checksummed only in places (rows; the start checks its indexes
        # against their tables), so it gets several flips, each in a copy of its own.
        flips = 1 if rel.startswith("journal/") else (3 if quick else 8)
        for damage in ["flip"] * flips + ["truncate"]:
            copy = os.path.join(work, "data-damaged")
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(base, copy)
            path = os.path.join(copy, rel)
            size = os.path.getsize(path)
            if size == 0:
                continue
            tried += 1
            if damage == "flip":
                flip_bit(path, rnd)
            else:
                with open(path, "r+b") as f:
                    f.truncate(size // 2)
            log = os.path.join(work, "server-damaged.log")
            open(log, "w").close()
            s = Server(binary, copy, log)
            try:
                code = s.start()
            except RuntimeError as e:
                code = f"not ready: {e}"
            if code is not None:
                message = open(log, errors="replace").read().strip().splitlines()
                said = message[-1].replace(copy, "DATA_DIR")[:300] if message else "(nothing)"
                if not message:
                    wrong += 1
                    notes.append(f"{rel} {damage}: refused with no message (exit {code})")
                else:
                    refused += 1
                    notes.append(f"{rel} {damage}: refused: {said}")
                continue
            # A damaged row of the views answers 503 where it is read (never a wrong
            # value): counted apart from a wrong state.
            bad, unavailable = [], []
            for item, want in items.items():
                status, view = call(s.port, "GET", f"/v1/shops/{SHOP}/items/{item}")
                if status == 503:
                    unavailable.append(item)
                elif status != 200 or (view.get("stock"), view.get("reserved"), view.get("seq")) != want:
                    bad.append(f"{item} {view} want {want}")
            for key, want in acked.items():
                status, ans = call(s.port, "GET", f"/v1/shops/{SHOP}/txns/{key}")
                if status == 503:
                    unavailable.append(key)
                elif status != 200 or (ans["status"], ans.get("seq")) != want:
                    bad.append(f"{key} polls {status}")
            s.stop()
            if bad:
                wrong += 1
                notes.append(f"{rel} {damage}: started with another state: {bad[:3]}")
            elif unavailable:
                refused_at_read += 1
                notes.append(
                    f"{rel} {damage}: started; {len(unavailable)} damaged row(s) answer 503 "
                    f"(e.g. {unavailable[0]}), every other read is the acknowledged state"
                )
            else:
                same += 1
    return {
        "case": "corruption",
        "files": len(files),
        "tried": tried,
        "refused": refused,
        "refused_at_read": refused_at_read,
        "started_same": same,
        "wrong": wrong,
        "lost": 0,
        "doubled": 0,
        "notes": notes,
    }


def latency_p50_ms(port, n=50):
    """p50 of `n` sequential sales (respond=true) of one connection at a time, in ms."""
    times = []
    for i in range(n):
        body = {"seller": "f", "item": "ov", "qty": 1, "request_id": f"lat-{time.time_ns()}-{i}"}
        t = time.perf_counter()
        status, _ = call(port, "POST", "/v1/shops/overload/txns", body)
        if status == 200:
            times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return times[len(times) // 2] if times else float("inf")


def overload(binary, work, connections=2000, seconds=10):
    """A burst of `connections` callers for `seconds` (nrtxn-bench, hot-sales): its 429s,
    the server's peak RSS, and how long after it sales answer as fast as before."""
    bench = os.path.join(os.path.dirname(binary), "nrtxn-bench")
    server = Server(binary, os.path.join(work, "data-overload"), os.path.join(work, "server-overload.log"))
    server.start()
    status, _ = call(server.port, "PUT", "/v1/shops/overload/items", {"items": [{"item": "ov", "stock": 10**9}]})
    if status != 200:
        raise RuntimeError(f"load: {status}")
    before = latency_p50_ms(server.port)
    out = os.path.join(work, "overload.json")
    subprocess.run(
        [bench, "run", "--target", f"http://127.0.0.1:{server.port}", "--system", "nrtxn",
         "--scenario", "hot-sales", "--connections", str(connections), "--duration", str(seconds),
         "--server-pid", str(server.proc.pid), "--json", out],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=seconds + 300,
    )
    ended = time.time()
    after = latency_p50_ms(server.port)
    while after > 2 * before + 1 and time.time() - ended < 60:
        after = latency_p50_ms(server.port, 20)
    back_s = time.time() - ended
    alive = call(server.port, "GET", "/healthz")[0] == 200
    server.stop()
    r = json.load(open(out))
    verdict_wrong = int(r["oversold"] or 0) + int(r["errors"]) + (0 if alive else 1) + (
        0 if r["check"].get("verdict") == "passed" else 1)
    return {
        "case": "overload",
        "tried": r["ok"] + r["rejected"] + r["overloaded"] + r["errors"],
        "connections": connections,
        "answered": r["ok"] + r["rejected"],
        "overloaded_429": r["overloaded"],
        "errors": r["errors"],
        "p99_ms": r["p99_ms"],
        "peak_rss_mb": r["peak_rss_mb"],
        "p50_before_ms": round(before, 2),
        "p50_after_ms": round(after, 2),
        "back_to_normal_s": round(back_s, 1),
        "lost": 0,
        "doubled": 0,
        "wrong": verdict_wrong,
        "notes": [f"check: {r['check'].get('verdict')}"] if verdict_wrong else [],
    }


def case_sigkill(ctx):
    return kill_cycles(ctx.bin, ctx.work, 3 if ctx.quick else 20, signal.SIGKILL, ctx.rnd)


def case_sigterm(ctx):
    return kill_cycles(ctx.bin, ctx.work, 2 if ctx.quick else 10, signal.SIGTERM, ctx.rnd)


def case_corruption(ctx):
    return corruption(ctx.bin, ctx.work, ctx.rnd, ctx.quick)


def case_overload(ctx):
    return overload(ctx.bin, ctx.work)


# Each case: (module, function), called with the run's context (bin, work, rnd, quick),
# returning a result dict or a list of them. A case of another module (scripts/
# faults_*.py, importing this one for Server, call, Book, run_load and reconcile) puts
# its own `what` and `figures` in each result, with `case`, `tried`, `lost`, `doubled`,
# `wrong` and `notes`.
CASES = {
    "sigkill": (None, "case_sigkill"),
    "sigterm": (None, "case_sigterm"),
    "corruption": (None, "case_corruption"),
    "disk-full": ("faults_disk", "disk_full"),
    "memory": ("faults_memory", "memory_bounds"),
    "overload": (None, "case_overload"),
    "cluster": ("faults_cluster", "cluster"),
    "burst": ("faults_burst", "repeated_burst"),
    "log-ends": ("faults_log", "log_ends"),
}
FULL = ["sigkill", "sigterm", "corruption", "log-ends", "disk-full", "overload", "burst", "memory",
        "cluster"]
QUICK = ["sigkill", "sigterm", "corruption", "log-ends", "disk-full", "memory", "cluster"]


BEGIN, END = "<!-- faults.sh: begin -->", "<!-- faults.sh: end -->"


def describe(r):
    """(what, figures) of a result of one of this file's cases, for the table. Cases
    in the other faults_*.py modules put their own `what` and `figures` in the result."""
    if r["case"] == "overload":
        what = (f"{r['connections']:,} connections of sales (respond=true) for 10 s "
                "(`nrtxn-bench run --scenario hot-sales`), then one caller; no 429 is due: "
                "each connection has one request in flight, far below `--inflight-max` 200,000")
        figures = (f"{r['answered']:,} answered, {r['overloaded_429']:,} answered 429, "
                   f"{r['errors']} errors; p99 {r['p99_ms']} ms; peak RSS {r['peak_rss_mb']} MB; "
                   f"one caller's p50 {r['p50_before_ms']} ms before, {r['p50_after_ms']} ms "
                   f"{r['back_to_normal_s']} s after")
    elif r["case"] == "corruption":
        what = (f"{r['files']} files of a clean data dir, each with a byte flipped (8 times, "
                f"each in its own copy, for an SQLite file) and, apart, cut to half")
        figures = (f"{r['refused']} refused to start with a message, {r['refused_at_read']} started "
                   f"and answer 503 for the damaged rows only, {r['started_same']} started with the "
                   "acknowledged state")
    else:
        what = (f"{r['cycles']} cycles of mixed load (12 callers) and {r['case'].upper()} "
                f"at a random moment, restarted")
        figures = f"{r['answered']:,} answered (200/202); exits {', '.join(r['exits'])}; {r['seconds']} s"
    return what, figures


def markdown(results, command, binary):
    """The campaign's section of docs/reliability.md."""
    rows = []
    for r in results:
        what, figures = (r["what"], r["figures"]) if "what" in r else describe(r)
        verdict = "passed" if not (r["lost"] or r["doubled"] or r["wrong"]) else "**failed**"
        rows.append(f"| {r['case']} | {what} | {r['tried']:,} | {figures} | {r['lost']} | {r['doubled']} | {r['wrong']} | {verdict} |")
    notes = []
    for r in results:
        for n in r["notes"]:
            notes.append(f"- {r['case']}: {n}")
    date = time.strftime("%Y-%m-%d", time.gmtime())
    return "\n".join([
        BEGIN,
        "## Fault campaign (`scripts/faults.sh`)",
        "",
        f"Run {date} on this machine with `{command}` ({binary}). Every case reconciles "
        "what callers were told with what the server holds: every 200 or 202 answer polls "
        "the same (a 202 polls decided); each item's events are gapless and replay to its "
        "stock and reserved at every seq; no key is applied twice; every decided key is in "
        "its item's events; holds pending at a kill have ended after the restart; 200 "
        "answered keys resubmitted get their first outcome. `lost`: an answered request "
        "the server no longer has; `doubled`: a key applied twice; `wrong`: any other "
        "difference (a state that does not replay, a hold still held past its expiry, an "
        "exit code other than the expected one).",
        "",
        "| case | what | requests tried | figures | lost | doubled | wrong | verdict |",
        "|---|---|---:|---|---:|---:|---:|---|",
        *rows,
        "",
        "What the cases saw (for a refusal to start, the server's last line):" if notes else "",
        "",
        *notes,
        "",
        "The property test of the engine (`tests/engine_model.rs`, 24 random sequences by "
        "default, `PROPTEST_CASES` for more), the fuzz target of request decoding "
        "(`api/src/validate.rs`, `mod fuzz`, 2,000 cases) and the HTTP garbage campaign "
        "(`tests/garbage.rs`, 661 malformed requests, every one answered 4xx, none 5xx) run "
        "with the tests.",
        END,
    ])


def write_section(path, section):
    text = open(path).read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    open(path, "w").write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--markdown", help="docs/reliability.md: its campaign section is rewritten")
    ap.add_argument("--command", default="scripts/faults.sh")
    ap.add_argument("--cases", help="comma-separated, from CASES; default all of them (QUICK with --quick)")
    ap.add_argument("--keep", help="JSON lines of an earlier run (what this prints): its results of cases not run now are kept in --markdown's table")
    args = ap.parse_args()
    rnd = random.Random(int(os.environ.get("NRTXN_FAULTS_SEED", time.time())))
    work = tempfile.mkdtemp(prefix="nrtxn-faults.")
    results = []
    cases = args.cases or ",".join(QUICK if args.quick else FULL)
    ctx = argparse.Namespace(bin=args.bin, work=work, rnd=rnd, quick=args.quick)
    try:
        for case in cases.split(","):
            if case not in CASES:
                raise SystemExit(f"faults.py: unknown case {case!r}; the cases: {', '.join(CASES)}")
            module, function = CASES[case]
            run = globals()[function] if module is None else getattr(importlib.import_module(module), function)
            # A module's case may give several results (the cluster cases do).
            got = run(ctx)
            for r in got if isinstance(got, list) else [got]:
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        table = results
        if args.keep:
            # Cases run now replace their earlier results; the others stay, in order.
            ran = {r["case"] for r in results}
            kept = [json.loads(line) for line in open(args.keep) if line.startswith("{")]
            table = [r for r in kept if r["case"] not in ran] + results
            order = {c: i for i, c in enumerate(r["case"] for r in kept)}
            table.sort(key=lambda r: order.get(r["case"], len(order)))
        write_section(args.markdown, markdown(table, args.command, os.path.basename(args.bin)))
    failed = [r["case"] for r in results if r["lost"] or r["doubled"] or r["wrong"]]
    if failed:
        print(f"faults.py: failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
