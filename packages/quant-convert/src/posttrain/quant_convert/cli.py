"""``quant-convert nvfp4``: the command line over :func:`convert_checkpoint`.

argparse rather than typer because the flags are miles' (``--extra-high-precision-layers-hf``
takes several values after one flag, ``--resume/--no-resume`` pairs) and unknown flags must be
errors (miles' ``parse_known_args`` swallowed them). Progress is a tqdm bar over source bytes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from posttrain.interface import ConfigError, NVFP4Precision
from posttrain.quant_convert._errors import QuantConvertError
from posttrain.quant_convert.convert import ProgressEvent, convert_checkpoint
from posttrain.quant_convert.plan import ConvertOptions
from posttrain.quant_convert.selection import QuantPolicy

__all__ = ["build_parser", "main"]


def _device(value: str) -> str:
    if value in ("cpu", "cuda") or value.isdigit() or value.startswith("cuda:"):
        return value
    raise argparse.ArgumentTypeError(f"--device {value!r}: use cpu, cuda or a GPU index")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quant-convert", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("nvfp4", help="convert an HF BF16 checkpoint to NVFP4 (ModelOpt layout)")
    p.add_argument("--model-dir", required=True, help="source HF checkpoint (safetensors)")
    p.add_argument("--save-dir", required=True, help="output dir (a sibling of --model-dir)")
    p.add_argument("--num-layers-at-start-in-bf16", type=int, default=0)
    p.add_argument("--num-layers-at-end-in-bf16", type=int, default=0)
    p.add_argument(
        "--extra-high-precision-layers-hf",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="keep matching tensors BF16: substring, re:REGEX or glob:GLOB",
    )
    p.add_argument("--include-shared-experts", action="store_true")
    p.add_argument("--quantize-3d-experts", action="store_true", help="fused [E, N, K] experts")
    p.add_argument("--four-over-six", choices=("off", "mae", "mse"), default="off")
    p.add_argument("--e4m3-max", type=int, choices=(448, 256), default=None)
    p.add_argument(
        "--scale-rounding", choices=("te-multiplier", "te-divide"), default="te-multiplier"
    )
    p.add_argument("--input-scale", choices=("1.0", "none"), default="1.0")
    p.add_argument("--kv-cache-quant-algo", choices=("FP8", "none"), default="FP8")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or a GPU index N")
    p.add_argument("--exclusion-style", choices=("compact", "explicit"), default="compact")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--overwrite", action="store_true", help="ignore earlier state, start over")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="re-hash shards a resume keeps")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the plan and exclusion list")
    p.add_argument("--workers", type=int, default=1, help="shards converted in parallel")
    p.add_argument("--no-progress", action="store_true")
    return parser


def _options(a: argparse.Namespace) -> ConvertOptions:
    return ConvertOptions(
        precision=NVFP4Precision(
            scale_rounding=a.scale_rounding,
            four_over_six=a.four_over_six,
            input_scale=None if a.input_scale == "none" else float(a.input_scale),
            kv_cache_quant_algo=None if a.kv_cache_quant_algo == "none" else "FP8",
        ),
        e4m3_max=a.e4m3_max,
        policy=QuantPolicy(
            num_layers_at_start_in_bf16=a.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=a.num_layers_at_end_in_bf16,
            keep_patterns=tuple(a.extra_high_precision_layers_hf),
            include_shared_experts=a.include_shared_experts,
            quantize_3d_experts=a.quantize_3d_experts,
        ),
        exclusion_style=a.exclusion_style,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    bar = None
    progress = None
    if not args.no_progress and not args.dry_run:
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="nvfp4", file=sys.stderr)

        def progress(e: ProgressEvent) -> None:
            assert bar is not None
            bar.total = e.bytes_total
            bar.update(e.bytes_done - bar.n)

    try:
        report = convert_checkpoint(
            args.model_dir,
            args.save_dir,
            options=_options(args),
            resume=args.resume,
            overwrite=args.overwrite,
            workers=args.workers,
            device=args.device,
            progress=progress,
            verify=args.verify,
            dry_run=args.dry_run,
        )
    except (QuantConvertError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a seam we did not name: still one line, never a traceback
        print(f"error: {exc.strerror or exc} ({exc.filename or 'no file'})", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    plan = report.plan
    if args.dry_run:
        print(f"plan: {args.model_dir} -> {args.save_dir} ({len(plan.shards)} shards)")
        for s in plan.shards:
            nq = sum(1 for o in s.outputs if o.kind == "packed")
            print(f"  {s.file}: {_gib(s.source_bytes)} -> {_gib(s.output_bytes)}, {nq} quantized")
        print(f"exclusion list ({plan.options.exclusion_style}, {len(plan.exclusions.entries)}):")
        for e in plan.exclusions.entries:
            print(f"  {e}")
    print(
        f"tensors quantized: {report.tensors_quantized}, kept: {report.tensors_kept}, "
        f"exclusion entries: {len(report.exclusion_entries)}, bytes in: {_gib(report.bytes_in)}, "
        f"bytes out: {_gib(report.bytes_out)}, time: {report.seconds:.1f} s"
        + (f", resumed shards: {len(report.shards_resumed)}" if report.shards_resumed else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
