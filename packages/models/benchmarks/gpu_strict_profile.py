"""Where the strict training forward spends its GPU time at the ~1B config (torch.profiler).

Builds the ``gpu_strict_kernels.py`` ~1B dense config on the GPU, warms both numerics up, then
profiles one no-grad training forward in each and prints one JSON object: wall time, the sum
of GPU kernel time, and the top kernels by GPU time for strict and fast. Run from the repo
root on a CUDA machine::

    PYTHONPATH=<every packages/*/src> python3 packages/models/benchmarks/gpu_strict_profile.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_strict_kernels import BIG, init_on_device

from posttrain.models import ModelConfig, Numerics


def kernel_table(prof: Any, top: int) -> tuple[float, list[dict[str, Any]]]:
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0:
            rows.append({"name": ev.key[:90], "gpu_ms": round(t / 1e3, 3), "calls": ev.count})
    rows.sort(key=lambda r: -r["gpu_ms"])
    return round(sum(r["gpu_ms"] for r in rows), 3), rows[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    cfg = ModelConfig.tiny(**BIG, torch_dtype="bfloat16")
    model = init_on_device(cfg, 0)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,))
    lens = [1024] * (args.tokens // 1024)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "tokens": args.tokens}
    for numerics in (Numerics.STRICT, Numerics.FAST):
        model.numerics = numerics
        with torch.no_grad():
            model.forward_logprobs(ids, lens)  # warm-up (compiles)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.forward_logprobs(ids, lens)
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
        total, top = kernel_table(prof, args.top)
        report[numerics.value] = {"wall_s": round(wall, 4), "gpu_kernel_ms": total, "top": top}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
