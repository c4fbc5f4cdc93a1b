"""NVFP4 quantizer on a GPU: GB/s of BF16 input against the copy bandwidth of the same run.

Also checks that the CUDA result is bit-identical to the CPU result (the quantizer is pure
torch; both must follow IEEE fp32 with round-to-nearest-even) for the default and 4-over-6
configs, and times a gate/up pair. Needs the interface, formats and quant-convert sources and
their light dependencies (pydantic, numpy, safetensors, httpx; ``tools/gpu/prepare.sh``
installs those a GPU image lacks). There is no stand-in for a missing one: importing the quantizer imports
``posttrain.formats``, which needs most of ``posttrain.interface``.

    PYTHONPATH=packages/interface/src:packages/formats/src:packages/quant-convert/src \
        python packages/quant-convert/benchmarks/gpu_nvfp4_throughput.py [--device cpu --small]

Prints one JSON object; finishes in well under 3 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU dry run)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import posttrain.quant_convert.nvfp4 as nvfp4

    dev = torch.device(args.device)
    rows, cols, n = (256, 512, 2) if args.small else (8192, 7168, 8)
    g = torch.Generator().manual_seed(0)
    cpu = [(torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16) for _ in range(n)]
    ws = [w.to(dev) for w in cpu]
    gb = sum(w.numel() * 2 for w in ws) / 1e9

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        fn()  # warm-up
        sync()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def copy_bandwidth() -> float:
        big = torch.cat([w.reshape(-1) for w in ws])
        out = torch.empty_like(big)
        return timed(lambda: out.copy_(big))

    copy_s = copy_bandwidth()

    cfgs = {"default": nvfp4.NVFP4Config(), "4over6_mse": nvfp4.NVFP4Config(four_over_six="mse")}
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": [rows, cols],
        "tensors": n,
        "input_gb": gb,
        "copy_gb_per_s": gb / copy_s,
    }
    for name, cfg in cfgs.items():
        s = timed(lambda cfg=cfg: [nvfp4.quantize_nvfp4(w, cfg=cfg) for w in ws])
        result[f"quantize_{name}_gb_per_s"] = gb / s
        result[f"quantize_{name}_over_copy"] = (gb / s) / (gb / copy_s)
        same = True
        for w_cpu, w_dev in zip(cpu[:2], ws[:2], strict=True):
            a = nvfp4.quantize_nvfp4(w_cpu[:1024], cfg=cfg)
            b = nvfp4.quantize_nvfp4(w_dev[:1024], cfg=cfg)
            same &= bool(torch.equal(a.packed, b.packed.cpu()))
            same &= bool(torch.equal(a.scale.view(torch.uint8), b.scale.cpu().view(torch.uint8)))
            same &= bool(torch.equal(a.scale_2, b.scale_2.cpu()))
        result[f"{name}_bit_identical_to_cpu"] = same
    pair_s = timed(lambda: nvfp4.quantize_nvfp4_pair(ws[0], ws[1]))
    result["pair_gb_per_s"] = (ws[0].numel() + ws[1].numel()) * 2 / 1e9 / pair_s
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
