"""A small real HTTP service for runner tests: GET /health answers 200 after an optional delay.

Run as ``python serve_health.py PORT [--delay S] [--spawn-child]``; ``--spawn-child`` leaves a
``sleep`` grandchild running, to check that stopping reaches a process's whole tree.
"""

import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path == "/health" and time.monotonic() >= READY_AT
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(b"ok" if ok else b"not yet")

    def log_message(self, fmt: str, *args: object) -> None:
        print("request", self.path, flush=True)


if __name__ == "__main__":
    port = int(sys.argv[1])
    delay = float(sys.argv[sys.argv.index("--delay") + 1]) if "--delay" in sys.argv else 0.0
    READY_AT = time.monotonic() + delay
    if "--spawn-child" in sys.argv:
        child = subprocess.Popen(["sleep", "300"])
        print("spawned child", child.pid, flush=True)
    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    print("listening on", port, flush=True)
    server.serve_forever()
