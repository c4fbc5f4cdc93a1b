"""Bytes communicated per LoRA forward+backward with sequence parallelism (gloo, TP=2).

Side by side in one run, on the same column-parallel site (x seq-sharded ``[T/tp, H]``):

* ``rank_r``: this package's design: all-gather ``x_loc @ A.T`` (``[T/tp, r]``), reduce-scatter
  its grad; A's grad SUMmed over TP by ``reduce_lora_grads``.
* ``regather``: the hidden-width design: all-gather ``x`` itself (``[T/tp, H]``) for the LoRA
  branch, reduce-scatter its grad, then all-reduce A's grad (partial over TP).

Bytes are counted by wrapping the torch.distributed collectives (bytes of the full output of
all-gathers / input of reduce-scatters and all-reduces, per rank). Also: the export of a 64-layer
synthetic adapter, coalesced (one all-gather per group) versus one all-gather per tensor.
Prints one JSON object. Run: ``python packages/lora-core/benchmarks/bench_comm_bytes.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.interface.processes import run_workers
from posttrain.lora import (
    ColumnShardedLinear,
    LoraConfig,
    LoraGroups,
    RowShardedLinear,
    attach_lora,
    export_adapter,
    reduce_lora_grads,
)
from posttrain.lora.comm import all_gather_flat, gather_from_seq

COUNTER: dict[str, int] = {"bytes": 0, "calls": 0}


def _wrap(name: str, pick: int) -> None:
    fn = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        t = args[pick]
        COUNTER["bytes"] += t.numel() * t.element_size()
        COUNTER["calls"] += 1
        return fn(*args, **kwargs)

    setattr(dist, name, counted)


class RegatherColumnLora(nn.Module):
    """Hidden-width design: the LoRA branch re-gathers the full input."""

    def __init__(self, base: ColumnShardedLinear, r: int, scaling: float) -> None:
        super().__init__()
        self.base, self.scaling = base, scaling
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.02)
        self.lora_B = nn.Parameter(torch.randn(base.weight.shape[0], r) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_full = gather_from_seq(x, self.base.tp_group)
        return self.base(x) + ((x_full @ self.lora_A.T) @ self.lora_B.T) * self.scaling


def _run(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """One gloo rank (the group comes from ``run_workers``); rank 0 returns the measurements."""
    for name, pick in (
        ("all_gather_into_tensor", 0),
        ("all_gather_single", 0),
        ("reduce_scatter_tensor", 1),
        ("reduce_scatter_single", 1),
        ("all_reduce", 0),
    ):
        if hasattr(dist, name):
            _wrap(name, pick)
    tp = dist.group.WORLD
    tokens, hidden, r = args.tokens, args.hidden, args.rank
    cfg = LoraConfig(r=r, alpha=2.0 * r, b_init="normal")
    out: dict[str, Any] = {}
    for variant in ("rank_r", "regather"):
        full = nn.Linear(hidden, hidden, bias=False)
        base = ColumnShardedLinear.from_full(full, tp_group=tp, sequence_parallel=True)
        if variant == "rank_r":
            model: nn.Module = nn.Sequential(base)
            handle = attach_lora(model, cfg, ["0"], LoraGroups(tp=tp))
        else:
            model = RegatherColumnLora(base, r, cfg.scaling)
            for p in model.base.parameters():
                p.requires_grad_(False)
        x = torch.randn(tokens // world, hidden, requires_grad=True)
        times, per_step = [], []
        for _ in range(args.iters):
            COUNTER.update(bytes=0, calls=0)
            for p in model.parameters():
                p.grad = None
            t0 = time.perf_counter()
            # Only the LoRA branch's traffic is counted: the base layer's own all-gather is
            # the same in both designs, so subtract it below.
            y = model(x)
            y.sum().backward()
            if variant == "rank_r":
                reduce_lora_grads(handle)
            else:
                dist.all_reduce(model.lora_A.grad, group=tp)
            times.append(time.perf_counter() - t0)
            per_step.append(COUNTER["bytes"])
        # the base layer's all-gather fwd + reduce-scatter bwd of [T, H] fp32
        base_bytes = 2 * tokens * hidden * 4
        out[variant] = {
            "lora_bytes_per_rank": per_step[-1] - base_bytes,
            "median_s": statistics.median(times[1:]),
        }
    # export: coalesced vs one all-gather per sharded tensor, 64 layers x 2 sites
    layers = nn.ModuleList()
    for _ in range(args.layers):
        layers.append(
            nn.ModuleDict(
                {
                    "up": ColumnShardedLinear(64, 128, tp_group=tp, bias=False),
                    "down": RowShardedLinear(128, 64, tp_group=tp, bias=False),
                }
            )
        )
    handle = attach_lora(layers, LoraConfig(r=8, alpha=16.0), ["up", "down"], LoraGroups(tp=tp))
    COUNTER.update(bytes=0, calls=0)
    t0 = time.perf_counter()
    export_adapter(handle)
    coalesced = {"collectives": COUNTER["calls"], "seconds": time.perf_counter() - t0}
    COUNTER.update(bytes=0, calls=0)
    t0 = time.perf_counter()
    for site in handle.sites.values():  # the per-tensor way: one all-gather per sharded factor
        t = site.lora_B if site.site.layout == "column" else site.lora_A
        buf = torch.empty(world * t.numel())
        all_gather_flat(buf, t.detach().reshape(-1).contiguous(), tp)
    per_tensor = {"collectives": COUNTER["calls"], "seconds": time.perf_counter() - t0}
    out["export"] = {"layers": args.layers, "coalesced": coalesced, "per_tensor": per_tensor}
    dist.barrier()
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--layers", type=int, default=64)
    args = ap.parse_args()
    res = run_workers(_run, 2, args=(args,), timeout_s=600, start_method="spawn")[0]
    rr, rg = res["rank_r"], res["regather"]
    res["config"] = vars(args) | {"tp": 2, "sequence_parallel": True, "dtype": "float32"}
    res["bytes_ratio_regather_over_rank_r"] = rg["lora_bytes_per_rank"] / rr["lora_bytes_per_rank"]
    res["time_ratio_regather_over_rank_r"] = rg["median_s"] / rr["median_s"]
    res["expected_ratio_about_H_over_r"] = args.hidden / args.rank
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
