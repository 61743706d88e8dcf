"""The repeated-burst case of the fault campaign: does memory come back after overload?

Rounds of overload against one server: in each, 4 of 5 connections send sales
(respond=true) on 20 items and 1 of 5 sends fire-and-forget batches of 1,000 entries
(`nrtxn-bench run --scenario spread` and `--scenario batch --batch-fire-and-forget`
side by side). After each round the case waits until nothing is in flight (the
`nrtxn_queue_depth{queue="inflight"}` gauge at 0), then 2 s more, and reads the server's RSS
(`/proc/PID/status`, VmRSS).

It fails (`wrong`) when a round ends more than `ROUND_NOISE_MB` above the round before it,
when the last round ends more than `GROWTH_MAX_MB` above the first, or when the RSS once
idle is above what `docs/reliability.md` documents for the bounds in play
(`IDLE_MAX_MB`): memory taken by a burst must come back, or stay within its bounds,
however many bursts there were.

Called by scripts/faults.py (`--cases burst`) as `repeated_burst(ctx)`.
"""

import http.client
import json
import os
import re
import subprocess
import time

import faults

# A round may end this much higher than the round before it (noise: what the allocator
# keeps of a burst depends on where its last live blocks fell; rounds here have ended up
# to 32 MB above the one before, and 20 MB below it). A leak of one burst is far more: the
# issue that asked for this case saw about 800 MB a round, and the queues a burst grew
# (actors/src/shrink.rs) about 45 MB.
ROUND_NOISE_MB = 50
# And the last round at most this much above the first, so that growth within the noise
# of each round cannot add up unseen.
GROWTH_MAX_MB = 150
# The bounds in play once idle, as docs/reliability.md documents them: outcomes cached
# (136 MB at the defaults), SQLite's page caches (640 MiB: the writer, the checkpointer
# and up to 8 readers), the key filter (16 MiB), 20 items and one shop (nothing), the
# binary and its threads (about 60 MB).
IDLE_MAX_MB = 870


def rss_mb(pid):
    text = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def memory(port):
    """The `nrtxn_memory_bytes` gauge by part, in MB ({} if unread)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return {}
    return {m.group(1): round(float(m.group(2)) / 1e6, 1) for m in
            re.finditer(r'^nrtxn_memory_bytes\{part="(\w+)"\} (\S+)$', text, re.M)}


def inflight(port):
    """The `nrtxn_queue_depth{queue="inflight"}` gauge (requests admitted and undecided),
    None if unread."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return None
    m = re.search(r'^nrtxn_queue_depth\{queue="inflight"\} (\d+(?:\.\d+)?)$', text, re.M)
    return int(float(m.group(1))) if m else None


def repeated_burst(ctx, rounds=None, seconds=None, connections=None):
    rounds = rounds or (3 if ctx.quick else 5)
    seconds = seconds or (4 if ctx.quick else 10)
    connections = connections or (500 if ctx.quick else 2000)
    bench = os.path.join(os.path.dirname(ctx.bin), "nrtxn-bench")
    server = faults.Server(ctx.bin, os.path.join(ctx.work, "data-burst"),
                           os.path.join(ctx.work, "server-burst.log"))
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    batch_conns = max(1, connections // 5)
    sale_conns = connections - batch_conns
    after, parts, tried, errors, notes, kinds = [], [], 0, 0, [], {}
    start_rss = rss_mb(server.proc.pid)
    try:
        for n in range(rounds):
            runs = [
                [bench, "run", "--target", base, "--system", "nrtxn", "--scenario", "spread",
                 "--items", "20", "--stock", str(10**9), "--connections", str(sale_conns),
                 "--duration", str(seconds), "--no-check", "--poll-timeout-s", "5",
                 "--json", os.path.join(ctx.work, f"burst-{n}-sales.json")],
                [bench, "run", "--target", base, "--system", "nrtxn", "--scenario", "batch",
                 "--batch-fire-and-forget", "--items", "20", "--stock", str(10**9),
                 "--connections", str(batch_conns), "--duration", str(seconds), "--no-check",
                 "--poll-timeout-s", "5",
                 "--json", os.path.join(ctx.work, f"burst-{n}-batches.json")],
            ]
            procs = [subprocess.Popen(r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for r in runs]
            for p in procs:
                p.wait(timeout=seconds + 600)
            for r in runs:
                try:
                    out = json.load(open(r[-1]))
                    tried += out["ok"] + out["rejected"] + out["overloaded"] + out["errors"]
                    errors += out["errors"]
                    for kind, n in out["counts"].items():
                        if kind.startswith("error_") or kind.startswith("http_5"):
                            kinds[kind] = kinds.get(kind, 0) + n
                except (OSError, ValueError, KeyError):
                    notes.append(f"round {n + 1}: a load generator wrote no result")
            deadline = time.time() + 120
            while time.time() < deadline:
                if inflight(server.port) == 0:
                    break
                time.sleep(0.5)
            else:
                notes.append(f"round {n + 1}: requests still in flight after 120 s")
            time.sleep(2)
            after.append(round(rss_mb(server.proc.pid), 1))
            parts.append(memory(server.port))
        time.sleep(10)
        idle = round(rss_mb(server.proc.pid), 1)
        if kinds:
            notes.append("load errors by kind: " + ", ".join(f"{k} {n:,}" for k, n in sorted(kinds.items())))
    finally:
        server.stop()
    growth = max(after) - after[0]
    wrong = 0
    steps = [b - a for a, b in zip(after, after[1:])]
    if steps and max(steps) > ROUND_NOISE_MB:
        wrong += 1
        worst = steps.index(max(steps))
        notes.append(f"round {worst + 2} ended {max(steps):.0f} MB above round {worst + 1} "
                     f"(allowed {ROUND_NOISE_MB})")
    if growth > GROWTH_MAX_MB:
        wrong += 1
        notes.append(f"RSS grew {growth:.0f} MB past the first round (allowed {GROWTH_MAX_MB})")
    if idle > IDLE_MAX_MB:
        wrong += 1
        notes.append(f"RSS once idle {idle} MB, above the {IDLE_MAX_MB} MB of the bounds in play")
    return {
        "case": "burst",
        "what": (f"{rounds} rounds of {seconds} s, each {connections:,} connections: 4 in 5 "
                 "send sales (respond=true) on 20 items, 1 in 5 fire-and-forget batches of "
                 "1,000 (`nrtxn-bench run --scenario spread` and `--scenario batch "
                 "--batch-fire-and-forget`); after each, wait until nothing is in flight"),
        "figures": (f"RSS {start_rss:.0f} MB at start; after each round "
                    f"{', '.join(f'{a:,.0f}' for a in after)} MB; {idle:,.0f} MB after 10 s idle "
                    f"(allowed: {ROUND_NOISE_MB} MB above the round before, {GROWTH_MAX_MB} MB "
                    f"above the first, {IDLE_MAX_MB} MB idle); "
                    f"{errors} load errors"),
        "tried": tried,
        "rss_after_rounds_mb": after,
        "rss_idle_mb": idle,
        "memory_after_rounds_mb": parts,
        "lost": 0,
        "doubled": 0,
        "wrong": wrong,
        "notes": notes,
    }
