"""B1: collective calls and bytes per optimizer step, deferred vs per-micro-batch replicate all-reduce.

Runs W gloo ranks on this machine (HSDP r x s), trains the same model on the same data with
M micro-batches per optimizer step in both modes, alternating modes step by step, and records per
step and per rank: calls and bytes of every collective, split into the replicate all-reduce
(``dp_replicate`` group) and the shard traffic (``dp_shard`` all-gather / reduce-scatter), plus
the step time. Gradients of the two modes are asserted equal (fp32, max |Δ| printed).

    uv run python packages/fsdp-mesh/benchmarks/bench_fsdp_mesh_accumulation.py \
        --world 4 --replicate 2 --micro-batches 4

Prints one JSON object (medians over steps; counts/bytes are per rank per optimizer step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from posttrain.fsdp_mesh import (
    HsdpConfig,
    ParityModel,
    accumulate_gradients,
    apply_hsdp,
    build_fsdp_mesh,
    count_collectives,
    gather_full_param,
)
from posttrain.interface import MeshSpec
from posttrain.interface.processes import run_workers


def _worker(
    rank: int, world: int, replicate: int, micro: int, steps: int, dim: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = build_fsdp_mesh(
        MeshSpec(world_size=world, replicate=replicate, shard=world // replicate)
    )
    rep = tuple(dist.get_process_group_ranks(mesh.replicate_group))
    shard = tuple(dist.get_process_group_ranks(mesh.shard_group))
    models = {}
    for defer in (False, True):
        torch.manual_seed(0)
        model = ParityModel(dim, 4, dim)
        apply_hsdp(model, mesh, HsdpConfig(param_dtype=None, reduce_dtype=None))
        models[defer] = model
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    max_diff = 0.0
    for step in range(steps + 1):
        grads = {}
        for defer in (False, True) if step % 2 else (True, False):
            model = models[defer]
            model.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            with count_collectives() as log, accumulate_gradients(model, micro, defer=defer) as acc:
                for m in range(micro):
                    with acc.micro_batch():
                        gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + m)
                        x = torch.randn(8, dim, generator=gen)
                        (model(x).square().mean() / micro).backward()
            elapsed = time.perf_counter() - t0
            grads[defer] = [gather_full_param(p.grad) for p in model.parameters()]
            if step == 0:
                continue  # warm-up
            rows[defer].append(
                {
                    "step_s": elapsed,
                    "calls_total": log.count(),
                    "bytes_total": log.nbytes(),
                    "replicate_all_reduce_calls": log.count("allreduce_", group_ranks=rep),
                    "replicate_all_reduce_bytes": log.nbytes("allreduce_", group_ranks=rep),
                    "shard_reduce_scatter_calls": log.count(
                        "_reduce_scatter_base_", group_ranks=shard
                    ),
                    "shard_all_gather_calls": log.count("_allgather_base_", group_ranks=shard),
                    "shard_bytes": log.nbytes(group_ranks=shard),
                }
            )
        for a, b in zip(grads[False], grads[True], strict=True):
            max_diff = max(max_diff, float((a - b).abs().max()))
    return {
        mode: {k: statistics.median(r[k] for r in rows[defer]) for k in rows[defer][0]}
        for mode, defer in (("per_micro_batch", False), ("deferred", True))
    } | {"max_grad_diff": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--replicate", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    out = run_workers(
        _worker,
        args.world,
        timeout_s=600,
        args=(args.replicate, args.micro_batches, args.steps, args.dim),
        start_method="forkserver",
        threads_per_rank=None,
        preload=("torch", "torch.distributed.fsdp"),
    )
    r0 = out[0]
    eager, deferred = r0["per_micro_batch"], r0["deferred"]
    result = {
        "world": args.world,
        "replicate": args.replicate,
        "shard": args.world // args.replicate,
        "micro_batches": args.micro_batches,
        "steps": args.steps,
        "dim": args.dim,
        "torch": torch.__version__,
        "rank0": r0,
        "max_grad_diff_all_ranks": max(o["max_grad_diff"] for o in out),
        "ratio_replicate_all_reduce_calls": eager["replicate_all_reduce_calls"]
        / deferred["replicate_all_reduce_calls"],
        "ratio_replicate_all_reduce_bytes": eager["replicate_all_reduce_bytes"]
        / deferred["replicate_all_reduce_bytes"],
        "ratio_total_calls": eager["calls_total"] / deferred["calls_total"],
        "ratio_total_bytes": eager["bytes_total"] / deferred["bytes_total"],
        "ratio_step_time_median_all_ranks": statistics.median(
            o["per_micro_batch"]["step_s"] / o["deferred"]["step_s"] for o in out
        ),
    }
    assert result["max_grad_diff_all_ranks"] <= 1e-5, result["max_grad_diff_all_ranks"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
