"""Where strict and fast spend their GPU time at the ~1B config (torch.profiler).

Builds the ``gpu_strict_kernels.py`` ~1B dense config on the GPU, warms both numerics up, then
profiles, in each, one no-grad training forward (``--tokens`` in 1024-token segments) and one
decode step of ``--decode-rows`` rows after a 128-token prompt each. Prints one JSON object:
per phase and numerics, the wall time, the sum of GPU kernel time (each kernel counted once)
and the top kernels by GPU time. Run from the repo root on a CUDA machine::

    PYTHONPATH=<every packages/*/src> python3 packages/models/benchmarks/gpu_strict_profile.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_strict_kernels import BIG, init_on_device

from posttrain.models import ModelConfig, Numerics


def kernel_table(prof: Any, top: int) -> tuple[float, list[dict[str, Any]]]:
    rows = []
    for ev in prof.key_averages():
        if ev.device_type != DeviceType.CUDA:
            continue  # a CPU op's device time is its kernels' again: count each kernel once
        t = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0:
            rows.append({"name": ev.key[:90], "gpu_ms": round(t / 1e3, 3), "calls": ev.count})
    rows.sort(key=lambda r: -r["gpu_ms"])
    return round(sum(r["gpu_ms"] for r in rows), 3), rows[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--decode-rows", type=int, default=32)
    args = parser.parse_args()
    cfg = ModelConfig.tiny(**BIG, torch_dtype="bfloat16")
    model = init_on_device(cfg, 0)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,))
    lens = [1024] * (args.tokens // 1024)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "tokens": args.tokens,
                              "decode_rows": args.decode_rows}  # fmt: skip
    for numerics in (Numerics.STRICT, Numerics.FAST):
        model.numerics = numerics
        with torch.no_grad():
            cache = model.new_kv_cache(args.decode_rows)
            for r in range(args.decode_rows):
                model.prefill(cache, r, [1 + r % 7] * 128)
            rows = list(range(args.decode_rows))
            phases = {
                "forward": partial(model.forward_logprobs, ids, lens),
                "decode_step": partial(model.decode_step, cache, rows, [2] * len(rows)),
            }
            for phase, run in phases.items():
                run()  # warm-up (compiles)
                torch.cuda.synchronize()
                t = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    run()
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t
                total, top = kernel_table(prof, args.top)
                report.setdefault(phase, {})[numerics.value] = {
                    "wall_s": round(wall, 4), "gpu_kernel_ms": total, "top": top}  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
