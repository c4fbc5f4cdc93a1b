"""NVFP4 quantizer on a GPU: the fused Triton kernel against copy bandwidth and the torch path.

One run, side by side, on 8 x [8192, 7168] BF16:

* ``copy``: a device-to-device copy of the same bytes; ``copy_gb_per_s`` counts bytes copied
  (the usual figure), ``copy_traffic_gb_per_s`` bytes read plus written;
* per config (te-multiplier, te-divide, 4-over-6 MAE and MSE): the Triton path as
  ``quantize_nvfp4`` runs it per tensor (amax pass + quantize pass + a host sync for the
  NaN/Inf check), and as ``quantize_nvfp4_many`` runs the 8 tensors (one sync), its bytes moved (BF16 in, codes and
  scales out) per second and that over ``copy_gb_per_s`` (the issue's ratio) and over the copy's
  traffic (stricter: the amax pass reads the input a second time); the quantize kernel alone
  (amax given); the pure-torch path (``backend="torch"``) and the speed-up;
* bit identity of the CUDA result against the CPU reference for every config, on hard shapes:
  zero and -0.0 blocks, heavy-tailed rows, subnormal and zero block scales, 1000 rows (not a
  multiple of 128), a gate/up pair sharing its amax, a 3-D expert stack, and one full
  [8192, 7168] tensor;
* live re-quantization of a Qwen3-30B-A3B-shaped expert set (48 layers x 128 experts, gate and
  up [768, 2048], down [2048, 768], random BF16, all on one GPU) through
  ``quantize_named_params``, one bucket per layer; and one layer through the torch path.

    PYTHONPATH=packages/interface/src:packages/formats/src:packages/quant-convert/src \\
        python packages/quant-convert/benchmarks/gpu_nvfp4_throughput.py [--out result.json]

Prints one JSON object (and writes it to ``--out``). Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--torch-repeats", type=int, default=3)
    ap.add_argument("--live-layers", type=int, default=48)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time launch shapes, then exit")
    ap.add_argument("--convert-dir", default=None, help="also time convert_checkpoint here")
    args = ap.parse_args()
    import posttrain.quant_convert.nvfp4 as nvfp4
    from posttrain.quant_convert.live import quantize_named_params

    dev = torch.device("cuda")
    rows, cols, n = 8192, 7168, 8
    ws = [(torch.randn(rows, cols, device=dev) * 0.02).to(torch.bfloat16) for _ in range(n)]
    numel = sum(w.numel() for w in ws)
    in_gb = numel * 2 / 1e9
    moved_gb = (numel * 2 + numel // 2 + numel // 16) / 1e9

    def timed(fn: Callable[[], Any], repeats: int) -> float:
        fn()  # warm-up (and compile)
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def copy_seconds() -> float:
        big = torch.cat([w.reshape(-1) for w in ws])
        copy_out = torch.empty_like(big)
        return timed(lambda: copy_out.copy_(big), args.repeats)

    copy_s = copy_seconds()
    copy_gbps = in_gb / copy_s
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": [rows, cols],
        "tensors": n,
        "input_gb": in_gb,
        "moved_gb": moved_gb,
        "copy_gb_per_s": copy_gbps,
        "copy_traffic_gb_per_s": 2 * copy_gbps,
    }
    cfgs = {
        "default": nvfp4.NVFP4Config(),
        "te_divide": nvfp4.NVFP4Config(scale_rounding="te-divide"),
        "4over6_mae": nvfp4.NVFP4Config(four_over_six="mae"),
        "4over6_mse": nvfp4.NVFP4Config(four_over_six="mse"),
    }
    amaxes = [nvfp4.global_amax(w) for w in ws]
    if args.sweep:
        result["sweep"] = _sweep(torch, cfgs, ws, amaxes, moved_gb, copy_gbps)
        print(json.dumps(result, indent=2))
        _dump(result, args.out)
        return
    for name, cfg in cfgs.items():
        t_tri = timed(lambda cfg=cfg: [nvfp4.quantize_nvfp4(w, cfg=cfg) for w in ws], args.repeats)
        t_kernel = timed(
            lambda cfg=cfg: [
                nvfp4.quantize_nvfp4(w, cfg=cfg, global_amax=a)
                for w, a in zip(ws, amaxes, strict=True)
            ],
            args.repeats,
        )
        t_many = timed(
            lambda cfg=cfg: nvfp4.quantize_nvfp4_many(
                [(str(i), w) for i, w in enumerate(ws)], cfg=cfg
            ),
            args.repeats,
        )
        t_torch = timed(
            lambda cfg=cfg: [nvfp4.quantize_nvfp4(w, cfg=cfg, backend="torch") for w in ws],
            args.torch_repeats,
        )
        result[name] = {
            "triton_ms": t_tri * 1e3,
            "triton_moved_gb_per_s": moved_gb / t_tri,
            "triton_over_copy": (moved_gb / t_tri) / copy_gbps,
            "triton_over_copy_traffic": (moved_gb / t_tri) / (2 * copy_gbps),
            "batched_ms": t_many * 1e3,
            "batched_moved_gb_per_s": moved_gb / t_many,
            "batched_over_copy": (moved_gb / t_many) / copy_gbps,
            "batched_over_copy_traffic": (moved_gb / t_many) / (2 * copy_gbps),
            "batched_speedup_over_torch": t_torch / t_many,
            "kernel_only_ms": t_kernel * 1e3,
            "kernel_only_over_copy": (moved_gb / t_kernel) / copy_gbps,
            "torch_ms": t_torch * 1e3,
            "torch_moved_gb_per_s": moved_gb / t_torch,
            "torch_input_gb_per_s": in_gb / t_torch,
            "speedup_over_torch": t_torch / t_tri,
        }
        _dump(result, args.out)
    pair_s = timed(lambda: nvfp4.quantize_nvfp4_pair(ws[0], ws[1]), args.repeats)
    result["pair_moved_gb_per_s"] = 2 * moved_gb / n / pair_s
    try:
        result["bit_identity"] = _bit_identity(torch, nvfp4, cfgs, ws[0])
    except Exception:  # keep the figures measured so far
        result["bit_identity"] = {"error": traceback.format_exc()}
    _dump(result, args.out)
    ws.clear()
    amaxes.clear()
    torch.cuda.empty_cache()
    if args.convert_dir:
        try:
            result["convert"] = _convert(torch, args.convert_dir)
        except Exception:
            result["convert"] = {"error": traceback.format_exc()}
        _dump(result, args.out)
    try:
        result["live_qwen3_30b_a3b"] = _live(torch, nvfp4, quantize_named_params, args.live_layers)
    except Exception:
        result["live_qwen3_30b_a3b"] = {"error": traceback.format_exc()}
    print(json.dumps(result, indent=2))
    _dump(result, args.out)


def _dump(result: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=2))


def _sweep(
    torch: Any,
    cfgs: dict[str, Any],
    ws: list[Any],
    amaxes: list[Any],
    moved_gb: float,
    copy_gbps: float,
) -> list[dict[str, Any]]:
    """Kernel-only time (CUDA events, no host sync between tensors) per launch shape."""
    import triton

    from posttrain.quant_convert import _nvfp4_triton as k

    rows = []
    dev = ws[0].device
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    bits = torch.zeros(1, dtype=torch.int32, device=dev)
    for _ in range(2):  # warm-up, then timed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            for x in ws:
                k.amax_into(x.reshape(1, -1), bits, slots)
        end.record()
        torch.cuda.synchronize(dev)
    ms = start.elapsed_time(end) / 5
    rows.append({"amax_pass_ms": ms, "amax_read_gb_per_s": moved_gb * 0.78 / (ms / 1e3)})
    amax1 = [a.reshape(1).contiguous() for a in amaxes]
    for name in ("default", "4over6_mae", "4over6_mse"):
        cfg = cfgs[name]
        if name == "default":
            variants = [
                k.KernelTuning(blocks_per_program=b, num_warps=w, pack_words=p)
                for b, w in ((64, 2), (128, 2), (128, 4), (256, 2), (256, 4), (512, 4))
                for p in (False, True)
            ]
        else:
            variants = [
                k.KernelTuning(four_over_six_rows=c, blocks_per_program_4over6=b,
                               num_warps_4over6=w, max_registers_4over6=r)
                for c, b, w, r in (
                    ((True, 128, 4, None), (True, 64, 2, None), (False, 32, 2, None))
                    if name == "4over6_mae"
                    else ((True, 128, 4, None), (True, 64, 2, None), (True, 256, 8, None),
                          (True, 128, 4, 96), (False, 32, 2, None))
                )
            ]  # fmt: skip
        for tuning in variants:

            def run(tuning: Any = tuning, cfg: Any = cfg) -> None:
                for x, a in zip(ws, amax1, strict=True):
                    k.quantize_matrices(x.unsqueeze(0), a, slots, four_over_six=cfg.four_over_six,
                                        scale_rounding=cfg.scale_rounding, emax=cfg.emax,
                                        tuning=tuning)  # fmt: skip

            run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                run()
            end.record()
            torch.cuda.synchronize(dev)
            ms = start.elapsed_time(end) / 5
            rows.append({
                "config": name, "tuning": str(tuning), "ms": ms,
                "moved_gb_per_s": moved_gb / (ms / 1e3),
                "over_copy": moved_gb / (ms / 1e3) / copy_gbps,
            })  # fmt: skip
    try:  # registers, spills and vector loads of each compiled variant
        compiled = []
        caches = [*k._quant_kernel.device_caches.values(),
                  *k._quant_4over6_kernel.device_caches.values()]  # fmt: skip
        for cache in caches:
            for key, c in cache[0].items():
                ptx = c.asm.get("ptx", "")
                compiled.append({
                    "key": str(key)[-160:], "n_regs": c.n_regs, "n_spills": c.n_spills,
                    "ld_v4": ptx.count("ld.global.v4"), "ld_v2": ptx.count("ld.global.v2"),
                    "ld_scalar_b16": ptx.count("ld.global.b16"),
                    "div_rn": ptx.count("div.rn.f32"), "fma": ptx.count("fma.rn.f32"),
                })  # fmt: skip
        rows.append({"compiled": compiled})
    except Exception as exc:
        rows.append({"compiled_error": repr(exc)})
    del triton
    return rows


def _convert(torch: Any, root: str) -> dict[str, Any]:
    """A synthetic Qwen3-MoE-named checkpoint (12 layers x 64 experts x 3 x [512, 1024] BF16,
    3 shards) converted on the GPU with and without the read/quantize/write overlap, against
    copying the same shard files (read + write + fsync: the disk's speed here)."""
    import os
    import shutil
    from pathlib import Path

    from posttrain.quant_convert import ConvertOptions, convert_checkpoint
    from posttrain.quant_convert.testing import SyntheticSpec, write_synthetic_checkpoint

    base = Path(root)
    shutil.rmtree(base, ignore_errors=True)
    spec = SyntheticSpec(layers=12, experts=64, hidden=1024, intermediate=512, shards=3)
    src = write_synthetic_checkpoint(base / "src", spec)
    shards = sorted(src.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)

    def copy_all() -> None:
        (base / "copy").mkdir()
        for p in shards:
            with open(p, "rb") as f_in, open(base / "copy" / p.name, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 16 << 20)
                f_out.flush()
                os.fsync(f_out.fileno())

    out: dict[str, Any] = {"source_gb": size / 1e9}
    runs: list[tuple[str, Callable[[], Any]]] = [
        ("copy_files", copy_all),
        ("cuda_pipelined", lambda: convert_checkpoint(
            src, base / "pipe", device="cuda", pipeline=True, options=ConvertOptions())),
        ("cuda_sequential", lambda: convert_checkpoint(
            src, base / "seq", device="cuda", pipeline=False, options=ConvertOptions())),
    ]  # fmt: skip
    for name, fn in runs:
        t0 = time.perf_counter()
        fn()
        out[f"{name}_s"] = time.perf_counter() - t0
    same = all(
        (base / "pipe" / p.name).read_bytes() == (base / "seq" / p.name).read_bytes()
        for p in shards
    )
    out["pipelined_equals_sequential"] = same
    out["pipelined_over_copy_time"] = out["cuda_pipelined_s"] / out["copy_files_s"]
    out["sequential_over_copy_time"] = out["cuda_sequential_s"] / out["copy_files_s"]
    shutil.rmtree(base, ignore_errors=True)
    del torch
    return out


def _hard(torch: Any, rows: int, cols: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[0:7, :] = 0.0
    w[7, ::3] = -0.0
    w[8:12, :64] = -0.0
    heavy = (
        torch.randn(16, cols, generator=g) / torch.rand(16, cols, generator=g).clamp_min(1e-4) ** 2
    )
    w[20:36] = heavy * 0.02
    w[40:60] *= 1e-5  # E4M3 subnormal / zero block scales against the heavy rows
    w[60:80] *= 3e-4
    return w.to(torch.bfloat16)


def _same(torch: Any, a: Any, b: Any) -> bool:
    return bool(
        torch.equal(a.packed, b.packed.cpu())
        and torch.equal(a.scale.view(torch.uint8), b.scale.cpu().view(torch.uint8))
        and torch.equal(a.scale_2.view(torch.int32), b.scale_2.cpu().view(torch.int32))
    )


def _bit_identity(torch: Any, nvfp4: Any, cfgs: dict[str, Any], full: Any) -> dict[str, bool]:
    dev = full.device
    out: dict[str, bool] = {}
    hard = _hard(torch, 1000, 7168, 1)
    gate, up = _hard(torch, 768, 2048, 2), _hard(torch, 768, 2048, 3) * 7
    stack = torch.stack([_hard(torch, 200, 768, s) * 10.0**s for s in range(4)])
    for name, cfg in cfgs.items():
        ok = _same(
            torch, nvfp4.quantize_nvfp4(hard, cfg=cfg), nvfp4.quantize_nvfp4(hard.to(dev), cfg=cfg)
        )
        ref = nvfp4.quantize_nvfp4_pair(gate, up, cfg=cfg)
        got = nvfp4.quantize_nvfp4_pair(gate.to(dev), up.to(dev), cfg=cfg)
        ok &= _same(torch, ref[0], got[0]) and _same(torch, ref[1], got[1])
        ok &= _same(
            torch,
            nvfp4.quantize_nvfp4(stack, cfg=cfg, allow_3d=True),
            nvfp4.quantize_nvfp4(stack.to(dev), cfg=cfg, allow_3d=True),
        )
        many = nvfp4.quantize_nvfp4_many(
            [("g", gate.to(dev)), ("u", up.to(dev))], partners={"g": "u", "u": "g"}, cfg=cfg
        )
        ok &= _same(torch, ref[0], many["g"]) and _same(torch, ref[1], many["u"])
        out[f"{name}_hard_shapes"] = ok
    for name in ("default", "4over6_mae", "4over6_mse"):
        cpu_full = full.cpu()
        out[f"{name}_full_8192x7168"] = _same(
            torch,
            nvfp4.quantize_nvfp4(cpu_full, cfg=cfgs[name]),
            nvfp4.quantize_nvfp4(full, cfg=cfgs[name]),
        )
    return out


def _live(torch: Any, nvfp4: Any, quantize_named_params: Any, layers: int) -> dict[str, Any]:
    """Qwen3-30B-A3B routed experts, one bucket (384 HF-named tensors) per layer."""
    dev = torch.device("cuda")
    experts, inter, hidden = 128, 768, 2048
    weights = []
    for _ in range(layers):
        gate = (torch.randn(experts, inter, hidden, device=dev) * 0.02).to(torch.bfloat16)
        up = (torch.randn(experts, inter, hidden, device=dev) * 0.02).to(torch.bfloat16)
        down = (torch.randn(experts, hidden, inter, device=dev) * 0.02).to(torch.bfloat16)
        weights.append((gate, up, down))

    def bucket(layer: int) -> list[tuple[str, Any]]:
        gate, up, down = weights[layer]
        named = []
        for e in range(experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            named += [(f"{p}.gate_proj.weight", gate[e]), (f"{p}.up_proj.weight", up[e]),
                      (f"{p}.down_proj.weight", down[e])]  # fmt: skip
        return named

    quantize_named_params(bucket(0), num_layers=layers)  # warm-up (compile)
    torch.cuda.synchronize(dev)
    per_layer = []
    out_tensors = 0
    t_all = time.perf_counter()
    for layer in range(layers):
        t0 = time.perf_counter()
        out = quantize_named_params(bucket(layer), num_layers=layers)
        torch.cuda.synchronize(dev)
        per_layer.append(time.perf_counter() - t0)
        out_tensors += len(out)
        del out
    total = time.perf_counter() - t_all
    in_bytes = layers * 3 * experts * inter * hidden * 2
    # the torch path for one layer, same tensors, for scale
    named = bucket(0)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for i in range(0, len(named), 3):
        nvfp4.quantize_nvfp4_pair(named[i][1], named[i + 1][1], backend="torch")
        nvfp4.quantize_nvfp4(named[i + 2][1], backend="torch")
    torch.cuda.synchronize(dev)
    torch_layer = time.perf_counter() - t0
    return {
        "layers": layers,
        "experts": experts,
        "input_gb": in_bytes / 1e9,
        "output_tensors": out_tensors,
        "total_s": total,
        "per_layer_ms_median": statistics.median(per_layer) * 1e3,
        "input_gb_per_s": in_bytes / 1e9 / total,
        "torch_path_one_layer_s": torch_layer,
        "torch_path_extrapolated_total_s": torch_layer * layers,
        "peak_gpu_mem_gb": torch.cuda.max_memory_allocated(dev) / 1e9,
    }


if __name__ == "__main__":
    main()
