"""SGLang's weight-update group between a trainer process and a receiving process.

Rank 0 (the trainer) joins with ``join_update_group`` and broadcasts ``--tensors`` BF16 tensors
of ``[--rows, --cols]`` in buckets; rank 1 receives them the way SGLang's engine does (its own
``init_custom_process_group``: c10d's helper, ``torch.distributed.broadcast`` on the group),
into tensors it allocates from the names/dtypes/shapes. Reports GB/s of the broadcast (median
of ``--repeats``) and whether every byte arrived. nccl on two GPUs (``--backend nccl``: rank r
on ``cuda:r``), gloo on CPU.

    uv run python packages/formats/benchmarks/bench_update_group.py --out group.json
    uv run python packages/formats/benchmarks/bench_update_group.py --backend nccl \\
        --rows 8192 --cols 7168 --tensors 8 --out group.json   # a 2-GPU machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.formats import free_port, join_update_group


def _tensors(args: argparse.Namespace, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(args.rows, args.cols, generator=g).to(torch.bfloat16).to(device)
        for _ in range(args.tensors)
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _receiver(port: int, args: argparse.Namespace, out: Any) -> None:
    """What SGLang's engine does: its own named group through c10d's helper, typed receives."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    device = "cuda:1" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(1)
    timeout = timedelta(seconds=120)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    pg, _ = c10d._new_process_group_helper(
        2, 1, [], c10d.Backend(args.backend), c10d.PrefixStore("weight_update_group", store),
        group_name=c10d.GroupName("weight_update_group"), timeout=timeout,
    )  # fmt: skip
    c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    expected = _tensors(args, device)
    same = True
    for _ in range(args.repeats + 1):
        bufs = [torch.empty_like(t) for t in expected]
        for b in bufs:
            torch.distributed.broadcast(b, src=0, group=pg)
        _sync(device)
        same = same and all(torch.equal(a, b) for a, b in zip(bufs, expected, strict=True))
    out.put(same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cuda:0" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(0)
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    result_q = ctx.Queue()
    peer = ctx.Process(target=_receiver, args=(port, args, result_q))
    peer.start()
    group = join_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
        group_name="weight_update_group", backend=args.backend, timeout_s=120,
    )  # fmt: skip
    tensors = _tensors(args, device)
    times = []
    for i in range(args.repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        group.broadcast(tensors)
        _sync(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    identical = bool(result_q.get(timeout=300))
    peer.join(timeout=60)
    group.destroy()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result = {
        "backend": args.backend,
        "device": torch.cuda.get_device_name(0) if args.backend == "nccl" else "cpu",
        "bytes": nbytes,
        "seconds": statistics.median(times),
        "gbps": nbytes / statistics.median(times) / 1e9,
        "bytes_identical": identical,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
