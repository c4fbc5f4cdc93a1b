"""Live NVFP4 quantization during weight sync vs a device-to-device copy of the same weights.

Three timings of the same BF16 expert weights, side by side in one run (median of
``--repeats``, each after a warm-up):

* ``live``: ``quantize_named_params`` through the public API, as grpo's sync calls it (the
  grouped path: one NaN check and one host sync per call; same-shape small weights stacked);
* ``per_tensor``: one ``quantize_nvfp4_pair`` per gate/up pair (the pre-grouping way);
* ``copy``: ``dst.copy_(src)`` of every weight on the same device.

Bandwidths count bytes read and written: BF16 in plus packed codes, E4M3 block scales and
``weight_scale_2`` out for quantization, twice the BF16 bytes for the copy.
``live_over_copy`` and ``per_tensor_over_copy`` are the quantizers' bandwidths over the
copy's; ``bytes_identical`` says whether both quantizers produced the same bytes.

    uv run python packages/quant-convert/benchmarks/bench_live_quantize.py --out live.json
    # the issue's shape, on a GPU:
    uv run python packages/quant-convert/benchmarks/bench_live_quantize.py \\
        --device cuda --rows 8192 --cols 7168 --tensors 8 --out live.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.quant_convert import QuantPolicy, quantize_named_params
from posttrain.quant_convert.nvfp4 import quantize_nvfp4_pair


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up (kernel compilation, allocator)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=8, help="an even count: gate/up pairs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.tensors < 2 or args.tensors % 2:
        ap.error("--tensors must be an even count >= 2 (gate/up pairs)")
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    named: list[tuple[str, torch.Tensor]] = []
    for e in range(args.tensors // 2):
        for proj in ("gate_proj", "up_proj"):
            w = (torch.randn(args.rows, args.cols, generator=g) * 0.02).to(torch.bfloat16)
            named.append((f"model.layers.0.mlp.experts.{e}.{proj}.weight", w.to(device)))
    policy = QuantPolicy(num_layers_at_end_in_bf16=0)

    def live() -> list[tuple[str, torch.Tensor]]:
        return quantize_named_params(named, num_layers=1, policy=policy)

    def per_tensor() -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for (gn, gw), (un, uw) in zip(named[::2], named[1::2], strict=True):
            gq, uq = quantize_nvfp4_pair(gw, uw, names=(gn, un))
            out += gq.named(gn) + uq.named(un)
        return out

    dst = [torch.empty_like(w) for _, w in named]

    def copy() -> None:
        for d, (_, w) in zip(dst, named, strict=True):
            d.copy_(w)

    live_out, tensor_out = dict(live()), dict(per_tensor())
    identical = live_out.keys() == tensor_out.keys() and all(
        torch.equal(
            live_out[k].reshape(-1).view(torch.uint8), tensor_out[k].reshape(-1).view(torch.uint8)
        )
        for k in live_out
    )
    bytes_in = sum(w.numel() * w.element_size() for _, w in named)
    bytes_out = sum(t.numel() * t.element_size() for t in live_out.values())
    t_live = _timed(live, device, args.repeats)
    t_tensor = _timed(per_tensor, device, args.repeats)
    t_copy = _timed(copy, device, args.repeats)
    copy_bw = 2 * bytes_in / t_copy
    quant_bytes = bytes_in + bytes_out
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": [args.rows, args.cols],
        "tensors": args.tensors,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "live_s": t_live,
        "per_tensor_s": t_tensor,
        "copy_s": t_copy,
        "live_gbps": quant_bytes / t_live / 1e9,
        "per_tensor_gbps": quant_bytes / t_tensor / 1e9,
        "copy_gbps": copy_bw / 1e9,
        "live_over_copy": quant_bytes / t_live / copy_bw,
        "per_tensor_over_copy": quant_bytes / t_tensor / copy_bw,
        "bytes_identical": identical,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
