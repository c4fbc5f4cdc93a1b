"""A real loopback teacher that speaks SGLang's ``/generate`` scoring shape (tests, benchmarks).

Import only from tests, benchmarks and CPU stacks (needs the ``testing`` extra:
starlette, uvicorn). The values are real: a small deterministic torch causal LM
(:class:`TinyTeacher`) computes full-vocabulary log-softmax rows, so flat and
per-position replies carry the same numbers and teacher = student can be arranged
exactly. Several teachers can be served by path prefix (``/<name>/generate``).

Faults for tests are queued on :class:`TeacherState` and consumed one per request:
``status:N``, ``delay:S``, ``truncate``, ``drop_meta``, ``meta_not_dict``,
``drop:<field>``, ``short:<field>``, ``null:<field>``, ``nan:<field>``, ``drift``.
The server binds 127.0.0.1 only. Departure from SGLang: a request that sets both
id keys, ids outside the vocabulary or ``max_new_tokens != 0`` gets a 400 instead of
a crash; ``per_position=False`` mimics an unpatched server that ignores the key.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.interface.testing import AppServer

__all__ = ["LoopbackTeacher", "TeacherState", "TinyTeacher", "build_app", "main"]


class TinyTeacher:
    """A deterministic causal LM: row j of :meth:`log_probs` is log p(. | x_0..x_j)."""

    def __init__(self, vocab_size: int = 512, dim: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.emb = torch.randn(vocab_size, dim, generator=g)
        self.mix = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
        self.head = torch.randn(dim, vocab_size, generator=g) * (3.0 / math.sqrt(dim))

    @torch.no_grad()
    def _logits_lse(self, input_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(list(input_ids), dtype=torch.int64)
        e = self.emb[ids]
        ctx = e.cumsum(0) / torch.arange(1, len(ids) + 1, dtype=torch.float32)[:, None]
        logits = torch.tanh(e + ctx @ self.mix) @ self.head
        return logits, logits.logsumexp(dim=-1, keepdim=True)

    def log_probs(self, input_ids: Sequence[int]) -> torch.Tensor:
        """float32[L, V] next-token log-probabilities after each prefix (logits - logsumexp)."""
        logits, lse = self._logits_lse(input_ids)
        return logits - lse

    def score(
        self,
        input_ids: Sequence[int],
        *,
        top_k: int = 0,
        flat_ids: Sequence[int] | None = None,
        positions: Sequence[Sequence[int]] | None = None,
    ) -> dict[str, Any]:
        """The ``meta_info`` lists of a scoring reply (row 0 a placeholder).

        Gathers the needed logits and subtracts the row's logsumexp, which gives the same
        float32 values as :meth:`log_probs` without writing the whole L x V table.
        """
        logits, lse = self._logits_lse(input_ids)
        logits, lse = logits[:-1], lse[:-1]
        n = len(input_ids)
        ids = torch.tensor(list(input_ids), dtype=torch.int64)
        rows_idx = torch.arange(n - 1)
        tok = (logits[rows_idx, ids[1:]] - lse[:, 0]).tolist()
        meta: dict[str, Any] = {
            "input_token_logprobs": [[None, int(input_ids[0]), None]]
            + [[v, int(t), None] for v, t in zip(tok, input_ids[1:], strict=True)]
        }
        if top_k > 0:
            vals, idx = logits.topk(min(top_k, self.vocab_size), dim=-1)
            meta["input_top_logprobs"] = [None] + [
                [[v, t, None] for v, t in zip(vr, ir, strict=True)]
                for vr, ir in zip((vals - lse).tolist(), idx.tolist(), strict=True)
            ]
        if flat_ids:
            u = list(flat_ids)
            vals_u = (logits[:, torch.tensor(u, dtype=torch.int64)] - lse).tolist()
            meta["input_token_ids_logprobs"] = [None] + [
                [[v, t, None] for v, t in zip(row, u, strict=True)] for row in vals_u
            ]
        elif positions is not None:
            rows: list[Any] = [None]
            for i in range(1, n):
                want = positions[i]
                if not want:
                    rows.append(None)
                    continue
                sel = torch.tensor(list(want), dtype=torch.int64)
                v = (logits[i - 1, sel] - lse[i - 1, 0]).tolist()
                rows.append([[x, t, None] for x, t in zip(v, want, strict=True)])
            meta["input_token_ids_logprobs"] = rows
        return meta


class TeacherState:
    """Knobs and counters of a running loopback teacher (read from any thread)."""

    def __init__(
        self,
        teachers: dict[str, TinyTeacher],
        *,
        delay_s: float = 0.0,
        per_position: bool = True,
        weight_version: str = "teacher-0",
    ) -> None:
        self.teachers = teachers
        self.delay_s = delay_s
        self.per_position = per_position
        self.weight_version = weight_version
        self.faults: collections.deque[str] = collections.deque()
        self.requests: collections.Counter[str] = collections.Counter()
        self.inflight: collections.Counter[str] = collections.Counter()
        self.max_inflight: collections.Counter[str] = collections.Counter()
        self.total_inflight = 0
        self.max_total_inflight = 0
        self.bodies: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)
        self.peers: set[tuple[str, int]] = set()

    def reset_counters(self) -> None:
        """Zero the request and in-flight maxima (not the in-flight counts)."""
        self.requests.clear()
        self.max_inflight.clear()
        self.max_total_inflight = 0
        self.bodies.clear()
        self.peers.clear()


def _bad(msg: str, status: int = 400) -> Response:
    return JSONResponse({"error": {"message": msg}}, status_code=status)


def _corrupt(body: dict[str, Any], fault: str) -> None:
    meta = body["meta_info"]
    kind, _, name = fault.partition(":")
    if kind == "drop_meta":
        del body["meta_info"]
    elif kind == "meta_not_dict":
        body["meta_info"] = ["not", "a", "dict"]
    elif kind == "drop":
        meta.pop(name, None)
    elif kind == "short":
        meta[name] = meta[name][:-1]
    elif kind in ("null", "nan"):
        last = meta[name][-1]
        bad = None if kind == "null" else float("nan")
        if name == "input_token_logprobs":
            last[0] = bad
        else:
            last[0][0] = bad
    elif kind == "drift":
        last = meta["input_token_logprobs"][-1]
        last[1] = last[1] + 1


def build_app(state: TeacherState) -> Starlette:
    """The ASGI app: ``POST [/<teacher>]/generate`` and ``GET /health``."""

    async def generate(request: Request) -> Response:
        name = request.path_params.get("teacher", "")
        teacher = state.teachers.get(name)
        if teacher is None:
            return _bad(f"no teacher {name!r}", 404)
        state.requests[name] += 1
        if request.client is not None:
            state.peers.add((request.client.host, request.client.port))
        state.inflight[name] += 1
        state.total_inflight += 1
        state.max_inflight[name] = max(state.max_inflight[name], state.inflight[name])
        state.max_total_inflight = max(state.max_total_inflight, state.total_inflight)
        try:
            return await _generate(request, teacher)
        finally:
            state.inflight[name] -= 1
            state.total_inflight -= 1

    async def _generate(request: Request, teacher: TinyTeacher) -> Response:
        arrived = time.monotonic()
        fault = state.faults.popleft() if state.faults else ""
        delay = state.delay_s
        if fault.startswith("delay:"):
            delay += float(fault.partition(":")[2])
        try:
            raw_request = await request.body()
        except ClientDisconnect:  # the client gave up (deadline tests): nobody to answer
            return Response(status_code=499)
        response = _answer(raw_request, teacher, fault)
        # The reply leaves ``delay`` after the request arrived, its compute included: a teacher
        # that batches its forward answers a wave of requests together, and a mock that
        # computed after sleeping would serialize the wave's forwards on its one event loop.
        remaining = delay - (time.monotonic() - arrived)
        if remaining > 0:
            await asyncio.sleep(remaining)
        return response

    def _answer(raw_request: bytes, teacher: TinyTeacher, fault: str) -> Response:
        if fault.startswith("status:"):
            code = int(fault.partition(":")[2])
            return _bad(f"injected status {code}", code)
        try:
            req = json.loads(raw_request)
        except json.JSONDecodeError as e:
            return _bad(f"bad JSON: {e}")
        state.bodies.append({k: v for k, v in req.items() if k != "input_ids"})
        ids = req.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return _bad("input_ids must be a non-empty list")
        sp = req.get("sampling_params") or {}
        if sp.get("max_new_tokens", 0) != 0:
            return _bad("this teacher only scores: max_new_tokens must be 0")
        flat = req.get("token_ids_logprob")
        positions = req.get("token_ids_logprob_positions") if state.per_position else None
        if flat is not None and positions is not None:
            return _bad("token_ids_logprob and token_ids_logprob_positions are exclusive")
        if positions is not None and len(positions) != len(ids):
            return _bad(
                f"token_ids_logprob_positions has {len(positions)} lists, expected {len(ids)}"
            )
        used = list(ids) + list(flat or []) + [t for row in positions or [] for t in row]
        if any(not isinstance(t, int) or not 0 <= t < teacher.vocab_size for t in used):
            return _bad(f"token id outside [0, {teacher.vocab_size})")
        meta = teacher.score(
            ids, top_k=int(req.get("top_logprobs_num") or 0), flat_ids=flat, positions=positions
        )
        meta.update(
            id=str(req.get("rid") or "score"),
            finish_reason={"type": "length", "length": 0},
            prompt_tokens=len(ids),
            completion_tokens=0,
            weight_version=state.weight_version,
        )
        body: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": meta}
        if fault:
            _corrupt(body, fault)
        raw = json.dumps(body, allow_nan=True).encode()
        if fault == "truncate":
            raw = raw[: len(raw) // 2]
        return Response(raw, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/generate", generate, methods=["POST"]),
            Route("/{teacher}/generate", generate, methods=["POST"]),
        ]
    )


class LoopbackTeacher:
    """Run :func:`build_app` with uvicorn in a thread on 127.0.0.1 (context manager).

    ``names`` are extra teachers served under ``/<name>``, each with its own seed;
    the root teacher uses ``seed``.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 512,
        seed: int = 0,
        names: Sequence[str] = (),
        delay_s: float = 0.0,
        per_position: bool = True,
        port: int = 0,
    ) -> None:
        teachers = {"": TinyTeacher(vocab_size, seed=seed)}
        for j, n in enumerate(names):
            teachers[n] = TinyTeacher(vocab_size, seed=seed + 1 + j)
        self.state = TeacherState(teachers, delay_s=delay_s, per_position=per_position)
        self._server = AppServer(
            build_app(self.state), port=port, timeout_s=5.0, access_log=False, lifespan="off"
        )
        self.port: int = self._server.port
        self.url = self._server.url

    def url_for(self, name: str) -> str:
        """Base URL of teacher ``name`` ("" is the root teacher)."""
        return f"{self.url}/{name}" if name else self.url

    def __enter__(self) -> LoopbackTeacher:
        self._server.start()  # ServerStartError if it does not start within 5 s
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m posttrain.opd.testing --port N [--delay S] [--vocab V] [--names a,b]``."""
    p = argparse.ArgumentParser(
        prog="python -m posttrain.opd.testing",
        description="Loopback SGLang-shaped teacher on 127.0.0.1 (tests and benchmarks).",
    )
    p.add_argument("--port", type=int, required=True, help="port to serve on (required)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds added to every reply "
                   "(default: 0)")  # fmt: skip
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size of the tiny "
                   "teachers (default: 512)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the root teacher (default: 0)")
    p.add_argument("--names", default="", help="extra teachers served at /NAME, "
                   "comma-separated (default: none)")  # fmt: skip
    p.add_argument("--no-per-position", action="store_true",
                   help="answer like an unpatched SGLang (no token_ids_logprob_positions; "
                   "default: off)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    a = p.parse_args(argv)
    # Requests are small: on a busy 2-core machine torch's thread pool turned a 1 ms
    # reply into 65 ms of synchronisation, so the server computes on one thread.
    torch.set_num_threads(a.threads)
    teachers = {"": TinyTeacher(a.vocab, seed=a.seed)}
    for j, n in enumerate(x for x in a.names.split(",") if x):
        teachers[n] = TinyTeacher(a.vocab, seed=a.seed + 1 + j)
    state = TeacherState(teachers, delay_s=a.delay, per_position=not a.no_per_position)
    uvicorn.run(
        build_app(state),
        host="127.0.0.1",
        port=a.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        backlog=4096,
    )


if __name__ == "__main__":
    main()
