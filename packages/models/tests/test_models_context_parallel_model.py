"""The inkling-tiny decoder under context parallel through the model's ``TokenLayout`` seam.

``ContextParallelLayout`` below is the whole adapter between ``posttrain.models``' layout seam
(``_blocks.PackedLayout``, from the Inkling-blocks branch) and ``context_parallel``: halo
windows for every sconv site (summed by the model's own ``ops.sconv``) and K/V gathered with
the autograd-aware ``all_gather_sequence`` for the model's own ``attend``. On CP=2 and CP=4
gloo ranks, both layouts, packed input with every block on (random sconv weights, so the
halos matter): strict logits equal the unsplit forward bit for bit, and every parameter
gradient matches within relative L2 1e-6. Skipped only where the layout seam is not in the
tree yet (this module was written before the two branches met).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.interface.testing import run_workers
from posttrain.models import ModelConfig, Numerics, build_model
from posttrain.models import context_parallel as cp

blocks = pytest.importorskip("posttrain.models._blocks")

SEGMENTS = (16, 24, 8)  # multiples of 2 * 4
CAPACITY = 32


class ContextParallelLayout(blocks.PackedLayout):
    """This rank's tokens of a packed batch split over a CP group."""

    def __init__(self, shard: cp.SequenceShard, capacity: int) -> None:
        positions = shard.positions
        segments = len(shard.sharding.segment_lengths)
        super().__init__(positions.segment_id, positions.position, segments, capacity)
        self.shard = shard

    def sconv(self, ops: Any, layer: int, site: str, x: Tensor, weight: Tensor) -> Tensor:
        plan = cp.plan_halo(self.shard, weight.shape[1])
        return ops.sconv(cp.halo_windows(x, cp.exchange_halo(x, plan), plan), weight)

    def attend(
        self,
        ops: Any,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None,
        rel_logits: Tensor | None,
    ) -> Tensor:
        stream = self.shard.stream_positions
        return blocks.attend(
            ops,
            q,
            cp.all_gather_sequence(k, self.shard, name="k"),
            cp.all_gather_sequence(v, self.shard, name="v"),
            q_pos=self.pos,
            q_seg=self.seg,
            k_pos=stream.position,
            k_seg=stream.segment_id,
            num_segments=self.num_segments,
            capacity=self.capacity,
            scale=scale,
            window=window,
            rel_logits=rel_logits,
        )


def _models() -> tuple[Any, Any]:
    config = ModelConfig.inkling_tiny(max_position_embeddings=CAPACITY)
    reference = build_model(config, seed=3, numerics=Numerics.STRICT)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for name, param in reference.named_parameters():
            if "conv" in name:  # zero-initialised sconv is the identity: make it matter
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    model = build_model(config, seed=3, numerics=Numerics.STRICT)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _rank(rank: int, world: int) -> dict[str, tuple[bool, str, float]]:
    group = dist.new_group(list(range(world)))
    results = {}
    for layout in cp.CPLayout:
        reference, model = _models()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (sum(SEGMENTS),), generator=g)
        weights = torch.randn(sum(SEGMENTS), model.config.vocab_size, generator=g)
        seg = torch.repeat_interleave(torch.arange(len(SEGMENTS)), torch.tensor(SEGMENTS))
        pos = torch.cat([torch.arange(n) for n in SEGMENTS])
        full = blocks.PackedLayout(seg, pos, len(SEGMENTS), CAPACITY)
        ref_logits = reference.forward_with_layout(ids, full)
        (ref_logits * weights).sum().backward()

        shard = cp.bind_shard(cp.shard_for_context_parallel(SEGMENTS, world, layout), group)
        logits = model.forward_with_layout(shard.split(ids), ContextParallelLayout(shard, CAPACITY))
        (logits * shard.split(weights)).sum().backward()
        worst, worst_name = 0.0, ""
        for (name, param), (_, ref_param) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad, group=group)
            want = ref_param.grad if ref_param.grad is not None else torch.zeros_like(param)
            error = float((grad - want).norm() / want.norm().clamp_min(1e-30))
            if want.norm() == 0:
                error = float(grad.norm())
            if error > worst:
                worst, worst_name = error, name
        bitwise = bool(torch.equal(logits.detach(), shard.split(ref_logits.detach())))
        results[str(layout)] = (bitwise, worst_name, worst)
    return results


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_inkling_tiny_under_cp_matches_the_unsplit_model(world: int) -> None:
    for rank, result in enumerate(run_workers(_rank, world, timeout_s=200)):
        assert set(result) == {"contiguous", "zigzag"}
        for layout, (bitwise, name, error) in result.items():
            assert bitwise, f"rank {rank} {layout}: logits differ from the unsplit forward"
            assert error <= 1e-6, f"rank {rank} {layout}: grad of {name} rel L2 {error:.2e}"
