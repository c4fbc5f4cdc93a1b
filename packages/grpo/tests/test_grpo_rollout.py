"""Rollout requests: one group request per prompt, deterministic per-sample seeds, versioned.

The session server here is ``httpx.MockTransport`` standing in for the session router's routes
(its real behaviour is covered by the integration tests); it lets a test see every request
and inject a failing reply.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from posttrain.formats import encode_samples
from posttrain.grpo import GrpoConfig, GrpoConfigError, GrpoRunError
from posttrain.grpo import rollout as rollout_module
from posttrain.grpo.loop import run
from posttrain.grpo.rewards import Prompt
from posttrain.grpo.rollout import (
    Rollouts,
    RolloutSettings,
    group_seed,
    run_rollout,
    sampling_seed,
)
from posttrain.interface import RolloutEngine, Sample, SampleStatus
from posttrain.session_router import SessionRolloutClient


class FakeSessions:
    """The session router's ``POST /rollouts``: one session per sample (``s1``, ``s2``, ...)."""

    def __init__(self, fail_chat: bool = False, time_out: frozenset[str] = frozenset()) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.auth: list[str | None] = []
        self.fail_chat = fail_chat
        self.time_out = time_out  # sessions whose turn gets no reply (the upstream's 504)
        self.count = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        self.auth.append(request.headers.get("authorization"))
        assert (request.method, request.url.path) == ("POST", "/rollouts")
        if self.fail_chat:
            return httpx.Response(502, json={"error": "sample 0: upstream answered 500"})
        out = []
        for _ in range(body["n"]):
            self.count += 1
            sid = f"s{self.count}"
            meta = {**body["metadata"], "session_id": sid}
            if sid in self.time_out:
                if "turn_timeout_s" not in body:
                    return httpx.Response(504, json={"error": "upstream timeout: no reply in 3 s"})
                out.append(Sample(prompt_ids=[], response_ids=[], rollout_logprobs=[],
                                  loss_mask=[], status=SampleStatus.ABORTED,
                                  metadata={**meta, "abort_reason": "upstream call timed out "
                                            "(504)"}))  # fmt: skip
                continue
            out.append(Sample(prompt_ids=[2, 3], response_ids=[50, 3],
                              rollout_logprobs=[-0.5, -0.25], loss_mask=[1, 1],
                              metadata=meta))  # fmt: skip
        return httpx.Response(200, content=encode_samples(out))


def _settings(**changes: Any) -> RolloutSettings:
    base: dict[str, Any] = {"url": "http://sr", "samples_per_prompt": 3, "max_new_tokens": 4,
                            "temperature": 1.0, "seed": 7}  # fmt: skip
    return RolloutSettings(**{**base, **changes})


PROMPTS = [Prompt(index=i, messages=({"role": "user", "content": f"{i}+1="},),
                  metadata={"answer": str(i + 1)}) for i in (4, 9)]  # fmt: skip


def test_one_group_request_per_prompt_in_order_with_seeds_and_the_weight_version() -> None:
    fake = FakeSessions()
    out = run_rollout(_settings(weight_version=3, top_logprobs=4), PROMPTS, step=2,
                      transport=httpx.MockTransport(fake))  # fmt: skip
    assert [(s.group_index, s.index) for s in out] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 3),
        (1, 4),
        (1, 5),
    ]
    assert [s.metadata["prompt_index"] for s in out] == [4, 4, 4, 9, 9, 9]
    assert out[0].metadata["answer"] == "5"
    groups = sorted((b for _, _, b in fake.requests), key=lambda b: b["metadata"]["prompt_index"])
    assert len(groups) == 2  # one request per prompt, not four per sample
    assert fake.count == 6
    for p, b in zip((4, 9), groups, strict=True):
        assert b["n"] == 3
        assert b["seeds"] == [sampling_seed(7, 2, p, j) for j in range(3)]  # sample j's seed
        # each session is opened with the served version: the session router derives the
        # adapter's lora_path and extra_key from it (posttrain.formats.apply_lora_fields)
        assert b["weight_version"] == 3
        turn = b["turn"]
        assert turn["messages"] == [{"role": "user", "content": f"{p}+1="}]
        assert "lora_path" not in turn
        assert "extra_key" not in turn
        assert "seed" not in turn
        assert turn["top_logprobs"] == 4
        assert turn["logprobs"] is True
        assert turn["max_tokens"] == 4
    assert len({s for b in groups for s in b["seeds"]}) == 6


def test_every_request_carries_the_stack_key_when_given() -> None:
    fake = FakeSessions()
    run_rollout(_settings(api_key="k3y"), PROMPTS[:1], step=0, transport=httpx.MockTransport(fake))
    assert fake.auth
    assert set(fake.auth) == {"Bearer k3y"}
    fake = FakeSessions()
    run_rollout(_settings(), PROMPTS[:1], step=0, transport=httpx.MockTransport(fake))
    assert set(fake.auth) == {None}


def test_seeds_depend_only_on_seed_step_prompt_sample() -> None:
    assert sampling_seed(0, 1, 2, 3) == sampling_seed(0, 1, 2, 3)
    assert (
        len({sampling_seed(0, s, p, j) for s in range(3) for p in range(3) for j in range(3)}) == 27
    )
    assert 0 <= sampling_seed(123, 4, 5, 6) < 2**31
    # a group's seeds are consecutive (one n request draws sample j with base + j)
    assert [sampling_seed(7, 2, 1, j) for j in range(4)] == [
        group_seed(7, 2, 1) + j for j in range(4)
    ]


def test_a_failed_turn_names_the_url_and_the_prompt() -> None:
    fake = FakeSessions(fail_chat=True)
    with pytest.raises(
        GrpoRunError,
        match=r"http://sr failed for prompt \d: .*POST /rollouts answered 502.*sample 0",
    ):
        run_rollout(_settings(), PROMPTS, step=0, transport=httpx.MockTransport(fake))


def test_transport_errors_are_run_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(GrpoRunError, match="ConnectError"):
        run_rollout(_settings(), PROMPTS[:1], step=0, transport=httpx.MockTransport(refuse))


def test_a_turn_past_the_deadline_is_an_aborted_sample_in_its_place() -> None:
    fake = FakeSessions(time_out=frozenset({"s2", "s5"}))
    out = run_rollout(_settings(turn_timeout_s=3.0), PROMPTS[:1], step=0,
                      transport=httpx.MockTransport(fake))  # fmt: skip
    out += run_rollout(_settings(turn_timeout_s=3.0), PROMPTS[1:], step=0,
                       transport=httpx.MockTransport(fake))  # fmt: skip
    assert [s.index for s in out] == [0, 1, 2, 0, 1, 2]
    aborted = [s for s in out if s.status is SampleStatus.ABORTED]
    assert [s.metadata["session_id"] for s in aborted] == ["s2", "s5"]
    assert [s.metadata["prompt_index"] for s in aborted] == [4, 9]
    assert all("504" in s.metadata["abort_reason"] and s.response_ids == [] for s in aborted)
    assert sum(s.status is SampleStatus.COMPLETED for s in out) == 4
    assert all(b["turn_timeout_s"] == 3.0 for _, _, b in fake.requests)
    # Without a turn deadline the same 504 fails the rollout.
    with pytest.raises(GrpoRunError, match="answered 504"):
        run_rollout(_settings(), PROMPTS, step=0,
                    transport=httpx.MockTransport(FakeSessions(time_out=frozenset({"s1"}))))  # fmt: skip


def test_one_client_and_loop_serve_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSessions()
    made: list[SessionRolloutClient] = []

    class Counted(SessionRolloutClient):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(rollout_module, "SessionRolloutClient", Counted)
    loops: list[asyncio.AbstractEventLoop] = []
    real = rollout_module.rollout

    async def spy(*args: Any, **kwargs: Any) -> list[Sample]:
        loops.append(asyncio.get_running_loop())
        return await real(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "rollout", spy)
    with Rollouts(transport=httpx.MockTransport(fake)) as rollouts:
        first = rollouts.run(_settings(weight_version=0), PROMPTS, step=0)
        second = rollouts.run(_settings(weight_version=1), PROMPTS, step=1)
    assert len(made) == 1  # one client for both steps
    assert loops[0] is loops[1]  # and one event loop
    assert len(first) == len(second) == 6
    assert [b["weight_version"] for _, _, b in fake.requests] == [0, 0, 1, 1]
    assert first[0].metadata["session_id"] != second[0].metadata["session_id"]


class OwnEngine:
    """A rollout engine that is not ours: speaks ``posttrain.interface.RolloutEngine`` in process."""

    def __init__(self, *, fail_on: int | None = None, hang: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any], int | None]] = []
        self.fail_on, self.hang = fail_on, hang

    async def rollout(
        self,
        messages: Any,
        *,
        sampling_params: Any = None,
        weight_version: int | None = None,
    ) -> Sample:
        self.calls.append((messages[0]["content"], dict(sampling_params), weight_version))
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise RuntimeError("out of memory")
        return Sample(prompt_ids=[2], response_ids=[7], rollout_logprobs=[-0.1], loss_mask=[1],
                      weight_version=weight_version)  # fmt: skip


def test_a_foreign_engine_rolls_out_through_the_protocol() -> None:
    engine = OwnEngine()
    assert isinstance(engine, RolloutEngine)
    samples = run_rollout(_settings(weight_version=5), PROMPTS, step=2, engine=engine)
    assert [(s.group_index, s.index) for s in samples] == [(g, g * 3 + j) for g in (0, 1)
                                                           for j in range(3)]  # fmt: skip
    # The prompt's metadata (what the reward reads) is on the sample; the engine never saw it.
    assert [s.metadata for s in samples] == [
        {"answer": str(p.index + 1), "prompt_index": p.index} for p in PROMPTS for _ in range(3)
    ]
    seeds = sorted(params["seed"] for _, params, _ in engine.calls)
    assert seeds == sorted(sampling_seed(7, 2, p.index, j) for p in PROMPTS for j in range(3))
    assert {(params["max_tokens"], params["logprobs"], v) for _, params, v in engine.calls} == {
        (4, True, 5)
    }


def test_a_foreign_engine_failure_or_hang_is_a_named_run_error() -> None:
    with pytest.raises(GrpoRunError, match=r"engine OwnEngine for prompt \d+ sample \d+: "
                       r"RuntimeError: out of memory"):  # fmt: skip
        run_rollout(_settings(), PROMPTS, step=0, engine=OwnEngine(fail_on=2))
    with pytest.raises(GrpoRunError, match=r"no sample within 0.2 s"):
        run_rollout(_settings(timeout_s=0.2), PROMPTS, step=0, engine=OwnEngine(hang=True))


def test_run_refuses_plugged_parts_that_do_not_speak_the_protocols(tmp_path: Path) -> None:
    cfg = GrpoConfig(model_path=tmp_path, replicate=1, shard=1)
    with pytest.raises(GrpoConfigError, match="engine is a str, which has no async rollout"):
        run(cfg, engine="http://engine")  # type: ignore[arg-type]
    with pytest.raises(GrpoConfigError, match=r"weight_sinks\[0\] is a OwnEngine"):
        run(cfg, engine=OwnEngine(), weight_sinks=[OwnEngine()])  # type: ignore[list-item]
    with pytest.raises(GrpoConfigError, match=r"engine_urls \(or weight_sinks\) is required"):
        run(cfg, engine=OwnEngine())
