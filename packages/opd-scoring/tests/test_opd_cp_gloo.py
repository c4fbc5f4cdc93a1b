"""Context-parallel slicing of OPD signals across real gloo ranks reassembles the full signal."""

from __future__ import annotations

import pytest
import torch

from posttrain.interface.testing import run_workers
from posttrain.opd import apply_opd, cp_response_index, slice_response_for_cp

# (total_len, resp_len, fmt, max_seq_len): the note's vector and a padded bshd case
CASES = [(11, 7, "thd", None), (11, 7, "bshd", 16), (40, 29, "thd", None), (40, 29, "bshd", 48)]


def _rank(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    ok = []
    for total, resp, fmt, pad in CASES:
        g = torch.Generator().manual_seed(total * 100 + resp)
        rkl = torch.randn(resp, generator=g, dtype=torch.float32)  # same on every rank
        adv = torch.randn(resp, generator=g, dtype=torch.float32)
        local = slice_response_for_cp(rkl, total, resp, rank, world, fmt, pad)
        local_adv = slice_response_for_cp(adv, total, resp, rank, world, fmt, pad)
        # OPD applied to the CP-local pieces must equal the full computation, sliced
        new_local, _ = apply_opd([local_adv], coef=0.5, reverse_kl=[local])
        idx = cp_response_index(total, resp, rank, world, fmt, pad)
        sizes: list[int] = [0] * world
        dist.all_gather_object(sizes, int(idx.numel()))
        width = max(sizes)
        pieces = [torch.zeros(width) for _ in range(world)]
        indices = [torch.zeros(width, dtype=torch.int64) for _ in range(world)]
        pad_to = width - idx.numel()
        dist.all_gather(pieces, torch.cat([new_local[0], torch.zeros(pad_to)]))
        dist.all_gather(indices, torch.cat([idx, torch.zeros(pad_to, dtype=torch.int64)]))
        full = torch.full((resp,), float("nan"))
        for r in range(world):
            full[indices[r][: sizes[r]]] = pieces[r][: sizes[r]]
        expected = adv - 0.5 * rkl
        ok.append(bool(local.dtype == torch.float32 and torch.equal(full, expected)))
    return ok


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_cp_sliced_signals_reassemble_on_two_gloo_ranks() -> None:
    results = run_workers(_rank, 2, timeout_s=90)
    assert results == [[True] * len(CASES)] * 2
