"""The memory bounds case of the fault campaign (issue 14): each structure that grows
with input, driven up to its bound and past it, on a server of its own.

For each bound of docs/reliability.md's table that grows with input (shops in memory,
cached outcomes, items in memory, pending holds, requests admitted undecided, request
body bytes, open connections) the case:

- drives the server to the bound (at the defaults in the full run, where that fits in
  a few minutes; with small bounds through flags in the quick run);
- checks the documented answer past it: idle shops and old outcomes and idle items
  leave memory and come back from the journal, a hold is `limit_exceeded`, a call is
  `429`, a connection waits in the kernel's backlog;
- reads the server's RSS (`/proc/PID/status`: VmRSS before the load, VmHWM after) and
  checks its growth against the row's documented worst case (`DOCUMENTED`). Where the
  load costs much elsewhere too (the journal, SQLite's page caches), the full run also
  runs the same load on a control server whose bound is far lower (or off): the
  difference between the two growths is the bound's own cost, which is what it checks
  then, and that over the units is the measured cost of one unit, beside the
  documented one. The quick run's units are too few for that: it checks the whole
  growth against the worst case at the defaults, a loose check whose point is the
  behaviour at each bound.

Called by scripts/faults.py (`--cases memory`) as `memory_bounds(ctx)`; returns one
result per bound. Standard library only; every server listens on 127.0.0.1 and is
stopped in a `finally`.
"""

import http.client
import json
import os
import re
import resource
import selectors
import signal
import socket
import threading
import time

import faults

MB = 1024 * 1024


class BoundServer(faults.Server):
    """`faults.Server` that reads its RSS."""

    def rss_mb(self):
        """(VmRSS, VmHWM) of the server, in MB."""
        text = open(f"/proc/{self.proc.pid}/status").read()
        return tuple(int(re.search(k + r":\s+(\d+)", text).group(1)) / 1024 for k in ("VmRSS", "VmHWM"))


def bounds_used(port):
    """`nrtxn_bound_used` and `nrtxn_queue_depth` gauges, by label."""
    status, text = None, ""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/metrics")
        res = conn.getresponse()
        status, text = res.status, res.read().decode()
        conn.close()
    except (OSError, http.client.HTTPException):
        pass
    if status != 200:
        raise RuntimeError(f"metrics: {status}")
    used = {}
    for m in re.finditer(r'^nrtxn_(?:bound_used\{bound|queue_depth\{queue)="(\w+)"\} (\d+)', text, re.M):
        used[m.group(1)] = int(m.group(2))
    return used


def pipeline(port, reqs, conns=8, window=64, timeout=120):
    """Sends `reqs` ((method, path, body or None), in order) over `conns` kept-alive
    connections, `window` requests at a time on each (HTTP/1.1 pipelining): many more
    requests a second than one call at a time. [(status, parsed JSON)] in the order of
    `reqs`; status None for a request whose connection failed (then a new one goes on)."""
    out = [(None, None)] * len(reqs)

    def worker(first):
        todo = list(range(first, len(reqs), conns))
        pos = 0
        while pos < len(todo):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
            except OSError:
                return
            buf = b""
            try:
                while pos < len(todo):
                    window_of = todo[pos:pos + window]
                    data = []
                    for i in window_of:
                        method, path, body = reqs[i]
                        raw = b"" if body is None else json.dumps(body).encode()
                        head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {len(raw)}\r\n"
                        if body is not None:
                            head += "content-type: application/json\r\n"
                        data.append(head.encode() + b"\r\n" + raw)
                    s.sendall(b"".join(data))
                    for i in window_of:
                        while b"\r\n\r\n" not in buf:
                            got = s.recv(1 << 16)
                            if not got:
                                raise OSError("closed")
                            buf += got
                        head, buf = buf.split(b"\r\n\r\n", 1)
                        lines = head.split(b"\r\n")
                        length = 0
                        for line in lines[1:]:
                            k, _, v = line.partition(b":")
                            if k.strip().lower() == b"content-length":
                                length = int(v)
                        while len(buf) < length:
                            got = s.recv(1 << 16)
                            if not got:
                                raise OSError("closed")
                            buf += got
                        raw, buf = buf[:length], buf[length:]
                        try:
                            out[i] = (int(lines[0].split()[1]), json.loads(raw) if raw else None)
                        except ValueError:
                            out[i] = (int(lines[0].split()[1]), None)
                        pos += 1
            except OSError:
                pos += 1  # the request being read is lost; the rest go on a new connection
            finally:
                s.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def statuses(answers):
    """{(http status, body status): count} of pipelined answers, for notes."""
    seen = {}
    for status, body in answers:
        k = f"{status} {(body or {}).get('status') or (body or {}).get('error') or ''}".strip()
        seen[k] = seen.get(k, 0) + 1
    return seen


class Run:
    """One server of the case: started on a fresh data dir, RSS read before the load;
    stopped with SIGTERM, or SIGKILL (`kill`) when a fault would make it wait minutes."""

    def __init__(self, ctx, name, env, kill=False):
        self.server = BoundServer(
            ctx.bin, os.path.join(ctx.work, f"data-mem-{name}"), os.path.join(ctx.work, f"server-mem-{name}.log"), env
        )
        self.name, self.kill = name, kill

    def __enter__(self):
        code = self.server.start()
        if code is not None:
            raise RuntimeError(f"memory {self.name}: the server did not start (exit {code})")
        self.port = self.server.port
        # One request first, so that what every server allocates on its first call
        # (threads' buffers, prepared statements) is in "before", not in the growth.
        faults.call(self.port, "PUT", "/v1/shops/warm/items", {"items": [{"item": "w", "stock": 1}]})
        faults.call(self.port, "POST", "/v1/shops/warm/txns", {"seller": "x", "item": "w", "qty": 1, "request_id": "w"})
        time.sleep(0.2)
        self.before = self.server.rss_mb()[0]
        return self

    def growth(self):
        """(RSS before, peak so far, peak - before), in MB."""
        peak = self.server.rss_mb()[1]
        return self.before, peak, peak - self.before

    def __exit__(self, *exc):
        if self.kill and self.server.proc.poll() is None:
            self.server.kill(signal.SIGKILL)
        else:
            self.server.stop()


def result(name, bound_what, tried, wrong, notes, what, figures):
    return {
        "case": f"memory: {name}",
        "bound": bound_what,
        "tried": tried,
        "lost": 0,
        "doubled": 0,
        "wrong": wrong,
        "notes": notes,
        "what": what,
        "figures": figures,
    }


def mb(x):
    return f"{x:,.1f} MB"


def per_unit_kb(growth_mb, units):
    return growth_mb * 1024 / units if units else float("nan")


# docs/reliability.md's figures, row by row: (one unit in KB, worst case at the defaults
# in MB). Keep them equal to the table's: the case checks what was measured against them.
DOCUMENTED = {
    "shops": (4.0, 40),
    "outcomes": (0.68, 136),
    "items": (0.3, 600),
    "holds": (0.4, 3_200),
    "inflight": (1.3, 260),
    "bodies": (None, 400),
    "connections": (18, 180),
}


def check_rss(notes, name, growth, worst_mb, what="RSS grew"):
    """1 if the growth passes the documented worst case (and a note), else 0."""
    if growth > worst_mb:
        notes.append(f"{name}: {what} {mb(growth)}, over the documented worst case {mb(worst_mb)}")
        return 1
    return 0


def verdict(ctx, name, growth, notes, worst_mb, control=None):
    """(wrong, words for the figures). The quick run checks the whole growth against
    the row's worst case; the full run, given a `control` (the arguments of
    `with_control` after `growth`), checks the bound's own cost."""
    if ctx.quick or control is None:
        return check_rss(notes, name, growth, worst_mb), ""
    return with_control(ctx, name, growth, *control, notes, worst_mb)


def with_control(ctx, name, growth, label, env, drive, units, unit_name, notes, worst_mb):
    """The same load on a control server (`env`: the bound far lower, or off, as `label`
    says): the difference between the two growths is the bound's own cost, free of what
    the load costs elsewhere, checked against `worst_mb`. (wrong, the figures' words)."""
    with Run(ctx, f"{name}-control", env) as run:
        drive(run, False)
        _, _, growth_c = run.growth()
    own = growth - growth_c
    unit_doc = DOCUMENTED[name][0]
    wrong = check_rss(notes, name, own, worst_mb, "its own cost (over the control) is")
    words = (f"; control ({label}) +{mb(growth_c)}, so {mb(own)} its own: {per_unit_kb(own, units):.2f} KB "
             f"{unit_name} (documented {unit_doc} KB)")
    return wrong, words


# --- shops in memory ---------------------------------------------------------------


def shops(ctx):
    """One request in each of more shops than `--shops-max`: the shops in memory never
    pass it (idle ones make room: every request answered), and a shop that left memory
    comes back with its outcome. The outcome cache is off, as in the documented
    measurement, so that the growth is the shops' own."""
    bound = 50 if ctx.quick else 10_000
    n = bound * 8 // 5 if ctx.quick else bound + 5_000
    env = {"NRTXN_SHOPS_MAX": bound, "NRTXN_OUTCOME_CACHE_PER_SHOP": 0}
    worst_mb = DOCUMENTED["shops"][1]
    notes, wrong, tried = [], 0, 0

    def drive(run, check):
        nonlocal wrong, tried
        reqs = [("POST", f"/v1/shops/m{i}/txns", {"seller": "x", "item": "none", "qty": 1, "request_id": "r"})
                for i in range(n)]
        used_max, answers = 0, []
        for at in range(0, n, 2_500):
            # Many callers at once, as many shops' clients would be: new shops arrive
            # together at the bound, each of them needing an idle one to make room.
            answers += pipeline(run.port, reqs[at:at + 2_500], conns=16 if ctx.quick else 256, window=1)
            used_max = max(used_max, bounds_used(run.port).get("shops", 0))
        tried += n
        if not check:
            return used_max
        bad = [a for a in answers if (a[0], (a[1] or {}).get("status")) != (200, "unknown_item")]
        if bad:
            wrong += 1
            notes.append(f"shops: {len(bad)} of {n} requests not answered 200 unknown_item: {statuses(bad)}")
        if used_max > bound:
            wrong += 1
            notes.append(f"shops: {used_max} shops in memory, bound {bound}")
        # The first shop left memory to make room; it comes back with its outcome.
        status, again = faults.call(run.port, "POST", "/v1/shops/m0/txns", reqs[0][2])
        polled = faults.call(run.port, "GET", "/v1/shops/m0/txns/r")
        tried += 2
        if status != 200 or again != answers[0][1] or polled != (200, answers[0][1]):
            wrong += 1
            notes.append(f"shops: m0 back: {status} {again}, polls {polled}, first {answers[0]}")
        return used_max

    with Run(ctx, "shops", env) as run:
        used_max = drive(run, True)
        before, peak, growth = run.growth()
    control = 100
    w, words = verdict(ctx, "shops", growth, notes, worst_mb, (
        f"`--shops-max {control}`", dict(env, NRTXN_SHOPS_MAX=control), drive, bound - control, "a shop"))
    wrong += w
    figures = (f"{n:,} shops, {used_max:,} in memory at most (bound {bound:,}); RSS {mb(before)} → "
               f"{mb(peak)} (+{mb(growth)}){words}; documented worst case {worst_mb:,} MB")
    what = (f"one sale in each of {n:,} shops (`--shops-max {bound:,}`, outcome cache off), "
            "then the first shop again")
    return result("shops", "--shops-max", tried, wrong, notes, what, figures)


# --- cached outcomes ---------------------------------------------------------------


def outcomes(ctx):
    """Sales in batches: first in one shop past `--outcome-cache-per-shop`, then in more
    shops until past `--outcome-cache-total`; the cache never passes either, and keys
    whose outcomes left memory answer their first outcome again, applied once."""
    per_shop, total = (200, 1_000) if ctx.quick else (10_000, 200_000)
    first_n = per_shop * 6 // 5
    shops_n = total // per_shop + 4
    batch = 100 if ctx.quick else 1_000
    stock = 10**9
    env = {"NRTXN_OUTCOME_CACHE_PER_SHOP": per_shop, "NRTXN_OUTCOME_CACHE_TOTAL": total}
    worst_mb = DOCUMENTED["outcomes"][1]
    notes, wrong, tried = [], 0, 0
    sales = first_n + (shops_n - 1) * per_shop

    def sale(shop, k):
        return {"seller": "x", "item": "sku", "qty": 1, "request_id": f"{shop}-{k}"}

    def drive(run, check):
        nonlocal wrong, tried
        port = run.port
        loads = [("PUT", f"/v1/shops/o{s}/items", {"items": [{"item": "sku", "stock": stock}]}) for s in range(shops_n)]
        if any(a[0] != 200 for a in pipeline(port, loads)):
            raise RuntimeError("outcomes: loads failed")
        tried += shops_n
        # One shop alone past its own bound.
        reqs = [("POST", "/v1/shops/o0/txns/batch", {"txns": [sale("o0", k) for k in range(at, min(first_n, at + batch))]})
                for at in range(0, first_n, batch)]
        answers = pipeline(port, reqs, conns=1, window=1)
        alone = bounds_used(port).get("outcomes_cached", 0)
        # Then the others, each up to its own bound: together past the total.
        reqs = [("POST", f"/v1/shops/o{s}/txns/batch", {"txns": [sale(f"o{s}", k) for k in range(at, at + batch)]})
                for s in range(1, shops_n) for at in range(0, per_shop, batch)]
        cached_max = 0
        for at in range(0, len(reqs), 16):
            answers += pipeline(port, reqs[at:at + 16], conns=4, window=1)
            cached_max = max(cached_max, bounds_used(port).get("outcomes_cached", 0))
        tried += sales
        if not check:
            return alone, cached_max
        oks = sum(1 for status, body in answers if status == 200
                  for r in body["results"] if r.get("status") == "ok")
        if oks != sales:
            wrong += 1
            notes.append(f"outcomes: {oks} of {sales} sales ok: {statuses(answers)}")
        if alone > per_shop + 1:  # the warm-up shop's one outcome besides
            wrong += 1
            notes.append(f"outcomes: one shop caches {alone}, bound {per_shop}")
        if cached_max > total:
            wrong += 1
            notes.append(f"outcomes: {cached_max} cached, bound {total}")
        # The first keys' outcomes left memory long ago: a repeat answers the first outcome
        # from the journal, and nothing is applied twice.
        firsts = answers[0][1]["results"][:20]
        again = faults.call(port, "POST", "/v1/shops/o0/txns/batch", {"txns": [sale("o0", k) for k in range(20)]})
        tried += 20
        if again[0] != 200 or [(r["status"], r.get("seq")) for r in again[1]["results"]] != [
                (r["status"], r.get("seq")) for r in firsts]:
            wrong += 1
            notes.append(f"outcomes: o0's first keys again: {again[0]} {str(again[1])[:200]}")
        status, item = faults.call(port, "GET", "/v1/shops/o0/items/sku")
        if status != 200 or item["stock"] != stock - first_n:
            wrong += 1
            notes.append(f"outcomes: o0 sku reads {status} {item}, want stock {stock - first_n}")
        return alone, cached_max

    with Run(ctx, "outcomes", env) as run:
        alone, cached_max = drive(run, True)
        before, peak, growth = run.growth()
    w, words = verdict(ctx, "outcomes", growth, notes, worst_mb, (
        "cache off", {"NRTXN_OUTCOME_CACHE_PER_SHOP": 0, "NRTXN_OUTCOME_CACHE_TOTAL": 0}, drive, total,
        "an outcome"))
    wrong += w
    figures = (f"{sales:,} sales in {shops_n} shops: one shop {alone:,} cached (bound {per_shop:,}), "
               f"all {cached_max:,} at most (bound {total:,}); RSS {mb(before)} → {mb(peak)} (+{mb(growth)})"
               f"{words}; documented worst case {worst_mb:,} MB")
    what = (f"{first_n:,} sales in one shop, then {per_shop:,} in each of {shops_n - 1} more, in batches; "
            f"then the first shop's first keys again (`--outcome-cache-per-shop {per_shop:,}`, "
            f"`--outcome-cache-total {total:,}`)")
    return result("outcomes", "--outcome-cache-per-shop, --outcome-cache-total", tried, wrong, notes, what, figures)


# --- items in memory ---------------------------------------------------------------


def items(ctx):
    """More items than `--items-max` loaded in batches: the items in memory settle within
    the bound, and an item that left memory is read back with its stock and seq."""
    bound = 2_000 if ctx.quick else 2_000_000
    n = bound * 3 // 2 if ctx.quick else bound + 200_000
    per_load = 500 if ctx.quick else 10_000
    env = {"NRTXN_ITEMS_MAX": bound}
    worst_mb = DOCUMENTED["items"][1]
    notes, wrong, tried = [], 0, 0

    def drive(run, check):
        nonlocal wrong, tried
        port = run.port
        reqs = [("PUT", "/v1/shops/it/items", {"items": [{"item": f"sku-{i:08d}", "stock": 5}
                                                          for i in range(at, min(n, at + per_load))]})
                for at in range(0, n, per_load)]
        answers = []
        for at in range(0, len(reqs), 8):
            answers += pipeline(port, reqs[at:at + 8], conns=2, window=1)
        tried += len(reqs)
        deadline = time.time() + 30
        used = bounds_used(port).get("items", 0)
        while used > bound and time.time() < deadline:
            time.sleep(0.2)
            used = bounds_used(port).get("items", 0)
        if not check:
            return used
        bad = [a for a in answers if a[0] != 200]
        if bad:
            wrong += 1
            notes.append(f"items: {len(bad)} loads failed: {statuses(bad)}")
        if used > bound:
            wrong += 1
            notes.append(f"items: {used} items in memory 30 s after the loads, bound {bound}")
        # The first item left memory long ago: a sale goes on from its stock and seq.
        status, sold = faults.call(port, "POST", "/v1/shops/it/txns",
                                   {"seller": "x", "item": "sku-00000000", "qty": 1, "request_id": "t0"})
        reads = [faults.call(port, "GET", f"/v1/shops/it/items/sku-{i:08d}") for i in range(1, n, n // 20)]
        unknown = faults.call(port, "GET", "/v1/shops/it/items/sku-none")[0]
        tried += 2 + len(reads)
        if (status, (sold or {}).get("status"), (sold or {}).get("stock_before"), (sold or {}).get("seq")) != (200, "ok", 5, 2):
            wrong += 1
            notes.append(f"items: sale of an item that left memory: {status} {sold}")
        if any(s != 200 or v["stock"] != 5 for s, v in reads) or unknown != 404:
            wrong += 1
            notes.append(f"items: reads {[s for s, _ in reads]}, unknown item {unknown}")
        return used

    with Run(ctx, "items", env) as run:
        used = drive(run, True)
        before, peak, growth = run.growth()
    control = bound // 10
    w, words = verdict(ctx, "items", growth, notes, worst_mb, (
        f"`--items-max {control:,}`", {"NRTXN_ITEMS_MAX": control}, drive, bound - control, "an item"))
    wrong += w
    figures = (f"{n:,} items, {used:,} in memory after (bound {bound:,}); RSS {mb(before)} → {mb(peak)} "
               f"(+{mb(growth)}){words}; documented worst case {worst_mb:,} MB")
    what = (f"{n:,} items loaded {per_load:,} a call (`--items-max {bound:,}`), then a sale of the first "
            "and reads of a sample")
    return result("items", "--items-max", tried, wrong, notes, what, figures)


# --- pending holds -----------------------------------------------------------------


def holds(ctx):
    """More holds than `--holds-max` on one shard, none ending: the ones past the bound
    are `limit_exceeded` (nothing reserved), and once one ends another is taken. The
    default (1,000,000 a shard, 8 shards) is more than the run has time for: the cost of
    one pending hold is measured at a lower bound, against a control whose bound is 1."""
    bound = 300 if ctx.quick else 100_000
    n = bound + bound // 10
    env = {"NRTXN_HOLDS_MAX": bound, "NRTXN_SHARDS": 1}
    unit_doc_kb, worst_default_mb = DOCUMENTED["holds"]
    notes, wrong, tried = [], 0, 0

    def drive(run, check):
        nonlocal wrong, tried
        port = run.port
        status, _ = faults.call(port, "PUT", "/v1/shops/h/items", {"items": [{"item": "sku", "stock": 10**9}]})
        if status != 200:
            raise RuntimeError(f"holds: load {status}")
        reqs = [("POST", "/v1/shops/h/holds", {"item": "sku", "qty": 1, "ttl_ms": 3_600_000, "request_id": f"h{i}"})
                for i in range(n)]
        answers = pipeline(port, reqs, conns=16, window=32)
        tried += n + 1
        if not check:
            return answers
        held = sum(1 for s, b in answers if s == 200 and b.get("status") == "held")
        refused = sum(1 for s, b in answers if s == 200 and b.get("status") == "limit_exceeded")
        if (held, refused) != (bound, n - bound):
            wrong += 1
            notes.append(f"holds: {held} held and {refused} limit_exceeded of {n}, bound {bound}: {statuses(answers)}")
        status, item = faults.call(port, "GET", "/v1/shops/h/items/sku")
        if status != 200 or item["reserved"] != held:
            wrong += 1
            notes.append(f"holds: item reads {status} {item}, {held} held")
        # One ends: another is taken.
        first = next(i for i, (s, b) in enumerate(answers) if s == 200 and b.get("status") == "held")
        cancel = faults.call(port, "POST", f"/v1/shops/h/holds/h{first}/cancel", {})
        more = faults.call(port, "POST", "/v1/shops/h/holds",
                           {"item": "sku", "qty": 1, "ttl_ms": 3_600_000, "request_id": "after"})
        tried += 2
        if cancel[0] != 200 or (more[0], (more[1] or {}).get("status")) != (200, "held"):
            wrong += 1
            notes.append(f"holds: cancel {cancel[0]}, then a hold: {more}")
        return held

    with Run(ctx, "holds", env) as run:
        held = drive(run, True)
        before, peak, growth = run.growth()
    # The quick run's holds are too few for a cost apart from what every request costs:
    # its growth is held to the worst case at the defaults. The full run's own cost is
    # held to the documented cost of one hold times its bound.
    worst_mb = worst_default_mb if ctx.quick else unit_doc_kb * bound / 1024
    w, words = verdict(ctx, "holds", growth, notes, worst_mb, (
        "`--holds-max 1`", dict(env, NRTXN_HOLDS_MAX=1), drive, bound - 1, "a pending hold"))
    wrong += w
    figures = (f"{n:,} holds, {held:,} held (bound {bound:,} on 1 shard); RSS {mb(before)} → {mb(peak)} "
               f"(+{mb(growth)}){words}; documented worst case "
               + ("" if ctx.quick else f"{worst_mb:,.0f} MB at this bound, ")
               + f"{worst_default_mb:,} MB at the defaults (1,000,000 a shard × 8)")
    what = (f"{n:,} holds of one item, none ending (`--holds-max {bound:,} --shards 1`), "
            "then one cancelled and one more")
    return result("holds", "--holds-max", tried, wrong, notes, what, figures)


# --- requests admitted, undecided -----------------------------------------------------


def inflight(ctx):
    """Fire-and-forget sales admitted faster than they are decided: their items have left
    memory (`--items-max 8`) and each read of an item back from the journal is held
    back (`NRTXN_FAULT_JOURNAL_READ_MS`), so they wait. One shop up to
    `--shop-pending-max`, then another up to `--inflight-max`: each call past a bound is
    429, and the undecided never pass it."""
    total, per_shop = (2_000, 1_000) if ctx.quick else (200_000, 100_000)
    batch = 250 if ctx.quick else 1_000
    env = {"NRTXN_INFLIGHT_MAX": total, "NRTXN_SHOP_PENDING_MAX": per_shop, "NRTXN_ITEMS_MAX": 8,
           "NRTXN_FAULT_JOURNAL_READ_MS": 600_000}
    unit_doc_kb, worst_mb = DOCUMENTED["inflight"]
    notes, wrong, tried = [], 0, 0
    # The reads wait for minutes: a SIGTERM would wait for them, hence SIGKILL.
    with Run(ctx, "inflight", env, kill=True) as run:
        port = run.port
        loads = [("a", ["sku"]), ("b", ["sku"]), ("c", ["sku"]), ("z", [f"f{i}" for i in range(100)])]
        for shop, names in loads:
            status, _ = faults.call(port, "PUT", f"/v1/shops/{shop}/items",
                                    {"items": [{"item": i, "stock": 10**9} for i in names]})
            tried += 1
            if status != 200:
                raise RuntimeError(f"inflight: load {status}")
        # The 100 items of shop z, loaded last, push the three sold ones out of memory.
        deadline = time.time() + 10
        while bounds_used(port).get("items", 0) > 8 and time.time() < deadline:
            time.sleep(0.1)
        calls = per_shop // batch + 1

        def reqs(shop, k):
            return [("POST", f"/v1/shops/{shop}/txns/batch",
                     {"txns": [{"seller": "x", "item": "sku", "qty": 1, "respond": False, "request_id": f"{shop}{c}-{j}"}
                               for j in range(batch)]})
                    for c in range(k)]

        got = {}
        for shop, k in (("a", calls), ("b", calls), ("c", 1)):
            # One call at a time, in order: each admitted call has its place before the next.
            answers = pipeline(port, reqs(shop, k), conns=1, window=1)
            tried += k * batch
            got[shop] = [s for s, _ in answers]
        undecided = bounds_used(port).get("inflight", 0)
        before, peak, growth = run.growth()
    want = {"a": [200] * (calls - 1) + [429], "b": [200] * (calls - 1) + [429], "c": [429]}
    answered = "two shops' last calls and a third shop's first answered 429"
    if got != want:
        wrong += 1
        answered = "calls answered by shop " + ", ".join(
            f"{s}: {sum(1 for x in v if x == 200)}×200 {sum(1 for x in v if x == 429)}×429 "
            f"{sum(1 for x in v if x not in (200, 429))} other" for s, v in got.items())
        notes.append(f"inflight: {answered}; want {calls - 1}×200 then 429 in a and b, 429 in c")
    if undecided != total:
        wrong += 1
        notes.append(f"inflight: {undecided} undecided, want the bound {total}")
    wrong += check_rss(notes, "inflight", growth, worst_mb)
    # A cost per request only where the requests are many enough to outweigh the rest.
    unit = "" if ctx.quick else f", {per_unit_kb(growth, undecided):.2f} KB a request; documented about {unit_doc_kb} KB"
    figures = (f"{undecided:,} undecided (bound {total:,}; {per_shop:,} a shop): {answered}; RSS {mb(before)} → {mb(peak)} (+{mb(growth)}{unit}); "
               f"documented worst case about {worst_mb} MB")
    what = (f"fire-and-forget sales in batches of {batch:,} of items whose reads from the journal are held "
            f"back: {calls} calls in each of two shops and one in a third (`--inflight-max {total:,}`, "
            f"`--shop-pending-max {per_shop:,}`)")
    return result("inflight", "--inflight-max, --shop-pending-max", tried, wrong, notes, what, figures)


# --- request body bytes ------------------------------------------------------------------


def partial_body(port, length, sent):
    """A load whose body says `length` bytes, of which `sent` are sent."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"PUT /v1/shops/b/items HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              f"content-length: {length}\r\n\r\n".encode())
    chunk = b" " * (64 * 1024)
    left = sent
    try:
        while left > 0:
            left -= s.send(chunk[:min(left, len(chunk))])
    except OSError:
        pass  # refused part way (429) and closed
    return s


def status_line(s, timeout):
    s.settimeout(timeout)
    try:
        line = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    except OSError:
        return ""
    return line.split(" ")[1] if line.startswith("HTTP/") else line


def bodies(ctx):
    """Load bodies that never complete, each one near the largest (4 MiB), until their
    bytes pass `--body-bytes-max`: the body that would pass it is 429, the held ones
    408 at the body timeout, and their bytes are let go."""
    bound = 8 * MB if ctx.quick else 256 * MB
    timeout_ms = 3_000 if ctx.quick else 10_000
    length, sent = 4 * MB - 1, 4_000_000
    n = bound // sent + 2
    env = {"NRTXN_BODY_BYTES_MAX": bound, "NRTXN_BODY_TIMEOUT_MS": timeout_ms}
    worst_mb = DOCUMENTED["bodies"][1]
    notes, wrong = [], 0
    with Run(ctx, "bodies", env) as run:
        conns, held_max = [], 0
        try:
            for _ in range(n):
                conns.append(partial_body(run.port, length, sent))
                time.sleep(0.05)
                held_max = max(held_max, bounds_used(run.port).get("body_bytes", 0))
            time.sleep(0.5)
            held_max = max(held_max, bounds_used(run.port).get("body_bytes", 0))
            lines = [status_line(s, timeout_ms / 1000 + 5) for s in conns]
        finally:
            for s in conns:
                s.close()
        time.sleep(0.2)
        held_after = bounds_used(run.port).get("body_bytes", 0)
        alive = faults.call(run.port, "GET", "/healthz")[0]
        before, peak, growth = run.growth()
    counts = {k: lines.count(k) for k in sorted(set(lines))}
    full = bound // sent
    if lines.count("408") < full - 1 or lines.count("429") < 1 or set(lines) - {"408", "429"}:
        wrong += 1
        notes.append(f"bodies: {n} bodies answered {counts}; want {full} 408 and the rest 429")
    if held_max > bound + 64 * 1024 or held_after != 0 or alive != 200:
        wrong += 1
        notes.append(f"bodies: {held_max} bytes held at most, {held_after} after, healthz {alive}")
    wrong += check_rss(notes, "bodies", growth, worst_mb)
    said = ", ".join(f"{c} answered {k or 'nothing'}" for k, c in counts.items())
    figures = (f"{held_max / MB:,.1f} MiB held at most (bound {bound // MB} MiB); {said}; "
               f"RSS {mb(before)} → {mb(peak)} (+{mb(growth)}); documented worst case {worst_mb:,} MB "
               "plus the bodies being parsed")
    what = (f"{n} loads each sending {sent:,} bytes of a 4 MiB body and no more "
            f"(`--body-bytes-max {bound // MB} MiB`, `--body-timeout-ms {timeout_ms:,}`)")
    return result("bodies", "--body-bytes-max", n, wrong, notes, what, figures)


# --- open connections ------------------------------------------------------------------


HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


class Conns:
    """Many kept-alive connections, each asking `/healthz` a round at a time (so that
    the server's keep-alive timeout, 5 s, never closes them)."""

    def __init__(self, port):
        self.port, self.socks, self.sel = port, [], selectors.DefaultSelector()

    def open(self, n):
        new = []
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
            new.append(s)
        self.socks += new
        return new

    def round(self, socks, timeout):
        """Sends one request on each of `socks` and waits for the answers: how many came."""
        pending = {}
        for s in socks:
            pending[s.fileno()] = [s, b"", False]
            self.sel.register(s, selectors.EVENT_WRITE | selectors.EVENT_READ)
        answered = 0
        deadline = time.time() + timeout
        try:
            while pending and time.time() < deadline:
                for key, ev in self.sel.select(timeout=max(0.0, deadline - time.time())):
                    p = pending.get(key.fd)
                    if p is None:
                        continue
                    s = p[0]
                    if ev & selectors.EVENT_WRITE and not p[2]:
                        try:
                            s.send(HEALTHZ)
                            p[2] = True
                            self.sel.modify(s, selectors.EVENT_READ)
                        except OSError:
                            pass
                        continue
                    if ev & selectors.EVENT_READ:
                        try:
                            got = s.recv(4096)
                        except OSError:
                            got = b""
                        p[1] += got
                        if not got or (b"\r\n\r\n" in p[1] and p[1].endswith(b"}")):
                            answered += 1 if got else 0
                            self.sel.unregister(s)
                            del pending[key.fd]
        finally:
            for p in pending.values():
                self.sel.unregister(p[0])
        return answered

    def close(self, socks):
        for s in socks:
            s.close()
            self.socks.remove(s)


def connections(ctx):
    """`--connections-max` kept-alive connections: each answered; one more waits in the
    kernel's backlog, unanswered, until some close."""
    bound = 64 if ctx.quick else 10_000
    # This process holds as many sockets as the server does, and the server inherits
    # its limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = bound + 1_024
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < want:
            raise RuntimeError(f"connections: {want} open files needed, the limit is {hard}")
    env = {"NRTXN_CONNECTIONS_MAX": bound}
    worst_mb = DOCUMENTED["connections"][1]
    notes, wrong, tried = [], 0, 0
    with Run(ctx, "connections", env) as run:
        conns = Conns(run.port)
        try:
            served = 0
            step = 16 if ctx.quick else 500
            while len(conns.socks) < bound:
                # A few hundred at a time, within the listen backlog; every open one asked
                # again each time, so that none reaches the keep-alive timeout.
                conns.open(min(step, bound - len(conns.socks)))
                served = conns.round(list(conns.socks), 10)
                tried += len(conns.socks)
            extra = conns.open(1)
            # The open ones asked again while the extra one waits.
            t = time.time()
            conns.round(list(conns.socks[:-1]), 10)
            waited = conns.round(extra, 2.0)
            conns.round(list(conns.socks[:-1]), 10)
            before, peak, growth = run.growth()
            closed = conns.socks[:10]
            conns.close(closed)
            late = conns.round(extra, 5.0)
            waited_s = time.time() - t
            tried += 2 * bound + 2
        finally:
            conns.close(list(conns.socks))
    if served != bound:
        wrong += 1
        notes.append(f"connections: {served} of {bound} answered")
    if waited or not late:
        wrong += 1
        notes.append(f"connections: one past the bound answered {'at once' if waited else 'never, after 10 closed'}")
    wrong += check_rss(notes, "connections", growth, worst_mb)
    unit = "" if ctx.quick else (f", {per_unit_kb(growth, bound):.1f} KB a connection; documented "
                                 f"{DOCUMENTED['connections'][0]} KB")
    figures = (f"{served:,} connections answered (bound {bound:,}); one more answered only once 10 closed "
               f"({waited_s:.1f} s); RSS {mb(before)} → {mb(peak)} (+{mb(growth)}{unit}); "
               f"documented worst case about {worst_mb:,} MB")
    what = f"{bound:,} kept-alive connections asking `/healthz`, and one more (`--connections-max {bound:,}`)"
    return result("connections", "--connections-max", tried, wrong, notes, what, figures)


BOUNDS = [shops, outcomes, items, holds, inflight, bodies, connections]


def memory_bounds(ctx):
    """One result per bound, in the order of docs/reliability.md's table."""
    out = []
    for bound in BOUNDS:
        started = time.time()
        r = bound(ctx)
        r["seconds"] = round(time.time() - started, 1)
        out.append(r)
    return out
