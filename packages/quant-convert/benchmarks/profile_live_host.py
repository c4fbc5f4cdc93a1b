"""Where the host time of a kept live call goes: cProfile over repeated ``quantize_named_params``.

The live NVFP4 path's GPU work for a kept bucket is one read (``bench_live_quantize.py``); what
is left between that and the wall time is Python and launch overhead in front of the first
kernel and after the one sync. This runs the same bucket as the benchmark (after a warm-up
that keeps the call), profiles ``--calls`` synchronised calls, and prints the functions with
the most own time and the wall time per call, so the next cut targets what is measured.

    python packages/quant-convert/benchmarks/profile_live_host.py --device cuda \\
        --rows 8192 --cols 7168 --tensors 8 --calls 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from posttrain.quant_convert import QuantPolicy, quantize_named_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=8, help="an even count: gate/up pairs")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.tensors < 2 or args.tensors % 2:
        ap.error("--tensors must be an even count >= 2 (gate/up pairs)")
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    named = [
        (
            f"model.layers.0.mlp.experts.{e}.{proj}.weight",
            (torch.randn(args.rows, args.cols, generator=g) * 0.02).to(torch.bfloat16).to(device),
        )
        for e in range(args.tensors // 2)
        for proj in ("gate_proj", "up_proj")
    ]
    policy = QuantPolicy(num_layers_at_end_in_bf16=0)

    def call() -> None:
        quantize_named_params(named, num_layers=1, policy=policy)
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):  # compile, keep the call, place the first bet
        call()
    t0 = time.perf_counter()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        call()
    profile.disable()
    wall = (time.perf_counter() - t0) / args.calls
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    print(f"wall per call under the profiler: {wall * 1e3:.3f} ms ({args.calls} calls)")


if __name__ == "__main__":
    main()
