"""The trainer command: ``python -m posttrain.grpo [OPTIONS]``, what launch plans start.

One flag per ``GrpoConfig`` field (``lora_r`` -> ``--lora-r``), generated from the dataclass
with its help line (``config.HELP``) and default, so the command line and the config cannot
drift. The library is typer, the project standard: click (under typer) already parses the
argv forms launch plans generate — ``--flag value`` and ``--flag=value``, the *last*
occurrence of a repeated flag wins (the plans append user ``--trainer-arg`` tokens last to
override rules, argparse-style) — and typer gives the rich ``--help``. The one departure is
that the command's signature is built from the dataclass fields instead of written by hand.

Launch's Megatron-style flags are accepted where this build honours them and refused, with
the flag and a remedy, where it does not:

- ``--bf16`` is ``--precision bf16``; ``--fp16`` and the fp8/fp4 recipe flags
  (``--fp8-format``, ``--fp8-recipe``, ``--fp4-format``, ``--fp4-recipe``) are refused: neither
  backend has a low-precision (Transformer Engine) training recipe.
- ``--backend megatron`` honours ``--tensor-model-parallel-size``, ``--sequence-parallel`` and
  ``--expert-model-parallel-size`` (they must divide torchrun's ``WORLD_SIZE``);
  ``--pipeline-model-parallel-size`` > 1 is refused (out of scope of this build), and so are
  tensor/expert/sequence parallel on the fsdp backend and, there, ``--replicate`` x ``--shard``
  that differs from torchrun's ``WORLD_SIZE``.
- ``--context-parallel-size N`` splits each sample's tokens over N consecutive ranks; N must
  divide ``--replicate`` x ``--shard`` (``GrpoConfigError`` naming the flag otherwise).
- ``--num-layers``, ``--num-experts``, ``--moe-layer-freq`` are checked against the
  checkpoint's ``config.json`` when ``--model-path`` is a local directory.

Before anything starts (and for ``--dry-run``), ``preflight.run_preflight`` runs every check
in ``preflight.CHECKS``: model config, task, output directory, key file, resume checkpoint;
each failure is one ``error: --flag: ...`` line.

Errors: every ``PosttrainError`` and every usage error (unknown flag, bad value) ends the
command with exit code 2 and one ``error: ...`` line on stderr. Any other exception is a bug:
one line and exit code 1 (``POSTTRAIN_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Annotated, Any

import typer
import typer.exceptions
from rich.console import Console
from rich.text import Text

from posttrain.grpo._errors import GrpoConfigError, GrpoUnsupportedError
from posttrain.grpo._shape import check_declared_shape
from posttrain.grpo.config import (
    HELP,
    GrpoConfig,
    field_default,
    field_type,
    parse_moe_layer_freq,
)
from posttrain.grpo.preflight import PreflightError, run_preflight
from posttrain.interface import PosttrainError

PROG = "python -m posttrain.grpo"

# Flags launch's Megatron-style plans may carry that no backend here has a recipe for. Both
# backends compute with the decoder's own fp32 kernels (from fp32 or bf16 parameters); fp8 and
# fp4 training would need Transformer Engine's low-precision linears, which neither builds.
_LOW_PRECISION = (
    "training needs Transformer Engine's low-precision linears, which neither the fsdp nor the "
    "megatron backend of this build uses (both compute with the decoder's own fp32 kernels"
)
_REFUSED_RECIPES: dict[str, str] = {
    "fp16": "fp16 training is not supported; use --bf16 or --precision fp32",
    "fp8_format": f"fp8 {_LOW_PRECISION}); drop it and train with --bf16",
    "fp8_recipe": f"fp8 {_LOW_PRECISION}); drop it and train with --bf16",
    "fp4_format": f"fp4 {_LOW_PRECISION}); drop it and train with --bf16 "
    "(--rollout-quant nvfp4 serves NVFP4 weights)",
    "fp4_recipe": f"fp4 {_LOW_PRECISION}); drop it and train with --bf16 "
    "(--rollout-quant nvfp4 serves NVFP4 weights)",
}


# Tuple-of-names fields, given on the command line as one comma-separated value.
_LIST_FIELDS = ("lora_targets", "engine_urls")
# Tuple fields given by repeating the flag (a reward spec or a path may hold commas).
_REPEATED_FIELDS = ("reward", "eval_data")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option(
    name: str, annotation: Any, default: Any, help_text: str, *decls: str, show: bool | str = True
) -> inspect.Parameter:
    """A keyword parameter typer reads as ``--option`` (``decls`` default: the field's flag)."""
    option = typer.Option(*(decls or (_flag(name),)), help=help_text, show_default=show)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default,
        annotation=Annotated[annotation, option],
    )  # fmt: skip


def _config_parameter(name: str) -> inspect.Parameter:
    """The typer option of one ``GrpoConfig`` field."""
    hint = field_type(name)
    default = field_default(name)
    help_text = HELP[name]
    if name in _LIST_FIELDS:
        return _option(name, str, ",".join(default), help_text + " (comma-separated)")
    if name in _REPEATED_FIELDS:
        return _option(name, list[str] | None, None, help_text + " (repeatable)", show=False)
    if name == "moe_layer_freq":
        return _option(name, str | None, None, help_text)
    if name == "precision":
        help_text += f" (fp32, bf16); --bf16 is the same as --precision bf16 [default: {default}]"
        return _option(name, str | None, None, help_text, show=False)  # click's would be "(fp32)"
    if name == "teacher_url":
        help_text += "; implies --opd"
    if hint is bool and default is True:
        return _option(name, bool, True, help_text, f"{_flag(name)}/--no-{_flag(name)[2:]}")
    return _option(name, hint, default, help_text)


def _extra_parameters() -> list[inspect.Parameter]:
    """Options that are not config fields: launch's precision spellings and ``--json``."""
    return [
        _option("bf16", bool, False, "train in bf16 (Megatron's spelling of --precision bf16)"),
        _option("as_json", bool, False, "with --dry-run: print the config as JSON", "--json"),
        _option(
            "model_check",
            bool,
            True,
            "with --dry-run: read --model-path's config.json (a directory, or a hub id from the "
            "local Hugging Face cache) and refuse an unsupported architecture or feature; "
            "--no-model-check validates the flags only (a plan for machines that hold the model)",
            "--model-check/--no-model-check",
        ),
        _option("fp16", bool, False, "refused: fp16 training is not supported"),
        *(
            _option(name, str | None, None, "refused: needs Transformer Engine's fp8/fp4 linears")
            for name in ("fp8_format", "fp8_recipe", "fp4_format", "fp4_recipe")
        ),
    ]


def build_config(
    values: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
) -> GrpoConfig:
    """Turn parsed option values (flag names as field names) into a supported ``GrpoConfig``.

    Refuses recipe flags this build cannot honour, resolves ``--bf16``/``--precision``, splits
    ``--lora-targets``, parses ``--moe-layer-freq``, then validates (``GrpoConfig``), checks
    support against torchrun's ``WORLD_SIZE`` (from ``environ``) and the declared shape.
    """
    env = os.environ if environ is None else environ
    for name, message in _REFUSED_RECIPES.items():
        value = values.get(name)
        if value not in (None, False):
            shown = _flag(name) if value is True else f"{_flag(name)} {value}"
            raise GrpoUnsupportedError(name, f"{shown}: {message}")
    kwargs = {f.name: values[f.name] for f in fields(GrpoConfig) if f.name in values}
    precision = values.get("precision")
    if values.get("bf16"):
        if precision not in (None, "bf16"):
            raise GrpoConfigError(f"--bf16 contradicts --precision {precision}; give one of them")
        precision = "bf16"
    kwargs["precision"] = precision if precision is not None else field_default("precision")
    for name in _LIST_FIELDS:
        listed = values.get(name)
        if isinstance(listed, str):
            kwargs[name] = tuple(t.strip() for t in listed.split(",") if t.strip())
    for name in _REPEATED_FIELDS:
        kwargs[name] = tuple(values.get(name) or ())
    if values.get("label_key") == "":  # --label-key '': rows without a label
        kwargs["label_key"] = None
    freq = values.get("moe_layer_freq")
    if isinstance(freq, str):
        kwargs["moe_layer_freq"] = parse_moe_layer_freq(freq, num_layers=values.get("num_layers"))
    if kwargs.get("teacher_url") is not None:
        kwargs["opd"] = True
    config = GrpoConfig(**kwargs)
    world = env.get("WORLD_SIZE")
    if world is not None and not world.isdigit():
        raise GrpoConfigError(f"WORLD_SIZE={world!r} (set by torchrun) is not a positive int")
    config.check_supported(world_size=int(world) if world else None)
    check_declared_shape(config)
    return config


def describe(config: GrpoConfig) -> str:
    """The resolved config for people: one ``--flag value`` line per field, ``*`` = changed."""
    lines = []
    width = max(len(_flag(f.name)) for f in fields(config))
    for f in fields(config):
        value = getattr(config, f.name)
        shown = (
            ",".join(value) if f.name in _LIST_FIELDS
            else json.dumps(list(value)) if isinstance(value, tuple)
            else "-" if value is None
            else str(value)
        )  # fmt: skip
        mark = "*" if value != field_default(f.name) else " "
        lines.append(f"{mark} {_flag(f.name):<{width}}  {shown}")
    return "\n".join(lines)


def run(config: GrpoConfig) -> None:
    """Run the GRPO loop (``posttrain.grpo.loop.run``); imported here, on use only."""
    loop = importlib.import_module("posttrain.grpo.loop")  # torch and friends load here
    runner: Callable[[GrpoConfig], object] = loop.run
    summary = runner(config)
    if isinstance(summary, dict):
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            Text("\n" + loop.summary_text(summary))
        )


def _command(**values: Any) -> None:
    """Validate the options; with --dry-run print the resolved config, else run GRPO."""
    config = build_config(values)
    if not config.dry_run:
        run(config)  # loop.run runs the preflight checks before it starts any process
        return
    # Every check the run makes before it starts a process (preflight.CHECKS): the model gate
    # (unless --no-model-check), the data, the reward, the eval sets, the out dir, the resume.
    run_preflight(config, skip=() if values.get("model_check", True) else ("model",))
    out = Console(highlight=False, soft_wrap=True)
    if values.get("as_json"):
        out.print(json.dumps(config.to_dict(), indent=2), markup=False)
        return
    out.print(Text(f"{PROG} --dry-run: the config is valid; nothing was started", style="bold"))
    from posttrain.grpo.trainer import backend_for  # torch and friends load here

    world = int(os.environ.get("WORLD_SIZE") or config.world_size)
    out.print(Text("  " + backend_for(config.backend).describe_ranks(config, world)))
    out.print(Text(describe(config)))


# typer reads options from the signature; this one is generated from the config's fields.
_SIGNATURE = inspect.Signature(
    [_config_parameter(f.name) for f in fields(GrpoConfig)] + _extra_parameters()
)
_command.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
_command.__annotations__ = {p.name: p.annotation for p in _SIGNATURE.parameters.values()}

app = typer.Typer(
    name="posttrain.grpo",
    help="The GRPO trainer. Every option is a GrpoConfig field; launch plans start this.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command(
    name="grpo",
    help="Validate the options; with --dry-run print the resolved config, otherwise run GRPO.",
)(_command)


def _fail(message: str) -> None:
    # Text, not markup: messages hold brackets ("[0]*1+[1]*46") rich would read as tags.
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        Text.assemble(("error: ", "red"), message)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run; returns the exit code."""
    command = typer.main.get_command(app)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = command.main(args=args, prog_name=PROG, standalone_mode=False)
    except typer.exceptions.TyperException as exc:  # unknown flag, bad value: the parser's words
        _fail(exc.format_message())
        return 2
    except PreflightError as exc:  # one line per failed check, each naming its flag
        for line in exc.failures:
            _fail(line)
        return 2
    except GrpoConfigError as exc:
        named = exc.field is None or str(exc).startswith("--")
        _fail(str(exc) if named else f"{_flag(exc.field or '')}: {exc}")
        return 2
    except PosttrainError as exc:
        _fail(str(exc))
        return 2
    except (KeyboardInterrupt, typer.exceptions.Abort):
        _fail("interrupted")
        return 130
    except Exception as exc:
        if os.environ.get("POSTTRAIN_TRACEBACK") == "1":
            raise
        _fail(f"internal error {type(exc).__name__}: {exc} (POSTTRAIN_TRACEBACK=1 shows where)")
        return 1
    return result if isinstance(result, int) else 0
