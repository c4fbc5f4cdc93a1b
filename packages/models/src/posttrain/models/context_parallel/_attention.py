"""Attention of local queries against the gathered K/V, masked by absolute positions.

Under context parallelism a rank holds some queries of every sequence but needs the keys
and values of all earlier tokens, so ``context_parallel_attention`` gathers K and V with the
autograd-aware ``all_gather_sequence`` and masks with the tokens' absolute positions:

* segment: a query sees only keys of its own segment (packing never leaks across sequences);
* causal: key global index <= query global index;
* sliding window ``w`` (optional): query index - key index < ``w``.

Optional relative position bias (Inkling-style): the query projection also emits a stream
``r`` of shape ``[tokens, heads, d_rel]``; with a table ``rel_proj`` of shape
``[d_rel, extent]``, ``bias[t, h, j] = r[t, h] . rel_proj[:, t - j]`` for
``0 <= t - j < extent`` and 0 otherwise, computed in fp32 and added after the scaling.
Scores, bias and softmax are fp32; grouped-query attention repeats each K/V head for its
query heads. The building blocks (``attention_mask``, ``relative_position_bias``,
``attend``) are public so a model with its own kernels can reuse the masks and the bias.
This is the dense reference formulation (``[heads, local, T]`` scores), not a flash kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.models.context_parallel._errors import (
    ContextParallelConfigError,
    ShardShapeError,
)
from posttrain.models.context_parallel._gather import SequenceShard, all_gather_sequence
from posttrain.models.context_parallel._layout import TokenPositions


def attention_mask(
    query: TokenPositions, key: TokenPositions, *, window: int | None = None
) -> Tensor:
    """``[n_query, n_key]`` bool: same segment, causal, and (optionally) inside the window."""
    _check_window(window)
    distance = query.global_index[:, None] - key.global_index[None, :]
    mask = (query.segment_id[:, None] == key.segment_id[None, :]) & (distance >= 0)
    if window is not None:
        mask &= distance < window
    return mask


def relative_position_bias(
    rel_stream: Tensor, rel_proj: Tensor, query: TokenPositions, key: TokenPositions
) -> Tensor:
    """``[n_query, heads, n_key]`` fp32 bias ``r[t, h] . rel_proj[:, t - j]`` (0 outside)."""
    if rel_proj.ndim != 2 or rel_proj.shape[1] < 1:
        raise ShardShapeError(
            f"rel_proj has shape {tuple(rel_proj.shape)}; expected [d_rel, extent]"
        )
    if rel_stream.ndim != 3 or rel_stream.shape[0] != query.global_index.numel():
        raise ShardShapeError(
            f"rel_stream has shape {tuple(rel_stream.shape)}; expected "
            f"[{query.global_index.numel()}, heads, {rel_proj.shape[0]}]"
        )
    if rel_stream.shape[2] != rel_proj.shape[0]:
        raise ShardShapeError(
            f"rel_stream's last dim {rel_stream.shape[2]} != rel_proj's d_rel {rel_proj.shape[0]}"
        )
    extent = rel_proj.shape[1]
    query, key = _on(query, rel_stream.device), _on(key, rel_stream.device)
    per_offset = torch.einsum("thd,de->the", rel_stream.float(), rel_proj.float())
    distance = query.global_index[:, None] - key.global_index[None, :]
    inside = (distance >= 0) & (distance < extent)
    index = distance.clamp(0, extent - 1)
    heads = rel_stream.shape[1]
    gathered = per_offset.gather(2, index[:, None, :].expand(-1, heads, -1))
    return gathered * inside[:, None, :]


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    query: TokenPositions,
    key: TokenPositions,
    *,
    scale: float,
    window: int | None = None,
    rel_stream: Tensor | None = None,
    rel_proj: Tensor | None = None,
) -> Tensor:
    """Masked softmax attention in fp32: ``q [nq, Hq, D]``, ``k, v [nk, Hkv, D]`` -> ``[nq, Hq, D]``."""
    _check_scale(scale)
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ShardShapeError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
            "q [n_query, heads, head_dim] and k, v [n_key, kv_heads, head_dim]"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ShardShapeError(
            f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
        )
    if q.shape[0] != query.global_index.numel() or k.shape[0] != key.global_index.numel():
        raise ShardShapeError(
            f"q has {q.shape[0]} rows and k {k.shape[0]}, but the positions hold "
            f"{query.global_index.numel()} queries and {key.global_index.numel()} keys"
        )
    if (rel_stream is None) != (rel_proj is None):
        raise ContextParallelConfigError("rel_stream and rel_proj must be given together")
    query, key = _on(query, q.device), _on(key, q.device)
    repeat = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(repeat, dim=1)
    values = v.float().repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if rel_stream is not None and rel_proj is not None:
        bias = relative_position_bias(rel_stream, rel_proj, query, key)
        scores = scores + bias.transpose(0, 1)
    mask = attention_mask(query, key, window=window)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def context_parallel_attention(
    q_local: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    shard: SequenceShard,
    *,
    scale: float,
    window: int | None = None,
    rel_stream: Tensor | None = None,
    rel_proj: Tensor | None = None,
) -> Tensor:
    """This rank's attention output: local queries against K/V gathered over the CP group."""
    shard.check_local(q_local, "q_local")
    k_full = all_gather_sequence(k_local, shard, name="k_local")
    v_full = all_gather_sequence(v_local, shard, name="v_local")
    return attend(
        q_local,
        k_full,
        v_full,
        shard.positions,
        shard.stream_positions,
        scale=scale,
        window=window,
        rel_stream=rel_stream,
        rel_proj=rel_proj,
    )


def _on(positions: TokenPositions, device: torch.device) -> TokenPositions:
    """The positions on ``device`` (plans and shardings are built on the CPU)."""
    if positions.global_index.device == device:
        return positions
    return TokenPositions(
        global_index=positions.global_index.to(device),
        segment_id=positions.segment_id.to(device),
        position=positions.position.to(device),
    )


def _check_window(window: int | None) -> None:
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ContextParallelConfigError(f"window must be a positive int or None, got {window!r}")


def _check_scale(scale: float) -> None:
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ContextParallelConfigError(f"scale must be a finite positive number, got {scale!r}")
