"""An engine a weight sync lost comes back: re-admitted only once it holds the trainer's weights.

The real stack on 127.0.0.1 (two ``posttrain.local_engine`` processes behind the real sgl-router
binary and the session router, launch's ``build_local_stack`` started by its ``LocalRunner``) and
the GRPO loop (``posttrain.grpo.loop.run``, one trainer rank in this process, strict numerics,
full-weight training unless said otherwise). Engine 1 gets SIGSTOP just before the sync after step 0 and SIGCONT
as soon as that sync returned: the sync loses it (no reply within the target's timeout).

* With re-admission (the default, and ``router_url``): the loop deregisters engine 1 from
  sgl-router, probes it at the next sync, pushes it the current weights and only then registers
  it again. At that moment (a spy on ``fleet.register``) engine 1 holds the trainer's weight
  version and its ``/weights_checksum`` equals the digest of the trainer's own HF tensors, and
  sgl-router does not list it yet. Every sample of every step was produced at the trainer's
  version (no stale sample), ``train_rollout_logprob_abs_diff`` is 0 at every step, and the
  metrics count the loss and the re-admission; engine 1 serves rollout turns again afterwards.
  The same with an adapter (the engines serve ``policy``): engine 1 reloads its base from the
  checkpoint and takes the current adapter before it is registered again, and the logprob
  difference stays 0 at every step (an engine serving the old adapter would break it).
* Negative control (``readmit_lost_engines=False``, no router URL: the loop as it was before):
  engine 1 is never pushed to again and is left at the version it took first, while
  sgl-router's health checks route turns to it again; those samples are stale, and the loop
  leaves them out of the step (``stale_samples``), so the trainer never trains on them.

The two full-weight runs share one stack (a module fixture): a run's first sync pushes the
trainer's weights to every engine. Every process is stopped by pid (``LocalRunner.stop``) in a
``finally``; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from faults import save_fault_model
from prometheus_client.parser import text_string_to_metric_families

import posttrain.grpo.fleet as grpo_fleet
import posttrain.grpo.loop as grpo_loop
from posttrain.formats import tensors_sha256
from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo import GrpoConfig
from posttrain.grpo.rewards import Task, addition_prompts
from posttrain.interface import Sample
from posttrain.interface.processes import free_port
from posttrain.launch.runners import LocalRunner
from posttrain.launch.stack import LocalStackConfig, build_local_stack
from posttrain.models import to_hf_state_dict

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(240)]
STEPS = 3
SYNC_TIMEOUT_S = 6.0  # the sync's per-engine timeout (rollout_timeout_s): how long a freeze lasts


def even_token_share(sample: Sample) -> float:
    """A dense reward (random weights never answer a sum): the share of even response ids. It
    differs between samples, so every step moves the weights."""
    return sum(t % 2 == 0 for t in sample.response_ids) / max(sample.response_length, 1)


TASK = Task(name="even-tokens", prompts=addition_prompts(), reward=even_token_share)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_fault_model(tmp_path_factory.mktemp("readmit-model"))


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as the one trainer rank; environment and torch threads restored after."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def local_stack(model_dir: Path, train: str) -> Iterator[tuple[LocalRunner, str]]:
    """The stack (with ``train="lora"`` the engines serve the adapter ``policy``) and
    sgl-router's metrics URL."""
    adapter = "policy" if train == "lora" else None
    plan = build_local_stack(
        LocalStackConfig(
            model_path=str(model_dir), engines=2, lora_adapter=adapter, ready_timeout_s=120.0
        )
    )
    argv = next(p.argv for p in plan.processes if p.name == "router")
    metrics_url = f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}/metrics"
    runner = LocalRunner(plan, sink=lambda name, line: None)
    try:
        runner.start()
        yield runner, metrics_url
    finally:
        runner.stop()  # every process group by pid: SIGTERM, then SIGKILL what is left


@pytest.fixture(scope="module")
def full_stack(model_dir: Path) -> Iterator[tuple[LocalRunner, str]]:
    """One full-weight stack for both full-weight runs: a run's first sync pushes the trainer's
    weights to every engine, so the second starts from what a fresh stack would serve."""
    with local_stack(model_dir, "full") as stack:
        yield stack


class FreezeAtFirstStepSync:
    """Wraps the fleet's ``sync``: SIGSTOP engine 1 just before the sync after step 0,
    SIGCONT once it returned. Records every call's version and the policy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pid: int) -> None:
        self.pid = pid
        self.versions: list[int] = []
        self.policy: Any = None
        real = grpo_fleet.EngineFleet.sync

        def sync(fleet: Any, policy: Any, version: int, **kwargs: Any) -> Any:
            self.policy = policy
            self.versions.append(version)
            if len(self.versions) != 2:
                return real(fleet, policy, version, **kwargs)
            os.kill(self.pid, signal.SIGSTOP)
            try:
                return real(fleet, policy, version, **kwargs)
            finally:
                os.kill(self.pid, signal.SIGCONT)

        monkeypatch.setattr(grpo_fleet.EngineFleet, "sync", sync)

    def trainer_sha256(self) -> str | None:
        """The digest of the trainer's weights as HF tensors (what the engine digests); None
        for an adapter (the engine digests its base only)."""
        if self.policy.lora is not None:
            return None
        model = self.policy.model
        return tensors_sha256(to_hf_state_dict(dict(iter_full_state_dict(model)), model.config))


def _records(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _served(metrics_url: str, worker: str) -> float:
    """sgl-router's count of requests ``worker`` answered (its circuit breaker's successes)."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=5.0).text):
        for s in family.samples:
            labels = s.labels
            if (
                s.name == "smg_worker_cb_outcomes_total"
                and labels.get("worker") == worker
                and (labels.get("outcome") == "success")
            ):
                total += s.value
    return total


def _run(
    stack: tuple[LocalRunner, str],
    model_dir: Path,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    readmit: bool,
    train: str,
) -> Any:
    """One run of ``STEPS`` steps on ``stack`` with engine 1 frozen through the first step's
    sync."""
    seen: dict[str, Any] = {}
    runner, metrics_url = stack
    urls = runner.urls
    frozen = urls["engine-1"]
    pid = next(rp.pid for rp in runner.running if rp.spec.name == "engine-1")
    freezer = FreezeAtFirstStepSync(monkeypatch, pid)
    real_register, real_deregister = grpo_fleet.register, grpo_fleet.deregister

    def deregister(router_url: str, url: str, *, timeout_s: float) -> None:
        real_deregister(router_url, url, timeout_s=timeout_s)
        seen["served_at_deregister"] = _served(metrics_url, url)

    def register(router_url: str, url: str, *, timeout_s: float) -> None:
        info = httpx.get(f"{url}/weights_checksum", timeout=30.0).json()
        seen.setdefault("at_register", []).append({
            "url": url, "engine": info, "version": freezer.versions[-1],
            "trainer_sha256": freezer.trainer_sha256(),
            "router_lists_it": url in httpx.get(f"{router_url}/workers", timeout=5.0).text,
            "served_before": _served(metrics_url, url),
        })  # fmt: skip
        real_register(router_url, url, timeout_s=timeout_s)

    monkeypatch.setattr(grpo_fleet, "register", register)
    monkeypatch.setattr(grpo_fleet, "deregister", deregister)
    cfg = GrpoConfig(
        model_path=model_dir, rollout_url=urls["session-router"],
        engine_urls=(urls["engine-0"], frozen), train=train, replicate=1, shard=1,
        steps=STEPS, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=12, lr=1e-2,
        out_dir=out, rollout_timeout_s=SYNC_TIMEOUT_S, turn_timeout_s=SYNC_TIMEOUT_S,
        router_url=urls["router"] if readmit else None, readmit_lost_engines=readmit,
    )  # fmt: skip
    summary = grpo_loop.run(cfg, task=TASK)
    seen["summary"] = summary
    seen["versions"] = list(freezer.versions)
    seen["trainer_sha256"] = freezer.trainer_sha256()
    seen["engines"] = {
        name: httpx.get(f"{urls[name]}/weights_checksum", timeout=30.0).json()
        for name in ("engine-0", "engine-1")
    }
    seen["served_end"] = _served(metrics_url, frozen)
    seen["frozen"] = frozen
    seen["records"] = _records(out)
    return seen


@pytest.mark.parametrize("train", ["full", "lora"])
def test_a_lost_engine_takes_the_current_weights_before_it_is_readmitted(
    model_dir: Path,
    tmp_path: Path,
    one_rank: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    train: str,
) -> None:
    out = tmp_path / "run"
    if train == "full":  # the module's full-weight stack, shared with the negative control
        stack = request.getfixturevalue("full_stack")
        seen = _run(stack, model_dir, out, monkeypatch, readmit=True, train=train)
    else:
        with local_stack(model_dir, train) as stack:
            seen = _run(stack, model_dir, out, monkeypatch, readmit=True, train=train)
    steps = seen["records"]
    versions = seen["versions"]  # the start sync, then one per step
    assert len(versions) == STEPS + 1
    assert all(r["grad_norm"] > 0 for r in steps)  # the weights move at every step
    # The sync after step 0 lost engine 1; the next one re-admitted it, once.
    assert [r["sync_engines_lost"] for r in steps] == [1.0, 0.0, 0.0]
    assert [r["sync_engines_readmitted"] for r in steps] == [0.0, 1.0, 0.0]
    (back,) = seen["at_register"]
    assert back["url"] == seen["frozen"]
    assert not back["router_lists_it"]  # deregistered while lost: it served no turn then
    assert back["served_before"] == seen["served_at_deregister"]
    # It serves rollout turns again afterwards, and the trainer's recompute equals the engines'
    # logprobs at every step (a stale adapter or stale weights would not).
    assert seen["served_end"] > back["served_before"]
    assert [r["train_rollout_logprob_abs_diff"] for r in steps] == [0.0] * STEPS
    assert back["engine"]["stale_tensors"] == 0
    if train == "lora":  # its base was reloaded from the checkpoint: engine 0's, unchanged
        assert back["engine"]["sha256"] == seen["engines"]["engine-0"]["sha256"]
        return
    # Before sgl-router lists it again, it holds the trainer's version and exact weights.
    assert back["version"] == versions[2]
    assert back["engine"]["weight_version"] == versions[2]
    assert back["engine"]["sha256"] == back["trainer_sha256"]
    assert [r["stale_samples"] for r in steps] == [0.0] * STEPS  # no stale sample anywhere
    for engine in seen["engines"].values():
        assert engine["weight_version"] == versions[-1]
        assert engine["sha256"] == seen["trainer_sha256"]


def test_without_readmission_the_lost_engine_stays_on_old_weights(
    model_dir: Path,
    full_stack: tuple[LocalRunner, str],
    tmp_path: Path,
    one_rank: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _run(full_stack, model_dir, tmp_path / "run", monkeypatch, readmit=False, train="full")
    steps = seen["records"]
    versions = seen["versions"]
    assert "at_register" not in seen
    assert "served_at_deregister" not in seen  # the old loop: it stays in sgl-router
    assert steps[0]["grad_norm"] > 0  # the weights moved away from what engine 1 holds
    assert [r["sync_engines_lost"] for r in steps] == [1.0, 0.0, 0.0]
    assert [r["sync_engines_readmitted"] for r in steps] == [0.0] * STEPS
    # Engine 1 is left at the version it took at the start; engine 0 moved on.
    assert seen["engines"]["engine-1"]["weight_version"] == versions[0]
    assert seen["engines"]["engine-1"]["sha256"] != seen["trainer_sha256"]
    assert seen["engines"]["engine-0"]["weight_version"] == versions[-1]
    # sgl-router sends it turns again; their samples are off-policy and left out of the step.
    assert sum(r["stale_samples"] for r in steps) >= 1
    assert [r["samples"] + r["stale_samples"] for r in steps] == [4.0] * STEPS
    assert [r["train_rollout_logprob_abs_diff"] for r in steps] == [0.0] * STEPS
