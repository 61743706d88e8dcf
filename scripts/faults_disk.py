"""The disk-full case of the fault campaign (issue 14): the data dir on a small tmpfs,
filled under load, as root.

On a tmpfs of its own (the server's log stays outside it), with `--disk-free-min-mb`
8, one server under the campaign's mixed load (12 callers) goes through:

1. filling: a filler file leaves the server 8 MiB plus some room; the load's own
   writes use that room until writes are refused (`503 disk_full`), and then some more,
   never taking the free space below the floor (read every 2 ms, here and in 2 and 4);
2. room again: the filler shrinks; writes must be taken again, without a restart;
3. no room at all: the filler takes every byte at once, under load, so that writes
   already admitted find no room (the log's and the views' writers wait for it); the
   server must stay up, answer reads, and refuse writes with 503 (an admitted write may
   wait, its caller answered 504 at the reply timeout);
4. room again: the writers that waited write, and new writes are taken;
5. full again, and the server stopped (SIGTERM) with the disk full: it must exit within
   a bound (with 0, or with a message saying the disk is full);
6. a start on the still-full disk: it must be refused with a message saying the disk
   is full and what to do;
7. the filler gone, a start: it must come up with the acknowledged state, checked by
   `faults.reconcile`.

Every call the load makes is timed and counted by its answer: a `5xx` other than
`503 disk_full` and `504`, a call that fails to connect while the server is up, or a
call longer than the reply timeout plus a margin (a hang) is `wrong`.

Called by scripts/faults.py (`--cases disk-full`) as `disk_full(ctx)`. Standard library
only; the server listens on 127.0.0.1; the tmpfs is unmounted and the server stopped in
a `finally`; every wait is bounded.
"""

import collections
import os
import signal
import subprocess
import threading
import time

import faults

MB = 1024 * 1024
# The server's --disk-free-min-mb: writes are refused below this much free space.
FREE_MIN_MB = 8
# The server's reply timeout (its default): a caller waits at most this for an outcome.
REPLY_TIMEOUT_S = 5.0
# A call that takes longer than this is a hang.
HANG_S = REPLY_TIMEOUT_S + 3.0
# How long the server may take to stop on a full disk: the HTTP front's grace (reply
# timeout plus 1 s) and the writers' giving up, with a margin.
STOP_S = 30.0


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Filler:
    """A file on the tmpfs sized so that a given amount stays free."""

    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        self.size = 0

    def leave_free(self, target):
        """Grows or shrinks the file so that about `target` bytes stay free."""
        dir_ = os.path.dirname(self.path)
        for _ in range(20):
            delta = free_bytes(dir_) - target
            if abs(delta) < 64 * 1024:
                return
            new = max(0, self.size + delta)
            try:
                if new > self.size:
                    os.posix_fallocate(self.fd, 0, new)
                else:
                    os.ftruncate(self.fd, new)
                self.size = new
            except OSError:
                # The server took some of it meanwhile: measure again.
                continue

    def take_all(self):
        """Grows the file until the disk has not a byte left."""
        dir_ = os.path.dirname(self.path)
        for _ in range(10_000):
            free = free_bytes(dir_)
            step = free if free > 0 else 4096
            try:
                os.posix_fallocate(self.fd, 0, self.size + step)
                self.size += step
            except OSError:
                if step == 4096:
                    return
                # Raced with the server's writes: a page at a time from here.
                try:
                    os.posix_fallocate(self.fd, 0, self.size + 4096)
                    self.size += 4096
                except OSError:
                    return

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def remove(self):
        self.close()
        os.remove(self.path)


class Meter:
    """Wraps `faults.call` (which the load threads use) to time and count every call,
    by phase and by answer."""

    def __init__(self):
        self.lock = threading.Lock()
        self.phase = "start"
        self.counts = collections.defaultdict(collections.Counter)
        self.worst_s = 0.0
        self.slow = []
        self.odd = []
        self.first_refused = None
        self.last_write_ok = 0.0

    def wrap(self, real):
        def timed(port, method, path, body=None, timeout=15):
            t0 = time.monotonic()
            status, ans = real(port, method, path, body, timeout)
            took = time.monotonic() - t0
            label = str(status)
            if status == 503 or (status is not None and status >= 500 and status != 504):
                label += " " + (ans.get("error", "?") if isinstance(ans, dict) else "no JSON body")
            with self.lock:
                self.counts[self.phase][label] += 1
                self.worst_s = max(self.worst_s, took)
                if took > HANG_S:
                    self.slow.append(f"{method} {path} took {took:.1f} s ({label})")
                if label == "503 disk_full":
                    if self.first_refused is None:
                        self.first_refused = time.monotonic()
                    if not (isinstance(ans, dict) and ans.get("detail")):
                        self.odd.append("a 503 disk_full without a detail")
                # A write taken: a single transaction or hold answered, not a batch
                # (whose 200 may carry `pending` entries).
                if method == "POST" and status in (200, 202) and not path.endswith("/batch"):
                    self.last_write_ok = time.monotonic()
            return status, ans

        return timed

    def total(self, label):
        return sum(c[label] for c in self.counts.values())


class FloorWatch:
    """The least free space on the tmpfs, read every 2 ms while watching: the server's
    own writes must never take it below the floor (issue 26). Not watched while the
    filler itself takes every byte."""

    def __init__(self, path):
        self.path = path
        self.least = None
        self.watching = False
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped:
            if self.watching:
                free = free_bytes(self.path)
                # Read again: the filler may have moved between the flag and the reading.
                if self.watching and (self.least is None or free < self.least):
                    self.least = free
            time.sleep(0.002)

    def stop(self):
        self.stopped = True
        self.thread.join(timeout=5)


def wait_for(what, limit_s):
    """Seconds until `what()` is true, or None past `limit_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if what():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def log_tail(path, since):
    """The lines written to the server's log from byte `since` on."""
    with open(path, errors="replace") as f:
        f.seek(since)
        return [line.rstrip() for line in f if line.strip()]


def disk_full(ctx):
    quick = ctx.quick
    size_mb = 48 if quick else 128
    # Room the load's own writes fill before the gate closes.
    room = (2 if quick else 24) * MB
    hold_s = 1.5 if quick else 5.0
    fill_limit_s = 40 if quick else 120
    mnt = os.path.join(ctx.work, "disk")
    log = os.path.join(ctx.work, "server-disk.log")
    wrong, notes, figures = 0, [], []

    def bad(note):
        nonlocal wrong
        wrong += 1
        notes.append(note)

    result = {"case": "disk-full", "tried": 0, "lost": 0, "doubled": 0}
    what = (
        f"data dir on a {size_mb} MiB tmpfs, `--disk-free-min-mb {FREE_MIN_MB}`, mixed load "
        f"(12 callers): its own writes fill the {room // MB} MiB left until refused; room "
        "freed; a filler takes every byte under load; freed; taken again; SIGTERM on the "
        "full disk, a start on it, a start once freed, reconciled"
    )
    if os.geteuid() != 0:
        return dict(result, wrong=1, what=what, figures="not run",
                    notes=["not run: mounting a tmpfs needs root"])
    os.makedirs(mnt)
    mounted = False
    server = None
    filler = None
    stop, workers = None, []
    real_call = faults.call
    book = faults.Book()
    meter = Meter()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", mnt],
                       check=True, capture_output=True, timeout=30)
        mounted = True
        server = faults.Server(ctx.bin, os.path.join(mnt, "data"), log,
                            {"NRTXN_DISK_FREE_MIN_MB": FREE_MIN_MB})
        code = server.start()
        if code is not None:
            raise RuntimeError(f"the server did not start on an empty tmpfs: exit {code}; see {log}")
        faults.load_items(server.port)
        filler = Filler(os.path.join(mnt, "filler"))
        filler.leave_free(FREE_MIN_MB * MB + room)
        floor = FloorWatch(mnt)
        floor.watching = True
        faults.call = meter.wrap(real_call)
        port_ref = [server.port]
        stop, workers = faults.run_load(port_ref, book, 0, 0)

        # 1. The load's own writes fill the room left, until refused.
        meter.phase = "filling"
        t0 = time.monotonic()
        took = wait_for(lambda: meter.first_refused is not None, fill_limit_s)
        if took is None:
            bad(f"never refused in {fill_limit_s} s: {free_bytes(mnt) / MB:.1f} MiB free")
        else:
            figures.append(f"refused after {took:.1f} s of load")
        meter.phase = "refusing"
        time.sleep(hold_s)

        # 2. Room again: writes are taken again, without a restart.
        meter.phase = "room again"
        t_free = time.monotonic()
        filler.leave_free(FREE_MIN_MB * MB + room)
        took = wait_for(lambda: meter.last_write_ok > t_free, 10)
        if took is None:
            bad("writes not taken again within 10 s of freeing room")
        else:
            figures.append(f"taken again {took:.1f} s after room was freed")

        # 3. No room at all, at once, under load: admitted writes wait for room.
        time.sleep(0.5)
        meter.phase = "no room"
        floor.watching = False
        filler.take_all()
        time.sleep(hold_s + 1.0)
        if server.proc.poll() is not None:
            bad(f"the server stopped when the disk filled: exit {server.proc.returncode}")
        else:
            status, _ = real_call(server.port, "GET", "/healthz", timeout=HANG_S)
            item_status, _ = real_call(server.port, "GET", f"/v1/shops/{faults.SHOP}/items/{faults.ITEMS[0]}",
                                       timeout=HANG_S)
            if (status, item_status) != (200, 200):
                bad(f"on the full disk /healthz answers {status} and an item read {item_status}")

        # 4. Room again: what waited is written, and writes are taken.
        meter.phase = "room again"
        t_free = time.monotonic()
        filler.leave_free(FREE_MIN_MB * MB + room)
        floor.watching = True
        took = wait_for(lambda: meter.last_write_ok > t_free, 10)
        if took is None:
            bad("after no room at all, writes not taken again within 10 s of freeing room")
        else:
            figures.append(f"after no room at all, taken again {took:.1f} s after freeing")
        time.sleep(0.5)

        # 5. Full again, and the server stopped on the full disk.
        meter.phase = "no room"
        floor.watching = False
        floor.stop()
        if floor.least is None:
            bad("the free space was never read")
        elif floor.least < FREE_MIN_MB * MB:
            bad(f"the server's writes took free space to {floor.least / MB:.2f} MiB, "
                f"below the {FREE_MIN_MB} MiB floor")
        else:
            figures.append(f"least free space while the server wrote: {floor.least / MB:.2f} MiB")
        filler.take_all()
        time.sleep(1.0)
        stop.set()
        for w in workers:
            w.join(timeout=HANG_S + 20)
        if any(w.is_alive() for w in workers):
            bad("a load thread still waits for an answer")
        faults.call = real_call
        since = os.path.getsize(log)
        t0 = time.monotonic()
        code = server.kill(signal.SIGTERM)
        stop_s = time.monotonic() - t0
        said = log_tail(log, since)
        waited = sum("written once the disk had room again" in line for line in open(log, errors="replace"))
        figures.append(f"writes that waited for room, then written: {waited}")
        if code == "hung" or stop_s > STOP_S:
            bad(f"SIGTERM on the full disk: {code} after {stop_s:.1f} s")
        elif code != 0 and not any("disk" in line and "full" in line for line in said):
            bad(f"SIGTERM on the full disk: exit {code} without saying the disk is full")
        figures.append(f"SIGTERM on the full disk: exit {code} in {stop_s:.1f} s")

        # 6. A start on the still-full disk is refused, saying what to do.
        since = os.path.getsize(log)
        try:
            code = server.start()
        except RuntimeError as e:
            code = f"not ready: {e}"
        said = log_tail(log, since)
        last = said[-1].replace(os.path.join(mnt, "data"), "DATA_DIR") if said else "(nothing)"
        if code is None:
            bad("started on the full disk")
            server.stop()
        elif not ("full" in last and "Free space" in last):
            bad(f"a start on the full disk: exit {code}, saying: {last[:200]}")
        else:
            notes.append(f"a start on the full disk: exit {code}: {last}")

        # 7. Room again: the server starts with the acknowledged state.
        filler.remove()
        code = server.start()
        if code is not None:
            raise RuntimeError(f"no start once the disk had room: exit {code}; see {log}")
        # A batch entry answered `pending` (at the reply timeout) was never acknowledged.
        for t in book.txns.values():
            if t["http"] == 200 and (t["answer"] or {}).get("status") == "pending":
                t["http"] = None
        lost, doubled, off, found = faults.reconcile(server.port, book, ctx.rnd)
        wrong += off
        notes.extend(found[:10])
        code = server.kill(signal.SIGTERM)
        if code != 0:
            bad(f"the last stop, with room: exit {code}")
    finally:
        faults.call = real_call
        if stop is not None:
            stop.set()
            for w in workers:
                w.join(timeout=HANG_S + 20)
        if server is not None:
            server.stop()
        if filler is not None:
            filler.close()
        if mounted:
            done = subprocess.run(["umount", mnt], check=False, capture_output=True, timeout=60)
            if done.returncode != 0:
                # Something still holds a file there: detached now, freed once let go.
                subprocess.run(["umount", "-l", mnt], check=False, capture_output=True, timeout=60)

    # Every answer the load got, judged.
    allowed = {"200", "202", "404", "409", "503 disk_full", "504"}
    for phase, counts in meter.counts.items():
        for label, n in counts.items():
            if label not in allowed:
                bad(f"{n} answered {label} while {phase}")
    if meter.slow:
        bad(f"{len(meter.slow)} calls past {HANG_S:.0f} s, e.g. {meter.slow[0]}")
    if meter.odd:
        bad(f"{len(meter.odd)} odd answers, e.g. {meter.odd[0]}")
    answered = sum(1 for t in book.txns.values() if t["http"] in (200, 202)) + sum(
        1 for h in book.holds.values() if h["http"] == 200)
    refused = meter.total("503 disk_full")
    late = meter.total("504")
    figures = [f"{answered:,} answered (200/202), {refused:,} refused 503 disk_full, {late:,} answered 504 "
               f"(admitted as the disk filled); slowest call {meter.worst_s:.1f} s"] + figures
    return dict(
        result,
        tried=book.sent,
        lost=lost,
        doubled=doubled,
        wrong=wrong,
        answered=answered,
        refused_503=refused,
        timeouts_504=late,
        slowest_s=round(meter.worst_s, 2),
        notes=notes,
        what=what,
        figures="; ".join(figures),
    )
