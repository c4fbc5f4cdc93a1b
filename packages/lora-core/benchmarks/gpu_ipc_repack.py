"""CUDA IPC of a repacked adapter: a second process opens the handles and reads identical bytes.

Run: ``PYTHONPATH=packages/interface/src:packages/lora-core/src \\
python packages/lora-core/benchmarks/gpu_ipc_repack.py`` (``--device cpu`` for a dry run, where
torch shares CPU storages through shared memory instead).

What it shows, side by side, for a synthetic 28-layer adapter (q/k/v/o/gate/up/down, r=16,
bf16) plus one non-contiguous view and one tensor from a non-default allocator pool:

* handles: distinct storages shipped without / with ``repack_for_ipc`` (one per tensor vs one
  per (dtype, device));
* bytes exposed: a view shares its whole base storage (here a 4x larger one); after repack the
  shared bytes equal the payload;
* a tensor from a ``torch.cuda.MemPool`` (or an expandable-segments/cuMem allocation): whether
  legacy IPC can export it directly, and that the repacked copy can;
* the child process recomputes sha256 of every tensor it received; all must match the parent's.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.lora import repack_for_ipc


def sha(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def child(q_in: Any, q_out: Any) -> None:
    tensors = q_in.get()
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    q_out.put({"sha": {k: sha(v) for k, v in tensors.items()}, "storages_opened": len(storages)})
    q_in.get()  # hold the handles until the parent is done


def adapter(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    h, kv, ff, r = 2048, 512, 5632, 16
    for i in range(28):
        for name, (o, n) in {
            "q_proj": (h, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, h),
            "gate_proj": (ff, h),
            "up_proj": (ff, h),
            "down_proj": (h, ff),
        }.items():
            base = f"base_model.model.model.layers.{i}.{name}"
            out[f"{base}.lora_A.weight"] = torch.randn(r, n, generator=gen).to(
                device, torch.bfloat16
            )
            out[f"{base}.lora_B.weight"] = torch.randn(o, r, generator=gen).to(
                device, torch.bfloat16
            )
    return out


def pool_tensor(device: str) -> tuple[torch.Tensor | None, str]:
    if device == "cpu":
        return None, "cpu dry run: no CUDA allocator pools"
    try:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            t = torch.randn(16, 2048, device=device).to(torch.bfloat16)
        return t, "torch.cuda.MemPool"
    except Exception as exc:  # older torch: no MemPool
        return None, f"MemPool unavailable: {exc!r}"


def can_export(t: torch.Tensor) -> str:
    try:
        t.untyped_storage()._share_cuda_()
        return "ok"
    except Exception as exc:
        return f"error: {type(exc).__name__}: {str(exc)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = args.device
    tensors = adapter(device)
    big = torch.randn(4096, 64, device=device).to(torch.bfloat16)
    tensors["view.noncontiguous"] = big[:, :16].T  # [16, 4096] view of a 4x larger storage
    pooled, pool_kind = pool_tensor(device)
    if pooled is not None:
        tensors["pool.tensor"] = pooled
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device != "cpu" else "cpu",
        "torch": torch.__version__,
        "tensors": len(tensors),
        "pool_kind": pool_kind,
    }
    payload = sum(t.numel() * t.element_size() for t in tensors.values())
    before = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()
    }
    res["before"] = {
        "storages": len(before),
        "bytes_exposed": sum(before.values()),
        "payload_bytes": payload,
    }
    if pooled is not None:
        res["before"]["pool_tensor_export"] = can_export(pooled)
    t0 = time.perf_counter()
    packed = repack_for_ipc(tensors)
    if device != "cpu":
        torch.cuda.synchronize()
    res["repack_seconds"] = time.perf_counter() - t0
    after = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed.values()}
    res["after"] = {
        "storages": len(after),
        "bytes_exposed": sum(after.values()),
        "payload_bytes": payload,
    }
    if pooled is not None:
        res["after"]["pool_tensor_export"] = can_export(packed["pool.tensor"])
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(q_in, q_out))
    proc.start()
    t0 = time.perf_counter()
    q_in.put(packed)
    got = q_out.get(timeout=120)
    res["ipc_roundtrip_seconds"] = time.perf_counter() - t0
    q_in.put("done")
    proc.join(timeout=60)
    mine = {k: sha(v) for k, v in packed.items()}
    res["child_storages_opened"] = got["storages_opened"]
    res["bytes_identical"] = got["sha"] == mine
    res["source_equals_packed"] = all(torch.equal(tensors[k], packed[k]) for k in tensors)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
