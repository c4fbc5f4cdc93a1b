"""``quant-convert nvfp4``: the command line over :func:`convert_checkpoint`.

argparse rather than typer because the flags are miles' (``--extra-high-precision-layers-hf``
takes several values after one flag, ``--resume/--no-resume`` pairs) and unknown flags must be
errors (miles' ``parse_known_args`` swallowed them). Progress is a rich bar over source bytes.
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


DESCRIPTION = """\
Convert a Hugging Face BF16 safetensors checkpoint to NVFP4 in the ModelOpt layout that SGLang's
modelopt_fp4 loader reads. Routed experts are quantized; everything else is copied unchanged.
The run streams (bounded memory), writes each shard atomically and resumes where it stopped."""

EPILOG = """\
example:
  quant-convert nvfp4 --model-dir Qwen3-30B-A3B --save-dir Qwen3-30B-A3B-NVFP4 \\
      --num-layers-at-end-in-bf16 8 --dry-run"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help; description and example kept as written.

    A required option has no default to show, and an option whose default is None says in its
    help what None means.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quant-convert", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "nvfp4",
        help="convert an HF BF16 checkpoint to NVFP4 (ModelOpt layout)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--model-dir",
        required=True,
        metavar="DIR",
        help="source HF checkpoint directory (config.json + *.safetensors)",
    )
    p.add_argument(
        "--save-dir", required=True, metavar="DIR", help="output directory; not inside --model-dir"
    )
    p.add_argument(
        "--num-layers-at-start-in-bf16",
        type=int,
        default=0,
        metavar="N",
        help="keep the first N decoder layers in BF16",
    )
    p.add_argument(
        "--num-layers-at-end-in-bf16",
        type=int,
        default=0,
        metavar="N",
        help="keep the last N decoder layers in BF16",
    )
    p.add_argument(
        "--extra-high-precision-layers-hf",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="keep matching tensors BF16: substring, re:REGEX or glob:GLOB",
    )
    p.add_argument(
        "--include-shared-experts", action="store_true", help="quantize shared experts too"
    )
    p.add_argument(
        "--quantize-3d-experts",
        action="store_true",
        help="quantize fused [E, N, K] expert tensors too",
    )
    p.add_argument(
        "--four-over-six",
        choices=("off", "mae", "mse"),
        default="off",
        help="4-over-6 block scaling, choosing per block by MAE or MSE",
    )
    p.add_argument(
        "--e4m3-max",
        type=int,
        choices=(448, 256),
        default=None,
        help="TE's Emax for the scales (default: 448, or 256 with --four-over-six)",
    )
    p.add_argument(
        "--scale-rounding",
        choices=("te-multiplier", "te-divide"),
        default="te-multiplier",
        help="block-scale arithmetic; te-divide reproduces older TransformerEngine",
    )
    p.add_argument(
        "--input-scale",
        choices=("1.0", "none"),
        default="1.0",
        help="input_scale to write: 1.0 suits SGLang's per-token activation mode",
    )
    p.add_argument(
        "--kv-cache-quant-algo",
        choices=("FP8", "none"),
        default="FP8",
        help="KV-cache algorithm declared in the quantization config",
    )
    p.add_argument(
        "--device",
        type=_device,
        default="cpu",
        metavar="DEVICE",
        help="where to quantize: cpu, cuda or a GPU index N",
    )
    p.add_argument(
        "--exclusion-style",
        choices=("compact", "explicit"),
        default="compact",
        help="compact: the shortest list SGLang decides identically; explicit: "
        "every kept module by name",
    )
    p.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep shards an interrupted run finished",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="ignore an earlier run's state and start over"
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-hash the shards a resume keeps",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and the exclusion list, write nothing",
    )
    p.add_argument(
        "--workers", type=int, default=1, metavar="N", help="shards converted in parallel"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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


class _ProgressBar:
    """Source bytes done over total, the shard at work, rate and time left (rich, on stderr)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("nvfp4 {task.fields[shard]}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
        )  # fmt: skip
        self._task = self._progress.add_task("nvfp4", total=None, shard="planning")
        self._progress.start()

    def update(self, event: ProgressEvent) -> None:
        shard = "done" if event.bytes_done >= event.bytes_total else event.shard
        self._progress.update(
            self._task, completed=event.bytes_done, total=event.bytes_total, shard=shard
        )

    def close(self, *, failed: bool = False) -> None:
        """Stop the bar; after a failure it is removed, so the error line is the last one."""
        if failed:
            self._progress.live.transient = True  # erased on stop
        self._progress.stop()


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    bar = None if args.no_progress or args.dry_run else _ProgressBar()
    progress = None if bar is None else bar.update
    failed = True
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
        failed = False
    except (QuantConvertError, ConfigError) as exc:
        message = f"error: {exc}"
    except OSError as exc:  # a seam we did not name: still one line, never a traceback
        message = f"error: {exc.strerror or exc} ({exc.filename or 'no file'})"
    finally:
        if bar is not None:  # before the error line, so the bar does not print after it
            bar.close(failed=failed)
    if failed:
        print(message, file=sys.stderr)
        return 2
    plan = report.plan
    if args.dry_run:
        print(f"plan: {args.model_dir} -> {args.save_dir} ({len(plan.shards)} shards)")
        for s in plan.shards:
            nq = sum(1 for o in s.outputs if o.kind == "weight")
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
