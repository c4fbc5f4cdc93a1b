"""Context/sequence parallel on real gloo ranks against a single-process reference.

A small Inkling-style block (q/k/v/r/o projections, residual short convolutions on K, V and
the attention output, relative position bias, an optional sliding window) runs on a packed
stream of several sequences split over CP=2 and CP=4 ranks in both layouts. Its output and
every parameter gradient (conv weights and K/V projections included) must match the
reference, written independently here (per-segment loops, ``F.conv1d``), within relative
L2 1e-6. Two negative controls show the check bites: a plain ``dist.all_gather`` of K/V and a
detached halo both leave the forward exact but lose gradients. One test function per world
size starts its ranks once; the cases run inside.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from posttrain.interface.testing import run_workers
from posttrain.models.context_parallel import (
    CPLayout,
    ProcessGroupMismatchError,
    SequenceShard,
    attend,
    bind_shard,
    causal_depthwise_conv,
    context_parallel_attention,
    plan_halo,
    residual_short_conv,
    shard_for_context_parallel,
    shard_for_sequence_parallel,
    subdivide_for_sequence_parallel,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, D_REL, KERNEL = 8, 2, 1, 4, 3, 4
SEGMENTS = (8, 24, 16)  # multiples of 2 * 4: zigzag chunks of 1 token (< KERNEL - 1) on CP=4
SCALE = 1.0 / HEAD_DIM
TOL = 1e-6
# (name, window, rel extent): a global layer and a sliding-window layer (extent = window)
VARIANTS = (("global", None, 6), ("sliding", 5, 5))


def _params(extent: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(7 + extent)

    def rand(*shape: int, scale: float = 0.4) -> Tensor:
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    qd, kd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    params = {
        "q_proj": rand(qd, HIDDEN),
        "k_proj": rand(kd, HIDDEN),
        "v_proj": rand(kd, HIDDEN),
        "r_proj": rand(HEADS * D_REL, HIDDEN),
        "o_proj": rand(HIDDEN, qd),
        "conv_k": rand(kd, KERNEL),
        "conv_v": rand(kd, KERNEL),
        "conv_o": rand(HIDDEN, KERNEL),
    }
    params["rel_proj"] = torch.randn(D_REL, extent, generator=g)  # frozen
    return params


def _stream(total: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(total)
    return torch.randn(total, HIDDEN, generator=g), torch.randn(total, HIDDEN, generator=g)


# ---- the single-process reference, independent of the module under test ----


def _ref_conv(x: Tensor, w: Tensor) -> Tensor:
    padded = F.pad(x.T[None], (KERNEL - 1, 0))
    return x + F.conv1d(padded, w[:, None, :], groups=x.shape[1])[0].T


def _ref_attention(
    q: Tensor, k: Tensor, v: Tensor, r: Tensor, rel: Tensor, window: int | None
) -> Tensor:
    n = q.shape[0]
    bias = torch.zeros(n, HEADS, n)
    for offset in range(min(rel.shape[1], n)):
        diagonal = torch.diag(torch.ones(n - offset), -offset)  # [t, j] = 1 where t - j == offset
        bias = bias + (r @ rel[:, offset])[:, :, None] * diagonal[:, None, :]
    keys = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    values = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->qhk", q, keys) * SCALE + bias
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    if window is not None:
        allowed &= ~torch.tril(torch.ones(n, n, dtype=torch.bool), -window)
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("qhk,khd->qhd", torch.softmax(scores, -1), values)


def _reference(x: Tensor, p: dict[str, Tensor], window: int | None) -> Tensor:
    outs, start = [], 0
    for n in SEGMENTS:
        xs = x[start : start + n]
        q = (xs @ p["q_proj"].T).view(n, HEADS, HEAD_DIM)
        k = _ref_conv(xs @ p["k_proj"].T, p["conv_k"]).view(n, KV_HEADS, HEAD_DIM)
        v = _ref_conv(xs @ p["v_proj"].T, p["conv_v"]).view(n, KV_HEADS, HEAD_DIM)
        r = (xs @ p["r_proj"].T).view(n, HEADS, D_REL)
        a = _ref_attention(q, k, v, r, p["rel_proj"], window).reshape(n, -1)
        outs.append(_ref_conv(a @ p["o_proj"].T, p["conv_o"]))
        start += n
    return torch.cat(outs)


# ---- the block on CP ranks, from the primitives ----


def _plain_all_gather(x_local: Tensor, shard: SequenceShard) -> Tensor:
    """The published design's gather: no autograd; only this rank's own rows keep a graph."""
    pieces = [torch.empty_like(x_local) for _ in range(shard.world_size)]
    dist.all_gather(pieces, x_local.detach().contiguous(), group=shard.group)
    pieces[shard.rank] = x_local
    return shard.sharding.merge(pieces)


def _cp_block(
    x: Tensor, p: dict[str, Tensor], shard: SequenceShard, window: int | None, control: str
) -> Tensor:
    n = x.shape[0]
    plan = plan_halo(shard, KERNEL)

    def conv(h: Tensor, w: Tensor) -> Tensor:
        if control == "detached-halo":
            halo = _exchange_detached(h, plan)
            return h + causal_depthwise_conv(h, halo, w, plan)
        return residual_short_conv(h, w, plan)

    q = (x @ p["q_proj"].T).view(n, HEADS, HEAD_DIM)
    k = conv(x @ p["k_proj"].T, p["conv_k"]).view(n, KV_HEADS, HEAD_DIM)
    v = conv(x @ p["v_proj"].T, p["conv_v"]).view(n, KV_HEADS, HEAD_DIM)
    r = (x @ p["r_proj"].T).view(n, HEADS, D_REL)
    if control == "plain-all-gather":
        k_full, v_full = _plain_all_gather(k, shard), _plain_all_gather(v, shard)
        a = attend(
            q,
            k_full,
            v_full,
            shard.positions,
            shard.stream_positions,
            scale=SCALE,
            window=window,
            rel_stream=r,
            rel_proj=p["rel_proj"],
        )
    else:
        a = context_parallel_attention(
            q, k, v, shard, scale=SCALE, window=window, rel_stream=r, rel_proj=p["rel_proj"]
        )
    return conv(a.reshape(n, -1) @ p["o_proj"].T, p["conv_o"])


def _exchange_detached(h: Tensor, plan: Any) -> Tensor:
    from posttrain.models.context_parallel import exchange_halo

    return exchange_halo(h.detach(), plan)


def _rel_l2(got: Tensor, want: Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm().clamp_min(1e-30))


def _compare(
    shard: SequenceShard, window: int | None, extent: int, control: str = ""
) -> dict[str, float]:
    """Relative L2 errors of the CP block's output, input grad and parameter grads."""
    x_full, weights = _stream(shard.sharding.total_tokens)
    ref_params = _params(extent)
    x_ref = x_full.clone().requires_grad_()
    ref_out = _reference(x_ref, ref_params, window)
    (ref_out * weights).sum().backward()

    params = _params(extent)
    x_local = shard.split(x_full).requires_grad_()
    out = _cp_block(x_local, params, shard, window, control)
    (out * shard.split(weights)).sum().backward()
    errors = {
        "output": _rel_l2(out, shard.split(ref_out.detach())),
        "grad.x": _rel_l2(x_local.grad, shard.split(x_ref.grad)),  # type: ignore[arg-type]
    }
    for name, param in params.items():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=shard.group)  # the CP group acts as a data-parallel group
        errors[f"grad.{name}"] = _rel_l2(grad, ref_params[name].grad)  # type: ignore[arg-type]
    return errors


def _sp_conv(shard: SequenceShard) -> float:
    """SP: a residual short conv over the TP group's sequence split matches the full conv."""
    g = torch.Generator().manual_seed(3)
    x_full = torch.randn(shard.sharding.total_tokens, HIDDEN, generator=g)
    w_ref = torch.randn(HIDDEN, KERNEL, generator=g).requires_grad_()
    w = w_ref.detach().clone().requires_grad_()
    starts = [0]
    for n in shard.sharding.segment_lengths:
        starts.append(starts[-1] + n)
    ref = torch.cat([_ref_conv(x_full[a:b], w_ref) for a, b in itertools.pairwise(starts)])
    ref.square().sum().backward()
    out = residual_short_conv(shard.split(x_full), w, plan_halo(shard, KERNEL))
    out.square().sum().backward()
    grad = w.grad if w.grad is not None else torch.zeros_like(w)
    dist.all_reduce(grad, group=shard.group)
    return max(_rel_l2(out, shard.split(ref.detach())), _rel_l2(grad, w_ref.grad))  # type: ignore[arg-type]


def _cases(world: int, group: dist.ProcessGroup, prefix: str) -> dict[str, dict[str, float]]:
    results = {}
    for layout in CPLayout:
        shard = bind_shard(shard_for_context_parallel(SEGMENTS, world, layout), group)
        for variant, window, extent in VARIANTS:
            results[f"{prefix}{layout}/{variant}"] = _compare(shard, window, extent)
    return results


def _rank_cp2(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)))
    results: dict[str, Any] = {"exact": _cases(world, group, "cp2/")}
    zigzag = bind_shard(shard_for_context_parallel(SEGMENTS, world, CPLayout.ZIGZAG), group)
    results["controls"] = {
        control: _compare(zigzag, None, 6, control)
        for control in ("plain-all-gather", "detached-halo")
    }
    results["sp"] = _sp_conv(bind_shard(shard_for_sequence_parallel((7, 13, 4), world), group))
    try:
        bind_shard(shard_for_context_parallel(SEGMENTS, 4, CPLayout.ZIGZAG), group)
        results["mismatch"] = "no error"
    except ProcessGroupMismatchError as exc:
        results["mismatch"] = str(exc)
    return results


def _rank_cp4(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)))
    # Two CP=2 groups inside 4 ranks: group ranks differ from global ranks.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results: dict[str, Any] = {"exact": _cases(world, group, "cp4/")}
    results["exact"].update(_cases(2, pairs[rank // 2], f"pair{rank // 2}/"))
    results["sp"] = _sp_conv(bind_shard(shard_for_sequence_parallel((7, 13, 4), world), group))
    # CP=2 x SP=2 over the 4 ranks (CP-major): the conv's halo crosses both splits.
    cp_sp = subdivide_for_sequence_parallel(shard_for_context_parallel(SEGMENTS, 2, "zigzag"), 2)
    results["sp"] = max(results["sp"], _sp_conv(bind_shard(cp_sp, group)))
    return results


def _assert_exact(all_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(all_ranks):
        for case, errors in result["exact"].items():
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOL, f"rank {rank} {case}: {worst} rel L2 {errors[worst]:.2e}"
        assert result["sp"] <= TOL, f"rank {rank} sp conv rel L2 {result['sp']:.2e}"


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_cp2_both_layouts_match_single_process_and_plain_all_gather_does_not() -> None:
    results = run_workers(_rank_cp2, 2, timeout_s=150)
    _assert_exact(results)
    assert len(results[0]["exact"]) == 4
    for result in results:
        for control, errors in result["controls"].items():
            assert errors["output"] <= TOL, control  # the forward alone cannot tell
        gather_loss = result["controls"]["plain-all-gather"]
        halo_loss = result["controls"]["detached-halo"]
        # K/V projections and the K/V convs lose the other rank's queries' contributions
        for name in ("grad.k_proj", "grad.v_proj", "grad.conv_k", "grad.conv_v"):
            assert gather_loss[name] > 1e-3, (name, gather_loss[name])
        for name in ("grad.k_proj", "grad.o_proj", "grad.x"):
            assert halo_loss[name] > 1e-3, (name, halo_loss[name])
        assert "2 ranks" in result["mismatch"]
        assert "over 4" in result["mismatch"]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_cp4_both_layouts_and_cp2_subgroups_match_single_process() -> None:
    results = run_workers(_rank_cp4, 4, timeout_s=200)
    _assert_exact(results)
    assert len(results[0]["exact"]) == 8
