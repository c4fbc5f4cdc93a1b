"""GRPO with context parallel on gloo ranks: one step at CP=2 equals the one-rank step.

The checkpoint is inkling-tiny with its short convolutions randomised, so the halo exchange,
the K/V gather and the sliding-window layers all matter. Six samples of lengths 9..13 (padded
to multiples of 2C at their ends), some response tokens masked, per-token advantages.

* full training with entropy bonus, k1 KL to a reference model, TIS and two micro-batches:
  world 2 (CP=2) and world 4 (2 data-parallel x CP=2) against world 1;
* LoRA training (the lora-core wrapped sites under ``forward_with_layout``), token-mean
  aggregation, KL to the adapter-off reference: world 2 (CP=2) against world 1.

Equal means: loss and every loss metric within rel 1e-6, every updated trainable tensor
within relative L2 1e-6, and the recomputed logprobs still the engine's bit for bit.
"""

from __future__ import annotations

from typing import Any

import grpo_workers as workers
import pytest
import torch

from posttrain.grpo import GrpoConfig, GrpoConfigError, GrpoInputError, LossSettings
from posttrain.grpo.batch import pack_context_parallel
from posttrain.grpo.losses import aggregate_loss, aggregation_weights
from posttrain.grpo.trainer import TrainSample, data_context_parallel
from posttrain.interface.testing import run_workers
from posttrain.models import VOCAB_SIZE, ModelConfig, build_model, build_tokenizer

pytestmark = [pytest.mark.multiproc]

TOL = 1e-6
FULL = {
    "train": "full", "entropy_coef": 0.01, "use_kl_loss": True, "kl_coef": 0.1,
    "kl_type": "k1", "tis": "tis", "micro_batch_size": 2,
}  # fmt: skip
LORA = {
    "train": "lora", "loss_aggregation": "token_mean", "use_kl_loss": True, "kl_coef": 0.1,
    "lora_targets": ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj"),
}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("grpo-cp") / "inkling"
    config = ModelConfig.inkling_tiny(vocab_size=VOCAB_SIZE, max_position_embeddings=32)
    model = build_model(config, seed=3)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for name, param in model.named_parameters():
            if "conv" in name:  # zero-initialised sconv is the identity: make the halos matter
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    model.save_pretrained(path, tokenizer=build_tokenizer())
    return str(path)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = float((got.double() - want.double()).norm())
    norm = float(want.double().norm())
    return diff / norm if norm else diff


def _assert_same_step(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    gm, wm = got["metrics"], want["metrics"]
    assert gm.keys() == wm.keys(), where
    for key in ("loss", "pg_loss", "kl_loss", "entropy", "ppo_kl", "grad_norm"):
        if key in wm:
            assert gm[key] == pytest.approx(wm[key], rel=TOL, abs=1e-9), f"{where}: {key}"
    assert gm["train_tokens"] == wm["train_tokens"], where
    assert gm["train_rollout_logprob_max_abs_diff"] == 0.0, f"{where}: not the engine's bits"
    assert gm["skipped_step"] == 0.0, where
    assert gm["grad_norm"] > 0.0, where
    assert got["weights"].keys() == want["weights"].keys(), where
    worst = max(
        ((name, _rel(got["weights"][name], value)) for name, value in want["weights"].items()),
        key=lambda item: item[1],
    )
    assert worst[1] <= TOL, f"{where}: {worst[0]} rel L2 {worst[1]:.2e}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("options", [FULL, LORA], ids=["full", "lora"])
def test_context_parallel_step_equals_one_rank(ckpt: str, options: dict[str, Any]) -> None:
    one = run_workers(workers.cp_step, 1, args=(ckpt, 1, options), timeout_s=240)[0]
    assert one["metrics"]["loss"] != 0.0
    worlds = [2, 4] if options is FULL else [2]
    for world in worlds:
        ranks = run_workers(workers.cp_step, world, args=(ckpt, 2, options), timeout_s=240)
        for rank, result in enumerate(ranks):
            # ranks of one CP group hold the same samples; the DP split is over groups only
            assert result["samples"] == ranks[rank - rank % 2]["samples"]
            _assert_same_step(result, one, f"world {world}, CP=2, rank {rank}")
        if world == 4:
            assert ranks[0]["samples"] != ranks[2]["samples"]


def test_aggregation_weights_reproduce_aggregate_loss() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 4]
    x = torch.randn(12, generator=g)
    mask = torch.tensor([1, 0, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0])  # the last sequence all masked
    for mode, kwargs in (
        ("token_mean", {}),
        ("token_mean", {"global_token_count": 9}),
        ("seq_mean_token_mean", {}),
        ("seq_mean_token_mean", {"global_batch_size": 7}),
    ):
        w = aggregation_weights(mask, lengths, mode=mode, **kwargs)  # type: ignore[arg-type]
        want = aggregate_loss(x, mask, lengths, mode=mode, **kwargs)  # type: ignore[arg-type]
        torch.testing.assert_close((w * x).sum(), want, rtol=1e-6, atol=1e-7)
        assert bool((w[mask == 0] == 0).all())
    with pytest.raises(GrpoConfigError, match="global_batch_size=0"):
        aggregation_weights(mask, lengths, mode="seq_mean_token_mean", global_batch_size=0)


def test_context_parallel_size_is_validated() -> None:
    assert GrpoConfig(replicate=2, shard=2, context_parallel_size=2).data_parallel_size == 2
    with pytest.raises(GrpoConfigError, match="context_parallel_size=3 does not divide") as err:
        GrpoConfig(replicate=1, shard=2, context_parallel_size=3)
    assert err.value.field == "context_parallel_size"
    with pytest.raises(GrpoConfigError, match="context_parallel_size=0 must be >= 1"):
        GrpoConfig(context_parallel_size=0)


def _groups(rank: int, world: int, cp_size: int) -> Any:
    try:
        parallel = data_context_parallel(cp_size)
    except GrpoConfigError as exc:
        return str(exc)
    assert parallel.cp_group is not None
    return (parallel.dp_rank, parallel.dp_size, torch.distributed.get_process_group_ranks(
        parallel.cp_group))  # fmt: skip


def test_context_parallel_groups_are_consecutive_ranks() -> None:
    got = run_workers(_groups, 4, args=(2,), timeout_s=60)
    assert got == [(0, 2, [0, 1]), (0, 2, [0, 1]), (1, 2, [2, 3]), (1, 2, [2, 3])]
    refused = run_workers(_groups, 2, args=(4,), timeout_s=60)
    assert all("does not divide the world size 2" in r for r in refused)


def test_context_parallel_pads_sequences_at_their_ends() -> None:
    settings = LossSettings()
    sample = TrainSample(
        tokens=list(range(4, 33)), prompt_len=3, loss_mask=[1] * 26,
        rollout_logprobs=[-1.0] * 26, advantages=[0.5] * 26,
    )  # fmt: skip
    packed = pack_context_parallel(
        [sample], 2, settings, capacity=32, global_batch_size=1, global_token_count=26
    )
    assert packed.lengths == (32,)  # 29 tokens, padded to a multiple of 2 x 2
    assert packed.mask.tolist() == [False] * 3 + [True] * 26 + [False] * 3
    assert float(packed.weights.sum()) == pytest.approx(1.0)
    with pytest.raises(GrpoInputError, match="sample 0 of the micro-batch has 29 tokens"):
        pack_context_parallel(
            [sample], 2, settings, capacity=30, global_batch_size=1, global_token_count=26
        )
