#!/usr/bin/env python3
"""A small rotating OAuth 2.0 token endpoint, to try leasectl's singleflight against.

It behaves like the providers that make concurrent refreshes dangerous: every refresh
(POST /token, grant_type=refresh_token) returns a new access token AND a new refresh token,
revokes the refresh token it was given and the previous access token. Presenting a revoked
refresh token again answers 400 {"error": "invalid_grant"} -- in real life, the user is
logged out. Two callers refreshing at the same moment therefore always produce one
invalid_grant; run through `leasectl run --wait --reuse-within`, there are none.

    provider.py --refresh-token rt-0 [--port 0] [--port-file F] [--delay 0.2]

GET /stats              {"refreshes": N, "invalid_grant": N}
GET /introspect?token=T {"active": true|false} -- true only for the newest access token
"""

import argparse
import json
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class Tokens:
    """The provider's state: one live refresh token and one live access token."""

    def __init__(self, refresh_token, delay):
        self.lock = threading.Lock()
        self.refresh_token = refresh_token
        self.access_token = None
        self.delay = delay
        self.refreshes = 0
        self.invalid_grant = 0

    def refresh(self, presented):
        """Rotates on a live refresh token; returns the new pair, or None for invalid_grant."""
        with self.lock:
            if presented != self.refresh_token:
                self.invalid_grant += 1
                return None
            # Rotating takes the provider a moment; holding the lock makes it atomic.
            if self.delay:
                threading.Event().wait(self.delay)
            self.refreshes += 1
            n = self.refreshes
            self.access_token = f"at-{n}-{secrets.token_hex(8)}"
            self.refresh_token = f"rt-{n}-{secrets.token_hex(8)}"
            return self.access_token, self.refresh_token


def handler(tokens):
    class Handler(BaseHTTPRequestHandler):
        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            if urlparse(self.path).path != "/token":
                return self.reply(404, {"error": "not_found"})
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            if form.get("grant_type") != ["refresh_token"]:
                return self.reply(400, {"error": "unsupported_grant_type"})
            pair = tokens.refresh((form.get("refresh_token") or [""])[0])
            if pair is None:
                return self.reply(400, {"error": "invalid_grant"})
            access, refresh = pair
            self.reply(
                200,
                {
                    "access_token": access,
                    "token_type": "Bearer",
                    "expires_in": 3600,
                    "refresh_token": refresh,
                },
            )

        def do_GET(self):
            url = urlparse(self.path)
            with tokens.lock:
                if url.path == "/stats":
                    return self.reply(
                        200,
                        {
                            "refreshes": tokens.refreshes,
                            "invalid_grant": tokens.invalid_grant,
                        },
                    )
                if url.path == "/introspect":
                    token = (parse_qs(url.query).get("token") or [""])[0]
                    live = token != "" and token == tokens.access_token
                    return self.reply(200, {"active": live})
            self.reply(404, {"error": "not_found"})

        def log_message(self, *args):
            pass

    return Handler


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--refresh-token", required=True, help="the initial live refresh token")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument("--delay", type=float, default=0.0, help="seconds each refresh takes")
    args = p.parse_args()
    tokens = Tokens(args.refresh_token, args.delay)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(tokens))
    server.daemon_threads = True
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{server.server_address[1]}\n")
        # Atomic, so a reader never sees an empty file.
        os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
