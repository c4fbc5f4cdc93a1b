"""Bytes moved by the short-convolution halo exchange versus gathering the whole sequence.

For each (CP size, layout, packing, stream length) the script starts real gloo ranks, runs one
convolution site both ways on the same ``[T / cp, hidden]`` fp32 activations -- the halo
exchange (``exchange_halo``) and a full all-gather (``all_gather_sequence``) -- and counts the
bytes every rank actually received from other ranks (rows of the exchanged tensors that are
not its own), summed over ranks. It also checks the count against the closed form
``(k - 1) x hidden x 4 bytes`` per chunk boundary that crosses ranks, and reports the median
wall time of each exchange (interleaved, ``--reps`` each; on a shared CPU the times are noisy,
the byte counts are exact). Prints one JSON line per case. Run from the repo root:

    uv run python packages/models/benchmarks/bench_cp_halo.py [--hidden 256] [--kernel 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from posttrain.interface.testing import run_workers
from posttrain.models.context_parallel import (
    CPLayout,
    all_gather_sequence,
    bind_shard,
    exchange_halo,
    plan_halo,
    shard_for_context_parallel,
)


def crossing_boundaries(cp: int, layout: CPLayout, segments: int) -> int:
    """Chunk boundaries whose two sides sit on different ranks (per segment, times segments)."""
    chunks = cp if layout is CPLayout.CONTIGUOUS else 2 * cp
    owner = [c if c < cp else 2 * cp - 1 - c for c in range(chunks)]
    return segments * sum(owner[c] != owner[c + 1] for c in range(chunks - 1))


def _rank(
    rank: int, world: int, cases: list[dict[str, Any]], hidden: int, kernel: int, reps: int
) -> list[dict[str, Any]]:
    group = dist.new_group(list(range(world)))
    out = []
    for case in cases:
        lengths = [case["tokens"] // case["segments"]] * case["segments"]
        shard = bind_shard(shard_for_context_parallel(lengths, world, case["layout"]), group)
        plan = plan_halo(shard, kernel)
        x = torch.randn(shard.local_count, hidden)
        halo_rows = exchange_halo(x, plan).shape[0]
        gathered_rows = all_gather_sequence(x, shard).shape[0] - shard.local_count
        halo_s, gather_s = [], []
        for _ in range(reps):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            exchange_halo(x, plan)
            halo_s.append(time.perf_counter() - t0)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            all_gather_sequence(x, shard)
            gather_s.append(time.perf_counter() - t0)
        out.append(
            {
                "halo_bytes": halo_rows * hidden * 4,
                "gather_bytes": gathered_rows * hidden * 4,
                "halo_s": statistics.median(halo_s),
                "gather_s": statistics.median(gather_s),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--kernel", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    args = parser.parse_args()
    for cp in args.cp:
        cases = [
            {"tokens": tokens, "segments": segments, "layout": layout}
            for layout in CPLayout
            for segments in (1, 8)
            for tokens in args.tokens
        ]
        per_rank = run_workers(
            _rank, cp, args=(cases, args.hidden, args.kernel, args.reps), timeout_s=600
        )
        for i, case in enumerate(cases):
            halo = sum(r[i]["halo_bytes"] for r in per_rank)
            gather = sum(r[i]["gather_bytes"] for r in per_rank)
            expected = (
                crossing_boundaries(cp, case["layout"], case["segments"])
                * (args.kernel - 1)
                * args.hidden
                * 4
            )
            if halo != expected:
                raise SystemExit(f"halo moved {halo} bytes, closed form says {expected}: {case}")
            halo_s = max(r[i]["halo_s"] for r in per_rank)
            gather_s = max(r[i]["gather_s"] for r in per_rank)
            print(
                json.dumps(
                    {
                        "cp": cp,
                        "layout": str(case["layout"]),
                        "segments": case["segments"],
                        "tokens": case["tokens"],
                        "hidden": args.hidden,
                        "kernel": args.kernel,
                        "halo_bytes": halo,
                        "gather_bytes": gather,
                        "halo_over_gather_bytes": halo / gather,
                        "halo_ms": round(halo_s * 1e3, 3),
                        "gather_ms": round(gather_s * 1e3, 3),
                        "halo_over_gather_time": round(halo_s / gather_s, 4),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
