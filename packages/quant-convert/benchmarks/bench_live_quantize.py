"""Live NVFP4 quantization during weight sync vs a device-to-device copy of the same weights.

In one run, on the same BF16 expert weights (gate/up pairs), median of ``--repeats`` after a
warm-up:

* ``copy``: ``dst.copy_(src)`` of every weight on the same device (the yardstick);
* ``live``: ``quantize_named_params`` through the public API, as grpo's sync calls it: on CUDA
  the grouped path (``posttrain.quant_convert._grouped``); its selection is memoised per
  bucket, so the timed calls (after the warm-up) are what every sync after the first costs;
* ``per_tensor``: one ``quantize_nvfp4_pair`` per gate/up pair (the old way: a sync per
  weight);
* ``breakdown`` (CUDA, or the CPU under ``TRITON_INTERPRET=1`` where the times mean nothing
  but the code path runs): one live bucket split into its stages: host planning (checks, table,
  buffers), host launch time, the pre-pass kernels' and quantize kernels' GPU time (CUDA
  events, with the GPU kept busy ahead of them so launch latency is not counted), and the
  views + single synchronisation; ``host_overhead_ms`` is the live wall time minus both
  kernels' GPU time (two-pass order), ``host_overhead_vs_pipelined_ms`` minus the pipelined
  kernels' GPU time (the default order), i.e. what is not kernel time;
* ``--sweep`` (CUDA): GPU time of the pre-pass and the quantize kernel under other launch
  shapes (``KernelTuning``), to choose the defaults.

Bandwidths count bytes read and written: BF16 in plus packed codes, E4M3 block scales and
``weight_scale_2`` out for quantization, twice the BF16 bytes for the copy (so a quantizer at
the copy's speed per byte moved scores 1.0). ``*_over_copy`` are the quantizers' bandwidths
over the copy's; ``bytes_identical`` says whether every quantizer (the grouped variants too)
produced the same bytes.

What runs per call (CUDA tensors), counted for the issue's bucket of 8 x [8192, 7168] BF16
(4 gate/up pairs, one launch group):

old, one ``quantize_nvfp4_pair`` per pair, for each pair:
  ``torch.zeros`` (amax bits: fill kernel), 2 ``amax_into`` launches (one read of each
  weight); then per weight ``quantize_nvfp4``: 3 ``torch.empty`` and 1 ``torch.zeros`` (flag:
  fill kernel), 1 quantize launch (a second read), ``flag.item()`` (a sync per weight), 3
  views. 8 weights: 8 amax + 8 quantize + 12 fill kernels, 36 allocations, 8 syncs.
old ``quantize_nvfp4_many`` (before the grouped path), weights >= 16 MiB one pair at a time:
  per pair ``torch.zeros`` (bits) + 2 amax launches + ``torch.zeros`` (flag); per weight 3
  ``torch.empty`` + ``torch.zeros`` + 1 quantize launch + ``torch.maximum`` (flag fold); one
  ``torch.stack`` + ``max`` + ``.item()`` (one sync); ``quantize_named_params`` then built an
  ``input_scale`` per weight (``torch.full_like``: 8 more fill kernels), mostly dropped.
new, the grouped path, per bucket (any number of weights):
  1 host-to-device copy of the int64 table (one row per matrix), 1 ``torch.zeros`` (amax
  slots + one flag per weight), 1 ``torch.empty`` (every output byte; views handed out),
  1 pre-pass launch and 1 quantize launch per group of same-size matrices of one dtype
  (here: 1 + 1), 1 device-to-host copy of the flags (the one sync). No torch op runs
  between the kernels; the global scales are computed on the device from the amax slots.

    uv run python packages/quant-convert/benchmarks/bench_live_quantize.py --out live.json
    # the issue's shape, on a GPU:
    python packages/quant-convert/benchmarks/bench_live_quantize.py \\
        --device cuda --rows 8192 --cols 7168 --tensors 8 --sweep --out live.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from posttrain.quant_convert import QuantPolicy, quantize_named_params
from posttrain.quant_convert.nvfp4 import NVFP4Config, quantize_nvfp4_pair


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _timed(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    before: Callable[[int], None] | None = None,
) -> float:
    """Median wall time of ``fn`` (synchronised); ``before(r)`` runs untimed ahead of each."""
    fn()  # warm-up (kernel compilation, allocator)
    _sync(device)
    times = []
    for r in range(repeats):
        if before is not None:
            before(r)
            _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median GPU time of ``fn``'s kernels (CUDA events), queued behind a busy GPU so the
    host's launch time is not in the figure."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work ahead of the timed launches
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _breakdown(
    weights: list[tuple[str, torch.Tensor]],
    partners: dict[str, str],
    device: torch.device,
    repeats: int,
) -> dict[str, Any]:
    """One bucket through the grouped path, stage by stage (see the module docstring)."""
    from posttrain.quant_convert._grouped import plan_bucket, results, run_prepass, run_quantize

    cfg = NVFP4Config()
    cuda = device.type == "cuda"
    stages: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        stages.setdefault(key, []).append(value)

    for r in range(repeats + 1):  # the first is the warm-up
        _sync(device)
        t0 = time.perf_counter()
        bucket = plan_bucket(weights, partners)
        t1 = time.perf_counter()
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
        run_prepass(bucket)
        if cuda:
            ev[1].record()
        t2 = time.perf_counter()
        run_quantize(bucket, cfg)
        if cuda:
            ev[2].record()
        t3 = time.perf_counter()
        results(bucket)
        t4 = time.perf_counter()
        if r == 0:
            continue
        add("plan_host_ms", (t1 - t0) * 1e3)
        add("prepass_launch_host_ms", (t2 - t1) * 1e3)
        add("quantize_launch_host_ms", (t3 - t2) * 1e3)
        add("views_and_sync_ms", (t4 - t3) * 1e3)
        add("bucket_wall_ms", (t4 - t0) * 1e3)
        if cuda:
            add("prepass_span_ms", ev[0].elapsed_time(ev[1]))
            add("quantize_span_ms", ev[1].elapsed_time(ev[2]))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in stages.items()}
    if cuda:  # the kernels alone, launch latency hidden behind a busy GPU
        from posttrain.quant_convert._grouped import run_pipelined
        from posttrain.quant_convert._nvfp4_triton import KernelTuning

        bucket = plan_bucket(weights, partners)
        out["prepass_gpu_ms"] = _gpu_ms(lambda: run_prepass(bucket), repeats)
        out["quantize_gpu_ms"] = _gpu_ms(lambda: run_quantize(bucket, cfg), repeats)
        from posttrain.quant_convert._grouped import run_speculative

        won = bucket.bits[: bucket.slots].clone()  # the true amaxes: every bet wins
        out["speculative_won_gpu_ms"] = _gpu_ms(
            lambda: run_speculative(bucket, won, cfg, KernelTuning()), repeats
        )
        lost = torch.full_like(won, -1)  # every bet loses: one read, then a full redo
        out["speculative_lost_gpu_ms"] = _gpu_ms(
            lambda: run_speculative(bucket, lost, cfg, KernelTuning()), repeats
        )
        for stage_mb in (16, 64, 256):
            tuning = KernelTuning(pipeline=True, pipeline_stage_bytes=stage_mb << 20)
            out[f"pipelined_{stage_mb}mb_gpu_ms"] = _gpu_ms(
                lambda t=tuning: run_pipelined(bucket, cfg, t), repeats
            )

    return out


def _sweep(
    weights: list[tuple[str, torch.Tensor]], partners: dict[str, str], repeats: int
) -> list[dict[str, Any]]:
    """GPU time of both kernels under a few launch shapes (bytes are the same: tested)."""
    from posttrain.quant_convert import _nvfp4_triton as kernels
    from posttrain.quant_convert._grouped import (
        plan_bucket,
        run_pipelined,
        run_prepass,
        run_quantize,
    )

    cfg = NVFP4Config()
    bucket = plan_bucket(weights, partners)
    rows: list[dict[str, Any]] = []
    for tile, tiles, warps in (
        (4096, 4, 4),
        (4096, 4, 8),
        (8192, 2, 8),
        (2048, 8, 4),
        (8192, 4, 8),
    ):
        tuning = kernels.KernelTuning(prepass_tile=tile, prepass_tiles=tiles, prepass_warps=warps)
        ms = _gpu_ms(lambda t=tuning: run_prepass(bucket, t), repeats)
        rows.append({"kernel": "prepass", "tile": tile, "tiles": tiles, "warps": warps, "ms": ms})
    shapes = [(256, 2, False, False), (256, 4, False, False), (512, 4, False, False),
              (128, 2, False, False), (256, 2, True, False), (512, 8, False, False),
              (128, 4, True, True), (256, 4, True, True), (256, 8, True, True),
              (512, 8, True, True)]  # fmt: skip
    for blocks, warps, words, one in shapes:  # one: one thread per 16-element block
        shape = {"blocks": blocks, "warps": warps, "pack_words": words, "block_per_thread": one}
        tuning = kernels.KernelTuning(
            blocks_per_program=blocks, num_warps=warps, pack_words=words, block_per_thread=one
        )
        ms = _gpu_ms(lambda t=tuning: run_quantize(bucket, cfg, t), repeats)
        rows.append({"kernel": "quantize", **shape, "ms": ms})
        for stage_mb in (16, 64):  # the same shape, pipelined (pre-pass tiles of its size)
            tuning = kernels.KernelTuning(
                blocks_per_program=blocks, num_warps=warps, pack_words=words,
                block_per_thread=one, pipeline=True, pipeline_stage_bytes=stage_mb << 20,
            )  # fmt: skip
            ms = _gpu_ms(lambda t=tuning: run_pipelined(bucket, cfg, t), repeats)
            rows.append({"kernel": "pipelined", **shape, "stage_mb": stage_mb, "ms": ms})
    return rows


SPECULATIVE_SHAPES = ((256, 4), (256, 8), (512, 4), (512, 8), (1024, 8), (128, 4), (128, 2))


def _sweep_speculative(
    weights: list[tuple[str, torch.Tensor]], partners: dict[str, str], repeats: int
) -> list[dict[str, Any]]:
    """GPU time of the one-read kernels (every bet won) under other launch shapes (blocks
    per program, warps): one thread per 16-element block, the bytes are the same (tested)."""
    from posttrain.quant_convert import _nvfp4_triton as kernels
    from posttrain.quant_convert._grouped import plan_bucket, run_prepass, run_speculative

    cfg = NVFP4Config()
    bucket = plan_bucket(weights, partners)
    run_prepass(bucket)
    won = bucket.bits[: bucket.slots].clone()  # the true amaxes: no redo
    rows: list[dict[str, Any]] = []
    for blocks, warps in SPECULATIVE_SHAPES:
        tuning = kernels.KernelTuning(blocks_per_program=blocks, num_warps=warps)
        ms = _gpu_ms(lambda t=tuning: run_speculative(bucket, won, cfg, t), repeats)
        rows.append({"kernel": "speculative", "blocks": blocks, "warps": warps, "ms": ms})
    return rows


GROUPED_LABELS = (
    "two_pass",
    "pipelined",
    "pipelined_block_tiles",
    "speculative_eager",
    "speculative",
    "live_unplanned",
    "live_bets_lost",
    "live_drifting",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=8, help="an even count: gate/up pairs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sweep", action="store_true", help="CUDA: kernel launch shapes too")
    ap.add_argument(
        "--sweep-speculative",
        action="store_true",
        help="CUDA: the one-read kernels' launch shapes (blocks per program, warps)",
    )
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
    partners = {}
    for (gn, _), (un, _) in zip(named[::2], named[1::2], strict=True):
        partners[gn], partners[un] = un, gn
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
    identical = _same_bytes(live_out, tensor_out)
    bytes_in = sum(w.numel() * w.element_size() for _, w in named)
    bytes_out = sum(t.numel() * t.element_size() for t in live_out.values())
    t_copy = _timed(copy, device, args.repeats)
    t_live = _timed(live, device, args.repeats)
    t_tensor = _timed(per_tensor, device, args.repeats)
    grouped_s: dict[str, float] = {}
    if device.type == "cuda":  # both orders of the grouped path, below the named API
        from posttrain.quant_convert._grouped import quantize_grouped
        from posttrain.quant_convert._nvfp4_triton import DEFAULT_TUNING, KernelTuning

        for label, tuning in (
            ("two_pass", KernelTuning(pipeline=False, speculate=False)),
            ("pipelined", KernelTuning(pipeline=True, speculate=False)),
            ("pipelined_block_tiles", KernelTuning(block_per_thread=False, num_warps=2)),
            ("speculative_eager", KernelTuning(replay=False)),
            ("speculative", KernelTuning()),
        ):
            got = quantize_grouped(named, partners, NVFP4Config(), tuning)
            outs = dict(part for n, _ in named for part in got[n].named(n))
            identical = identical and _same_bytes(outs, tensor_out)
            grouped_s[label] = _timed(
                lambda t=tuning: quantize_grouped(named, partners, NVFP4Config(), t),
                device,
                args.repeats,
            )
        grouped_s["default_is_pipelined"] = float(DEFAULT_TUNING.pipeline)

        def live_unplanned() -> list[tuple[str, torch.Tensor]]:
            from posttrain.quant_convert import _grouped
            from posttrain.quant_convert import live as live_path

            live_path._CALLS.clear()  # what the first sync of a bucket costs
            _grouped._PLANS.clear()
            return live()

        grouped_s["live_unplanned"] = _timed(live_unplanned, device, args.repeats)

        def live_bets_lost() -> list[tuple[str, torch.Tensor]]:
            from posttrain.quant_convert import live as live_path

            for call in live_path._CALLS.values():  # as if every weight's max had moved
                layout = call[-1]
                if layout.last_amax is not None:
                    layout.last_amax.fill_(-1)
            return live()

        grouped_s["live_bets_lost"] = _timed(live_bets_lost, device, args.repeats)
        top = max(float(w.abs().max()) for _, w in named)
        saved = [w[0, 0].clone() for _, w in named]

        def drift(r: int) -> None:  # every weight's max moves before every call
            for _, w in named:
                w[0, 0] = top * (2.0 + r % 2)

        grouped_s["live_drifting"] = _timed(live, device, args.repeats, before=drift)
        for (_, w), v in zip(named, saved, strict=True):
            w[0, 0] = v
    copy_bw = 2 * bytes_in / t_copy
    quant_bytes = bytes_in + bytes_out
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": [args.rows, args.cols],
        "tensors": args.tensors,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "copy_s": t_copy,
        "live_s": t_live,
        "per_tensor_s": t_tensor,
        "copy_gbps": copy_bw / 1e9,
        "live_gbps": quant_bytes / t_live / 1e9,
        "per_tensor_gbps": quant_bytes / t_tensor / 1e9,
        "live_over_copy": quant_bytes / t_live / copy_bw,
        "per_tensor_over_copy": quant_bytes / t_tensor / copy_bw,
        "bytes_identical": identical,
    }
    for label in GROUPED_LABELS:
        if label in grouped_s:
            result[f"grouped_{label}_s"] = grouped_s[label]
            result[f"grouped_{label}_over_copy"] = quant_bytes / grouped_s[label] / copy_bw
    if grouped_s:
        result["default_is_pipelined"] = bool(grouped_s["default_is_pipelined"])
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        import triton  # type: ignore[import-untyped]

        result["triton"] = triton.__version__
        bd = _breakdown(named, partners, device, args.repeats)
        if "prepass_gpu_ms" in bd:
            kernels_ms = bd["prepass_gpu_ms"] + bd["quantize_gpu_ms"]
            bd["kernels_gpu_ms"] = kernels_ms
            bd["host_overhead_ms"] = t_live * 1e3 - kernels_ms
            bd["prepass_read_gbps"] = bytes_in / bd["prepass_gpu_ms"] / 1e6
            bd["quantize_gbps"] = quant_bytes / bd["quantize_gpu_ms"] / 1e6
            bd["quantize_over_copy"] = quant_bytes / (bd["quantize_gpu_ms"] / 1e3) / copy_bw
            bd["kernels_over_copy"] = quant_bytes / (kernels_ms / 1e3) / copy_bw
            for stage_mb in (16, 64, 256):
                ms = bd[f"pipelined_{stage_mb}mb_gpu_ms"]
                bd[f"pipelined_{stage_mb}mb_over_copy"] = quant_bytes / (ms / 1e3) / copy_bw
            # the default order is pipelined (64 MiB stages): what the live call adds to it
            bd["host_overhead_vs_pipelined_ms"] = t_live * 1e3 - bd["pipelined_64mb_gpu_ms"]
            for bet in ("won", "lost"):
                ms = bd[f"speculative_{bet}_gpu_ms"]
                bd[f"speculative_{bet}_over_copy"] = quant_bytes / (ms / 1e3) / copy_bw
            # a live call after the first bets on the last amaxes: what it adds to the kernels
            bd["host_overhead_vs_speculative_ms"] = t_live * 1e3 - bd["speculative_won_gpu_ms"]
        result["breakdown"] = bd
        if args.sweep and device.type == "cuda":
            result["sweep"] = _sweep(named, partners, args.repeats)
        if args.sweep_speculative and device.type == "cuda":
            result["sweep_speculative"] = _sweep_speculative(named, partners, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
