"""What refusing NaN/Inf costs a weight update: the engine's check against a copy of the same bytes.

    uv run python packages/local-engine/benchmarks/bench_finite_check.py [--mib 64] [--reps 7]

Every bucket the engine stages is copied once; ``check_finite`` (``posttrain.formats``) reads it
once more. This times, interleaved on one torch thread, a copy of a bf16 tensor, the engine's
check (one ``aminmax`` pass) and the obvious ``torch.isfinite(t).all()``, and prints the medians
and their ratios to the copy (results: docs/benchmarks/local-engine.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from posttrain.formats import check_finite


def _time_into(fn: Callable[[], object], samples: list[float]) -> None:
    start = time.perf_counter()
    fn()
    samples.append((time.perf_counter() - start) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="tensor size in MiB (bf16)")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions (median)")
    a = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(a.mib * 1024 * 1024 // 2, dtype=torch.float32).to(torch.bfloat16)
    buf = torch.empty_like(x)
    modes: dict[str, Callable[[], object]] = {
        "copy": lambda: buf.copy_(x),
        "check_finite (aminmax)": lambda: check_finite([("x", x)], what="bench", error=ValueError),
        "isfinite(t).all()": lambda: bool(torch.isfinite(x).all()),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(a.reps):
        for name, fn in modes.items():
            _time_into(fn, times[name])
    copy = statistics.median(times["copy"])
    print(f"{a.mib} MiB bf16, 1 torch thread, median of {a.reps}")
    for name, samples in times.items():
        ms = statistics.median(samples)
        print(f"{name:24s} {ms:8.1f} ms  {ms / copy:6.2f}x copy")


if __name__ == "__main__":
    main()
