"""sgl-router lifecycle: start the Rust router from the ``sglang-router`` wheel, manage its workers.

``start_router`` runs ``Router.from_args(RouterArgs(...)).start()`` in a child process through the
wheel's Python API. It does not use ``smg launch`` / ``launch_router``: those import more than the
router needs (with sglang installed, sglang and torch: tens of seconds on a small machine); the
Python API path answers ``/health`` within about a second. The child runs in its own process
group and is stopped by its pid only.

Worker management follows the router's HTTP API: ``POST /workers`` and ``DELETE /workers/{id}``
answer 202 and finish in the background, so both poll ``GET /workers``. With ``dp_aware`` the
router lists one entry per data-parallel rank as ``url@rank``; ``workers()`` strips the rank.
sglang-router 0.3.2 cannot deregister dp-aware entries (its removal job looks for the prefix
``url@rank@``); ``remove_worker`` then fails with a ``RouterStartError`` that says so.

Session affinity: with ``policy="manual"`` the router maps each ``X-SMG-Routing-Key`` to one
worker; ``assignment_mode="min_load"`` (not the wheel's ``random``) assigns new keys to the least
loaded worker. ``RouterSpec`` defaults to both, the setting sessions need.

``probe_passthrough`` checks that the router forwards every field the session server sends to
``/generate`` (and the reply unchanged) by registering a loopback echo worker; a router that drops
fields raises ``RouterIncompatible`` naming them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from posttrain.interface import ConfigError, ServerStartError
from posttrain.interface.processes import free_port, stop_process_group, wait_until_ready
from posttrain.session_router._errors import RouterIncompatible, RouterStartError
from posttrain.session_router.assembly import ROUTING_KEY_HEADER, build_generate_body
from posttrain.session_router.config import SessionRouterConfig
from posttrain.session_router.loopback import LoopbackWorker

Policy = Literal[
    "random", "round_robin", "cache_aware", "power_of_two", "manual", "consistent_hashing"
]

_ROUTER_MAIN = """
import json, sys
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs
Router.from_args(RouterArgs(**json.loads(sys.argv[1]))).start()
"""


@dataclass(kw_only=True, slots=True)
class RouterSpec:
    """How to start sgl-router; the defaults are what sessions need (sticky keys, 127.0.0.1)."""

    port: int
    host: str = "127.0.0.1"
    policy: Policy = "manual"
    assignment_mode: Literal["random", "min_load"] = "min_load"
    request_timeout_s: int = 600
    dp_aware: bool = False
    prometheus_port: int | None = None
    health_check_interval_s: int = 60
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"RouterSpec.port must be in 1..65535, got {self.port}")
        if self.request_timeout_s <= 0:
            raise ConfigError(
                f"RouterSpec.request_timeout_s must be > 0, got {self.request_timeout_s}"
            )

    def router_args(self) -> dict[str, Any]:
        """Keyword arguments of ``sglang_router.router_args.RouterArgs``."""
        args: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "worker_urls": [],
            "policy": self.policy,
            "assignment_mode": self.assignment_mode,
            "request_timeout_secs": self.request_timeout_s,
            "dp_aware": self.dp_aware,
            "health_check_interval_secs": self.health_check_interval_s,
            "log_level": self.log_level,
        }
        if self.prometheus_port is not None:
            args.update(prometheus_port=self.prometheus_port, prometheus_host=self.host)
        else:
            # The wheel's Rust side otherwise binds its default Prometheus port (29000), which
            # makes two routers on one machine collide; give each its own port on loopback.
            args.update(prometheus_port=free_port(), prometheus_host="127.0.0.1")
        args.update(self.extra_args)
        return args


def strip_rank(url: str) -> str:
    """``http://h:p@3`` -> ``http://h:p`` (dp-aware worker entries carry ``@rank``)."""
    head, sep, tail = url.rpartition("@")
    return head if sep and tail.isdigit() else url


class RouterHandle:
    """A running sgl-router: its URL, pid and worker management. Stop it with ``stop()``."""

    def __init__(
        self,
        url: str,
        *,
        process: subprocess.Popen[bytes] | None = None,
        log_path: Path | None = None,
        transport: httpx.BaseTransport | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path
        self._client = httpx.Client(base_url=self.url, transport=transport, timeout=timeout_s)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def log_tail(self, n: int = 2000) -> str:
        """The end of the router's log (empty for an attached router)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def list_workers(self) -> list[dict[str, Any]]:
        """The router's raw ``GET /workers`` entries."""
        reply = self._client.get("/workers")
        if reply.status_code != 200:
            raise RouterStartError(
                f"GET /workers answered {reply.status_code}: {reply.text[:200]}", url=self.url
            )
        workers = reply.json().get("workers", [])
        return [w for w in workers if isinstance(w, dict)]

    def workers(self) -> list[str]:
        """Registered worker URLs, ``@rank`` suffixes stripped, each once, in registration order."""
        seen: dict[str, None] = {}
        for w in self.list_workers():
            seen.setdefault(strip_rank(str(w.get("url", ""))), None)
        return list(seen)

    def _wait(self, done: Any, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.05)
        raise RouterStartError(f"{what} did not finish within {timeout_s} s", url=self.url)

    def add_worker(
        self,
        url: str,
        *,
        worker_type: Literal["regular", "prefill", "decode"] = "regular",
        bootstrap_port: int | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Register a worker and wait until the router lists it (the POST only queues the job)."""
        url = url.rstrip("/")
        body: dict[str, Any] = {"url": url, "worker_type": worker_type}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        reply = self._client.post("/workers", json=body)
        if reply.status_code not in (200, 201, 202):
            raise RouterStartError(
                f"POST /workers for {url} answered {reply.status_code}: {reply.text[:200]}",
                url=self.url,
            )
        self._wait(
            lambda: any(
                strip_rank(str(w.get("url"))) == url and w.get("is_healthy", True)
                for w in self.list_workers()
            ),
            f"registering worker {url}",
            timeout_s,
        )

    def remove_worker(self, url: str, *, timeout_s: float = 30.0) -> None:
        """Deregister every entry of a worker (all dp ranks) and wait until none is listed."""
        url = url.rstrip("/")
        entries = [w for w in self.list_workers() if strip_rank(str(w.get("url"))) == url]
        ids = [str(w["id"]) for w in entries]
        ranked = any(str(w.get("url")) != url for w in entries)
        if not ids:
            raise RouterStartError(f"worker {url} is not registered", url=self.url)
        for worker_id in ids:
            reply = self._client.delete(f"/workers/{worker_id}")
            if reply.status_code not in (200, 202, 204, 404):
                raise RouterStartError(
                    f"DELETE /workers/{worker_id} ({url}) answered {reply.status_code}",
                    url=self.url,
                )
        try:
            self._wait(lambda: url not in self.workers(), f"removing worker {url}", timeout_s)
        except RouterStartError as exc:
            if not ranked:
                raise
            # sglang-router 0.3.2: the removal job of a dp-aware entry searches for the prefix
            # "<url>@<rank>@" and finds nothing; there is no removal by base URL.
            raise RouterStartError(
                f"{exc}; sgl-router did not remove the dp-aware entries of {url} (its removal "
                "job looks for '<url>@<rank>@'); restart the router to drop them",
                url=self.url,
            ) from exc

    def probe_passthrough(
        self, body: Mapping[str, Any] | None = None, *, timeout_s: float = 30.0
    ) -> None:
        """See ``probe_passthrough``; raises ``RouterIncompatible`` naming dropped fields."""
        probe_passthrough(self, body, timeout_s=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the router process (by its pid and process group) and close the client."""
        self._client.close()
        if self.process is not None:
            stop_process_group(self.process, grace_s=timeout_s)

    def __enter__(self) -> RouterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_router(
    spec: RouterSpec,
    *,
    ready_timeout_s: float = 30.0,
    log_dir: str | Path | None = None,
    transport: httpx.BaseTransport | None = None,
) -> RouterHandle:
    """Start sgl-router in a child process and return once ``/health`` answers 200."""
    log_root = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir())
    log_path = log_root / f"sgl-router-{spec.port}-{uuid.uuid4().hex[:8]}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _ROUTER_MAIN, json.dumps(spec.router_args())],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    handle = RouterHandle(
        f"http://{spec.host}:{spec.port}", process=proc, log_path=log_path, transport=transport
    )
    try:
        wait_until_ready(
            f"{handle.url}/health", timeout_s=ready_timeout_s, process=proc, poll_interval_s=0.02
        )
    except ServerStartError as exc:
        handle.stop()
        raise RouterStartError(f"sgl-router: {exc}: {handle.log_tail()}", url=handle.url) from None
    return handle


def default_probe_body(cfg: SessionRouterConfig | None = None) -> dict[str, Any]:
    """The ``/generate`` body the session server would send for a typical turn under ``cfg``."""
    cfg = cfg or SessionRouterConfig(
        upstream_url="http://127.0.0.1:1", tokenizer="-", lora_adapter="posttrain_probe_lora"
    )
    chat = {
        "messages": [{"role": "user", "content": "probe"}],
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "stop": ["</probe>"],
        "stop_token_ids": [7],
        "seed": 1,
        "rid": f"probe-{uuid.uuid4().hex}",
    }
    # Any version will do: the probe checks that the fields arrive, not what they say.
    return build_generate_body(chat, cfg, [11, 12, 13], weight_version=cfg.lora_weight_version or 0)


def _dropped(sent: Any, got: Any, path: str = "") -> list[str]:
    if isinstance(sent, dict):
        if not isinstance(got, dict):
            return [path or "<body>"]
        out: list[str] = []
        for key, value in sent.items():
            sub = f"{path}.{key}" if path else key
            out += [sub] if key not in got else _dropped(value, got[key], sub)
        return out
    return [] if sent == got else [path]


def probe_passthrough(
    router: RouterHandle | str,
    body: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = 30.0,
    transport: httpx.BaseTransport | None = None,
) -> None:
    """Check that ``router`` forwards ``body`` (default: ``default_probe_body()``) to ``/generate``.

    Registers a loopback echo worker that answers only requests carrying the probe's routing key
    (anything else gets 503, so real traffic on a live router is never answered by it), sends the
    body through the router, compares what arrived field by field and checks the reply came back
    unchanged, then deregisters the worker. Raises ``RouterIncompatible`` naming every dropped or
    changed field.
    """
    if isinstance(router, RouterHandle):
        _probe(router, body, timeout_s=timeout_s)
        return
    handle = RouterHandle(router, transport=transport)
    try:
        _probe(handle, body, timeout_s=timeout_s)
    finally:
        handle.stop()  # an attached handle owns no process: this only closes its client


def _probe(handle: RouterHandle, body: Mapping[str, Any] | None, *, timeout_s: float) -> None:
    sent = dict(body) if body is not None else default_probe_body()
    key = f"posttrain-probe-{uuid.uuid4().hex}"
    with LoopbackWorker(accept_routing_key=key) as echo:
        handle.add_worker(echo.url, timeout_s=timeout_s)
        try:
            deadline = time.monotonic() + timeout_s
            reply: httpx.Response | None = None
            for attempt in range(8):
                # With other workers registered the key may land elsewhere (503 there is
                # impossible: real workers answer); a fresh key is assigned again.
                reply = handle._client.post(
                    "/generate",
                    content=json.dumps(sent),
                    headers={"content-type": "application/json", ROUTING_KEY_HEADER: key},
                    timeout=max(0.1, deadline - time.monotonic()),
                )
                if echo.generate_requests or time.monotonic() > deadline:
                    break
                key = f"posttrain-probe-{uuid.uuid4().hex}-{attempt}"
                echo.accept_routing_key = key
        finally:
            handle.remove_worker(echo.url, timeout_s=timeout_s)
        if not echo.generate_requests or reply is None:
            raise RouterStartError(
                f"passthrough probe: no probe request reached the echo worker through {handle.url}",
                url=handle.url,
            )
        headers, arrived = echo.generate_requests[0]
    dropped = _dropped(sent, arrived)
    if headers.get(ROUTING_KEY_HEADER.lower()) is None:
        dropped.append(f"header {ROUTING_KEY_HEADER}")
    if reply.status_code != 200:
        dropped.append(f"reply (status {reply.status_code})")
    else:
        returned = reply.json()
        echo_reply = returned.get("echo", {}) if isinstance(returned, dict) else {}
        if (
            not isinstance(returned, dict)
            or "meta_info" not in returned
            or echo_reply.get("body") != arrived
        ):
            dropped.append("reply body")
    if dropped:
        raise RouterIncompatible(
            f"router {handle.url} does not pass through what token-in/token-out needs; "
            f"dropped or changed: {', '.join(dropped)}",
            dropped=dropped,
        )
