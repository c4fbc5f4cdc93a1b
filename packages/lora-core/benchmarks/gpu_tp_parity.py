"""TP=2 parity of the rank-r LoRA design over NCCL (2 GPUs), with and without sequence parallelism.

Run on a 2-GPU host: ``PYTHONPATH=packages/interface/src:packages/formats/src:packages/lora-core/src \\
python packages/lora-core/benchmarks/gpu_tp_parity.py`` (``--device cpu`` runs the same over gloo).

Each rank builds the single-process reference (full ``nn.Linear``s, fp32, TF32 off) and the TP=2
model (fused interleaved q/k/v and gate/up columns, row outs, a vocab-padded head), runs one
forward+backward, ``reduce_lora_grads``, and reports: relative L2 of output, input grad and every
LoRA grad vs the reference, grad norm vs the reference norm, whether the exported adapter equals
the reference adapter bitwise (init invariance + export), and median fwd+bwd+reduce time.
Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from posttrain.interface.processes import run_workers
from posttrain.lora import (
    ColumnShardedLinear,
    LoraConfig,
    LoraGroups,
    RowShardedLinear,
    Target,
    attach_lora,
    export_adapter,
    lora_grad_norm,
    reduce_lora_grads,
)
from posttrain.lora.attach import fused_local_parts, fused_local_rows

H, FF, V_PAD, V, R = 256, 512, 1024, 1000, 16


class Block(nn.Module):
    def __init__(self, qkv: nn.Module, o: nn.Module, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(torch.tanh(self.qkv(x)))
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Net(nn.Module):
    def __init__(self, blocks: list[Block], head: nn.Module) -> None:
        super().__init__()
        self.blocks, self.head = nn.ModuleList(blocks), head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def full(device: str) -> dict[str, nn.Linear]:
    torch.manual_seed(0)
    m: dict[str, nn.Linear] = {}
    for i in range(2):
        m[f"{i}.qkv"], m[f"{i}.o"] = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        m[f"{i}.gate_up"], m[f"{i}.down"] = nn.Linear(H, 2 * FF), nn.Linear(FF, H)
    m["head"] = nn.Linear(H, V_PAD, bias=False)
    return {k: v.to(device) for k, v in m.items()}


def targets() -> dict[str, Target]:
    t: dict[str, Target] = {}
    for i in range(2):
        t[f"blocks.{i}.qkv"] = Target(
            parts=((f"l.{i}.q_proj", H), (f"l.{i}.k_proj", H // 2), (f"l.{i}.v_proj", H // 2)),
            groups=4,
        )
        t[f"blocks.{i}.o"] = Target(hf_name=f"l.{i}.o_proj")
        t[f"blocks.{i}.gate_up"] = Target(parts=((f"l.{i}.gate_proj", FF), (f"l.{i}.up_proj", FF)))
        t[f"blocks.{i}.down"] = Target(hf_name=f"l.{i}.down_proj")
    t["head"] = Target(hf_name="lm_head", unpadded_out=V)
    return t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run(rank: int, world: int, device_kind: str, tokens: int, iters: int) -> dict[str, Any] | None:
    """One rank (its group comes from ``run_workers``: NCCL on cuda:rank, else gloo)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if device_kind == "cuda" else "gloo"
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    tp = dist.group.WORLD
    cfg = LoraConfig(r=R, alpha=32.0, b_init="normal", seed=1, export_dtype=torch.float32)
    m = full(device)
    ref = Net(
        [Block(m[f"{i}.qkv"], m[f"{i}.o"], m[f"{i}.gate_up"], m[f"{i}.down"]) for i in range(2)],
        m["head"],
    )
    ref_handle = attach_lora(ref, cfg, targets())
    x_full = torch.randn(tokens, H, generator=torch.Generator().manual_seed(3)).to(device)
    w = torch.randn(tokens, V_PAD, generator=torch.Generator().manual_seed(4)).to(device)
    w[:, V:] = 0
    xr = x_full.clone().requires_grad_(True)
    ref_out = ref(xr)
    (ref_out * w).sum().backward()
    ref_norm = sum(float(p.grad.double().pow(2).sum()) for p in ref_handle.parameters()) ** 0.5
    ref_adapter = export_adapter(ref_handle)
    out: dict[str, Any] = {}
    for sp in (False, True):
        m = full(device)

        def col(
            mod: nn.Linear, split: list[int] | None = None, sp: bool = sp
        ) -> ColumnShardedLinear:
            return ColumnShardedLinear.from_full(
                mod, tp_group=tp, sequence_parallel=sp, split_sizes=split
            )

        def row(mod: nn.Linear, sp: bool = sp) -> RowShardedLinear:
            return RowShardedLinear.from_full(mod, tp_group=tp, sequence_parallel=sp)

        net = Net(
            [
                Block(
                    col(m[f"{i}.qkv"]),
                    row(m[f"{i}.o"]),
                    col(m[f"{i}.gate_up"], [FF, FF]),
                    row(m[f"{i}.down"]),
                )
                for i in range(2)
            ],
            col(m["head"]),
        )
        handle = attach_lora(net, cfg, targets(), LoraGroups(tp=tp))
        exported = export_adapter(handle)
        bitwise = all(torch.equal(exported[k], ref_adapter[k]) for k in ref_adapter)
        times = []
        for it in range(iters):
            for p in handle.parameters():
                p.grad = None
            x = (x_full.chunk(world)[rank] if sp else x_full).clone().requires_grad_(True)
            if device_kind == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = net(x)
            (y * w.chunk(world, dim=1)[rank]).sum().backward()
            reduce_lora_grads(handle)
            if device_kind == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if it == 0:
                ref_dx = xr.grad.chunk(world)[rank] if sp else xr.grad
                errs = {}
                for path, site in handle.sites.items():
                    rs = ref_handle.sites[path]
                    for f in ("A", "B"):
                        g = getattr(rs, f"lora_{f}").grad
                        info = site.site
                        if f == "A" and info.layout == "row":
                            g = g.chunk(world, dim=1)[rank]
                        elif f == "B" and info.layout == "column":
                            sizes = [s for _, s in info.parts]
                            g = fused_local_rows(
                                fused_local_parts(g, sizes, info.groups, 1),
                                info.groups,
                                rank,
                                world,
                            )
                        errs[f"{path}.{f}"] = rel(getattr(site, f"lora_{f}").grad, g)
                res = {
                    "fwd_rel": rel(y.detach(), ref_out.detach().chunk(world, dim=1)[rank]),
                    "dx_rel": rel(x.grad, ref_dx),
                    "max_grad_rel": max(errs.values()),
                    "grad_norm": lora_grad_norm(handle),
                    "ref_grad_norm": ref_norm,
                    "export_bitwise": bitwise,
                }
        res["median_step_ms"] = 1e3 * statistics.median(times[1:])
        out["sp" if sp else "nosp"] = res
    if rank == 0:
        out["config"] = {
            "backend": backend,
            "tokens": tokens,
            "hidden": H,
            "r": R,
            "world": world,
            "device": torch.cuda.get_device_name(0) if device_kind == "cuda" else "cpu",
        }
        out["pass"] = all(
            out[k]["fwd_rel"] <= 1e-5
            and out[k]["dx_rel"] <= 1e-5
            and out[k]["max_grad_rel"] <= 1e-5
            and out[k]["export_bitwise"]
            for k in ("nosp", "sp")
        )
    dist.barrier()
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=11)
    args = ap.parse_args()
    res = run_workers(
        run,
        2,
        args=(args.device, args.tokens, args.iters),
        timeout_s=300,
        backend="nccl" if args.device == "cuda" else "gloo",
        start_method="spawn",
    )[0]
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
