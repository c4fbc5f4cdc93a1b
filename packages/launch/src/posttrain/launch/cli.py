"""The ``posttrain`` command line: ``plan``, ``up``, ``demo``, ``grpo``, ``hardware`` and ``run``.

typer, the project's CLI library (the capability packages' ``python -m`` commands use argparse
where their docstrings say why). Help screens are click's plain layout (``rich_markup_mode=None``):
typer's rich layout prints a type column (``<bool>`` beside every flag) that ignores metavars.
Every option has help text and shows its default.

Output for people goes through rich; machine output (``--json``, the URLs and the API-key file
``up`` prints) is plain text on stdout so scripts can read it. Any ``LaunchError`` ends the
command with exit code 2 and one red line naming the field at fault, never a traceback.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from posttrain.launch._cli_grpo import GRPO_CONTEXT, grpo_command
from posttrain.launch._cli_stack import demo_command, up_command
from posttrain.launch._console import err as _err
from posttrain.launch._console import fail as _fail
from posttrain.launch._console import out as _out
from posttrain.launch._console import stop_on_signals as _stop_on_signals
from posttrain.launch._errors import LaunchConfigError, LaunchError
from posttrain.launch.catalog import get_model
from posttrain.launch.hardware import GPUS_PER_NODE, Hardware, detect_hardware, parse_hardware
from posttrain.launch.plan import Plan
from posttrain.launch.planner import build_plan
from posttrain.launch.ray_runner import RAY_STRATEGIES
from posttrain.launch.rules import LaunchConfig
from posttrain.launch.runners import DryRun, LocalRunner, console_sink
from posttrain.launch.tables import Precision

app = typer.Typer(
    name="posttrain",
    help="posttrain: hardware-aware launch plans and a local RL rollout stack.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _split(values: list[str] | None, flag: str) -> tuple[str, ...]:
    """Each ``--engine-arg`` value may hold several tokens: ``"--mem-fraction-static 0.8"``."""
    tokens: list[str] = []
    for value in values or []:
        try:
            tokens.extend(shlex.split(value))
        except ValueError as exc:  # an unclosed quote
            raise LaunchConfigError(f"{flag} {value!r}: {exc}") from None
    return tuple(tokens)


@app.command("plan")
def plan_command(
    model: Annotated[
        str, typer.Option("--model", metavar="ID", help="model id, e.g. glm-4.7-flash")
    ],
    hardware: Annotated[
        str,
        typer.Option(
            "--hardware",
            metavar="NAME",
            help="h100, h200, b200, b300, gb200, gb300, mi300x, mi355x or cpu",
        ),
    ],
    attention_backend: Annotated[
        str | None,
        typer.Option(
            "--attention-backend",
            metavar="NAME",
            help="escape hatch: passed to the engine untouched; switches off backend rules "
            "[default: the rules' choice]",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the plan as JSON [default: off]")
    ] = False,
    nodes: Annotated[int, typer.Option("--nodes", min=1, metavar="N", help="nodes")] = 1,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision",
            metavar="NAME",
            help="rollout/training precision: "
            + ", ".join(p.value for p in Precision)
            + " [default: the rules' choice]",
        ),
    ] = None,
    rollout_tp: Annotated[
        int | None,
        typer.Option(
            "--rollout-tp",
            metavar="N",
            help="engine tensor-parallel size [default: the rules' choice]",
        ),
    ] = None,
    model_path: Annotated[
        str | None,
        typer.Option(
            "--model-path",
            metavar="PATH",
            help="checkpoint the engines load [default: the model's hub id]",
        ),
    ] = None,
    engine_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--engine-arg",
            metavar="ARGS",
            help="extra engine flags, last so they win (repeatable) [default: none]",
        ),
    ] = None,
    router_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--router-arg",
            metavar="ARGS",
            help="extra sgl-router flags (repeatable) [default: none]",
        ),
    ] = None,
    session_router_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--session-router-arg",
            metavar="ARGS",
            help="extra session-router flags (repeatable) [default: none]",
        ),
    ] = None,
    trainer_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--trainer-arg", metavar="ARGS", help="extra trainer flags (repeatable) [default: none]"
        ),
    ] = None,
    train: Annotated[
        str,
        typer.Option(
            "--train",
            metavar="MODE",
            help="lora (the engines serve the trained adapter: --enable-lora) or full "
            "(every weight synced)",
        ),
    ] = "lora",
) -> None:
    """Print the launch plan for a model on a hardware profile (nothing is started)."""
    try:
        cfg = LaunchConfig(
            model=get_model(model),
            hardware=parse_hardware(hardware),
            nodes=nodes,
            model_path=model_path,
            attention_backend=attention_backend,
            precision=_parse_precision(precision),
            rollout_tp=rollout_tp,
            engine_args=_split(engine_arg, "--engine-arg"),
            router_args=_split(router_arg, "--router-arg"),
            session_router_args=_split(session_router_arg, "--session-router-arg"),
            trainer_args=_split(trainer_arg, "--trainer-arg"),
            train=train,  # type: ignore[arg-type]  # checked by build_plan
        )
        plan = build_plan(cfg)
    except LaunchError as exc:
        _fail(exc)
    if as_json:
        sys.stdout.write(plan.to_json())
    else:
        DryRun(plan, console=_out).run()


def _parse_precision(value: str | None) -> Precision | None:
    if value is None:
        return None
    try:
        return Precision(value)
    except ValueError:
        allowed = ", ".join(p.value for p in Precision)
        raise LaunchConfigError(f"precision {value!r} is not one of: {allowed}") from None


@app.command("hardware")
def hardware_command(
    hardware: Annotated[
        str | None,
        typer.Option(
            "--hardware",
            envvar="POSTTRAIN_HARDWARE",
            metavar="NAME",
            help="the declared hardware [default: none, only detect]",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the result as JSON [default: off]")
    ] = False,
) -> None:
    """Show the detected GPUs next to the declared hardware, and every profile."""
    try:
        declared = parse_hardware(hardware) if hardware else None
    except LaunchError as exc:
        _fail(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        detection = detect_hardware(declared)
    mismatch = [str(w.message) for w in caught]
    if as_json:
        payload = {
            "declared": declared.value if declared else None,
            "detected": detection.hardware.value if detection.hardware else None,
            "tool": detection.tool,
            "gpu_names": list(detection.gpu_names),
            "warnings": mismatch,
        }
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return
    _out.print(f"declared: {declared.value if declared else '(none; pass --hardware)'}")
    detected = detection.hardware.value if detection.hardware else "unknown"
    via = detection.tool or "no GPU tool answered"
    _out.print(f"detected: {detected} ({detection.gpu_count} GPU(s), via {via})")
    for message in mismatch:
        _err.print(Text.assemble(("warning: ", "yellow"), message))
    table = Table(title="hardware profiles")
    for col in ("hardware", "gpus/node", "generation", "vendor"):
        table.add_column(col)
    for hw in Hardware:
        table.add_row(hw.value, str(GPUS_PER_NODE[hw]), hw.generation.value, hw.vendor.value)
    _out.print(table)


@app.command("run")
def run_command(
    plan_file: Annotated[
        Path, typer.Argument(metavar="PLAN", help="a plan written by `posttrain plan --json`")
    ],
    runner: Annotated[
        str, typer.Option("--runner", metavar="NAME", help="dry (print), local or ray")
    ] = "dry",
    ray_address: Annotated[
        str,
        typer.Option(
            "--ray-address",
            metavar="HOST:PORT",
            help="Ray cluster to join (auto: the one this machine runs)",
        ),
    ] = "auto",
    ray_strategy: Annotated[
        str,
        typer.Option(
            "--ray-strategy",
            metavar="NAME",
            help="placement group strategy: SPREAD, STRICT_SPREAD or PACK",
        ),
    ] = "SPREAD",
) -> None:
    """Execute a saved plan with a runner (multi-node plans through Ray)."""
    if runner not in ("dry", "local", "ray"):
        _fail(LaunchConfigError(f"--runner {runner!r} is not one of dry, local, ray"))
    if ray_strategy not in RAY_STRATEGIES:
        _fail(
            LaunchConfigError(
                f"--ray-strategy {ray_strategy!r} is not one of {', '.join(RAY_STRATEGIES)}"
            )
        )
    try:
        plan = Plan.from_json(plan_file.read_text())
    except OSError as exc:
        _fail(LaunchConfigError(f"plan file {plan_file}: {exc.strerror or exc}"))
    except LaunchConfigError as exc:
        _fail(LaunchConfigError(f"plan file {plan_file}: {exc}"))
    _stop_on_signals()
    try:
        if runner == "dry":
            DryRun(plan, console=_out).run()
        elif runner == "local":
            with LocalRunner(plan, sink=console_sink(_err)) as local:
                local.start()
                local.wait()
        else:
            from posttrain.launch.ray_runner import RayRunner

            with RayRunner(
                plan, address=ray_address, strategy=ray_strategy, sink=console_sink(_err)
            ) as ray_runner:
                ray_runner.start()
                ray_runner.wait()
    except KeyboardInterrupt:
        _err.print("interrupted; stopped every process")
    except LaunchError as exc:
        _fail(exc)


app.command("up")(up_command)
app.command("demo")(demo_command)
app.command("grpo", context_settings=GRPO_CONTEXT)(grpo_command)


def main() -> None:
    """Console-script entry point (``posttrain``)."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
