"""Context parallel (CP) and sequence parallel (SP) primitives for packed sequences.

The sequence is split over an explicit process group; nothing here uses the default group.
How the model uses it, per forward:

1. ``sharding = shard_for_context_parallel(segment_lengths, cp_size, CPLayout.ZIGZAG)``
   (or ``CONTIGUOUS``; ``shard_for_sequence_parallel(lengths, tp_size)`` for SP under TP,
   ``subdivide_for_sequence_parallel(sharding, tp_size)`` for CP x SP over a CP-major group),
   identical on every rank; ``shard = bind_shard(sharding, cp_group)`` checks the group.
2. Inputs: ``shard.split(input_ids)``; RoPE positions: ``shard.positions.position``.
3. Attention: ``context_parallel_attention(q, k, v, shard, scale=..., window=...,
   rel_stream=r, rel_proj=table)`` (K/V gathered with the autograd-aware
   ``all_gather_sequence``; masks and the relative-bias index from absolute positions).
4. Short convolutions: ``plan = plan_halo(shard, kernel_size)`` once, then
   ``residual_short_conv(x, weight, plan)`` at each site (only ``k - 1`` boundary rows move).
5. Outputs: per-token results stay local (sum the loss, all-reduce parameter gradients over the
   CP group); ``sharding.merge(pieces)`` reassembles full tensors where needed.

Model level (``_model``): ``forward_context_parallel(model, input_ids, segment_lengths, group,
CPLayout.ZIGZAG)`` runs a ``DecoderModel`` on this rank's tokens and returns its logits and
logprobs (``ContextParallelOutput``; in strict numerics the rows of the single-process forward
bit for bit); ``all_reduce_gradients(model, group)`` sums the ranks' gradient shares (FSDP2's
reduction covers it when the CP ranks are in its mesh). ``ContextParallelLayout`` is the
``TokenLayout`` underneath (``_blocks``' seam): halo windows for the model's ``ops.sconv`` and
K/V gathered with ``all_gather_sequence`` for the model's ``attend``, so the model keeps its
own strict kernels (``context_parallel_attention`` here is the dense fp32 reference
formulation for models with their own blocks).

Errors: ``ContextParallelConfigError`` (a ``ModelConfigError``), ``SequenceLayoutError``,
``ShardShapeError``, ``ProcessGroupMismatchError`` and ``UnsupportedModelError`` (all
``ContextParallelError``).
"""

from posttrain.models.context_parallel._attention import (
    attend,
    attention_mask,
    context_parallel_attention,
    relative_position_bias,
)
from posttrain.models.context_parallel._errors import (
    ContextParallelConfigError,
    ContextParallelError,
    ProcessGroupMismatchError,
    SequenceLayoutError,
    ShardShapeError,
    UnsupportedModelError,
)
from posttrain.models.context_parallel._gather import (
    SequenceShard,
    all_gather_sequence,
    bind_shard,
)
from posttrain.models.context_parallel._halo import (
    HaloPlan,
    causal_depthwise_conv,
    exchange_halo,
    halo_windows,
    plan_halo,
    residual_short_conv,
)
from posttrain.models.context_parallel._layout import (
    CPLayout,
    SequenceSharding,
    TokenPositions,
    padded_segment_lengths,
    segment_lengths_from_cu_seqlens,
    shard_for_context_parallel,
    shard_for_sequence_parallel,
    subdivide_for_sequence_parallel,
)
from posttrain.models.context_parallel._model import (
    ContextParallelLayout,
    ContextParallelOutput,
    all_reduce_gradients,
    forward_context_parallel,
)

__all__ = [
    "CPLayout",
    "ContextParallelConfigError",
    "ContextParallelError",
    "ContextParallelLayout",
    "ContextParallelOutput",
    "HaloPlan",
    "ProcessGroupMismatchError",
    "SequenceLayoutError",
    "SequenceShard",
    "SequenceSharding",
    "ShardShapeError",
    "TokenPositions",
    "UnsupportedModelError",
    "all_gather_sequence",
    "all_reduce_gradients",
    "attend",
    "attention_mask",
    "bind_shard",
    "causal_depthwise_conv",
    "context_parallel_attention",
    "exchange_halo",
    "forward_context_parallel",
    "halo_windows",
    "padded_segment_lengths",
    "plan_halo",
    "relative_position_bias",
    "residual_short_conv",
    "segment_lengths_from_cu_seqlens",
    "shard_for_context_parallel",
    "shard_for_sequence_parallel",
    "subdivide_for_sequence_parallel",
]
