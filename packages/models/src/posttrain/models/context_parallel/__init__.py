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

With the model's ``TokenLayout`` seam (``_blocks``: a CP layout subclasses ``PackedLayout``),
the layout is ``PackedLayout(shard.positions.segment_id, shard.positions.position, n_segments,
capacity)`` whose ``sconv`` returns ``ops.sconv(halo_windows(x, exchange_halo(x, plan), plan),
weight)`` and whose ``attend`` calls the model's ``attend`` with ``all_gather_sequence(k)``,
``all_gather_sequence(v)`` and ``k_pos/k_seg`` from ``shard.stream_positions``; the model's
own kernels then keep strict numerics (``context_parallel_attention`` here is the dense fp32
reference formulation).

Errors: ``ContextParallelConfigError`` (a ``ModelConfigError``), ``SequenceLayoutError``,
``ShardShapeError`` and ``ProcessGroupMismatchError`` (all ``ContextParallelError``).
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

__all__ = [
    "CPLayout",
    "ContextParallelConfigError",
    "ContextParallelError",
    "HaloPlan",
    "ProcessGroupMismatchError",
    "SequenceLayoutError",
    "SequenceShard",
    "SequenceSharding",
    "ShardShapeError",
    "TokenPositions",
    "all_gather_sequence",
    "attend",
    "attention_mask",
    "bind_shard",
    "causal_depthwise_conv",
    "context_parallel_attention",
    "exchange_halo",
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
