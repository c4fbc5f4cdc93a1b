"""TeacherScoringClient against the real local engine (posttrain.local_engine) serving a tiny model.

The engine speaks SGLang's ``/generate`` scoring shape, flat and per-position; here it
is the teacher (and, for rkl = 0, also the student). opd-scoring never imports the engine
or the models package: they meet here, in integration_tests, where every package is installed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import posttrain.local_engine as local_engine
import posttrain.models as models
from posttrain.interface.testing import AppServer
from posttrain.opd import (
    EquivalenceReport,
    OPDConfig,
    OPDSignals,
    ScoringSample,
    Strategy,
    TeacherRouter,
    TeacherScoringClient,
    build_score_payload,
    parse_score_response,
)

TINY = {"torch_dtype": "bfloat16", "max_position_embeddings": 48}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("opd-teacher")
    cfg = models.ModelConfig.tiny(**TINY)
    models.build_model(cfg, seed=0).save_pretrained(d, tokenizer=models.build_tokenizer())
    return d


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Iterator[AppServer]:
    app = local_engine.build_app(local_engine.EngineConfig(model_path=str(ckpt)))
    with AppServer(app) as server:
        yield server


def _samples(vocab: int, n: int, k: int, seed: int) -> list[ScoringSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, resp = rng.randint(1, 8), rng.randint(1, 10)
        tokens = [rng.randrange(4, vocab) for _ in range(prompt + resp)]
        top = [
            {t: -1.0 - 0.5 * j for j, t in enumerate(rng.sample(range(vocab), k))}
            for _ in range(resp)
        ]
        out.append(ScoringSample(tokens=tokens, response_length=resp, student_top=top))
    return out


def test_flat_equals_per_position_on_the_local_engine(engine: AppServer, ckpt: Path) -> None:
    vocab = models.ModelConfig.tiny(**TINY).vocab_size
    samples = _samples(vocab, 4, 3, seed=0)
    cfg = OPDConfig(top_k=3, per_position=True, vocab_size=vocab)

    async def go() -> tuple[dict[str, float], EquivalenceReport, list[OPDSignals]]:
        async with TeacherScoringClient(TeacherRouter(fallback_url=engine.url), cfg) as s:
            probed = await s.probe()
            report = await s.equivalence_check(samples, atol=0.0)
            return probed, report, await s.score_batch(samples)

    probed, report, outs = asyncio.run(go())
    assert list(probed) == [engine.url]
    assert report.ok
    assert report.max_abs_diff == 0.0
    assert report.per_position_response_bytes < report.flat_response_bytes
    # The engine's teacher logprobs are the trainer forward's, bit for bit.
    model = models.load_pretrained(ckpt)
    for smp, out in zip(samples, outs, strict=True):
        with torch.no_grad():
            lp = model.forward_logprobs(torch.tensor(list(smp.tokens)), [len(smp.tokens)])
        want = tuple(lp.tolist()[len(smp.tokens) - smp.response_length :])
        assert out.sampled_logprobs == want
        assert out.reverse_kl is not None
        assert out.reverse_kl.shape == (smp.response_length,)


def test_reverse_kl_is_zero_when_the_engine_is_teacher_and_student(engine: AppServer) -> None:
    vocab = models.ModelConfig.tiny(**TINY).vocab_size
    rng = random.Random(1)
    tokens = [rng.randrange(4, vocab) for _ in range(20)]
    resp = 12
    with httpx.Client(timeout=30) as client:  # the student's top-k, as a rollout reports it
        reply = client.post(f"{engine.url}/generate", json=build_score_payload(tokens, top_k=4))
        reply.raise_for_status()
    top = parse_score_response(reply.json(), tokens, resp, ["top"]).top
    sample = ScoringSample(tokens=tokens, response_length=resp, student_top=top)

    async def go(strategy: Strategy) -> OPDSignals:
        cfg = OPDConfig(top_k=4, strategy=strategy, per_position=True)
        router = TeacherRouter(fallback_url=engine.url)
        async with TeacherScoringClient(router, cfg, student_url=engine.url) as s:
            return await s.score(sample)

    for strategy in Strategy:
        out = asyncio.run(go(strategy))
        assert out.reverse_kl is not None
        assert torch.count_nonzero(out.reverse_kl) == 0, strategy
