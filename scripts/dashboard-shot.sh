#!/usr/bin/env bash
# The README's dashboard screenshot (docs/dashboard.png): a release server on the
# embedded default in a temporary directory, a flash sale's items loaded, two minutes of
# sales from a small load generator (a few hot items, some refused for want of stock and
# some for a buyer's limit), and the page at / in headless Chromium near the end of it.
#
#   scripts/dashboard-shot.sh [OUT.png]     (default docs/dashboard.png; needs
#                                            scripts/browser.sh install and a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/dashboard.png}
bin=${NRTXN_BIN:-target/release/nrtxn}
port=${NRTXN_SHOT_PORT:-18481}
secs=${NRTXN_SHOT_SECS:-120}
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$dir"' EXIT
"$bin" serve --listen 127.0.0.1:$port --data-dir "$dir/data" >"$dir/out" 2>"$dir/log" &
for _ in $(seq 100); do curl -sf localhost:$port/readyz >/dev/null && break; sleep 0.1; done
base=http://127.0.0.1:$port/v1/shops/flash
curl -sf -X PUT "$base/items" -H 'content-type: application/json' -d '{"items":[
  {"item":"console-x","stock":60000,"per_buyer_max":2},{"item":"headphones-q2","stock":20000},
  {"item":"lamp-neo","stock":9000},{"item":"mug-classic","stock":40000},
  {"item":"sneaker-v3-42","stock":12000},{"item":"sneaker-v3-43","stock":30000},
  {"item":"tee-limited","stock":15000},{"item":"watch-s","stock":2500}]}' >/dev/null
python3 - "$port" "$secs" <<'PY' &
import http.client, json, random, sys, threading, time
port, secs = int(sys.argv[1]), float(sys.argv[2])
# A few hot items take most of the traffic.
items = ["console-x"] * 6 + ["sneaker-v3-42"] * 3 + ["sneaker-v3-43"] * 3 + ["watch-s"] * 2 + [
    "headphones-q2", "lamp-neo", "mug-classic", "tee-limited"]
end = time.time() + secs
def worker(w):
    c = http.client.HTTPConnection("127.0.0.1", port)
    n = 0
    while time.time() < end:
        n += 1
        t = time.time()
        # The rate rises then falls, like a drop's first minutes.
        phase = 1 - abs((end - t) / secs - 0.5) * 2
        time.sleep(0.02 * (1.2 - phase))
        body = {"seller": "web", "buyer": f"u-{random.randrange(3000)}",
                "item": random.choice(items), "qty": random.choice([1, 1, 1, 2, 3]),
                "request_id": f"w{w}-{n}"}
        c.request("POST", "/v1/shops/flash/txns", json.dumps(body), {"content-type": "application/json"})
        c.getresponse().read()
threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
for t in threads: t.start()
for t in threads: t.join()
PY
gen=$!
# The picture is taken while the sale still runs, so the items' last changes show.
sleep $((secs - 5))
mkdir -p "$(dirname "$out")"
case $out in /*) abs=$out ;; *) abs=$PWD/$out ;; esac
profile=$(mktemp -d)
/usr/bin/chromium --headless=new --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --hide-scrollbars --window-size=1280,1180 \
  --virtual-time-budget=3000 --screenshot="$abs" "http://127.0.0.1:$port/#shop=flash" 2>/dev/null
rm -rf "$profile"
wait $gen
echo "dashboard-shot: $out"
