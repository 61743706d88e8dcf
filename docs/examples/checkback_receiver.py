#!/usr/bin/env python3
"""A shop's check-back receiver for nrtxn: verifies each call's signature, then answers.

nrtxn calls a shop's `check_url` with `POST`, a JSON body, and the header

    X-Nrtxn-Signature: t=<unix time in ms>,v1=<hex HMAC-SHA256 of "<t>.<body>">

keyed by the shop's check secret (shown once by `PUT /v1/shops/{shop}/settings`). The
time is signed with the body, so a receiver can refuse an old call played again. This
receiver:

- computes the HMAC over the exact bytes received (`t`, a dot, the body) and compares
  it with `hmac.compare_digest` (constant time), else answers 401;
- refuses a time more than 5 minutes from its own clock (401), and a signature it has
  already seen within those 5 minutes (409): a replay;
- answers `{"action": ACTION}` (confirm, release, or extend with `ttl_ms`).

Standard library only. Usage:

    checkback_receiver.py --secret-file PATH [--port 0] [--action confirm]

The secret is read from the file at each call (so it can be written, or rotated, while the
receiver runs). The receiver prints `listening on PORT`, then one JSON line per call it
accepts or refuses (`{"accepted": bool, "reason": ..., "signature": ..., "body": ...}`).
"""

import argparse
import hashlib
import hmac
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOLERANCE_MS = 5 * 60 * 1000
BODY_MAX_BYTES = 1024 * 1024


def verify(secret: bytes, header: str, body: bytes, now_ms: int):
    """Returns None if the signature holds and is fresh, else the reason it does not."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    t, v1 = parts.get("t", ""), parts.get("v1", "")
    if not t.isdigit() or not v1:
        return "malformed signature"
    expected = hmac.new(secret, t.encode() + b"." + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, v1):
        return "bad signature"
    if abs(now_ms - int(t)) > TOLERANCE_MS:
        return "stale timestamp"
    return None


class Seen:
    """Signatures accepted within the tolerance: the same call twice is a replay."""

    def __init__(self):
        self.lock = threading.Lock()
        self.at = {}

    def first_time(self, signature: str, now_ms: int) -> bool:
        with self.lock:
            for s, at in list(self.at.items()):
                if now_ms - at > 2 * TOLERANCE_MS:
                    del self.at[s]
            if signature in self.at:
                return False
            self.at[signature] = now_ms
            return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secret-file", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--action", default="confirm", choices=["confirm", "release", "extend"])
    ap.add_argument("--ttl-ms", type=int, default=60_000)
    args = ap.parse_args()
    seen = Seen()
    out_lock = threading.Lock()

    def report(line: dict):
        with out_lock:
            print(json.dumps(line), flush=True)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            length = int(self.headers.get("content-length") or 0)
            if length > BODY_MAX_BYTES:
                return self.answer(413, {"error": "too large"})
            body = self.rfile.read(length)
            header = self.headers.get("x-nrtxn-signature", "")
            with open(args.secret_file, "rb") as f:
                secret = f.read().strip()
            now_ms = int(time.time() * 1000)
            reason = verify(secret, header, body, now_ms)
            if reason is None and not seen.first_time(header, now_ms):
                reason = "replayed"
            report({
                "accepted": reason is None,
                "reason": reason,
                "signature": header,
                "body": body.decode("utf-8", "replace"),
            })
            if reason == "replayed":
                return self.answer(409, {"error": reason})
            if reason is not None:
                return self.answer(401, {"error": reason})
            # Decide here from the call (json.loads(body): shop, kind, id, lines,
            # expires_at): was it paid?
            action = {"action": args.action}
            if args.action == "extend":
                action["ttl_ms"] = args.ttl_ms
            self.answer(200, action)

        def answer(self, status: int, doc: dict):
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
