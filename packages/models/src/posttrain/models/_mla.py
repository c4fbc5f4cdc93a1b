"""Multi-head latent attention (MLA) as DeepSeek-V3 and GLM-4.x-Lite define it, on our kernels.

Per token (``_mla_config`` has the shapes and the transformers facts)::

    q      = q_b(rms(q_a(x)))  or  q_proj(x)          -> [heads, nope | rope]
    c, kr  = kv_a(x)                                   c: rms(c) [kv_lora_rank], kr: [rope]
    q_rope, kr = rope(q_rope), rope(kr)                rope part only; kr shared by all heads
    k_nope, v  = kv_b(c)                               [heads, nope], [heads, v_head_dim]
    o      = o_proj(softmax(scale * q . [k_nope | kr]) @ v)

**The paths, and which are bit-identical.**

* Training (``forward_packed``) over packed segments expands every latent through ``kv_b``
  and attends through the decoder's ``PackedLayout`` seam (so a context-parallel layout
  gathers keys as it does for the other attention). Fast: SDPA per segment. Strict: the
  fixed-capacity masked attention of ``_blocks`` (keys and values zero-padded to one width,
  which adds exact zeros to the reductions and leaves the real output columns alone).
* Decode (``forward_cached``) caches ``[c | kr]`` per token (``MlaCache``) and has two forms:

  - **non-absorbed** (``absorbed=False``; the strict default): the cached latents of the row
    are expanded through ``kv_b`` with the same kernel as training, then the same strict
    attention runs over them. Every step re-expands the slots up to the chunk's reduction
    width, so it costs ``O(width * kv_lora_rank * heads * (nope + v))`` per row and layer.
    **Strict decode uses this form because absorption reorders the reductions**: the score
    ``q_nope . (W_UK c)`` becomes ``(W_UK^T q_nope) . c`` and the output ``sum_s p_s (W_UV
    c_s)`` becomes ``W_UV (sum_s p_s c_s)``; equal in exact arithmetic, different roundings
    (measured: strict absorbed decode differs from strict training in the last bits; the
    tests keep that as a negative control). Strict train == strict decode holds bit for bit
    because every kernel here is row-invariant (``_ops``): a cached latent is the training
    latent's bits, its expansion the training keys' bits, and the attention reduces over a
    fixed capacity.
  - **absorbed** (``absorbed=True``; the fast default): ``W_UK`` is folded into the query
    (``q_lat = W_UK^T q_nope``, per head), attention runs as multi-query attention over the
    cached ``[c | kr]`` vectors directly (one shared key/value head of width
    ``kv_lora_rank + qk_rope_head_dim``; the rope part of the output is computed and dropped),
    and ``W_UV`` is applied after. No expansion: the cost is that of attention over 576-wide
    keys for DeepSeek-V3's shapes. Within tolerance of training, not bitwise.

A ``linear`` hook (``name -> y``, names are the HF leaf names ``q_proj``, ``q_a_proj``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``) lets a caller route every
projection through its own sites (LoRA); the default is ``ops.linear`` on this module's
weights. The absorbed form reads ``kv_b_proj``'s weight directly, so with a LoRA on
``kv_b_proj`` decode must be non-absorbed (or use merged weights).

Departures from transformers: activations are fp32 whatever the parameter dtype (as in the
rest of ``posttrain.models``), rope tables are computed in fp64, and the rope dims of the
queries and keys come out de-interleaved exactly as transformers' ``rope_interleave`` path
writes them (see ``_mla_config``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.models._blocks import PackedLayout, attend_buffers
from posttrain.models._errors import (
    CacheError,
    MissingTensorError,
    ModelInputError,
    TensorSpecMismatchError,
    UnknownTensorError,
)
from posttrain.models._mla_cache import MlaCache
from posttrain.models._mla_config import MlaSpec
from posttrain.models._ops import FastOps, apply_rope

Linear = Callable[[str, Tensor], Tensor]
"""A projection by HF leaf name: ``linear("kv_b_proj", x)`` -> ``x @ W.T`` (fp32)."""


class MlaProjection(NamedTuple):
    """The per-token part of MLA (rope applied, de-interleaved): everything before attention."""

    q_nope: Tensor  # [T, heads, qk_nope_head_dim]
    q_rope: Tensor  # [T, heads, qk_rope_head_dim]
    latent: Tensor  # [T, kv_lora_rank], after kv_a_layernorm
    rope_key: Tensor  # [T, qk_rope_head_dim], shared by all heads


def deinterleave(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)`` over the last dim."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def per_head_linear(ops: type[FastOps], x: Tensor, weight: Tensor) -> Tensor:
    """``out[t, h] = x[t, h] @ weight[h].T`` for ``x[T, heads, K]``, ``weight[heads, N, K]``."""
    if ops is FastOps:
        return torch.einsum("thk,hnk->thn", x, weight.float())
    heads = [ops.linear(x[:, h].contiguous(), weight[h]) for h in range(x.shape[1])]
    return torch.stack(heads, dim=1)


def _pad_last(x: Tensor, width: int) -> Tensor:
    extra = width - x.shape[-1]
    return x if extra == 0 else F.pad(x, (0, extra))


class MlaAttention(nn.Module):
    """One MLA layer's weights (HF leaf names, ``[out, in]``) and its train and decode forwards.

    ``q_proj[heads * qk_head_dim, H]`` when ``q_lora_rank`` is None, else
    ``q_a_proj[q_lora_rank, H]``, ``q_a_layernorm[q_lora_rank]``,
    ``q_b_proj[heads * qk_head_dim, q_lora_rank]``; ``kv_a_proj_with_mqa[kv_lora_rank +
    qk_rope_head_dim, H]``, ``kv_a_layernorm[kv_lora_rank]``, ``kv_b_proj[heads * (nope + v),
    kv_lora_rank]``, ``o_proj[H, heads * v_head_dim]``. Per head, ``q`` is ``[nope | rope]``
    and ``kv_b``'s rows are ``[k_nope | v]``, as in transformers.
    """

    q_proj: nn.Parameter
    q_a_proj: nn.Parameter
    q_a_layernorm: nn.Parameter
    q_b_proj: nn.Parameter
    kv_a_proj_with_mqa: nn.Parameter
    kv_a_layernorm: nn.Parameter
    kv_b_proj: nn.Parameter
    o_proj: nn.Parameter

    def __init__(self, spec: MlaSpec, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        s, h, nh = spec, spec.hidden_size, spec.num_heads
        if s.q_lora_rank is None:
            self.q_proj = nn.Parameter(torch.zeros(nh * s.qk_head_dim, h, dtype=dtype))
        else:
            self.q_a_proj = nn.Parameter(torch.zeros(s.q_lora_rank, h, dtype=dtype))
            self.q_a_layernorm = nn.Parameter(torch.ones(s.q_lora_rank, dtype=dtype))
            self.q_b_proj = nn.Parameter(
                torch.zeros(nh * s.qk_head_dim, s.q_lora_rank, dtype=dtype)
            )
        self.kv_a_proj_with_mqa = nn.Parameter(torch.zeros(s.cache_width, h, dtype=dtype))
        self.kv_a_layernorm = nn.Parameter(torch.ones(s.kv_lora_rank, dtype=dtype))
        kv_rows = nh * (s.qk_nope_head_dim + s.v_head_dim)
        self.kv_b_proj = nn.Parameter(torch.zeros(kv_rows, s.kv_lora_rank, dtype=dtype))
        self.o_proj = nn.Parameter(torch.zeros(h, nh * s.v_head_dim, dtype=dtype))

    # ------------------------------------------------------------------ weights

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The weights under transformers' attention-module names (``kv_b_proj.weight``, ...)."""
        return {f"{name}.weight": p for name, p in self.named_parameters()}

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy in an attention module's tensors (``DeepseekV3Attention.state_dict()`` names).

        Every tensor must be used and every weight given, with the exact shape and dtype
        (dtypes are never cast, G1); nothing is copied unless all of them fit.
        """
        own = self.hf_state_dict()
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise UnknownTensorError(f"MLA attention has no tensor {unknown[0]!r}")
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise MissingTensorError(f"MLA attention tensor {missing[0]!r} was not given")
        for name, value in tensors.items():
            want = own[name]
            if value.shape != want.shape or value.dtype != want.dtype:
                raise TensorSpecMismatchError(
                    f"MLA tensor {name!r} is {value.dtype} {list(value.shape)}, expected "
                    f"{want.dtype} {list(want.shape)}"
                )
        for name, value in tensors.items():
            own[name].copy_(value)

    def default_linear(self, ops: type[FastOps]) -> Linear:
        """The ``linear`` hook on this module's own weights."""

        def linear(name: str, x: Tensor) -> Tensor:
            return ops.linear(x, getattr(self, name))

        return linear

    # ------------------------------------------------------------------ forwards

    def project(
        self,
        ops: type[FastOps],
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        linear: Linear | None = None,
        rope_key_tokens: Callable[[Tensor], Tensor] | None = None,
    ) -> MlaProjection:
        """Queries, latent and rope key of ``x[T, H]`` (fp32); ``cos/sin[T, rope]`` per token.

        ``rope_key_tokens`` (sequence parallel): maps the rope key computed from ``x``'s tokens
        to the tokens the queries cover (``cos``'s rows), before rope; identity by default."""
        s = self.spec
        lin = linear or self.default_linear(ops)
        if s.q_lora_rank is None:
            q = lin("q_proj", x)
        else:
            q_lat = ops.rms_norm(lin("q_a_proj", x), self.q_a_layernorm, s.latent_norm_eps)
            q = lin("q_b_proj", q_lat)
        q = q.reshape(q.shape[0], s.num_heads, s.qk_head_dim)  # every token (see forward_packed)
        q_nope, q_rope = q[..., : s.qk_nope_head_dim], q[..., s.qk_nope_head_dim :]
        ckv = lin("kv_a_proj_with_mqa", x)
        latent = ops.rms_norm(ckv[:, : s.kv_lora_rank], self.kv_a_layernorm, s.latent_norm_eps)
        k_rope = ckv[:, None, s.kv_lora_rank :]
        if rope_key_tokens is not None:
            k_rope = rope_key_tokens(k_rope)
        if s.rope.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        return MlaProjection(
            q_nope, apply_rope(q_rope, cos, sin), latent, apply_rope(k_rope, cos, sin)[:, 0]
        )

    def forward_packed(
        self,
        ops: type[FastOps],
        x: Tensor,
        layout: PackedLayout,
        *,
        cos: Tensor,
        sin: Tensor,
        layer: int = 0,
        linear: Linear | None = None,
        rope_key_tokens: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """The training forward ``[T, H]`` of ``x[T, H]`` over ``layout``'s packed segments.

        ``cos/sin[T, rope]`` are the tables' rows at ``layout.pos``; ``layer`` is passed to
        the layout (a context-parallel layout keys its exchanges by it). Under sequence
        parallelism ``x`` holds this rank's tokens only: ``linear``'s column projections
        (``q_b_proj`` / ``q_proj``, ``kv_b_proj``) gather every token and ``o_proj`` scatters
        them back, and ``rope_key_tokens`` gathers the rope key (see ``project``).
        """
        lin = linear or self.default_linear(ops)
        proj = self.project(ops, x, cos, sin, lin, rope_key_tokens)
        k_nope, v = self._expand(lin, proj.latent)
        q, k = self._query_key(proj.q_nope, proj.q_rope, k_nope, proj.rope_key)
        t, nh = q.shape[0], self.spec.num_heads
        if ops is not FastOps:  # the strict attention needs one head width for q, k and v
            width = max(q.shape[-1], v.shape[-1])
            q, k, v = _pad_last(q, width), _pad_last(k, width), _pad_last(v, width)
        o = layout.attend(
            ops, layer, q, k, v, scale=self.spec.softmax_scale, window=None, rel_logits=None
        )
        return self._output(o.reshape(t, nh, -1)[..., : self.spec.v_head_dim], lin)

    def forward_cached(
        self,
        ops: type[FastOps],
        x: Tensor,
        cache: MlaCache,
        layer: int,
        *,
        rows: Tensor,
        pos: Tensor,
        cos: Tensor,
        sin: Tensor,
        absorbed: bool | None = None,
        linear: Linear | None = None,
    ) -> Tensor:
        """Decode: append ``x[T, H]`` to the cache (token ``t`` at row ``rows[t]``, slot
        ``pos[t]``; see ``MlaCache.placement``) and attend over each row. Returns ``[T, H]``.

        ``absorbed``: None picks the numerics' default (fast: absorbed; strict: expanded,
        the form that is bit-identical to ``forward_packed``; see the module doc).
        """
        if rows.shape != pos.shape or rows.shape[0] != x.shape[0]:
            raise ModelInputError(
                f"forward_cached: {x.shape[0]} tokens, {rows.shape[0]} rows and "
                f"{pos.shape[0]} positions"
            )
        buf = cache.kv[layer]
        if x.shape[0] and not 0 <= int(pos.min()) <= int(pos.max()) < buf.shape[1]:
            raise CacheError(f"forward_cached: positions must lie in [0, {buf.shape[1]})")
        lin = linear or self.default_linear(ops)
        proj = self.project(ops, x, cos, sin, lin)
        buf[rows, pos] = torch.cat([proj.latent, proj.rope_key], dim=-1).to(buf.dtype)
        if absorbed is None:
            absorbed = ops is FastOps
        if absorbed:
            o = self._attend_absorbed(ops, proj, buf, rows, pos)
        else:
            o = self._attend_expanded(ops, proj, buf, rows, pos, lin)
        return self._output(o, lin)

    # ------------------------------------------------------------------ internals

    def _expand(self, lin: Linear, latent: Tensor) -> tuple[Tensor, Tensor]:
        """``kv_b`` of latents ``[..., kv_lora_rank]`` -> ``k_nope [..., heads, nope]``, ``v``."""
        s = self.spec
        kv = lin("kv_b_proj", latent.reshape(-1, s.kv_lora_rank))
        # the token dim from kv: a sequence-parallel kv_b gathers every token's latent
        kv = kv.reshape(*latent.shape[:-2], -1, s.num_heads, s.qk_nope_head_dim + s.v_head_dim)
        return kv[..., : s.qk_nope_head_dim], kv[..., s.qk_nope_head_dim :]

    @staticmethod
    def _query_key(
        q_nope: Tensor, q_rope: Tensor, k_nope: Tensor, rope_key: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``q = [q_nope | q_rope]`` and ``k = [k_nope | rope_key]`` (the rope key broadcast over
        heads), the per-head layout of transformers' query and key states."""
        k_rope = rope_key.unsqueeze(-2).expand(*k_nope.shape[:-1], rope_key.shape[-1])
        return torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope], dim=-1)

    def _attend_expanded(
        self,
        ops: type[FastOps],
        proj: MlaProjection,
        buf: Tensor,
        rows: Tensor,
        pos: Tensor,
        lin: Linear,
    ) -> Tensor:
        """Expand the rows' cached latents with ``kv_b`` and attend as training does: ``[T, heads, v]``."""
        s = self.spec
        width = min(buf.shape[1], 1 << int(pos.max()).bit_length())
        used, local = torch.unique(rows, return_inverse=True)
        cached = buf[used, :width]  # [U, W, latent | rope key]
        k_nope, v = self._expand(lin, cached[..., : s.kv_lora_rank])
        q, k = self._query_key(proj.q_nope, proj.q_rope, k_nope, cached[..., s.kv_lora_rank :])
        head_width = max(q.shape[-1], v.shape[-1])
        q, k, v = _pad_last(q, head_width), _pad_last(k, head_width), _pad_last(v, head_width)
        o = attend_buffers(ops, q, k, v, local, pos, scale=s.softmax_scale)
        return o.reshape(q.shape[0], s.num_heads, head_width)[..., : s.v_head_dim]

    def _attend_absorbed(
        self, ops: type[FastOps], proj: MlaProjection, buf: Tensor, rows: Tensor, pos: Tensor
    ) -> Tensor:
        """Absorbed MLA: multi-query attention over the cached ``[c | kr]``: ``[T, heads, v]``."""
        s = self.spec
        w = self.kv_b_proj.reshape(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]
        q_lat = per_head_linear(ops, proj.q_nope, w_uk.transpose(1, 2))  # [T, heads, latent]
        q = torch.cat([q_lat, proj.q_rope], dim=-1)
        kv = buf[:, :, None, :]  # one key/value head: the cached vector is both
        o = attend_buffers(ops, q, kv, kv, rows, pos, scale=s.softmax_scale)
        o_lat = o.reshape(q.shape[0], s.num_heads, s.cache_width)[..., : s.kv_lora_rank]
        return per_head_linear(ops, o_lat, w_uv)

    def _output(self, o: Tensor, lin: Linear) -> Tensor:
        return lin("o_proj", o.reshape(o.shape[0], -1))
