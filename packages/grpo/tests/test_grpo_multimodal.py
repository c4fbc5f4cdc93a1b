"""The trainer on multimodal samples: media references rebuilt into the engine's input, exact
parity with a fresh forward, and the towers frozen (full-parameter and LoRA training)."""

from __future__ import annotations

from typing import Any

import grpo_mm_workers as workers
import pytest
import torch

from posttrain.grpo.trainer import TrainSample, expand_sample_media
from posttrain.interface import WorkerFailedError
from posttrain.interface.testing import run_workers
from posttrain.models import (
    MediaError,
    ModelConfig,
    build_model,
    build_tokenizer,
    load_pretrained,
)

pytestmark = [pytest.mark.multiproc]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("grpo-mm") / "mm-tiny"
    model = build_model(ModelConfig.multimodal_tiny(max_position_embeddings=32), seed=2)
    model.save_pretrained(path, tokenizer=build_tokenizer(multimodal=True))
    return str(path)


@pytest.fixture(scope="module", params=["full", "lora"])
def step(request: pytest.FixtureRequest, ckpt: str) -> dict[str, Any]:
    (out,) = run_workers(workers.mm_step, 1, args=(ckpt, request.param), timeout_s=240)
    out["mode"] = request.param
    return out  # type: ignore[no-any-return]


def test_recomputed_logprobs_equal_the_rollouts_bit_for_bit(step: dict[str, Any]) -> None:
    m = step["metrics"]
    assert m["train_rollout_logprob_abs_diff"] == 0.0
    assert m["train_rollout_logprob_max_abs_diff"] == 0.0
    assert m["train_tokens"] == 4 * workers.RESPONSE
    assert m["grad_norm"] > 0.0


def test_towers_stay_frozen_out_of_the_optimizer(step: dict[str, Any]) -> None:
    """No tower parameter requires grad, has a gradient, sits in the optimizer or moved."""
    assert step["towers"], "the multimodal model has tower parameters"
    assert not any(step["tower_requires_grad"].values())
    assert step["tower_grads_at_step"].keys() == set(step["towers"])  # the step ran
    assert not any(step["tower_grads_at_step"].values())
    assert step["towers_in_optimizer"] == []
    assert step["towers_with_state"] == []
    assert not [k for k in step["moved"] if "_tower." in k]
    if step["mode"] == "full":  # the decoder trained, the text embedding included
        assert "embedding" in step["moved"]
    else:  # only the adapter trained; the base is untouched
        assert [k for k in step["moved"] if ".lora_" not in k] == []
        assert step["adapter"]


def test_the_image_decides_the_logprobs(ckpt: str) -> None:
    """Same tokens, another image: other logprobs (the media path is really taken)."""
    model = load_pretrained(ckpt)
    a, b = (TrainSample(tokens=[*workers.PROMPT, 40, 41], prompt_len=len(workers.PROMPT),
                        loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0], advantages=[0.0, 0.0],
                        media=[workers.image(i)]) for i in (0, 2))  # fmt: skip
    out = []
    for s in (a, b):
        ids, prompt_len, media = expand_sample_media(s, model)
        assert prompt_len == len(workers.PROMPT) - 1 + 4  # the sentinel became 4 patches
        with torch.no_grad():
            out.append(model.forward_logprobs(torch.tensor(ids), [len(ids)], media=media))
    assert not torch.equal(out[0][-2:], out[1][-2:])


def test_a_sample_whose_media_do_not_match_its_sentinels_is_refused(ckpt: str) -> None:
    model = load_pretrained(ckpt)
    s = TrainSample(tokens=[1, 30, 40], prompt_len=2, loss_mask=[1], rollout_logprobs=[0.0],
                    advantages=[0.0], media=[workers.image(0)])  # fmt: skip
    with pytest.raises(MediaError, match="0 image sentinel token"):
        expand_sample_media(s, model)


def test_context_parallel_refuses_multimodal_samples(ckpt: str) -> None:
    with pytest.raises(WorkerFailedError, match="does not take multimodal samples"):
        run_workers(workers.mm_context_parallel, 2, args=(ckpt,), timeout_s=120)
