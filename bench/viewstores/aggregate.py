#!/usr/bin/env python3
"""Aggregate results/raw.txt -> median [min..max] per candidate x mix.
Usage: aggregate.py [raw file] [candidates, comma-separated]"""
import re, sys, statistics as st
from collections import defaultdict
path = sys.argv[1] if len(sys.argv) > 1 else "results/raw.txt"
runs = defaultdict(list)
for line in open(path):
    kv = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
    if 'cand' not in kv: continue
    runs[(kv['cand'], kv['mix'])].append(kv)
metrics = [
 ("cpu_us_per_entry", "writer CPU µs/entry (write loop)", 2),
 ("cpu_us_per_entry_settled", "CPU µs/entry incl. settle (bg flush/compaction, final commit)", 2),
 ("cpu_us_per_entry_forced", "CPU µs/entry incl. forced checkpoint/flush", 2),
 ("wall_us_per_entry", "wall µs/entry (write loop)", 2),
 ("b_per_entry_settled", "disk B/entry as left (settled, not forced)", 1),
 ("b_per_entry_forced", "disk B/entry after forced checkpoint/flush", 1),
 ("b_per_entry_closed", "disk B/entry after close", 1),
 ("hit_p50_ns", "hit lookup p50 ns", 0), ("hit_p99_ns", "hit lookup p99 ns", 0),
 ("miss_p50_ns", "miss lookup p50 ns", 0), ("miss_p99_ns", "miss lookup p99 ns", 0),
 ("range_p50_ns", "range read p50 ns", 0), ("range_p99_ns", "range read p99 ns", 0),
 ("range_rows_avg", "rows per range read", 1),
 ("reopen_s", "reopen time s", 3), ("proc_elapsed_s", "process elapsed s", 1),
 ("maxrss_kb", "max RSS MiB", 0),
 # added 2026-11-26 (log-backed candidates; thread CPU for all)
 ("derive_cpu_us_per_entry_forced", "derivation CPU µs/entry, all threads, incl. forced, log write excluded", 3),
 ("derive_thr_us_per_entry_forced", "derivation CPU µs/entry, writer thread only (RUSAGE_THREAD), incl. forced, log write excluded", 3),
 ("bulk_cpu_us_per_entry", "of which sealing segments / writing sorted runs, writer thread µs/entry", 3),
 ("log_cpu_us_per_entry", "simulated log write CPU µs/entry (excluded above)", 3),
 ("b_per_entry_index", "index/store B/entry after forced (log segments excluded)", 1),
 ("range_fetch_p50_ns", "range read incl. reading the entries from the log, p50 ns", 0),
 ("range_fetch_p99_ns", "range read incl. reading the entries from the log, p99 ns", 0),
 ("hwm_kb", "peak RSS MiB (VmHWM, in-process)", 0),
 ("rss_gen_kb", "RSS MiB after generating the entries (before any store)", 0),
 ("check_all_s", "segidx: full check of every index block s", 3),
 ("rebuild_open_s", "segidx: open with one index refused and rebuilt from its segment s", 3),
]
cands = (sys.argv[2].split(",") if len(sys.argv) > 2 else ["sqlite", "fjall", "redb"])
mixes = ["hot", "spread", "soldout"]
def fmt(x, d):
    return f"{x:,.{d}f}"
for key, title, d in metrics:
    if not any(key in r for rs in runs.values() for r in rs if r["cand"] in cands): continue
    print(f"\n### {title}\n")
    print("| candidate | " + " | ".join(mixes) + " |")
    print("|---|" + "---|" * len(mixes))
    for c in cands:
        cells = []
        for m in mixes:
            vals = [float(r[key]) for r in runs.get((c, m), []) if key in r and r[key] != "-"]
            if key in ("maxrss_kb", "hwm_kb", "rss_gen_kb"): vals = [v / 1024 for v in vals]
            if not vals: cells.append("–"); continue
            cells.append(f"{fmt(st.median(vals), d)} [{fmt(min(vals), d)}–{fmt(max(vals), d)}] (n={len(vals)})")
        print(f"| {c} | " + " | ".join(cells) + " |")
