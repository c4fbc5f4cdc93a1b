"""Quantizer throughput on CPU: this package's TE-bitwise quantizer vs torchao's, same tensors.

Both get the same bf16 weights and the same global scale; reported as GB/s of BF16 input
(median of ``--repeats``), side by side, plus their ratio.

    uv run python packages/quant-convert/benchmarks/bench_quantizer.py --rows 2048 --cols 2048 --tensors 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from posttrain.quant_convert.nvfp4 import NVFP4Config, quantize_nvfp4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    g = torch.Generator().manual_seed(0)
    ws = [
        (torch.randn(args.rows, args.cols, generator=g) * 0.02).to(torch.bfloat16)
        for _ in range(args.tensors)
    ]
    scales = [quantize_nvfp4(w[:16]).scale_2 for w in ws]  # any valid global scale
    gb = sum(w.numel() * 2 for w in ws) / 1e9

    def ours(cfg: NVFP4Config) -> None:
        for w in ws:
            quantize_nvfp4(w, cfg=cfg)

    def theirs() -> None:
        for w, s in zip(ws, scales, strict=True):
            nvfp4_quantize(w, block_size=16, per_tensor_scale=s)

    runs: dict[str, list[float]] = {"ours": [], "ours_4over6_mse": [], "torchao": []}
    for _ in range(args.repeats):
        for name, fn in (
            ("ours", lambda: ours(NVFP4Config())),
            ("ours_4over6_mse", lambda: ours(NVFP4Config(four_over_six="mse"))),
            ("torchao", theirs),
        ):
            t0 = time.perf_counter()
            fn()
            runs[name].append(gb / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(
        json.dumps(
            {
                "machine": "2-core CPU sandbox",
                "date": time.strftime("%Y-%m-%d"),
                "torch_threads": torch.get_num_threads(),
                "input_gb": gb,
                "median_gb_per_s": med,
                "ratio_ours_over_torchao": med["ours"] / med["torchao"],
                "ratio_4over6_over_torchao": med["ours_4over6_mse"] / med["torchao"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
