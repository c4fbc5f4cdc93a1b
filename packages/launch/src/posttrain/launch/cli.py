"""The ``posttrain`` command line: ``plan``, ``up``, ``demo``, ``hardware`` and ``run``.

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
import signal
import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from posttrain.launch._errors import LaunchConfigError, LaunchError
from posttrain.launch.args import parse_assignments
from posttrain.launch.catalog import get_model
from posttrain.launch.hardware import GPUS_PER_NODE, Hardware, detect_hardware, parse_hardware
from posttrain.launch.keys import new_api_key, remove_key_file, write_key_file
from posttrain.launch.plan import Plan
from posttrain.launch.planner import build_plan
from posttrain.launch.progress import StackProgress
from posttrain.launch.rules import LaunchConfig
from posttrain.launch.runners import DryRun, LocalRunner, console_sink
from posttrain.launch.stack import LocalStackConfig, build_local_stack, default_engine_kind
from posttrain.launch.tables import EngineKind, Precision

app = typer.Typer(
    name="posttrain",
    help="posttrain: hardware-aware launch plans and a local RL rollout stack.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(exc: Exception) -> NoReturn:
    # Text, not markup: messages hold brackets ("[0]*1+[1]*46") rich would eat as tags.
    _err.print(Text.assemble(("error: ", "red"), str(exc)))
    raise typer.Exit(code=2)


def _split(values: list[str] | None) -> tuple[str, ...]:
    """Each ``--engine-arg`` value may hold several tokens: ``"--mem-fraction-static 0.8"``."""
    return tuple(tok for v in values or [] for tok in shlex.split(v))


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
            engine_args=_split(engine_arg),
            router_args=_split(router_arg),
            session_router_args=_split(session_router_arg),
            trainer_args=_split(trainer_arg),
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


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@app.command("up")
def up_command(
    model_path: Annotated[
        Path, typer.Option("--model-path", metavar="DIR", help="checkpoint directory to serve")
    ],
    engines: Annotated[
        int, typer.Option("--engines", min=1, metavar="N", help="engine processes")
    ] = 2,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            "--lora",
            metavar="NAME=PATH",
            help="a PEFT adapter every engine loads and every session uses [default: none]",
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            metavar="KIND",
            help="local-engine or sglang [default: sglang "
            "where it imports and a GPU answers, else local-engine]",
        ),
    ] = None,
    ready_timeout_s: Annotated[
        float,
        typer.Option(
            "--ready-timeout-s",
            metavar="S",
            help="seconds each process may take to answer its health check",
        ),
    ] = 300.0,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print the plan, start nothing [default: off]")
    ] = False,
    session_router_port: Annotated[
        int,
        typer.Option(
            "--session-router-port",
            metavar="PORT",
            min=0,
            help="the session router's port (0: a free one)",
        ),
    ] = 0,
    router_port: Annotated[
        int,
        typer.Option(
            "--router-port", metavar="PORT", min=0, help="sgl-router's port (0: a free one)"
        ),
    ] = 0,
    router_metrics_port: Annotated[
        int,
        typer.Option(
            "--router-metrics-port",
            metavar="PORT",
            min=0,
            help="sgl-router's Prometheus port (0: a free one)",
        ),
    ] = 0,
    api_key: Annotated[
        bool,
        typer.Option(
            "--api-key/--no-api-key",
            help="require a random per-stack key (stored 0600, path printed) on the "
            "engines' state-changing routes and on the session router [default: on]",
        ),
    ] = True,
) -> None:
    """Start engines, the sgl-router and a session router on loopback; Ctrl-C stops all."""
    try:
        kind = EngineKind(engine) if engine else default_engine_kind()
    except ValueError:
        _fail(ValueError(f"--engine {engine!r} is not one of local-engine, sglang"))
    key = new_api_key() if api_key else None
    try:
        plan = build_local_stack(
            LocalStackConfig(
                model_path=str(model_path),
                engines=engines,
                loras=tuple(parse_assignments(lora or [], "--lora")),
                engine_kind=kind,
                ready_timeout_s=ready_timeout_s,
                session_router_port=session_router_port,
                router_port=router_port,
                router_metrics_port=router_metrics_port,
                api_key="<a random key made at start>" if key and dry_run else key,
            )
        )
    except LaunchError as exc:
        _fail(exc)
    if dry_run:
        DryRun(plan, console=_out).run()
        return
    signal.signal(signal.SIGTERM, _raise_interrupt)
    key_file = None
    try:
        if key is not None:
            key_file = write_key_file(key, f"stack-{os.getpid()}")
            _err.print(f"API key of this stack: {key_file} (mode 0600; removed at stop)")
        with LocalRunner(plan, sink=console_sink(_err), api_key=key) as runner:
            with StackProgress(_err) as progress:
                runner.on_event = progress.on_event
                runner.start()
            runner.on_event = lambda name, what: None
            for name, url in runner.urls.items():
                sys.stdout.write(f"{name} {url}\n")
            if key_file is not None:
                sys.stdout.write(f"api-key-file {key_file}\n")
            sys.stdout.write("ready (Ctrl-C stops every process)\n")
            sys.stdout.flush()
            runner.wait()
    except KeyboardInterrupt:
        _err.print("interrupted; stopped every process")
    except LaunchError as exc:
        _fail(exc)
    finally:
        if key_file is not None:
            remove_key_file(key_file)


@app.command("demo")
def demo_command(
    model_path: Annotated[
        Path | None,
        typer.Option(
            "--model-path",
            metavar="DIR",
            help="checkpoint to serve [default: a fresh tiny one in a temp dir]",
        ),
    ] = None,
    engines: Annotated[
        int, typer.Option("--engines", min=1, metavar="N", help="engine processes")
    ] = 2,
    turns: Annotated[
        int, typer.Option("--turns", min=1, max=3, metavar="N", help="chat turns in the session")
    ] = 2,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, metavar="N", help="tokens generated per turn")
    ] = 12,
    seed: Annotated[
        int, typer.Option("--seed", metavar="N", help="seed of the checkpoint and the sampling")
    ] = 0,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            help="stream every process's log instead of the progress display [default: off]",
        ),
    ] = False,
) -> None:
    """Run the CPU rollout path end to end: tiny model, engines, sgl-router, a session chat."""
    from posttrain.launch.demo import DemoConfig, run_demo, tail_sink

    sink, kept = (console_sink(_err), None) if verbose else tail_sink()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        config = DemoConfig(model_path=model_path, engines=engines, turns=turns,
                            max_tokens=max_tokens, seed=seed)  # fmt: skip
        if verbose:
            report = run_demo(config, sink)
        else:
            with StackProgress(_err) as progress:
                report = run_demo(config, sink, progress)
    except KeyboardInterrupt:
        _err.print("interrupted; stopped every process")
        raise typer.Exit(code=130) from None
    except LaunchError as exc:
        if kept:
            _err.print(Text("\n".join(kept)))
        _fail(exc)
    table = Table(title=f"posttrain demo: {report.model_path}")
    for column in ("turn", "user", "reply (tiny random model)", "tokens", "sum logprob"):
        table.add_column(column)
    for i, turn in enumerate(report.turns):
        table.add_row(str(i + 1), turn.user, repr(turn.reply), str(turn.completion_tokens),
                      f"{turn.logprob_sum:.4f}")  # fmt: skip
    _out.print(table)
    for name, url in report.urls.items():
        _out.print(f"{name}: {url}")
    _out.print(f"API key of the stack: {report.api_key_file} (mode 0600, removed at stop)")
    _out.print(
        f"training sample: {report.sample_tokens} tokens over {report.sample_turns} turn(s), "
        f"{report.sample_trained_tokens} trained (loss mask 1), status {report.sample_status}; "
        f"its rollout logprobs are exactly the engine's: {report.sample_logprobs_match_turns}"
    )
    if not report.sample_logprobs_match_turns:
        _fail(LaunchError("the assembled sample's logprobs differ from what the engine returned"))


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
    try:
        plan = Plan.from_json(plan_file.read_text())
    except (OSError, ValueError, KeyError) as exc:
        _fail(exc)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if runner == "dry":
            DryRun(plan, console=_out).run()
        elif runner == "local":
            with LocalRunner(plan, sink=console_sink(_err)) as local:
                local.start()
                local.wait()
        elif runner == "ray":
            from posttrain.launch.ray_runner import RayRunner

            with RayRunner(
                plan, address=ray_address, strategy=ray_strategy, sink=console_sink(_err)
            ) as ray_runner:
                ray_runner.start()
                ray_runner.wait()
        else:
            _fail(ValueError(f"--runner {runner!r} is not one of dry, local, ray"))
    except KeyboardInterrupt:
        _err.print("interrupted; stopped every process")
    except LaunchError as exc:
        _fail(exc)


def main() -> None:
    """Console-script entry point (``posttrain``)."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
