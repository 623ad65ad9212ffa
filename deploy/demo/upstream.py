#!/usr/bin/env python3
"""A stand-in for a provider's API, for the quickstart and the compose demo.

It answers every request with 200 and a small JSON body, and prints one line
per request it received, so you can see which effects reached it and which
stopgate refused before they left. Standard library only.

    python3 upstream.py [HOST:PORT]     (default 127.0.0.1:8099)
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Provider(BaseHTTPRequestHandler):
    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode("utf-8", "replace") if length else ""
        print(f"provider received {self.command} {self.path} {body}", flush=True)
        out = json.dumps({"ok": True, "received": self.command + " " + self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, *args):
        pass  # one line per request, above, is enough


def main():
    host, _, port = (sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8099").rpartition(":")
    server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Provider)
    print(f"provider listening on {host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
