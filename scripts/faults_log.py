"""The log's ends case of the fault campaign: damage to the embedded log that a torn
write cannot explain, each variant in a copy of one data dir.

A server with 1 MiB segments takes loads (several segments' worth) and mixed traffic;
every answered key is polled and every item read, then the server is killed (SIGKILL:
the views may lag the log). Each variant then damages a copy:

- the newest segment's last 100 bytes cut, or the newest segment deleted, each with the
  views kept and with them removed (then only the log and its durable mark say what
  was acknowledged);
- each older (sealed) segment cut by 1 byte, by 100 bytes, to half, deleted, and with
  a byte flipped at a random place;
- the durable mark (`journal/DURABLE`) with a byte flipped.

A variant passes when the server refuses to start with a message, or starts with every
answered key polling the same and every item as it was. A flip inside an older segment
the start does not read must be found by the full read after the start
(`nrtxn_journal_damaged_segments`), or the start must refuse: a start with the state
whole and the damage unreported counts as `wrong` (damage started with no word). The
log is a decision's only copy (the views keep a row per record, not per decision:
docs/decisions/derived-views.md), so the keys of a flipped record cannot be answered:
a start that reports the damage and refuses those keys' polls with `503` (the journal
is damaged; a backup is the second copy) passes as `refused reads`, never `404` or
another outcome. A start with a state other than the acknowledged one counts as `lost`.

Called by scripts/faults.py (`--cases log-ends`) as `log_ends(ctx)`.
"""

import http.client
import os
import shutil
import signal
import time

import faults

SEGMENT_MB = 1


def snapshot(binary, work):
    """A killed data dir with several segments, and what callers were told."""
    base = os.path.join(work, "data-log")
    server = faults.Server(binary, base, os.path.join(work, "server-log.log"),
                           env={"NRTXN_JOURNAL_SEGMENT_MB": SEGMENT_MB,
                                "NRTXN_FAULT_KEEP_SEGMENTS": 1})
    server.start()
    faults.load_items(server.port)
    book = faults.Book()
    stop, workers = faults.run_load([server.port], book, 1.5, 0, threads=6)
    stop.set()
    for w in workers:
        w.join()
    time.sleep(1.0)
    acked = {}
    for key, t in book.txns.items():
        if t["http"] in (200, 202):
            status, ans = faults.call(server.port, "GET", f"/v1/shops/{faults.SHOP}/txns/{key}")
            if status == 200 and ans.get("status") != "pending":
                acked[key] = (ans["status"], ans.get("seq"))
    items = {}
    for item in faults.ITEMS:
        _, view = faults.call(server.port, "GET", f"/v1/shops/{faults.SHOP}/items/{item}")
        items[item] = (view["stock"], view["reserved"], view["seq"])
    # Then about 5 MiB of loads (several segments), killed at once. Older segments are
    # kept (they are retired once the views hold them for good, as a checkpoint falling
    # behind would keep them; NRTXN_FAULT_KEEP_SEGMENTS), so that there are some to damage.
    others = [{"item": f"bulk-{n:05}", "stock": 5} for n in range(2000)]
    for _ in range(60):
        faults.call(server.port, "PUT", f"/v1/shops/{faults.SHOP}/items", {"items": others})
    server.kill(signal.SIGKILL)
    return base, acked, items


def segments(data):
    d = os.path.join(data, "journal")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".log"))


def cut(path, bytes_):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(max(0, size - bytes_))


def drop_views(data):
    for f in ["nrtxn.db", "nrtxn.db-wal", "nrtxn.db-shm"]:
        try:
            os.remove(os.path.join(data, f))
        except FileNotFoundError:
            pass


def variants(base, rnd):
    """(name, damage(copy)) for every variant."""
    segs = [os.path.basename(p) for p in segments(base)]
    newest = lambda d: os.path.join(d, "journal", segs[-1])  # noqa: E731
    out = []
    for views in ("views kept", "views removed"):
        extra = drop_views if views == "views removed" else (lambda d: None)
        out.append((f"newest segment's last 100 bytes cut, {views}",
                    lambda d, e=extra: (cut(newest(d), 100), e(d))))
        out.append((f"newest segment deleted, {views}",
                    lambda d, e=extra: (os.remove(newest(d)), e(d))))
    for name in segs[:-1]:
        at = lambda d, n=name: os.path.join(d, "journal", n)  # noqa: E731
        out.append((f"{name} cut by 1 byte", lambda d, a=at: cut(a(d), 1)))
        out.append((f"{name} cut by 100 bytes", lambda d, a=at: cut(a(d), 100)))
        out.append((f"{name} cut to half",
                    lambda d, a=at: cut(a(d), os.path.getsize(a(d)) // 2)))
        out.append((f"{name} deleted", lambda d, a=at: os.remove(a(d))))
        out.append((f"{name} a byte flipped", lambda d, a=at: faults.flip_bit(a(d), rnd)))
    out.append(("DURABLE a byte flipped",
                lambda d: faults.flip_bit(os.path.join(d, "journal", "DURABLE"), rnd)))
    return out


def damaged_segments(port, wait_s=10.0):
    """The full read's count of damaged older segments, once it has had time to run."""
    deadline = time.time() + wait_s
    found = 0
    while time.time() < deadline:
        conn_status, _ = faults.call(port, "GET", "/readyz")
        text = metrics_text(port)
        for line in text.splitlines():
            if line.startswith("nrtxn_journal_damaged_segments "):
                found = int(float(line.split()[1]))
        if found or conn_status is None:
            return found
        time.sleep(0.5)
    return found


def metrics_text(port):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    except OSError:
        return ""


def log_ends(ctx):
    base, acked, items = snapshot(ctx.bin, ctx.work)
    tried = refused = same = found_after = refused_reads = lost = wrong = 0
    notes = []
    for name, damage in variants(base, ctx.rnd):
        copy = os.path.join(ctx.work, "data-log-damaged")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(base, copy)
        damage(copy)
        tried += 1
        log = os.path.join(ctx.work, "server-log-damaged.log")
        open(log, "w").close()
        s = faults.Server(ctx.bin, copy, log, env={"NRTXN_JOURNAL_SEGMENT_MB": SEGMENT_MB})
        try:
            code = s.start()
        except RuntimeError as e:
            code = f"not ready: {e}"
        if code is not None:
            message = open(log, errors="replace").read().strip().splitlines()
            if message:
                refused += 1
                notes.append(f"{name}: refused: {message[-1].replace(copy, 'DATA_DIR')[:240]}")
            else:
                wrong += 1
                notes.append(f"{name}: refused with no message (exit {code})")
            continue
        missing = []
        unreadable = 0
        for key, want in acked.items():
            status, ans = faults.call(s.port, "GET", f"/v1/shops/{faults.SHOP}/txns/{key}")
            if status == 503:
                unreadable += 1
            elif status != 200 or (ans["status"], ans.get("seq")) != want:
                missing.append(f"{key} polls {status}")
        for item, want in items.items():
            status, view = faults.call(s.port, "GET", f"/v1/shops/{faults.SHOP}/items/{item}")
            if status != 200 or (view["stock"], view["reserved"], view["seq"]) != want:
                missing.append(f"{item} {view} want {want}")
        # A flip inside a segment the start may not read: the full read must report it.
        segment_flip = name.endswith(".log a byte flipped")
        damaged = damaged_segments(s.port) if segment_flip else 0
        s.stop()
        if unreadable and not (segment_flip and damaged):
            missing.append(f"{unreadable} keys poll 503 with no damage reported")
        if missing:
            lost += 1
            notes.append(f"{name}: started without acknowledged state: {missing[:3]}")
        elif unreadable:
            refused_reads += 1
            notes.append(f"{name}: started, reported the damage, {unreadable} keys of the "
                         "damaged record refused (503)")
        elif damaged:
            found_after += 1
        elif segment_flip:
            wrong += 1
            notes.append(f"{name}: started, the damage not reported")
        else:
            same += 1
    figures = (f"{tried} variants on {len(segments(base))} segments: {refused} refused to start "
               f"with a message, {found_after} started and reported the damaged segment "
               f"(full read after the start), {refused_reads} started, reported it and "
               f"refused the damaged record's keys (503), {same} started with the "
               f"acknowledged state "
               f"({len(acked):,} answered keys, {len(items)} items checked)")
    return {
        "case": "log-ends",
        "what": ("a killed data dir with 1 MiB segments: the newest segment cut by 100 bytes "
                 "or deleted (with and without the views), each older segment cut by 1, by "
                 "100 bytes, to half, deleted, a byte flipped; the durable mark flipped"),
        "figures": figures,
        "tried": tried,
        "lost": lost,
        "doubled": 0,
        "wrong": wrong,
        "notes": notes,
    }
