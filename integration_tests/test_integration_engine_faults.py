"""Engine faults in the middle of a GRPO rollout, on the real stack: two ``posttrain.local_engine``
processes behind the real sgl-router binary, the session router, all on 127.0.0.1 (launch's
``build_local_stack`` started by its ``LocalRunner``), and the GRPO loop (``posttrain.grpo.loop
.run``, one trainer rank in this process) training a LoRA adapter on them.

"Mid-rollout" is exact: a thread polls sgl-router's Prometheus gauge
``smg_worker_requests_active{worker=<engine-1>}`` and strikes the moment engine 1 holds a request
of the step's rollout. The generations are long enough (random weights, 48 new tokens) that the
request is still being decoded then.

* SIGKILL: sgl-router retries the dead engine's requests on the other one (``--retry-max-
  retries``, set by the stack; its Prometheus counters show the retries and the dead engine's
  failures), every sample of the step is in the batch exactly once (each (prompt, sample) pair
  and each session id once; the session router committed exactly as many turns as were
  trained), the run completes, and the run names the dead engine (the weight sync's warning and
  ``sync_engines_lost``).
* SIGKILL of an engine holding a single request (no GRPO loop: two session rollouts): it fails
  over within its own retries, because the stack's health check (1 s) marks the dead engine
  out before the retries (backoff from 500 ms, doubling) run out; the circuit breaker is off.
* SIGSTOP: the turns engine 1 holds get no reply within the run's ``turn_timeout_s`` (the
  session router's ``--upstream-timeout-s`` is the same deadline): their samples come back
  ``aborted``, are left out of the step (the trainer sees only the completed ones), the step
  completes and ``aborted_samples`` counts them. The engine gets SIGCONT before it is stopped.

The loop runs in this process so the test can read the step's samples (a spy that records what
the real ``Rollouts.run`` returned and what the real ``train_step`` was given); the rank's
environment (RANK, WORLD_SIZE, MASTER_*) is set through ``monkeypatch`` and restored after.
Every process is stopped by pid (``LocalRunner.stop``) in a ``finally``; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from faults import save_fault_model
from prometheus_client.parser import text_string_to_metric_families

import posttrain.grpo.loop as grpo_loop
from posttrain.grpo import GrpoConfig
from posttrain.interface import Sample, SampleStatus
from posttrain.interface.processes import free_port
from posttrain.launch.runners import LocalRunner
from posttrain.launch.stack import LocalStackConfig, build_local_stack
from posttrain.session_router import SessionRolloutClient

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(180)]
ADAPTER = "policy"
PROMPTS, SAMPLES = 4, 2
TURN_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_fault_model(tmp_path_factory.mktemp("fault-model"))


class Stack:
    """The local stack's processes, their logs, and sgl-router's Prometheus endpoint."""

    def __init__(self, runner: LocalRunner, logs: list[str], metrics_port: str) -> None:
        self.runner = runner
        self.logs = logs
        self.urls = runner.urls
        self.pids = {rp.spec.name: rp.pid for rp in runner.running}
        self.router_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def router_metric(self, name: str, **labels: str) -> float:
        """The sum of sgl-router's samples ``name`` whose labels include ``labels``."""
        return _metric(httpx.get(self.router_metrics_url, timeout=5.0).text, name, **labels)

    def session_metric(self, name: str, **labels: str) -> float:
        reply = httpx.get(f"{self.urls['session-router']}/metrics", timeout=5.0)
        return _metric(reply.text, name, **labels)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@contextlib.contextmanager
def local_stack(
    model_dir: Path, *, session_router_args: tuple[str, ...] = (), lora: bool = True
) -> Iterator[Stack]:
    """The stack; with ``lora`` the engines serve the adapter the trainer pushes."""
    plan = build_local_stack(
        LocalStackConfig(
            model_path=str(model_dir), engines=2, lora_adapter=ADAPTER if lora else None,
            session_router_args=session_router_args, ready_timeout_s=120.0,
        )
    )  # fmt: skip
    router_argv = next(p.argv for p in plan.processes if p.name == "router")
    metrics_port = router_argv[router_argv.index("--prometheus-port") + 1]
    logs: list[str] = []
    runner = LocalRunner(plan, sink=lambda name, line: logs.append(f"{name}: {line}"))
    try:
        runner.start()
        yield Stack(runner, logs, metrics_port)
    finally:
        runner.stop()  # every process group by pid: SIGTERM, then SIGKILL what is left


class Striker:
    """A thread that sends ``sig`` to engine 1 once sgl-router counts a request active on it."""

    def __init__(self, stack: Stack, sig: signal.Signals, *, timeout_s: float = 90.0) -> None:
        self.stack, self.sig, self.timeout_s = stack, sig, timeout_s
        self.url = stack.urls["engine-1"]
        self.pid = stack.pids["engine-1"]
        self.active_at_strike = 0.0
        self.struck = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                active = self.stack.router_metric("smg_worker_requests_active", worker=self.url)
                if active >= 1:
                    os.kill(self.pid, self.sig)
                    if self.sig is signal.SIGSTOP and not self._still_held():
                        # the request finished between the read and the signal (a loaded
                        # machine): nothing is held, so let the engine go and wait for another
                        os.kill(self.pid, signal.SIGCONT)
                        continue
                    self.active_at_strike = active
                    self.struck.set()
                    return
            time.sleep(0.02)

    def _still_held(self) -> bool:
        """Whether sgl-router still counts a request on the stopped engine (it cannot answer)."""
        time.sleep(0.1)
        with contextlib.suppress(httpx.HTTPError):
            active = self.stack.router_metric("smg_worker_requests_active", worker=self.url)
            return active >= 1
        return False

    def join(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10.0)


class Spy:
    """Records what the loop's real ``Rollouts.run`` returned and what ``train_step`` was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rollouts: list[list[Sample]] = []
        self.trained: list[list[Any]] = []
        real_rollout, real_train = grpo_loop.Rollouts.run, grpo_loop.train_step

        def run_rollout(rollouts: Any, *args: Any, **kwargs: Any) -> list[Sample]:
            samples = real_rollout(rollouts, *args, **kwargs)
            self.rollouts.append(list(samples))
            return samples

        def train_step(policy: Any, mine: Any, *args: Any, **kwargs: Any) -> Any:
            self.trained.append(list(mine))
            return real_train(policy, mine, *args, **kwargs)

        monkeypatch.setattr(grpo_loop.Rollouts, "run", run_rollout)
        monkeypatch.setattr(grpo_loop, "train_step", train_step)


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as the one trainer rank; environment and torch threads restored after."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def grpo_config(stack: Stack, out: Path, model_dir: Path, **overrides: Any) -> GrpoConfig:
    settings: dict[str, Any] = {
        "model_path": model_dir, "rollout_url": stack.urls["session-router"],
        "engine_urls": (stack.urls["engine-0"], stack.urls["engine-1"]), "lora_name": ADAPTER,
        "replicate": 1, "shard": 1, "steps": 1, "prompts_per_step": PROMPTS,
        "samples_per_prompt": SAMPLES, "max_new_tokens": 48, "lr": 1e-3, "out_dir": out,
    }  # fmt: skip
    settings.update(overrides)
    return GrpoConfig(**settings)


def _once_each(samples: list[Sample]) -> None:
    """Every (prompt, sample) pair of the step exactly once, and every session once."""
    pairs = Counter((s.metadata["prompt_index"], s.index) for s in samples)
    assert len(pairs) == PROMPTS * SAMPLES, pairs
    assert set(pairs.values()) == {1}, pairs
    sessions = Counter(s.metadata["session_id"] for s in samples)
    assert set(sessions.values()) == {1}, sessions


def test_an_engine_killed_mid_rollout_fails_over_and_the_step_counts_each_sample_once(
    model_dir: Path, tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    spy = Spy(monkeypatch)
    with local_stack(model_dir) as stack:
        dead = stack.urls["engine-1"]
        striker = Striker(stack, signal.SIGKILL)
        try:
            with caplog.at_level(logging.WARNING, logger="posttrain.grpo"):
                summary = grpo_loop.run(grpo_config(stack, tmp_path / "run", model_dir, steps=2))
        finally:
            striker.join()
        assert striker.struck.is_set(), "engine 1 never held a request of the rollout"
        # sgl-router retried the dead engine's requests (on engine 0: the only one alive).
        assert stack.router_metric("smg_worker_retries_total") >= 1
        assert stack.router_metric("smg_worker_cb_outcomes_total", worker=dead, outcome="failure")
        committed = stack.session_metric("session_router_turns_total", outcome="committed")
        failed = stack.session_metric("session_router_turns_total", outcome="upstream_error")
        created = stack.session_metric("session_router_sessions_created_total")
    assert summary is not None
    assert len(spy.rollouts) == len(spy.trained) == 2
    for samples, trained in zip(spy.rollouts, spy.trained, strict=True):
        assert all(s.status is not SampleStatus.ABORTED for s in samples)
        _once_each(samples)
        assert [t.tokens for t in trained] == [s.tokens for s in samples]  # each once, in order
    # The session router committed each turn once: no retry reached it as a second turn.
    assert committed == created == 2 * PROMPTS * SAMPLES
    assert failed == 0
    # The run says what happened: the sync after step 0 names the dead engine and drops it.
    lost = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lost) == 1, lost
    assert dead in lost[0]
    assert "1 of 2 engines remain" in lost[0]
    steps = _records(tmp_path / "run")
    assert [r["sync_engines_lost"] for r in steps] == [1.0, 0.0]
    assert [r["samples"] for r in steps] == [PROMPTS * SAMPLES] * 2
    assert [r["aborted_samples"] for r in steps] == [0.0, 0.0]


def test_a_request_alone_on_an_engine_killed_mid_generation_fails_over(model_dir: Path) -> None:
    """The router's manual policy keeps a session on its engine, retries included, until that
    engine is unavailable: with sgl-router's defaults a lone request on a dead engine failed
    with a 500. The stack's breaker is off (client 4xx must not trip it, issue 35): the health
    check marks the dead engine out within a second and the retries span longer than that."""
    with local_stack(model_dir, lora=False) as stack:
        messages = [{"role": "user", "content": "12+30="}]

        async def rollouts() -> list[Sample]:
            async with SessionRolloutClient(stack.urls["session-router"], timeout_s=60) as client:
                # ignore_eos: each request decodes to its cap, so it is still in flight when the
                # striker reads sgl-router's count (an engine fast enough to answer "12+30=" and
                # stop within one 20 ms poll left nothing to strike)
                params = {
                    "max_tokens": 200,
                    "temperature": 1.0,
                    "logprobs": True,
                    "ignore_eos": True,
                }
                jobs = [client.rollout(messages, sampling_params={**params, "seed": i})
                        for i in range(2)]  # fmt: skip
                return list(await asyncio.wait_for(asyncio.gather(*jobs), timeout=90))

        striker = Striker(stack, signal.SIGKILL)
        try:
            samples = asyncio.run(rollouts())
        finally:
            striker.join()
        assert striker.struck.is_set(), "engine 1 never held a request"
        # sgl-router may have put both sessions on engine 1: then both are in flight there
        active = striker.active_at_strike
        assert active in (1.0, 2.0)
        ended = {SampleStatus.COMPLETED, SampleStatus.TRUNCATED}  # EOS or the token cap
        assert all(s.status in ended for s in samples)
        assert [s.response_length > 0 for s in samples] == [True, True]
        assert stack.session_metric("session_router_turns_total", outcome="committed") == 2


def test_an_engine_frozen_mid_rollout_aborts_its_turns_at_the_deadline_and_the_step_completes(
    model_dir: Path, tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    spy = Spy(monkeypatch)
    deadline = ("--upstream-timeout-s", str(TURN_TIMEOUT_S))
    with local_stack(model_dir, session_router_args=deadline) as stack:
        frozen = stack.urls["engine-1"]
        striker = Striker(stack, signal.SIGSTOP)
        try:
            cfg = grpo_config(
                stack, tmp_path / "run", model_dir,
                turn_timeout_s=TURN_TIMEOUT_S, rollout_timeout_s=2 * TURN_TIMEOUT_S,
            )  # fmt: skip
            with caplog.at_level(logging.WARNING, logger="posttrain.grpo"):
                summary = grpo_loop.run(cfg)
            committed = stack.session_metric("session_router_turns_total", outcome="committed")
        finally:
            striker.join()
            with contextlib.suppress(ProcessLookupError):
                os.kill(stack.pids["engine-1"], signal.SIGCONT)  # so that SIGTERM can stop it
    assert striker.struck.is_set(), "engine 1 never held a request of the rollout"
    assert summary is not None
    (samples,), (trained,) = spy.rollouts, spy.trained
    _once_each(samples)
    aborted = [s for s in samples if s.status is SampleStatus.ABORTED]
    done = [s for s in samples if s.status is not SampleStatus.ABORTED]
    assert aborted, "no turn was held by the frozen engine"
    for s in aborted:  # no tokens, and why: the deadline
        assert s.response_ids == []
        assert s.loss_mask == []
        assert (
            "timed out" in s.metadata["abort_reason"]
            or "turn_timeout_s" in (s.metadata["abort_reason"])
        ), s.metadata
    # Left out of the step: the trainer got exactly the completed samples, token for token.
    assert [t.tokens for t in trained] == [s.tokens for s in done]
    assert committed == len(done)
    (record,) = _records(tmp_path / "run")
    assert record["aborted_samples"] == len(aborted)
    assert record["samples"] == len(done)
    # The configured deadline bounded the rollout, not the session router's default 120 s.
    assert record["time/rollout"] < 60.0
    assert record["sync_engines_lost"] == 1.0  # the frozen engine did not take the new adapter
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"{len(aborted)} of {PROMPTS * SAMPLES} samples aborted" in m for m in messages)
    assert any(frozen in m and "unreachable" in m for m in messages), messages


def _records(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
