"""fp32 master weights for full training of a bf16 checkpoint (issue 33), on both backends (fsdp:
FSDP2's fp32 parameters with a bf16 compute copy; megatron: ``MasterAdamW``).

At a learning rate whose single Adam updates (about ``lr``) are far below bf16's resolution
at the weights' scale, a bf16-parameter optimizer rounds every update away and the weights
never move; with fp32 masters they do. The engine still gets bf16 weights (the checkpoint's
dtype) and the trainer's logprobs equal the engine's exactly; a run resumed from a checkpoint
takes the same steps bit for bit (the checkpoint holds the fp32 masters).
"""

from __future__ import annotations

from typing import Any

import grpo_masters_workers as workers
import pytest
import torch
from grpo_workers import VOCAB_SIZE

from posttrain.interface.testing import run_workers
from posttrain.models import ModelConfig, build_model, build_tokenizer

pytestmark = [pytest.mark.multiproc]

LR = 1e-6  # an Adam step moves each weight by about 1e-6; bf16's spacing near 0.1 is 4.9e-4


@pytest.fixture(scope="module", params=["fsdp", "megatron"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = tmp_path_factory.mktemp("bf16") / "tiny"
    cfg = ModelConfig.tiny(
        vocab_size=VOCAB_SIZE, max_position_embeddings=32, torch_dtype="bfloat16"
    )
    build_model(cfg, seed=5).save_pretrained(ckpt, tokenizer=build_tokenizer())
    out = str(tmp_path_factory.mktemp("bf16-run"))
    return run_workers(  # type: ignore[no-any-return]
        workers.bf16_full_training, 1, args=(str(ckpt), out, LR, request.param), timeout_s=240
    )[0]


def test_updates_below_bf16_resolution_move_the_fp32_masters(run: dict[str, Any]) -> None:
    initial, final = run["initial"], run["final"]
    assert {t.dtype for t in final.values()} == {torch.float32}
    moved = [k for k in final if not torch.equal(final[k], initial[k])]
    assert len(moved) > len(final) // 2, moved  # bf16 parameters would all stay where they were
    steps = max(float((final[k] - initial[k].float()).abs().max()) for k in moved)
    assert steps < 1e-4  # tiny moves, well below bf16's spacing at the weights' scale


def test_the_engine_gets_bf16_and_parity_holds(run: dict[str, Any]) -> None:
    assert run["sent_dtypes"] == ["torch.bfloat16"]
    assert run["parity"]["train_rollout_logprob_abs_diff"] == 0.0


def test_resume_matches_the_uninterrupted_run_bit_for_bit(run: dict[str, Any]) -> None:
    final, resumed = run["final"], run["resumed"]
    assert final.keys() == resumed.keys()
    assert all(torch.equal(final[k], resumed[k]) for k in final)
