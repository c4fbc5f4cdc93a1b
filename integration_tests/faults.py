"""Faults a real cluster sees, made on 127.0.0.1 for the integration tests.

``CuttingProxy``
    a TCP proxy in front of a real server that forwards bytes both ways and drops the
    connection (both sockets closed, nothing more forwarded) once the client has sent
    ``cut_after_bytes`` bytes, or just before the client's stream shows ``cut_before`` (a
    request line such as ``b"POST /end_weight_update"``). What the server sees is a peer that
    vanished mid-request, as when a trainer host dies or a link drops.
``FlakyTeacher``
    an HTTP server in front of a real teacher engine: its first ``fail_first`` ``/generate``
    requests get 503 (an overloaded or restarting teacher), every later one is forwarded, and
    each request is counted; with ``hang=True`` it reads each ``/generate`` and never answers
    (a teacher that accepted the connection and froze), noting when the client gave up and
    closed the connection. Other routes are always forwarded.

``save_fault_model``
    the tiny Dense/MoE checkpoint (random weights) the engine fault tests serve.

The two servers bind 127.0.0.1 on a free port, run in daemon threads of the test process, and are stopped
by ``close()`` (or the ``with`` block); every socket has a finite timeout.
"""

from __future__ import annotations

import contextlib
import http.server
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

_IO_TIMEOUT_S = 120.0


class CuttingProxy:
    """Forward TCP to ``upstream`` (host, port); cut the connection at the configured point."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        cut_after_bytes: int | None = None,
        cut_before: bytes | None = None,
    ) -> None:
        self.upstream = upstream
        self.cut_after_bytes = cut_after_bytes
        self.cut_before = cut_before
        self.forwarded = 0  # client -> server bytes actually forwarded
        self.cut = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="cutting-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.upstream, timeout=_IO_TIMEOUT_S)
            client.settimeout(_IO_TIMEOUT_S)
            with self._lock:
                self._sockets += [client, server]
            pair = (client, server)
            threading.Thread(target=self._pump_up, args=pair, daemon=True).start()
            threading.Thread(target=self._pump_down, args=pair, daemon=True).start()

    def _allowed(self, chunk: bytes, tail: bytes) -> tuple[int, bool]:
        """How many bytes of ``chunk`` may pass, and whether the connection is then cut."""
        if self.cut_after_bytes is not None and self.forwarded + len(chunk) >= self.cut_after_bytes:
            return max(0, self.cut_after_bytes - self.forwarded), True
        if self.cut_before is not None:
            at = (tail + chunk).find(self.cut_before)
            if at >= 0:
                return max(0, at - len(tail)), True
        return len(chunk), False

    def _pump_up(self, client: socket.socket, server: socket.socket) -> None:
        tail = b""
        keep = len(self.cut_before or b"") - 1
        try:
            while not self._stop.is_set():
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                n, cut = self._allowed(chunk, tail)
                server.sendall(chunk[:n])
                self.forwarded += n
                if cut:
                    self.cut.set()
                    break
                tail = (tail + chunk)[-keep:] if keep > 0 else b""
        except OSError:
            pass
        finally:
            _close(client, server)

    def _pump_down(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                chunk = server.recv(1 << 16)
                if not chunk:
                    break
                client.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(client, server)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            _close(*self._sockets)
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()


class _Server(http.server.ThreadingHTTPServer):
    # A client scoring a batch opens tens of connections at once: the default backlog of 5
    # would refuse some of them, a fault of this server rather than the one injected.
    request_queue_size = 256
    daemon_threads = True


class FlakyTeacher:
    """503 for the first ``fail_first`` ``/generate`` requests, then forward to ``upstream``;
    or, with ``hang``, never answer a ``/generate`` at all."""

    def __init__(self, upstream: str | None, *, fail_first: int = 0, hang: bool = False) -> None:
        self.upstream = upstream
        self.fail_first = fail_first
        self.hang = hang
        self.generate_requests = 0
        self.answered_503 = 0  # the injected ones
        self.upstream_errors = 0  # non-200 replies of the real teacher, relayed as they were
        self.first_generate_at: float | None = None  # time.monotonic() of the first /generate
        self.abandoned_at: float | None = None  # hang: when a client first closed a hung request
        self._lock = threading.Lock()
        self._release = threading.Event()  # set at close: hanging handlers return
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = _IO_TIMEOUT_S

            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                if self.path.startswith("/generate"):
                    with owner._lock:
                        owner.generate_requests += 1
                        if owner.first_generate_at is None:
                            owner.first_generate_at = time.monotonic()
                        fail = owner.answered_503 < owner.fail_first
                        if fail:
                            owner.answered_503 += 1
                    if owner.hang:
                        self._hang_until_abandoned()
                        return
                    if fail:
                        self._reply(503, b'{"error": {"message": "teacher overloaded"}}')
                        return
                self._forward(body)

            def _hang_until_abandoned(self) -> None:
                """Answer nothing; note when the client gives up (closes the connection)."""
                self.close_connection = True
                end = time.monotonic() + _IO_TIMEOUT_S
                while not owner._release.is_set() and time.monotonic() < end:
                    readable, _, _ = select.select([self.connection], [], [], 0.1)
                    if not readable:
                        continue
                    try:
                        peeked = self.connection.recv(1, socket.MSG_PEEK)
                    except OSError:
                        peeked = b""
                    if not peeked:  # EOF: the client closed its side
                        with owner._lock:
                            if owner.abandoned_at is None:
                                owner.abandoned_at = time.monotonic()
                        return
                    time.sleep(0.1)

            def _forward(self, body: bytes | None) -> None:
                if owner.upstream is None:
                    self._reply(404, b'{"error": {"message": "no upstream"}}')
                    return
                req = urllib.request.Request(
                    owner.upstream + self.path, data=body, method=self.command,
                    headers={"content-type": self.headers.get("content-type", "application/json")},
                )  # fmt: skip
                try:
                    with urllib.request.urlopen(req, timeout=_IO_TIMEOUT_S) as r:
                        self._reply(r.status, r.read())
                except urllib.error.HTTPError as e:  # the real teacher's own error: relayed
                    with owner._lock:
                        owner.upstream_errors += 1
                    self._reply(e.code, e.read())

            def _reply(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def save_fault_model(root: Path) -> Path:
    """The tiny Dense/MoE checkpoint the engine fault tests serve (random weights: EOS is rare,
    so a rollout decodes its full ``max_new_tokens``), saved under ``root / "model"``."""
    from posttrain import models

    cfg = models.ModelConfig(
        vocab_size=models.VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=32,
        num_experts=2, num_experts_per_tok=1, mlp_only_layers=(0,), max_position_embeddings=256,
    )  # fmt: skip
    return models.save_pretrained(
        models.build_model(cfg, seed=0), root / "model", tokenizer=models.build_tokenizer()
    )
