"""``POST /rollouts`` (``SessionRolloutClient.rollout_n``): a group of samples in one request.

Each sample must be exactly what one session per sample gives (``rollout``): the same prompt ids,
the engine's own token ids and logprobs, its own session (routing key) and seed, every session
deleted afterwards; a frozen turn is an aborted sample in its place, any other failure names the
sample. The app is the real one in process; the upstream is a scripted engine whose reply is a
function of the request's seed, so the two paths can be compared token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from posttrain.interface import ConfigError, Sample, SampleStatus, TransportError
from posttrain.session_router import ChatTokenizer, SessionRolloutClient, create_app


def seeded_engine(tok: ChatTokenizer) -> Any:
    """A ``/generate`` whose reply and logprobs depend only on the prompt and the seed."""
    stop_id = tok.tokenizer.token_to_id("<|im_end|>")

    def generate(body: dict[str, Any]) -> dict[str, Any]:
        seed = body["sampling_params"].get("sampling_seed", 0)
        ids = [*tok.encode(f"reply {seed % 1000}"), stop_id]
        logprobs = [-((seed + 7 * i) % 101) / 97 - 1e-3 for i in range(len(ids))]
        return {
            "text": tok.decode(ids),
            "output_ids": ids,
            "meta_info": {
                "id": f"req-{seed}",
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids),
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(logprobs, ids, strict=True)
                ],
                "finish_reason": {"type": "stop", "matched": stop_id},
                "weight_version": "3",
            },
        }

    return generate


def assert_same_samples(group: list[Sample], singles: list[Sample]) -> None:
    """The group's samples are the per-sample requests' own, token for token."""
    for g, s in zip(group, singles, strict=True):
        assert g.prompt_ids == s.prompt_ids
        assert g.response_ids == s.response_ids
        assert g.rollout_logprobs == s.rollout_logprobs  # exact: the engine's own numbers
        assert g.loss_mask == s.loss_mask
        assert g.weight_version == s.weight_version
        assert g.status is SampleStatus.COMPLETED


def test_a_group_in_one_request_equals_one_session_per_sample(
    chat_tok: ChatTokenizer, router_config: Any
) -> None:
    engine = seeded_engine(chat_tok)
    seen: list[dict[str, Any]] = []
    keys: list[str | None] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        keys.append(request.headers.get("x-smg-routing-key"))
        return httpx.Response(200, json=engine(seen[-1]))

    async def main() -> None:
        app = create_app(
            router_config(lora_adapter="miles_lora"), tokenizer=chat_tok,
            transport=httpx.MockTransport(upstream),
        )  # fmt: skip
        server = app.state.server
        asgi = httpx.ASGITransport(app=app)
        messages = [{"role": "user", "content": "hello there"}]
        params = {"max_tokens": 8, "temperature": 1.0, "logprobs": True}
        seeds = [11, 905, 3, 77]
        try:
            async with SessionRolloutClient("http://sr", transport=asgi) as client:
                group = await client.rollout_n(
                    messages, 4, seeds=seeds, sampling_params=params, weight_version=2,
                    metadata={"prompt_index": 5},
                )  # fmt: skip
                assert server.sessions == {}  # every session was deleted
                singles = [
                    await client.rollout(
                        messages, sampling_params={**params, "seed": s}, weight_version=2
                    )
                    for s in seeds
                ]
                assert server.sessions == {}
                raw = await client.rollout_n([], 2, seeds=[1, 2], prompt="hello",
                                             weight_version=2)  # fmt: skip
            metrics = generate_latest(server.metrics.registry).decode()
        finally:
            await server.aclose()
        assert "session_router_sessions_created_total 10.0" in metrics  # 4 + 4 + 2 sessions
        assert len(group) == 4
        assert_same_samples(group, singles)
        assert all(g.metadata["prompt_index"] == 5 for g in group)
        assert [g.response_ids for g in group] != [group[0].response_ids] * 4  # seeds differ
        ups = seen[:4]
        assert sorted(b["sampling_params"]["sampling_seed"] for b in ups) == sorted(seeds)
        assert {b["extra_key"] for b in seen} == {"miles_lora:v2"}
        assert len(set(keys[:4])) == 4  # one session (routing key) per sample
        assert {g.metadata["session_id"] for g in group} == set(keys[:4])
        assert len(raw) == 2
        assert raw[0].response_ids != raw[1].response_ids
        assert raw[0].prompt_ids == chat_tok.encode("hello")  # no chat template

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_a_frozen_turn_aborts_its_sample_and_a_failure_names_the_sample(
    chat_tok: ChatTokenizer, router_config: Any
) -> None:
    engine = seeded_engine(chat_tok)

    async def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seed = body["sampling_params"]["sampling_seed"]
        if seed == 2:  # an engine that froze on this one (bounded, for the test)
            await asyncio.sleep(30)
        if seed == 9:
            return httpx.Response(400, json={"error": "prompt too long"})
        return httpx.Response(200, json=engine(body))

    async def main() -> None:
        app = create_app(router_config(), tokenizer=chat_tok,
                         transport=httpx.MockTransport(upstream))  # fmt: skip
        server = app.state.server
        asgi = httpx.ASGITransport(app=app)
        messages = [{"role": "user", "content": "hi"}]
        try:
            async with SessionRolloutClient("http://sr", transport=asgi,
                                            turn_timeout_s=0.3) as client:  # fmt: skip
                out = await client.rollout_n(messages, 3, seeds=[1, 2, 3],
                                             metadata={"prompt_index": 4})  # fmt: skip
                assert [s.status for s in out] == [
                    SampleStatus.COMPLETED, SampleStatus.ABORTED, SampleStatus.COMPLETED
                ]  # fmt: skip
                assert out[1].response_ids == out[1].prompt_ids == []
                assert "no reply within turn_timeout_s=0.3 s" in out[1].metadata["abort_reason"]
                assert out[1].metadata["prompt_index"] == 4
                assert server.sessions == {}
                with pytest.raises(TransportError, match=r"answered 400: .*sample 1: .*too long"):
                    await client.rollout_n(messages, 2, seeds=[1, 9])
                assert server.sessions == {}  # the failed group's sessions are gone too
            async with httpx.AsyncClient(transport=asgi, base_url="http://sr") as raw:
                for body, field in (
                    ({"n": 0, "turn": {"messages": messages}}, "n:"),
                    ({"n": 2, "turn": "hi"}, "turn:"),
                    ({"n": 2, "turn": {"messages": messages}, "seeds": [1]}, "seeds:"),
                    (
                        {"n": 1, "turn": {"messages": messages}, "turn_timeout_s": -1},
                        "turn_timeout_s:",
                    ),
                    ({"n": 1, "turn": {"messages": []}}, "messages:"),
                ):
                    reply = await raw.post("/rollouts", json=body)
                    assert reply.status_code == 400, body
                    assert reply.json()["error"].startswith(field) or field in reply.json()["error"]
                assert server.sessions == {}
            with pytest.raises(ConfigError, match="seeds: 1 given for n=2"):
                await client.rollout_n(messages, 2, seeds=[1])
        finally:
            await server.aclose()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def parallel_engine(tok: ChatTokenizer) -> Any:
    """The seeded engine, answering ``sampling_params.n`` as local-engine does: SGLang's list, in
    sample order, sample j drawn with ``sampling_seed + j``."""
    one = seeded_engine(tok)

    def generate(body: dict[str, Any]) -> Any:
        sp = body["sampling_params"]
        n = sp.get("n", 1)
        if n == 1:
            return one(body)
        seed = sp["sampling_seed"]
        return [
            one({**body, "sampling_params": {**sp, "sampling_seed": seed + j}}) for j in range(n)
        ]

    return generate


def test_a_group_as_one_n_request_equals_one_request_per_sample(
    chat_tok: ChatTokenizer, router_config: Any
) -> None:
    engine = parallel_engine(chat_tok)
    seen: list[dict[str, Any]] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=engine(seen[-1]))

    async def main() -> None:
        app = create_app(
            router_config(lora_adapter="miles_lora", parallel_sampling=True), tokenizer=chat_tok,
            transport=httpx.MockTransport(upstream),
        )  # fmt: skip
        server = app.state.server
        asgi = httpx.ASGITransport(app=app)
        messages = [{"role": "user", "content": "hello there"}]
        params = {"max_tokens": 8, "temperature": 1.0}
        seeds = [40, 41, 42, 43]
        try:
            async with SessionRolloutClient("http://sr", transport=asgi) as client:
                group = await client.rollout_n(messages, 4, seeds=seeds, sampling_params=params,
                                               weight_version=2, metadata={"p": 1})  # fmt: skip
                assert len(seen) == 1  # ONE upstream request for the group
                sent = seen[0]
                # not consecutive: one request per sample, as before
                await client.rollout_n(messages, 2, seeds=[5, 9], sampling_params=params,
                                       weight_version=2)  # fmt: skip
                assert len(seen) == 3
                # a seed pinned in the turn: every sample alike, as one request each would be
                await client.rollout_n(messages, 2, sampling_params={
                    **params, "sampling_params": {"sampling_seed": 8}}, weight_version=2)  # fmt: skip
                assert len(seen) == 5
                assert all("n" not in b["sampling_params"] for b in seen[1:])
                singles = [
                    await client.rollout(
                        messages, sampling_params={**params, "seed": s}, weight_version=2
                    )
                    for s in seeds
                ]
                assert server.sessions == {}
            metrics = generate_latest(server.metrics.registry).decode()
        finally:
            await server.aclose()
        assert sent["sampling_params"]["n"] == 4
        assert sent["sampling_params"]["sampling_seed"] == 40
        assert sent["extra_key"] == "miles_lora:v2"
        assert seen[-1]["input_ids"] == sent["input_ids"]  # the same prompt ids
        assert "session_router_sessions_created_total 12.0" in metrics  # 4+2+2+4: per sample
        assert 'session_router_turns_total{outcome="committed"} 12.0' in metrics
        assert_same_samples(group, singles)
        assert all(g.weight_version == 3 and g.metadata["p"] == 1 for g in group)
        assert len({g.metadata["session_id"] for g in group}) == 4  # a session per sample

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_an_n_request_reports_each_samples_status_and_falls_back_when_refused(
    chat_tok: ChatTokenizer, router_config: Any
) -> None:
    engine = parallel_engine(chat_tok)
    seen: list[dict[str, Any]] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        sp = body["sampling_params"]
        base = sp.get("sampling_seed")
        if base == 100 and "n" in sp:
            return httpx.Response(400, json={"error": "sampling_params.n: not supported"})
        if base == 200:
            await asyncio.sleep(30)  # an engine that froze (bounded, for the test)
        reply = engine(body)
        if base == 300:  # sample 1 aborted by the engine, sample 2 a broken item
            reply[1]["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted"}
        if base == 400:
            del reply[2]["meta_info"]["output_token_logprobs"]
        return httpx.Response(200, json=reply)

    async def main() -> None:
        app = create_app(router_config(parallel_sampling=True), tokenizer=chat_tok,
                         transport=httpx.MockTransport(upstream))  # fmt: skip
        hi = [{"role": "user", "content": "hi"}]
        async with (
            contextlib.aclosing(app.state.server) as server,
            SessionRolloutClient(
                "http://sr", transport=httpx.ASGITransport(app=app), turn_timeout_s=0.3
            ) as client,
        ):
            refused = await client.rollout_n(hi, 2, seeds=[100, 101])
            assert [b["sampling_params"].get("n", 1) for b in seen] == [2, 1, 1]
            assert [s.status for s in refused] == [SampleStatus.COMPLETED] * 2
            frozen = await client.rollout_n(hi, 2, seeds=[200, 201])
            assert [s.status for s in frozen] == [SampleStatus.ABORTED] * 2
            assert "turn_timeout_s=0.3" in frozen[0].metadata["abort_reason"]
            mixed = await client.rollout_n(hi, 3, seeds=[300, 301, 302])
            assert [s.status for s in mixed] == [
                SampleStatus.COMPLETED, SampleStatus.ABORTED, SampleStatus.COMPLETED
            ]  # fmt: skip
            with pytest.raises(TransportError, match=r"answered 502: .*sample 2: .*output_"):
                await client.rollout_n(hi, 3, seeds=[400, 401, 402])
            assert server.sessions == {}

    asyncio.run(asyncio.wait_for(main(), timeout=30))
