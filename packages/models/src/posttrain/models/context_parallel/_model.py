"""The decoder under context parallel: a ``TokenLayout`` over a CP shard and a one-call forward.

``DecoderModel.forward_with_layout`` reaches other tokens only in the residual short
convolutions and in attention (``posttrain.models._blocks``). ``ContextParallelLayout`` is
the ``PackedLayout`` of one CP rank's tokens whose two seams talk to the other ranks:

* ``sconv``: the ``k - 1`` tokens before each local chunk come from the rank that holds them
  (``exchange_halo``, autograd-aware), and the model's own ``ops.sconv`` sums the taps
  (``halo_windows``), so strict mode keeps its bits.
* ``attend``: K and V of the whole stream are gathered with ``all_gather_sequence`` (its
  backward returns every rank's gradient of this rank's K/V rows) and the model's own
  ``attend`` masks them by position, segment, window and relative-bias index.

Everything else in the forward is per token. ``forward_context_parallel(model, input_ids,
segment_lengths, group)`` does the whole step for a trainer: shard the packed batch (same on
every rank of ``group``), run the forward, and return this rank's logits and logprobs in the
model's convention (``out[t] = log p(ids[t] | ids[start:t])``, 0 at a sequence's first token;
the logprob of a token whose predecessor sits on another rank comes over with a one-token halo).
In strict numerics the local rows equal the single-process ``forward_logits`` /
``forward_logprobs`` rows bit for bit, for either layout and any CP size.

Gradients: each rank sums the loss of its own tokens and backpropagates; each rank then holds
part of every parameter's gradient, and their sum over the CP group is the single-process
gradient. ``all_reduce_gradients(model, group)`` sums them for a plain (replicated) model.
Under FSDP2 with the CP ranks inside the sharding mesh, FSDP's gradient reduce-scatter already
sums over them but divides by the mesh size: scale each rank's loss by the CP size and do not
call ``all_reduce_gradients`` (the gloo test does this). ``forward_context_parallel`` registers
``forward_with_layout`` as an FSDP forward method on an FSDP2 module the first time it sees
one (FSDP's hooks wrap ``forward`` only, so the sharded parameters would otherwise not be
gathered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.models._blocks import PackedLayout, attend
from posttrain.models._errors import ModelInputError
from posttrain.models._lora import LoraAdapter
from posttrain.models._model import DecoderModel
from posttrain.models._ops import FastOps
from posttrain.models.context_parallel._errors import UnsupportedModelError
from posttrain.models.context_parallel._gather import (
    SequenceShard,
    all_gather_sequence,
    bind_shard,
)
from posttrain.models.context_parallel._halo import exchange_halo, halo_windows, plan_halo
from posttrain.models.context_parallel._layout import CPLayout, shard_for_context_parallel


class ContextParallelLayout(PackedLayout):
    """This rank's tokens of a packed batch split over a CP group (see the module docstring).

    ``shard`` is this rank's ``SequenceShard`` (``bind_shard``); ``capacity`` the model's
    ``config.capacity``; ``device`` where the model runs (positions move there).
    """

    def __init__(
        self, shard: SequenceShard, capacity: int, *, device: torch.device | str = "cpu"
    ) -> None:
        local = shard.positions
        stream = shard.stream_positions
        super().__init__(
            local.segment_id.to(device),
            local.position.to(device),
            len(shard.sharding.segment_lengths),
            capacity,
        )
        self.shard = shard
        self.key_positions = stream.position.to(device)
        """Position within its sequence of each row of the gathered K/V (global order)."""
        self.key_segments = stream.segment_id.to(device)
        """Segment id of each row of the gathered K/V."""

    def gather(self, x: Tensor, name: str) -> Tensor:
        """The whole stream of a local K or V tensor, in global order, with autograd."""
        return all_gather_sequence(x, self.shard, name=name)

    def sconv(self, ops: type[FastOps], layer: int, site: str, x: Tensor, weight: Tensor) -> Tensor:
        plan = plan_halo(self.shard, weight.shape[1])
        halo = exchange_halo(x, plan, name=f"layer {layer} sconv {site} input")
        return ops.sconv(halo_windows(x, halo, plan), weight)

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
        return attend(
            ops,
            q,
            self.gather(k, f"layer {layer} keys"),
            self.gather(v, f"layer {layer} values"),
            q_pos=self.pos,
            q_seg=self.seg,
            k_pos=self.key_positions,
            k_seg=self.key_segments,
            num_segments=self.num_segments,
            capacity=self.capacity,
            scale=scale,
            window=window,
            rel_logits=rel_logits,
        )


@dataclass(frozen=True, slots=True, eq=False)
class ContextParallelOutput:
    """One rank's share of a context-parallel forward (rows in ``shard``'s local order)."""

    logits: Tensor
    """``[T_local, vocab]`` fp32 logits of this rank's tokens."""
    logprobs: Tensor
    """``[T_local]`` fp32: ``log p(ids[t] | ids[start:t])`` of each local token (0 at starts)."""
    shard: SequenceShard
    """Which tokens these are: ``shard.split(full)`` aligns per-token data (advantages, masks)
    with the rows; ``all_gather_sequence(local, shard)`` or ``shard.sharding.merge(pieces)``
    rebuilds a full-stream tensor."""


def forward_context_parallel(
    model: DecoderModel,
    input_ids: Tensor,
    segment_lengths: Sequence[int],
    group: dist.ProcessGroup | None,
    layout: CPLayout | str = CPLayout.ZIGZAG,
    *,
    lora: LoraAdapter | None = None,
) -> ContextParallelOutput:
    """This rank's logits and logprobs of a packed batch split over ``group``.

    ``input_ids`` is the whole packed stream ``[T]`` and ``segment_lengths`` its sequences,
    identical on every rank of ``group`` (``group=None`` only for a one-rank run); each length
    must be a multiple of the CP size (contiguous) or twice it (zigzag):
    ``padded_segment_lengths`` says how far to pad. Differentiable; see the module docstring
    for the gradient reduction. Raises ``UnsupportedModelError`` for a model that is not a
    ``DecoderModel``, ``ModelInputError`` for ids that do not fit the lengths or the model, and
    the CP errors (``SequenceLayoutError``, ``ProcessGroupMismatchError``) from the sharding.
    """
    if not isinstance(model, DecoderModel):
        raise UnsupportedModelError(
            f"forward_context_parallel needs a posttrain.models DecoderModel (it runs the "
            f"forward through forward_with_layout), got {type(model).__name__}"
        )
    device = model.embedding.device
    ids = input_ids.reshape(-1).long().to(device)
    lengths = [int(n) for n in segment_lengths]
    if sum(lengths) != ids.shape[0]:
        raise ModelInputError(
            f"input_ids has {ids.shape[0]} tokens but segment_lengths sum to {sum(lengths)}"
        )
    capacity = model.config.capacity
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ModelInputError(
                f"segment {i} has {n} tokens, more than the KV capacity {capacity}"
            )
    cp_size = 1 if group is None else dist.get_world_size(group)
    shard = bind_shard(shard_for_context_parallel(lengths, cp_size, layout), group)
    # imported here: torch.distributed.fsdp costs ~2 s at import, which every process that
    # imports posttrain.models (an engine, the recipe step) would otherwise pay
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if isinstance(model, FSDPModule) and "forward_with_layout" not in vars(model):
        register_fsdp_forward_method(model, "forward_with_layout")
    logits = model.forward_with_layout(
        shard.split(ids, name="input_ids"),
        ContextParallelLayout(shard, capacity, device=device),
        lora=lora,
    )
    return ContextParallelOutput(
        logits=logits, logprobs=_local_logprobs(model, ids, logits, shard), shard=shard
    )


def _local_logprobs(
    model: DecoderModel, ids: Tensor, logits: Tensor, shard: SequenceShard
) -> Tensor:
    """``forward_logprobs``' rows of this rank: the logprob of each local token comes from its
    predecessor's logits, which a one-token halo brings over when another rank holds them."""
    local = shard.positions
    total = ids.shape[0]
    nxt = (local.global_index + 1).clamp(max=total - 1)
    seg = shard.sharding.segment_ids
    has_next = (local.global_index + 1 < total) & (seg[nxt] == local.segment_id)
    nxt, has_next = nxt.to(logits.device), has_next.to(logits.device)
    picked = model.ops.log_softmax(logits).gather(1, ids[nxt][:, None])[:, 0]
    predicts = torch.where(has_next, picked, 0.0)[:, None]  # logprob of the next token, [T, 1]
    plan = plan_halo(shard, 2)
    halo = exchange_halo(predicts, plan, name="next-token logprobs")
    return halo_windows(predicts, halo, plan)[0, :, 0]  # tap 0: the token before (0 at starts)


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum every trainable parameter's ``.grad`` over ``group`` in place (CP ranks' shares).

    Call after ``backward`` on every rank of the group, in the same parameter order (same
    model). A parameter without a gradient on this rank (an expert no local token chose)
    contributes zeros and gets the group's sum. One collective per (dtype, device). For an
    FSDP2 model, let FSDP reduce instead (see the module docstring): DTensor gradients are
    refused with ``UnsupportedModelError``. ``group=None`` (one rank) does nothing.
    """
    if group is None:
        return
    from torch.distributed.tensor import DTensor  # lazily, as FSDPModule above

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name, param in trainable:  # check everything before touching any gradient
        if isinstance(param.data, DTensor):
            raise UnsupportedModelError(
                f"parameter {name} is a DTensor (an FSDP/TP-sharded model): its gradient is "
                "reduced by FSDP over the mesh; all_reduce_gradients is for replicated models"
            )
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for _, param in trainable:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        buckets.setdefault((param.dtype, param.device), []).append(param)
    for params in buckets.values():
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for p in params:
            assert p.grad is not None
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
