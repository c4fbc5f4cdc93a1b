"""A loopback SGLang-shaped worker on 127.0.0.1, served from a thread (stdlib ``http.server``).

It answers what sgl-router asks of a worker when registering it (``/health``, ``/server_info``,
``/model_info``) and ``/generate``, and records every call. Two uses:

* the passthrough probe runs it in *echo* mode: ``/generate`` answers with the body and headers it
  received, so the probe sees what the router forwarded; with ``accept_routing_key`` set, every
  other request gets 503 (a live router's real traffic is never answered by the probe);
* tests and benchmarks give it a ``generate`` function returning an SGLang ``/generate`` reply,
  and optionally a ``chat`` function answering ``/v1/chat/completions`` (what an engine does with
  chat text: the benchmark's worker renders the template and tokenizes there, as SGLang does).

Nagle is disabled on its sockets: with it on, delayed ACKs add ~40 ms to every loopback hop.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

GenerateFn = Callable[[dict[str, Any]], dict[str, Any]]
ChatFn = Callable[[dict[str, Any]], dict[str, Any]]
ROUTING_KEY = "x-smg-routing-key"


class LoopbackWorker:
    """A threaded HTTP worker on 127.0.0.1 (port 0 picks a free port); use as a context manager."""

    def __init__(
        self,
        *,
        generate: GenerateFn | None = None,
        chat: ChatFn | None = None,
        accept_routing_key: str | None = None,
        dp_size: int = 1,
        model_path: str | None = None,
        port: int = 0,
    ) -> None:
        self.generate = generate
        self.chat = chat
        self.accept_routing_key = accept_routing_key
        self.dp_size = dp_size
        self.model_path = model_path
        self.calls: list[tuple[str, str]] = []
        self.generate_requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _get_reply(self, path: str) -> tuple[int, dict[str, Any]]:
        route = path.split("?", 1)[0]
        if route in ("/server_info", "/get_server_info"):
            return 200, {
                "dp_size": self.dp_size,
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
            }
        if route in ("/model_info", "/get_model_info"):
            return 200, {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
            }
        if route in ("/health", "/health_generate", "/readiness", "/liveness"):
            return 200, {"status": "ok"}
        if route == "/v1/models":
            return 200, {
                "object": "list",
                "data": [{"id": self.model_path or "loopback", "object": "model"}],
            }
        return 404, {"error": f"loopback worker has no GET {route}"}

    def _post_reply(
        self, path: str, headers: dict[str, str], body: Any
    ) -> tuple[int, dict[str, Any]]:
        route = path.split("?", 1)[0]
        if (
            self.accept_routing_key is not None
            and headers.get(ROUTING_KEY) != self.accept_routing_key
        ):
            return 503, {"error": "loopback probe worker: not a probe request"}
        if not isinstance(body, dict):
            return 400, {"error": "body must be a JSON object"}
        if route == "/generate":
            with self._lock:
                self.generate_requests.append((headers, body))
            if self.generate is None:
                return 200, {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {
                        "prompt_tokens": len(body.get("input_ids") or []),
                        "completion_tokens": 0,
                        "output_token_logprobs": [],
                        "finish_reason": {"type": "stop", "matched": None},
                    },
                    "echo": {"body": body, "headers": headers, "port": self.port},
                }
            return 200, self.generate(body)
        if route == "/v1/chat/completions" and self.chat is not None:
            return 200, self.chat(body)
        return 404, {"error": f"loopback worker has no POST {route}"}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def _send(self, status: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                with worker._lock:
                    worker.calls.append(("GET", self.path))
                self._send(*worker._get_reply(self.path))

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                with worker._lock:
                    worker.calls.append(("POST", self.path))
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    self._send(400, {"error": "invalid JSON"})
                    return
                headers = {k.lower(): v for k, v in self.headers.items()}
                self._send(*worker._post_reply(self.path, headers, body))

            def log_message(self, format: str, *args: Any) -> None:
                return

        return Handler
