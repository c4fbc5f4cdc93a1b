"""``posttrain demo``: the whole CPU rollout path, end to end, with real processes.

It writes a tiny seeded checkpoint (by running ``python -m posttrain.models init``;
launch never imports its siblings), brings up the local stack of ``posttrain up``
(local engines, the stock sgl-router, the session router), holds a multi-turn chat
through one token-in/token-out session, and collects the training sample the
session assembles: the exact token ids, rollout logprobs and loss mask the engine
produced. Then it stops every process it started. Like ``posttrain up``, the stack gets a
random API key (``keys.py``) for its engines and session router; the chat sends it.

The sample arrives in samples/1, the session router's wire format, and is read
with ``posttrain.formats.decode_samples`` (formats sits below launch; the read needs
numpy and safetensors, no server and no torch). The demo runs only with launch's
``local`` extra, which installs it.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from posttrain.formats import decode_samples
from posttrain.interface import PosttrainError
from posttrain.launch._errors import LaunchError
from posttrain.launch.keys import new_api_key, remove_key_file, write_key_file
from posttrain.launch.progress import StackProgress
from posttrain.launch.runners import LocalRunner, LogSink
from posttrain.launch.stack import LocalStackConfig, build_local_stack
from posttrain.launch.tables import EngineKind

DEFAULT_TURNS = ("Hello! Who are you?", "Tell me one more thing.", "Thanks, bye.")


class DemoError(LaunchError):
    """The demo could not complete: a process failed or a reply was not what the path promises."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    model_path: Path | None = None  # None: write a fresh tiny checkpoint to a temp dir
    engines: int = 2
    turns: int = 2
    max_tokens: int = 12
    seed: int = 0
    ready_timeout_s: float = 300.0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= len(DEFAULT_TURNS):
            raise DemoError(f"--turns must be in 1..{len(DEFAULT_TURNS)}, got {self.turns}")
        if self.max_tokens < 1:
            raise DemoError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.engines < 1:
            raise DemoError(f"--engines must be >= 1, got {self.engines}")


@dataclass(slots=True)
class TurnReport:
    user: str
    reply: str
    completion_tokens: int
    logprob_sum: float
    logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class DemoReport:
    model_path: str
    urls: dict[str, str]
    turns: list[TurnReport] = field(default_factory=list)
    sample_tokens: int = 0
    sample_turns: int = 0
    sample_trained_tokens: int = 0
    sample_logprobs_match_turns: bool = False
    sample_status: str = ""
    api_key_file: str = ""


def write_tiny_checkpoint(path: Path, seed: int, timeout_s: float = 300.0) -> None:
    """Run the models package's ``init`` command (a subprocess: launch imports no sibling)."""
    # This interpreter, as LocalRunner resolves PYTHON: `python` on PATH may be another one.
    argv = [sys.executable, "-m", "posttrain.models", "init", str(path), "--seed", str(seed)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise DemoError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr[-2000:]}")


def run_demo(cfg: DemoConfig, sink: LogSink, progress: StackProgress | None = None) -> DemoReport:
    """Bring the stack up, chat through one session, collect the sample, stop everything.

    ``progress`` (the CLI's display) shows each step; ``None`` (a library caller) shows nothing.
    """
    key = new_api_key()
    with tempfile.TemporaryDirectory(prefix="posttrain-demo-") as scratch:
        model_path = cfg.model_path
        if model_path is None:
            model_path = Path(scratch) / "tiny-moe"
            sink("demo", f"writing a tiny Dense/MoE checkpoint (seed {cfg.seed}) to {model_path}")
            with _step(progress, f"writing a tiny Dense/MoE checkpoint (seed {cfg.seed})"):
                write_tiny_checkpoint(model_path, cfg.seed)
        key_file = write_key_file(key, f"demo-{os.getpid()}")
        try:
            plan = build_local_stack(
                LocalStackConfig(
                    model_path=str(model_path),
                    engines=cfg.engines,
                    engine_kind=EngineKind.LOCAL,
                    ready_timeout_s=cfg.ready_timeout_s,
                    api_key=key,
                    api_key_file=str(key_file),
                )
            )
            events = None if progress is None else progress.on_event
            with LocalRunner(plan, sink=sink, api_key=key, on_event=events) as runner:
                runner.start()
                report = DemoReport(
                    model_path=str(model_path), urls=dict(runner.urls), api_key_file=str(key_file)
                )
                _chat(cfg, report, sink, progress, key)
        finally:
            remove_key_file(key_file)
        sink("demo", "stopped every process")
        return report


def _step(progress: StackProgress | None, description: str) -> AbstractContextManager[None]:
    """``progress.step(description)``, or nothing shown without a display (a library caller)."""
    return contextlib.nullcontext() if progress is None else progress.step(description)


def _chat(
    cfg: DemoConfig, report: DemoReport, sink: LogSink, progress: StackProgress | None, key: str
) -> None:
    base = report.urls["session-router"]
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=timeout, headers=headers) as client:
        session = _ok(client.post(f"{base}/sessions"))["session_id"]
        sink("demo", f"session {session} at {base}")
        messages: list[dict[str, str]] = []
        for number, user in enumerate(DEFAULT_TURNS[: cfg.turns], start=1):
            messages.append({"role": "user", "content": user})
            body = {"messages": messages, "max_tokens": cfg.max_tokens, "temperature": 1.0,
                    "seed": cfg.seed, "logprobs": True}  # fmt: skip
            with _step(progress, f"chat turn {number} through the session"):
                url = f"{base}/sessions/{session}/v1/chat/completions"
                reply = _ok(client.post(url, json=body))
            choice = reply["choices"][0]
            text = choice["message"]["content"] or ""
            entries = choice["meta_info"]["output_token_logprobs"]
            report.turns.append(
                TurnReport(
                    user=user,
                    reply=text,
                    completion_tokens=int(reply["usage"]["completion_tokens"]),
                    logprob_sum=math.fsum(float(e[0]) for e in entries),
                    logprobs=[float(e[0]) for e in entries],
                )
            )
            messages.append({"role": "assistant", "content": text})
        with _step(progress, "collecting the training sample"):
            sample_reply = client.post(
                f"{base}/sessions/{session}/samples", json={"max_seq_len": None}
            )
        if sample_reply.status_code != 200:
            raise DemoError(
                f"POST /samples answered {sample_reply.status_code}: {sample_reply.text}"
            )
        try:
            decoded = decode_samples(sample_reply.content)
        except PosttrainError as exc:
            raise DemoError(f"POST /samples answered a malformed samples/1 payload: {exc}") from exc
        if not decoded.samples:
            raise DemoError(f"the session assembled no sample: {decoded.empty_reason}")
        sample = decoded.samples[0]
        mask, logprobs = sample.loss_mask, sample.rollout_logprobs
        report.sample_tokens = len(sample.tokens)
        report.sample_trained_tokens = sum(mask)
        # The sample covers the leading turns up to the first one that did not complete (a turn
        # cut by max_tokens is "truncated" and ends the merge); its trained logprobs must be
        # exactly the engine's, turn after turn.
        trained = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
        engine: list[float] = []
        for turn in report.turns:
            if len(engine) >= len(trained):
                break
            engine.extend(turn.logprobs)
            report.sample_turns += 1
        report.sample_logprobs_match_turns = trained == engine
        report.sample_status = sample.status.value
        _ok(client.delete(f"{base}/sessions/{session}"), empty=True)


def _ok(reply: httpx.Response, *, empty: bool = False) -> Any:
    if reply.status_code >= 300:
        raise DemoError(f"{reply.request.method} {reply.request.url} answered "
                        f"{reply.status_code}: {reply.text[:500]}")  # fmt: skip
    return None if empty else reply.json()
