"""End to end: two local-engine workers behind the real sgl-router, LoRA chats through sessions.

session-router, local-engine and models meet here (integration_tests: every package is
installed, nothing is skipped). A 3-turn chat: the sample's tokens, logprobs and loss mask must match what the engine generated, and its
logprobs must equal the trainer's recomputation (``models``' training forward with the same
adapter) bit for bit; without the adapter they must differ, so ``lora_path`` really reached
the engine. The two engines are local-engine's real ASGI app under uvicorn, each on its own
port, served from threads of this process (``AppServer``, see ``_engine``). Then the interface's
``RolloutEngine``, ``SessionRolloutClient``, draws a GRPO group through the same stack.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import posttrain.local_engine as local_engine
import posttrain.models as models
from posttrain.formats import decode_samples, peft_key, write_peft_adapter
from posttrain.interface import LoraSpec, RolloutEngine
from posttrain.interface.testing import AppServer, free_port
from posttrain.session_router import (
    RouterSpec,
    SessionRolloutClient,
    SessionRouterConfig,
    create_app,
    start_router,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(120)]
ADAPTER = "miles_lora"
RANK, ALPHA = 4, 8.0
STOP_IDS = list(range(4, 70))


def _write_model(root: Path) -> tuple[Path, Path, dict[str, Any]]:
    cfg = models.ModelConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        mlp_only_layers=(0, 1),
        max_position_embeddings=1024,
        eos_token_id=3,
    )
    model_dir = models.save_pretrained(
        models.build_model(cfg, seed=0), root / "model", tokenizer=models.build_tokenizer()
    )
    gen = torch.Generator().manual_seed(1)
    targets = {
        name: shape
        for name, shape in models.lora_targets(cfg).items()
        if name.endswith(("q_proj", "v_proj", "lm_head"))
    }
    tensors = {}
    for name, (fan_in, fan_out) in targets.items():
        tensors[peft_key(name, "A")] = torch.randn(RANK, fan_in, generator=gen) * 0.3
        tensors[peft_key(name, "B")] = torch.randn(fan_out, RANK, generator=gen) * 0.3
    spec = LoraSpec(
        r=RANK, alpha=ALPHA, target_modules=tuple(sorted({n.rsplit(".", 1)[-1] for n in targets}))
    )
    return model_dir, write_peft_adapter(root / "adapter", tensors, spec), tensors


def _engine(model_dir: Path, adapter_dir: Path) -> AppServer:
    """One local-engine server (its real ASGI app under uvicorn) on 127.0.0.1, in a thread.

    In-process rather than ``python -m posttrain.local_engine`` subprocesses: each subprocess
    would import torch and transformers again, which dominates this test's time on 2 cores.
    The router still reaches each engine over real HTTP on its own port.
    """
    port = free_port()
    argv = [
        "--model-path", str(model_dir), "--port", str(port),
        "--enable-lora", "--lora-paths", f"{ADAPTER}={adapter_dir}",
    ]  # fmt: skip
    return AppServer(local_engine.build_app(local_engine.parse_args(argv)), port=port)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir, adapter_dir, tensors = _write_model(tmp_path_factory.mktemp("e2e"))
    engines = [_engine(model_dir, adapter_dir) for _ in range(2)]
    with start_router(RouterSpec(port=free_port())) as router:
        try:
            for engine in engines:
                engine.start()
                router.add_worker(engine.url)
            yield {"router": router, "model_dir": model_dir, "tensors": tensors}
        finally:
            for engine in engines:
                engine.stop()


def _trainer(stack: dict[str, Any]) -> tuple[Any, Any]:
    """The trainer's model and the adapter the engines serve (for recomputing logprobs)."""
    model = models.load_pretrained(stack["model_dir"])
    lora = models.LoraAdapter.from_peft_state_dict(
        stack["tensors"], scaling=ALPHA / RANK, name=ADAPTER
    )
    return model, lora


def _session_config(stack: dict[str, Any], **kw: Any) -> SessionRouterConfig:
    return SessionRouterConfig(
        upstream_url=stack["router"].url,
        tokenizer=str(stack["model_dir"]),
        lora_adapter=ADAPTER,
        upstream_timeout_s=60,
        **kw,
    )


def test_three_turn_lora_chat_matches_the_engine_and_the_trainer(stack: dict[str, Any]) -> None:
    # The adapter the engines loaded at startup is version 0.
    cfg = _session_config(stack, lora_weight_version=0)

    async def chat() -> tuple[dict[str, Any], bytes]:
        app = create_app(cfg)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://sr", timeout=60
            ) as c:
                sid = (await c.post("/sessions")).json()["session_id"]
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
                for turn in range(3):
                    r = await c.post(
                        f"/sessions/{sid}/v1/chat/completions",
                        json={
                            "messages": msgs,
                            "max_tokens": 16,
                            "temperature": 1.0,
                            # A random tiny model rarely samples EOS: stop on about half
                            # the vocabulary so every turn completes (merging stops at a
                            # truncated turn) within a few tokens.
                            "stop_token_ids": STOP_IDS,
                            # Student top-k rows for OPD ride along into the sample.
                            "top_logprobs": 3,
                        },
                    )
                    assert r.status_code == 200, r.text
                    msgs = [
                        *msgs,
                        r.json()["choices"][0]["message"],
                        {"role": "user", "content": f"Again {turn}."},
                    ]
                info = (await c.get(f"/sessions/{sid}")).json()
                data = (await c.post(f"/sessions/{sid}/samples", json={})).content
                return info, data
        finally:
            await app.state.server.aclose()

    info, data = asyncio.run(asyncio.wait_for(chat(), timeout=100))
    (sample,) = decode_samples(data).samples
    records = info["records"]
    assert len(records) == 3
    assert [r["response"]["meta_info"]["finish_reason"]["type"] for r in records] == ["stop"] * 3
    assert sample.metadata["merged_turns"] == 3
    assert sample.tokens == info["metadata"]["accumulated_token_ids"]
    # What the engine generated, position by position (absolute index in the sequence).
    generated: dict[int, tuple[int, float]] = {}
    for record in records:
        assert record["request"]["lora_path"] == ADAPTER
        assert record["request"]["extra_key"] == f"{ADAPTER}:v0"
        prompt = record["request"]["input_ids"]
        for j, (lp, tid, _) in enumerate(record["response"]["meta_info"]["output_token_logprobs"]):
            generated[len(prompt) + j] = (tid, lp)
    trained = [len(sample.prompt_ids) + j for j, m in enumerate(sample.loss_mask) if m]
    assert trained
    assert set(trained) <= set(generated)
    for pos in trained:
        j = pos - len(sample.prompt_ids)
        assert (sample.response_ids[j], sample.rollout_logprobs[j]) == generated[pos]
    # One top-3 row per response token: the engine's row where it generated, [] elsewhere.
    rows = sample.metadata["opd_student_top_logprobs"]
    top: dict[int, list[Any]] = {}
    for record in records:
        prompt = record["request"]["input_ids"]
        for j, row in enumerate(record["response"]["meta_info"]["output_top_logprobs"]):
            top[len(prompt) + j] = row
    assert len(rows) == sample.response_length
    for j, row in enumerate(rows):
        pos = len(sample.prompt_ids) + j
        assert row == (top[pos] if sample.loss_mask[j] else [])
        assert len(row) == (3 if sample.loss_mask[j] else 0)
    # The trainer's recomputation with the same adapter equals the engine's logprobs.
    model, lora = _trainer(stack)
    ids = torch.tensor(sample.tokens)
    with torch.no_grad():
        with_lora = model.forward_logprobs(ids, [len(sample.tokens)], lora=lora)
        base = model.forward_logprobs(ids, [len(sample.tokens)])
    recomputed = [float(with_lora[pos]) for pos in trained]
    engine = [sample.rollout_logprobs[pos - len(sample.prompt_ids)] for pos in trained]
    assert recomputed == engine
    assert [float(base[pos]) for pos in trained] != engine


def test_the_rollout_client_draws_a_group_through_the_stack(stack: dict[str, Any]) -> None:
    cfg = _session_config(stack)  # no version configured: the rollout names it

    async def draw() -> Any:
        app = create_app(cfg)
        try:
            async with SessionRolloutClient(
                "http://sr", transport=httpx.ASGITransport(app=app), timeout_s=60
            ) as client:
                assert isinstance(client, RolloutEngine)
                return await client.rollout_group(
                    [{"role": "user", "content": "Say hi."}],
                    3,
                    group_index=5,
                    sampling_params={
                        "max_tokens": 8,
                        "temperature": 1.0,
                        "stop_token_ids": STOP_IDS,
                    },
                    weight_version=0,  # no version configured: the session names it
                )
        finally:
            await app.state.server.aclose()

    group = asyncio.run(asyncio.wait_for(draw(), timeout=100))
    assert [(s.group_index, s.index) for s in group] == [(5, 0), (5, 1), (5, 2)]
    model, lora = _trainer(stack)
    for sample in group:
        assert sample.response_length > 0
        assert sample.loss_mask == [1] * sample.response_length  # one turn: all generated
        assert sample.weight_version is None  # the engines never received a versioned update
        ids = torch.tensor(sample.tokens)
        with torch.no_grad():
            recomputed = model.forward_logprobs(ids, [len(sample.tokens)], lora=lora)
        assert recomputed[len(sample.prompt_ids) :].tolist() == sample.rollout_logprobs


def test_a_group_as_one_n_request_equals_one_request_per_sample(stack: dict[str, Any]) -> None:
    """``--parallel-sampling``: a group is one ``/generate`` with ``sampling_params.n`` through
    the real sgl-router; the local engine draws sample j with seed s + j, so every sample equals
    the one its own request draws (tokens and logprobs exactly), LoRA fields included."""
    params = {"max_tokens": 8, "temperature": 1.0, "stop_token_ids": STOP_IDS}
    messages = [{"role": "user", "content": "Say hi."}]

    async def draw(parallel: bool) -> Any:
        app = create_app(_session_config(stack, parallel_sampling=parallel))
        try:
            async with SessionRolloutClient(
                "http://sr", transport=httpx.ASGITransport(app=app), timeout_s=60
            ) as client:
                out = await client.rollout_n(messages, 4, seeds=[70, 71, 72, 73],
                                             sampling_params=params, weight_version=0)  # fmt: skip
            turns = app.state.server.metrics.upstream_seconds.collect()[0].samples
            count = next(x.value for x in turns if x.name.endswith("_count"))
            return out, count
        finally:
            await app.state.server.aclose()

    group, group_requests = asyncio.run(asyncio.wait_for(draw(True), timeout=100))
    singles, single_requests = asyncio.run(asyncio.wait_for(draw(False), timeout=100))
    assert (group_requests, single_requests) == (1, 4)  # one engine request for the group
    for g, s in zip(group, singles, strict=True):
        assert (g.prompt_ids, g.response_ids, g.rollout_logprobs, g.loss_mask) == (
            s.prompt_ids, s.response_ids, s.rollout_logprobs, s.loss_mask,
        )  # fmt: skip
    assert len({tuple(g.response_ids) for g in group}) > 1  # the seeds differ


def test_a_frozen_engine_fails_the_turn_with_504_then_serves_again(
    tmp_path: Path,
) -> None:
    """A real local-engine process stopped with SIGSTOP: the turn is a 504 naming the engine
    after ``upstream_timeout_s``, nothing is recorded, and after SIGCONT the same turn succeeds."""
    import os
    import signal
    import sys

    from posttrain.interface.testing import ServerProcess

    model_dir, _, _ = _write_model(tmp_path)
    port = free_port()
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(model_dir),
            "--port", str(port)]  # fmt: skip
    engine_url = f"http://127.0.0.1:{port}"
    cfg = SessionRouterConfig(
        upstream_url=engine_url, tokenizer=str(model_dir), upstream_timeout_s=1.0
    )
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    with ServerProcess(argv, f"{engine_url}/health", timeout_s=60) as engine:

        async def scenario() -> None:
            app = create_app(cfg)
            try:
                async with httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://sr", timeout=30
                ) as c:
                    sid = (await c.post("/sessions")).json()["session_id"]
                    url = f"/sessions/{sid}/v1/chat/completions"
                    os.kill(engine.pid, signal.SIGSTOP)
                    try:
                        frozen = await c.post(url, json=body)
                    finally:
                        os.kill(engine.pid, signal.SIGCONT)
                    assert frozen.status_code == 504, frozen.text
                    assert engine_url in frozen.json()["error"]
                    assert (await c.get(f"/sessions/{sid}")).json()["records"] == []
                    again = await c.post(url, json=body)
                    assert again.status_code == 200, again.text
                    assert len((await c.get(f"/sessions/{sid}")).json()["records"]) == 1
            finally:
                await app.state.server.aclose()

        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
