"""``posttrain.models.context_parallel.forward_context_parallel`` against the single-process model.

On CP=2 and CP=4 gloo ranks (one spawn per world size), both layouts, a packed batch of three
sequences (the last one shorter per zigzag chunk than the kernel's halo under CP=4):

* inkling-tiny with every block on (sconv weights randomised so the halos matter, dense and
  MoE layers, sliding-window and global layers, relative bias): each rank's logits and
  logprobs equal the rows of ``forward_logits`` / ``forward_logprobs`` bit for bit, and after
  ``all_reduce_gradients`` every parameter gradient matches the single-process one within
  relative L2 1e-6 (reported separately for the conv weights and the K/V rows of ``qkv``);
* negative control: the same layout with a plain (no-grad) ``dist.all_gather`` of K/V keeps the
  forward bit-identical but loses K/V-projection and conv gradients (relative L2 > 1e-2);
* CP=2 only: the plain Qwen3-layout ``tiny`` model (no optional block) the same way;
  inkling-tiny in FAST numerics (logprobs within 2e-5, gradients within 1e-6); and
  inkling-tiny under FSDP2 ``fully_shard`` over the CP ranks, its gradient reduction in place
  of ``all_reduce_gradients`` (loss scaled by the CP size), within the same 1e-6.

Single-process: one rank (``group=None``) is the plain forward; named errors for bad input.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from posttrain.interface.testing import run_workers
from posttrain.models import (
    DecoderModel,
    ModelConfig,
    ModelInputError,
    Numerics,
    build_model,
)
from posttrain.models import context_parallel as cp

SEGMENTS = (16, 24, 8)  # multiples of 2 * 4 (zigzag under CP=4)
CAPACITY = 32
TOL = 1e-6


def _models(
    config: ModelConfig, *, randomise_convs: bool, numerics: Numerics = Numerics.STRICT
) -> tuple[DecoderModel, DecoderModel]:
    reference = build_model(config, seed=3, numerics=numerics)
    if randomise_convs:
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for name, param in reference.named_parameters():
                if "conv" in name:  # zero-initialised sconv is the identity: make it matter
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    model = build_model(config, seed=3, numerics=numerics)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _batch(vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (sum(SEGMENTS),), generator=g)
    lp_weights = torch.randn(sum(SEGMENTS), generator=g)
    logit_weights = torch.randn(sum(SEGMENTS), vocab, generator=g)
    return ids, lp_weights, logit_weights


def _rel(got: Tensor | None, want: Tensor | None, like: Tensor) -> float:
    got = torch.zeros_like(like) if got is None else got
    want = torch.zeros_like(like) if want is None else want
    if want.norm() == 0:
        return float(got.norm())
    return float((got - want).norm() / want.norm())


def _grad_errors(model: DecoderModel, reference: DecoderModel) -> dict[str, float]:
    """Relative L2 error of every trainable gradient, plus the K/V rows of each fused qkv."""
    errors = {}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        want = ref_params[name].grad
        errors[name] = _rel(param.grad, want, param)
        if name.endswith(".qkv"):
            layer = int(name.split(".")[1])
            nh, nkv, hd = model.config.attention_shape(layer)
            rows = slice(nh * hd, (nh + 2 * nkv) * hd)
            got = None if param.grad is None else param.grad[rows]
            errors[name + "[k,v rows]"] = _rel(
                got, None if want is None else want[rows], param[rows]
            )
    return errors


def _worst(errors: dict[str, float], keep: Any = lambda name: True) -> tuple[str, float]:
    picked = {n: e for n, e in errors.items() if keep(n)}
    name = max(picked, key=lambda n: picked[n])
    return name, picked[name]


def _kv_or_conv(name: str) -> bool:
    return "conv" in name or "[k,v rows]" in name


class PlainGatherLayout(cp.ContextParallelLayout):
    """The published design's K/V gather: ``dist.all_gather`` with no autograd; only this
    rank's own rows keep their graph, other ranks' queries never reach its K/V projections."""

    def gather(self, x: Tensor, name: str) -> Tensor:
        pieces = [torch.empty_like(x) for _ in range(self.shard.world_size)]
        dist.all_gather(pieces, x.detach().contiguous(), group=self.shard.group)
        pieces[self.shard.rank] = x
        return self.shard.sharding.merge(pieces)


def _case(
    config: ModelConfig,
    layout: cp.CPLayout,
    group: dist.ProcessGroup,
    *,
    randomise: bool,
    numerics: Numerics = Numerics.STRICT,
) -> dict[str, Any]:
    reference, model = _models(config, randomise_convs=randomise, numerics=numerics)
    ids, lp_weights, _ = _batch(config.vocab_size)
    with torch.no_grad():
        ref_logits = reference.forward_logits(ids, SEGMENTS)
    ref_lp = reference.forward_logprobs(ids, SEGMENTS)
    (ref_lp * lp_weights).sum().backward()

    out = cp.forward_context_parallel(model, ids, SEGMENTS, group, layout)
    (out.logprobs * out.shard.split(lp_weights)).sum().backward()
    cp.all_reduce_gradients(model, group)
    errors = _grad_errors(model, reference)
    return {
        "logits_bitwise": torch.equal(out.logits.detach(), out.shard.split(ref_logits)),
        "logprobs_bitwise": torch.equal(out.logprobs.detach(), out.shard.split(ref_lp.detach())),
        "logprobs_max_abs": float((out.logprobs - out.shard.split(ref_lp)).abs().max().detach()),
        "merged_bitwise": torch.equal(
            cp.all_gather_sequence(out.logprobs.detach(), out.shard), ref_lp.detach()
        ),
        "worst": _worst(errors),
        "worst_kv_conv": _worst(errors, _kv_or_conv),
        "kv_conv_checked": sum(_kv_or_conv(n) for n in errors),
    }


def _plain_gather_control(group: dist.ProcessGroup) -> dict[str, Any]:
    """Loss on the logits; K/V gathered without autograd: the forward stays exact, grads don't."""
    reference, model = _models(
        ModelConfig.inkling_tiny(max_position_embeddings=CAPACITY), randomise_convs=True
    )
    ids, _, logit_weights = _batch(model.config.vocab_size)
    ref_logits = reference.forward_logits(ids, SEGMENTS)
    (ref_logits * logit_weights).sum().backward()

    sharding = cp.shard_for_context_parallel(SEGMENTS, dist.get_world_size(group), "zigzag")
    shard = cp.bind_shard(sharding, group)
    logits = model.forward_with_layout(shard.split(ids), PlainGatherLayout(shard, CAPACITY))
    (logits * shard.split(logit_weights)).sum().backward()
    cp.all_reduce_gradients(model, group)
    errors = _grad_errors(model, reference)
    return {
        "logits_bitwise": torch.equal(logits.detach(), shard.split(ref_logits.detach())),
        "kv_rows": min(e for n, e in errors.items() if "[k,v rows]" in n),
        "k_conv": min(e for n, e in errors.items() if n.endswith("k_conv")),
        "worst": _worst(errors),
    }


def _fsdp_case(world: int) -> dict[str, Any]:
    """FSDP2 over the CP ranks: its reduce-scatter (a mean over the mesh) replaces
    ``all_reduce_gradients`` once each rank's loss is scaled by the CP size."""
    mesh = init_device_mesh("cpu", (world,))
    config = ModelConfig.inkling_tiny(max_position_embeddings=CAPACITY)
    reference, model = _models(config, randomise_convs=True)
    ids, lp_weights, _ = _batch(config.vocab_size)
    ref_lp = reference.forward_logprobs(ids, SEGMENTS)
    (ref_lp * lp_weights).sum().backward()

    fully_shard(model, mesh=mesh)  # forward_context_parallel registers forward_with_layout
    out = cp.forward_context_parallel(model, ids, SEGMENTS, mesh.get_group(), "zigzag")
    ((out.logprobs * out.shard.split(lp_weights)).sum() * world).backward()
    try:  # FSDP reduced the sharded gradients already; summing them again is refused
        cp.all_reduce_gradients(model, mesh.get_group())
        refused = "no error"
    except cp.UnsupportedModelError as exc:
        refused = str(exc)
    for param in model.parameters():
        if param.grad is not None:
            param.grad = param.grad.full_tensor()  # type: ignore[attr-defined]
    return {
        "logprobs_bitwise": torch.equal(out.logprobs.detach(), out.shard.split(ref_lp.detach())),
        "worst": _worst(_grad_errors(model, reference)),
        "all_reduce_refused": refused,
    }


def _rank(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)))
    inkling = ModelConfig.inkling_tiny(max_position_embeddings=CAPACITY)
    results: dict[str, Any] = {
        f"inkling/{layout}": _case(inkling, layout, group, randomise=True) for layout in cp.CPLayout
    }
    if world == 2:
        plain = ModelConfig.tiny(max_position_embeddings=CAPACITY)
        for layout in cp.CPLayout:
            results[f"qwen3/{layout}"] = _case(plain, layout, group, randomise=False)
        results["fsdp2"] = _fsdp_case(world)
        results["fast"] = _case(
            inkling, cp.CPLayout.ZIGZAG, group, randomise=True, numerics=Numerics.FAST
        )
    results["plain-all-gather"] = _plain_gather_control(group)
    return results


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_forward_context_parallel_matches_the_single_process_model(world: int) -> None:
    for rank, result in enumerate(run_workers(_rank, world, timeout_s=240)):
        cases = {k: v for k, v in result.items() if k not in ("plain-all-gather", "fsdp2", "fast")}
        expected = {"inkling/contiguous", "inkling/zigzag"}
        if world == 2:
            expected |= {"qwen3/contiguous", "qwen3/zigzag"}
        assert set(cases) == expected
        for case, r in cases.items():
            where = f"rank {rank} of {world}, {case}"
            assert r["logits_bitwise"], f"{where}: logits differ from the single-process rows"
            assert r["logprobs_bitwise"], f"{where}: logprobs differ from forward_logprobs"
            assert r["merged_bitwise"], f"{where}: gathered logprobs differ"
            name, error = r["worst"]
            assert error <= TOL, f"{where}: grad of {name} rel L2 {error:.2e}"
            name, error = r["worst_kv_conv"]
            assert error <= TOL, f"{where}: grad of {name} rel L2 {error:.2e}"
            # inkling: 4 convs x 4 layers + 4 K/V row blocks; plain Qwen3: the 4 K/V row blocks
            assert r["kv_conv_checked"] == (20 if case.startswith("inkling") else 4)
        if world == 2:
            fast = result["fast"]  # FAST numerics: no bitwise promise, the stated tolerance
            assert fast["logprobs_max_abs"] <= 2e-5, f"rank {rank}: FAST logprobs drift"
            name, error = fast["worst"]
            assert error <= TOL, f"rank {rank}: FAST grad of {name} rel L2 {error:.2e}"
            fsdp = result["fsdp2"]
            assert fsdp["logprobs_bitwise"], f"rank {rank}: FSDP2 logprobs differ"
            name, error = fsdp["worst"]
            assert error <= TOL, f"rank {rank}: FSDP2 grad of {name} rel L2 {error:.2e}"
            assert "is a DTensor" in fsdp["all_reduce_refused"], fsdp["all_reduce_refused"]
        control = result["plain-all-gather"]
        assert control["logits_bitwise"], f"rank {rank}: the control's forward should be exact"
        assert control["kv_rows"] > 1e-2, f"rank {rank}: plain all_gather kept K/V grads"
        assert control["k_conv"] > 1e-2, f"rank {rank}: plain all_gather kept conv grads"


def test_one_rank_without_a_group_is_the_plain_forward() -> None:
    _, model = _models(
        ModelConfig.inkling_tiny(max_position_embeddings=CAPACITY), randomise_convs=True
    )
    ids, _, _ = _batch(model.config.vocab_size)
    with torch.no_grad():
        out = cp.forward_context_parallel(model, ids, SEGMENTS, None, "contiguous")
        assert torch.equal(out.logits, model.forward_logits(ids, SEGMENTS))
        assert torch.equal(out.logprobs, model.forward_logprobs(ids, SEGMENTS))
    cp.all_reduce_gradients(model, None)  # one rank: nothing to sum, nothing raised


def test_bad_inputs_raise_named_errors() -> None:
    _, model = _models(ModelConfig.tiny(max_position_embeddings=CAPACITY), randomise_convs=False)
    ids, _, _ = _batch(model.config.vocab_size)
    with pytest.raises(cp.UnsupportedModelError, match="DecoderModel"):
        cp.forward_context_parallel(nn.Linear(2, 2), ids, SEGMENTS, None)  # type: ignore[arg-type]
    with pytest.raises(ModelInputError, match="segment_lengths sum to 40"):
        cp.forward_context_parallel(model, ids, (16, 24), None)
    with pytest.raises(ModelInputError, match="segment 1 has 40 tokens"):
        cp.forward_context_parallel(model, ids, (8, 40), None)
    with pytest.raises(cp.ContextParallelConfigError, match="layout must be one of"):
        cp.forward_context_parallel(model, ids, SEGMENTS, None, "ring")
    with pytest.raises(cp.ProcessGroupMismatchError, match="no process group"):
        cp.bind_shard(cp.shard_for_context_parallel(SEGMENTS, 2, "zigzag"), None)
