"""Token layouts, the residual short convolution and masked attention: the seams of the forward.

The decoder's forward (``DecoderModel.forward_with_layout``) never looks at how its tokens
are arranged. Two things in a layer need other tokens than a token's own: the residual
short convolution (``sconv``, its ``k - 1`` predecessors) and attention (the keys and values
of its sequence). Both go through a ``TokenLayout``:

* ``PackedLayout`` -- the training forward over packed segments (positions restart at each
  segment; nothing crosses a segment boundary).
* ``CacheLayout`` -- KV-cache decode: keys and values land in the cache's fixed-capacity
  rows; each sconv site keeps the last ``k - 1`` inputs of every row as its state.

**Seams for context / sequence parallel** (``posttrain.models.context_parallel`` plugs in
here: its ``ContextParallelLayout`` subclasses ``PackedLayout`` and overrides its two methods):

* ``residual_sconv(ops, x_local, seg_local, weight, halo=None, halo_seg=None)`` --
  ``x_local[T, C]`` this rank's tokens in global packed order, ``seg_local[T]`` their global
  segment ids; ``halo[k-1, C]`` / ``halo_seg[k-1]`` the ``k - 1`` tokens just before
  ``x_local[0]`` in the global order (the previous rank's tail; under zigzag, the tail of
  the chunk before each local chunk: call once per chunk) and their segment ids, ``-1``
  where there is no token. A tap counts only when its segment id equals the token's, so a
  halo never leaks across a sequence boundary. Bit for bit the rows of the unsplit call;
  differentiable in ``x_local``, ``halo`` and ``weight`` (an autograd-aware halo exchange
  carries the halo's gradient back to its sender).
* ``attend(ops, q_local, k_full, v_full, q_pos=, q_seg=, k_pos=, k_seg=, num_segments=,
  capacity=, scale=, window=, rel_logits=)`` -- queries of this rank against keys and
  values of the whole sequence (gathered, RoPE already applied with their positions).
  Positions are within the segment (what RoPE uses, independent of the split); segment
  ids are global. Keys are scattered into a per-segment buffer of the fixed capacity
  ``C`` by ``(k_seg, k_pos)`` and every query reduces over its segment's buffer with the
  causal (``k_pos <= q_pos``), window (``q_pos - k_pos < window``) and relative-bias
  (index ``q_pos - k_pos``) terms all taken from positions, exactly as decode does, so the
  result does not depend on how queries are split or ordered (zigzag included).
* ``rel_logits_of(ops, r, rel_proj)`` -- the bias table ``[T, heads, extent]`` of local
  queries; per-token, so it needs no communication.

Numerics: both are fixed-shape reductions (``tree_sum`` over the ``k`` taps; attention over
``C`` slots) in strict mode, so train == decode == split, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.models import _ops
from posttrain.models._ops import FastOps
from posttrain.models._row_attention import PackedRuns

if TYPE_CHECKING:
    from posttrain.models._cache import KVCache

NO_TOKEN = -1
"""Segment id of a halo slot that holds no token (before the first token of the batch)."""


def sconv_windows(x: Tensor, seg: Tensor, width: int) -> Tensor:
    """``[width, T, C]``: tap ``i`` of token ``t`` is ``x[t - (width - 1 - i)]`` when that token
    exists and has ``t``'s segment id, else 0 (oldest tap first, the token itself last)."""
    n = x.shape[0]
    taps = []
    for shift in range(width - 1, 0, -1):
        shifted = torch.cat([x.new_zeros((shift, *x.shape[1:])), x])[:n]
        shifted_seg = torch.cat([seg.new_full((shift,), NO_TOKEN - 1), seg])[:n]
        taps.append(torch.where((shifted_seg == seg)[:, None], shifted, 0.0))
    taps.append(x)
    return torch.stack(taps)


def residual_sconv(
    ops: type[FastOps],
    x: Tensor,
    seg: Tensor,
    weight: Tensor,
    halo: Tensor | None = None,
    halo_seg: Tensor | None = None,
) -> Tensor:
    """``y_t = x_t + sum_i weight[:, i] * x_{t-k+1+i}`` within ``t``'s segment (see the module doc).

    ``x[T, C]``, ``seg[T]``, ``weight[C, k]``; ``halo[k-1, C]`` and ``halo_seg[k-1]`` are the
    tokens before ``x[0]`` (absent: none). Returns ``[T, C]`` fp32.
    """
    width = weight.shape[1]
    if halo is None:
        return ops.sconv(sconv_windows(x, seg, width), weight)
    if halo_seg is None or halo.shape[0] != halo_seg.shape[0]:
        raise ValueError("residual_sconv: halo and halo_seg must be given together, same length")
    ext = torch.cat([halo, x])
    ext_seg = torch.cat([halo_seg.to(seg.dtype), seg])
    windows = sconv_windows(ext, ext_seg, width)[:, halo.shape[0] :]
    return ops.sconv(windows, weight)


def rel_logits_of(ops: type[FastOps], r: Tensor, rel_proj: Tensor) -> Tensor:
    """``out[t, h, d] = r[t, h] . rel_proj[:, d]`` in fp32: ``r[T, heads, d_rel]``,
    ``rel_proj[d_rel, extent]`` -> ``[T, heads, extent]``."""
    return ops.linear(r, rel_proj.t())


def attend_buffers(
    ops: type[FastOps],
    q: Tensor,
    kbuf: Tensor,
    vbuf: Tensor,
    rows: Tensor,
    pos: Tensor,
    *,
    scale: float,
    window: int | None = None,
    rel_logits: Tensor | None = None,
) -> Tensor:
    """Each query ``q[t]`` (``[T, heads, hd]``, position ``pos[t]``) over buffer row ``rows[t]``
    of ``kbuf/vbuf[R, C, kv_heads, hd]`` (slot = key position). Returns ``[T, heads * hd]``.

    Slot ``c`` is seen when ``c <= pos`` and (with a window) ``pos - c < window``; with
    ``rel_logits[T, heads, E]`` the score gets ``rel_logits[t, h, pos - c]`` for
    ``0 <= pos - c < E`` (0 elsewhere), added after scaling.
    """
    t, nh, hd = q.shape
    cap, nkv = kbuf.shape[1], kbuf.shape[2]
    if rel_logits is None and ops.uses_row_attention(q):
        # the rows' buffers flattened to [R * C, ...]: slot c of row r is r * C + c
        flat_k = kbuf.reshape(-1, nkv, kbuf.shape[3])
        flat_v = vbuf.reshape(-1, nkv, vbuf.shape[3])
        return ops.attend_rows(q, flat_k, flat_v, rows * cap, pos, scale=scale, window=window)
    group = nh // nkv
    qg = q.reshape(t, nkv, group, hd)
    slots = torch.arange(cap, device=q.device)
    rel = None
    if rel_logits is not None:
        extent = rel_logits.shape[-1]
        rel = torch.cat([rel_logits, rel_logits.new_zeros((t, nh, 1))], dim=-1)
    step = max(1, ops.attention_chunk_elements // (nh * cap * hd))
    outs = []
    # merged runs of chunks; the reference backward (autograd's own graph) runs chunk by chunk
    for i, stop, width in _query_groups(pos, step, cap, merge=_ops._CUSTOM_BACKWARD):
        r, p = rows[i:stop], pos[i:stop]
        # Reduce over the first W = 2**ceil(log2(max pos + 1)) slots of each chunk only: slots
        # past the chunk's last position are masked, contribute exact zeros, and in the
        # pairwise tree ``x + 0 == x``, so the bits equal those of the full-C reduction.
        dist = p[:, None] - slots[None, :width]  # [t, W]
        valid = dist >= 0
        if window is not None:
            valid = valid & (dist < window)
        bias = None
        if rel is not None:
            idx = torch.where((dist >= 0) & (dist < extent), dist, extent)
            n = p.shape[0]
            bias = rel[i:stop].gather(2, idx[:, None, :].expand(n, nh, width))
            bias = bias.reshape(n, nkv, group, width)
        keys, values = _gather_rows(kbuf, r, width), _gather_rows(vbuf, r, width)
        outs.append(ops.attention(qg[i:stop], keys, values, valid, scale, bias))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(t, nh * hd)


_MERGED_CHUNKS = 32
"""At most this many query chunks of ``attend_buffers`` go through one ``ops.attention`` call."""


def _query_groups(pos: Tensor, step: int, cap: int, *, merge: bool) -> list[tuple[int, int, int]]:
    """``attend_buffers``' query chunks (``step`` queries each, each reduced over the width of
    its own largest position), merged (``merge``) into runs of up to ``_MERGED_CHUNKS`` chunks of
    one width: ``(start, stop, width)`` per call. Every query is reduced alone, so merging
    changes no forward bit (the gradients, BLAS contractions over a run's shape, only to fp32
    rounding)."""
    t = pos.shape[0]
    n = -(-t // step)
    padded = torch.cat([pos, pos.new_full((n * step - t,), -1)]) if n * step != t else pos
    widths = [min(cap, 1 << int(m).bit_length()) for m in padded.view(n, step).amax(1).tolist()]
    out: list[tuple[int, int, int]] = []
    runs = 0  # chunks in the last call
    for i, width in enumerate(widths):
        stop = min(t, (i + 1) * step)
        if merge and out and out[-1][2] == width and runs < _MERGED_CHUNKS:
            out[-1], runs = (out[-1][0], stop, width), runs + 1
        else:
            out.append((i * step, stop, width))
            runs = 1
    return out


def _gather_rows(buf: Tensor, rows: Tensor, width: int) -> Tensor:
    """``buf[rows, :width]``; under autograd with ``_GatherRows``' backward."""
    if torch.is_grad_enabled() and buf.requires_grad:
        out: Tensor = _GatherRows.apply(buf, rows, width)  # type: ignore[no-untyped-call]
        return out
    return buf[rows, :width]


class _GatherRows(torch.autograd.Function):
    """``buf[rows, :width]`` whose backward sums each buffer row's gradient with ``index_add_``
    over dim 0: the queries in order, one slice add each, the same bits at any thread count.
    Autograd's own (``index_put_`` with accumulation) walks every element through an index
    and adds with atomics on several CPU threads (no fixed order), at ~10x the cost here."""

    @staticmethod
    def forward(ctx: Any, buf: Tensor, rows: Tensor, width: int) -> Tensor:
        ctx.save_for_backward(rows)
        ctx.shape, ctx.width = buf.shape, width
        return buf[rows, :width]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (rows,) = ctx.saved_tensors
        shape, width = ctx.shape, ctx.width
        # contiguous source and target: one vectorised slice add per query
        summed = grad.new_zeros((shape[0], width, *shape[2:])).index_add_(
            0, rows, grad.contiguous()
        )
        if width == shape[1]:
            return summed, None, None
        full = grad.new_zeros(shape)
        full[:, :width] = summed
        return full, None, None


def attend(
    ops: type[FastOps],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    q_pos: Tensor,
    q_seg: Tensor,
    k_pos: Tensor,
    k_seg: Tensor,
    num_segments: int,
    capacity: int,
    scale: float,
    window: int | None = None,
    rel_logits: Tensor | None = None,
) -> Tensor:
    """Queries ``q[T, heads, hd]`` against keys/values ``k, v[S, kv_heads, hd]`` of any tokens
    (local or gathered; see the module doc). Returns ``[T, heads * hd]``."""
    shape = (num_segments, capacity, k.shape[1], k.shape[2])
    kbuf = k.new_zeros(shape).index_put((k_seg, k_pos), k)
    vbuf = v.new_zeros(shape).index_put((k_seg, k_pos), v)
    return attend_buffers(
        ops, q, kbuf, vbuf, q_seg, q_pos, scale=scale, window=window, rel_logits=rel_logits
    )


def causal_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seg: Tensor,
    pos: Tensor,
    num_segments: int,
    scale: float,
    dtype: torch.dtype,
    longest: int | None = None,
) -> Tensor:
    """Fast-mode training attention without window or bias: torch SDPA (flash / efficient
    kernels where the device has them) over packed segments whose tokens are in order.

    Every segment is padded at its end to the longest one and all go through one causal SDPA
    call ``[segments, heads, L, hd]`` in ``dtype``: a real query never sees a pad key (the
    pads come after it), so the rows of the real tokens are exactly per-segment attention.
    When padding would more than double the work, segments run one SDPA call each.
    ``q, k[T, heads | kv_heads, hd]``, ``v[T, kv_heads, hd_v]`` (MLA: ``hd_v != hd``); returns
    ``[T, heads * hd_v]`` in ``dtype``.
    ``longest``: the longest segment (``max(pos) + 1``), when the caller knows it.
    """
    t, nh = q.shape[0], q.shape[1]
    group = nh // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    longest = int(pos.max()) + 1 if longest is None else longest
    if num_segments * longest <= 2 * t:
        # every segment exactly ``longest`` long: the packing is the padded batch itself (no
        # scatter into a zero buffer, no gather back: 4 kernels and their backwards fewer)
        t_pad = num_segments * longest
        slot = None if t_pad == t else seg * longest + pos  # the token's row in the padded batch

        def padded(x: Tensor) -> Tensor:
            rows = x if slot is None else x.new_zeros((t_pad, *x.shape[1:])).index_copy(0, slot, x)
            return rows.reshape(num_segments, longest, *x.shape[1:]).transpose(1, 2)

        kp = padded(k).repeat_interleave(group, dim=1)
        vp = padded(v).repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(padded(q), kp, vp, is_causal=True, scale=scale)
        out = o.transpose(1, 2).reshape(t_pad, -1)
        return out if slot is None else out[slot]
    outs = []
    for s in torch.unique_consecutive(seg).tolist():
        idx = (seg == s).nonzero().flatten()
        qs = q[idx].transpose(0, 1)[None]  # [1, nh, L, hd]
        ks = k[idx].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        vs = v[idx].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(o[0].transpose(0, 1).reshape(idx.shape[0], -1))
    return torch.cat(outs)


class TokenLayout:
    """Where a forward's tokens sit; base of ``PackedLayout`` and ``CacheLayout``.

    ``seg[T]`` / ``pos[T]``: each token's segment (or cache row slot in the call) and its
    position within its sequence (RoPE and the attention masks use it).
    """

    def __init__(self, seg: Tensor, pos: Tensor) -> None:
        self.seg = seg
        self.pos = pos

    def sconv(self, ops: type[FastOps], layer: int, site: str, x: Tensor, weight: Tensor) -> Tensor:
        """The residual short convolution of ``x[T, C]`` at ``site`` of layer ``layer``."""
        raise NotImplementedError

    def attend(
        self,
        ops: type[FastOps],
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
        rel_logits: Tensor | None,
    ) -> Tensor:
        """Attention of this call's queries (RoPE applied); ``[T, heads * hd]``."""
        raise NotImplementedError


class PackedLayout(TokenLayout):
    """Packed training segments: ``seg`` in ``[0, num_segments)``, positions restart per segment.

    ``longest``: the longest segment, given by a caller that built ``seg``/``pos`` itself from
    host segment lengths (segments contiguous, positions ``0, 1, ...``): the layout then takes
    both facts as given instead of reading them back from the device (two host syncs).
    """

    def __init__(
        self,
        seg: Tensor,
        pos: Tensor,
        num_segments: int,
        capacity: int,
        *,
        longest: int | None = None,
    ) -> None:
        super().__init__(seg, pos)
        self.num_segments = num_segments
        self.capacity = capacity
        self._in_order: bool | None = None
        self._longest: int | None = None
        self._runs: PackedRuns | None = None
        if longest is not None:
            # the caller built seg/pos from host segment lengths (``DecoderModel._pack``): in
            # order by construction and the longest known, so no host sync is ever needed
            self._in_order, self._longest = True, longest
            # segments 0..num_segments-1 in order, each its own key row: the facts a packed
            # attention backward needs, known here without reading the device
            self._runs = PackedRuns(seg, num_segments, longest)

    def tokens_in_order(self) -> bool:
        """Whether every segment's tokens are contiguous with positions ``0, 1, 2, ...``
        (what ``forward_logits`` builds), so slot ``c`` of token ``t``'s segment is token
        ``t - pos[t] + c``. Checked once per layout."""
        if self._in_order is None:
            seg, pos = self.seg, self.pos
            starts = pos == 0
            follows = (seg[1:] == seg[:-1]) & (pos[1:] == pos[:-1] + 1)
            new_seg = starts[1:] & (seg[1:] != seg[:-1])
            self._in_order = bool(starts[0]) and bool((new_seg | follows).all())
        return self._in_order

    def longest(self) -> int:
        """The longest segment (``max(pos) + 1``): one host sync, once per layout."""
        if self._longest is None:
            self._longest = int(self.pos.max()) + 1
        return self._longest

    def prepare(self) -> None:
        """Take the layout's host syncs now (``tokens_in_order``, ``longest``), before the
        layers: a compiled layer then reads plain Python values and never breaks its graph."""
        if self.tokens_in_order():
            self.longest()

    def sconv(self, ops: type[FastOps], layer: int, site: str, x: Tensor, weight: Tensor) -> Tensor:
        return residual_sconv(ops, x, self.seg, weight)

    def attend(
        self,
        ops: type[FastOps],
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
        rel_logits: Tensor | None,
    ) -> Tensor:
        plain = not ops.batch_invariant and window is None and rel_logits is None
        if plain and self.tokens_in_order():
            return causal_sdpa(
                q, k, v, self.seg, self.pos, self.num_segments, scale, ops.compute_dtype,
                self.longest(),  # once per layout, not once per layer (a host sync)
            )  # fmt: skip
        if rel_logits is None and ops.uses_row_attention(q) and self.tokens_in_order():
            # each segment's keys are its own tokens, in position order: no buffers needed
            first = torch.arange(q.shape[0], device=q.device) - self.pos
            return ops.attend_rows(
                q, k, v, first, self.pos, scale=scale, window=window, runs=self._runs
            )
        return attend(
            ops,
            q,
            k,
            v,
            q_pos=self.pos,
            q_seg=self.seg,
            k_pos=self.pos,
            k_seg=self.seg,
            num_segments=self.num_segments,
            capacity=self.capacity,
            scale=scale,
            window=window,
            rel_logits=rel_logits,
        )


class SharedPrefixLayout(PackedLayout):
    """Packed training segments where a segment may begin with another's first tokens, which
    the packed stream holds once (GRPO's samples of one prompt: the prompt once, then every
    sample's own response tokens).

    ``seg``/``pos``: each packed token's segment and its position in the segment's whole
    sequence (a segment that shares ``n`` tokens has its own tokens at positions ``n, n+1,
    ...``). ``key_rows``: for every segment in order, the packed rows of its whole sequence
    (the shared tokens' rows in the segment they belong to, then its own); ``key_start[T]``:
    where each token's segment begins in ``key_rows``; ``key_seg``/``key_pos``: the segment
    and position of each entry. Attention reads each segment's keys through ``key_rows``, so a
    token sees exactly the keys it would see with its segment packed whole; in strict numerics
    every row is computed alone, so its bits are the same too.
    """

    def __init__(
        self,
        seg: Tensor,
        pos: Tensor,
        num_segments: int,
        capacity: int,
        *,
        key_rows: Tensor,
        key_start: Tensor,
        key_seg: Tensor,
        key_pos: Tensor,
    ) -> None:
        super().__init__(seg, pos, num_segments, capacity)
        self._in_order = False  # a shared segment's own tokens do not start at position 0
        self._longest = capacity
        self.key_rows, self.key_start = key_rows, key_start
        self.key_seg, self.key_pos = key_seg, key_pos

    def sconv(self, ops: type[FastOps], layer: int, site: str, x: Tensor, weight: Tensor) -> Tensor:
        raise NotImplementedError("short convolutions read a shared prefix's tokens in place")

    def attend(
        self,
        ops: type[FastOps],
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
        rel_logits: Tensor | None,
    ) -> Tensor:
        if rel_logits is not None:
            raise NotImplementedError("a relative position bias reads whole packed segments")
        keys, values = k.index_select(0, self.key_rows), v.index_select(0, self.key_rows)
        if ops.uses_row_attention(q):
            return ops.attend_rows(
                q, keys, values, self.key_start, self.pos, scale=scale, window=window
            )
        return attend(
            ops, q, keys, values, q_pos=self.pos, q_seg=self.seg, k_pos=self.key_pos,
            k_seg=self.key_seg, num_segments=self.num_segments, capacity=self.capacity,
            scale=scale, window=window,
        )  # fmt: skip


class CacheLayout(TokenLayout):
    """KV-cache decode: the tokens of ``rows[j]`` are contiguous (``sizes[j]`` of them), in order.

    ``seg[t] = j`` (the row's slot in this call); attention reads and writes the cache's row
    buffers, and each sconv site reads and then advances its per-row state.
    """

    def __init__(
        self, cache: KVCache, rows: list[int], sizes: list[int], seg: Tensor, pos: Tensor
    ) -> None:
        super().__init__(seg, pos)
        self.cache = cache
        self.rows = rows
        self.sizes = sizes
        self.buf_row = torch.tensor(rows, dtype=torch.long, device=seg.device)[seg]

    def sconv(self, ops: type[FastOps], layer: int, site: str, x: Tensor, weight: Tensor) -> Tensor:
        state = self.cache.conv_state(layer, site)  # [num_rows, k-1, C]
        keep = state.shape[1]
        pieces, piece_seg, own = [], [], []
        for j, (chunk, row) in enumerate(zip(torch.split(x, self.sizes), self.rows, strict=True)):
            ext = torch.cat([state[row], chunk])
            pieces.append(ext)
            piece_seg.append(torch.full((ext.shape[0],), j, dtype=torch.long, device=x.device))
            own.append(torch.arange(keep, ext.shape[0], device=x.device))
            state[row] = ext[-keep:]
        offsets = torch.tensor([0, *[p.shape[0] for p in pieces[:-1]]], device=x.device).cumsum(0)
        take = torch.cat([o + off for o, off in zip(own, offsets.tolist(), strict=True)])
        windows = sconv_windows(torch.cat(pieces), torch.cat(piece_seg), weight.shape[1])
        return ops.sconv(windows[:, take], weight)

    def attend(
        self,
        ops: type[FastOps],
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
        rel_logits: Tensor | None,
    ) -> Tensor:
        kbuf, vbuf = self.cache.keys[layer], self.cache.values[layer]
        kbuf[self.buf_row, self.pos] = k
        vbuf[self.buf_row, self.pos] = v
        return attend_buffers(
            ops,
            q,
            kbuf,
            vbuf,
            self.buf_row,
            self.pos,
            scale=scale,
            window=window,
            rel_logits=rel_logits,
        )
