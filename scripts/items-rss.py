#!/usr/bin/env python3
"""RSS of a server (target/debug/nrtxn) after loading N items, once with every item in
memory and once with --items-max N/10: `python3 scripts/items-rss.py N` (issue 11)."""
import json, subprocess, sys, time, urllib.request, tempfile, re, os
def run(items_max, n):
    d = tempfile.mkdtemp()
    p = subprocess.Popen(["target/debug/nrtxn","serve","--listen","127.0.0.1:0","--data-dir",d,"--items-max",str(items_max)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    base=None
    for line in p.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m: base=m.group(1); break
    def rss():
        with open(f"/proc/{p.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))//1024
    start = rss()
    chunk = 10000
    for s in range(0, n, chunk):
        body = json.dumps({"items":[{"item":f"sku-{i:08d}","stock":5} for i in range(s, min(n,s+chunk))]}).encode()
        req = urllib.request.Request(base+"/v1/shops/shop/items", data=body, method="PUT", headers={"content-type":"application/json"})
        urllib.request.urlopen(req, timeout=120).read()
    time.sleep(1)
    m = urllib.request.urlopen(base+"/metrics").read().decode()
    used = re.search(r'nrtxn_bound_used\{bound="items"\} (\d+)', m).group(1)
    end = rss()
    p.terminate(); p.wait()
    print(f"items-max {items_max}: {n} items loaded, {used} in memory, RSS {start} -> {end} MB")
n=int(sys.argv[1])
run(n*10, n)
run(n//10, n)
