"""NVFP4 on the GPU with subnormal inputs: do the CUDA paths give the CPU reference's bytes?

Rows whose BF16 values are fp32-subnormal (|x| < 2**-126) under a tiny global amax, and rows of
ordinary values next to them, quantized on the CPU (the reference) and on CUDA with the fused
Triton kernel and with the torch path, for every scale rounding and 4-over-6 mode. Prints one
JSON object: per config, whether each CUDA path's packed codes, block scales and global scale
equal the CPU's byte for byte, and how many bytes differ.

    PYTHONPATH=packages/interface/src:packages/formats/src:packages/quant-convert/src \\
        python packages/quant-convert/benchmarks/gpu_nvfp4_subnormal.py
"""

from __future__ import annotations

import itertools
import json

import torch


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 256, generator=g)
    tiny = (base * 1e-39).to(torch.bfloat16)  # every value fp32-subnormal
    mixed = base.clone()
    mixed[::2] *= 1e-38  # subnormal rows beside normal rows under an ordinary amax
    edge = base * 2.0**-120  # normal values whose per-block scaling lands in subnormal range
    return {
        "all_subnormal": tiny,
        "subnormal_rows_under_normal_amax": mixed.to(torch.bfloat16),
        "tiny_normal_amax": edge.to(torch.bfloat16),
    }


def main() -> None:
    import posttrain.quant_convert.nvfp4 as nvfp4

    out: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    for (name, w), rounding, mode in itertools.product(
        cases().items(), ("te-multiplier", "te-divide"), ("off", "mae", "mse")
    ):
        cfg = nvfp4.NVFP4Config(scale_rounding=rounding, four_over_six=mode)
        ref = nvfp4.quantize_nvfp4(w, cfg=cfg, backend="torch")
        row: dict[str, object] = {}
        for backend in ("triton", "torch"):
            got = nvfp4.quantize_nvfp4(w.cuda(), cfg=cfg, backend=backend)
            diff = {
                part: int(
                    (
                        getattr(got, part).cpu().view(torch.uint8)
                        != getattr(ref, part).view(torch.uint8)
                    ).sum()
                )
                for part in ("packed", "scale")
            }
            diff["scale_2"] = int(not torch.equal(got.scale_2.cpu(), ref.scale_2))
            row[backend] = {"identical": not any(diff.values()), "bytes_differing": diff}
        out[f"{name}/{rounding}/{mode}"] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
