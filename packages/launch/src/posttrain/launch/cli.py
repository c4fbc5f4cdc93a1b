"""The ``posttrain`` command line: ``plan``, ``up``, ``grpo``, ``demo``, ``hardware``, ``run``.

Output for people goes through rich; machine output (``--json``, the URLs ``up`` prints) is
plain text on stdout so scripts can read it. Any ``LaunchError`` ends the command with exit
code 2 and one red line naming the field at fault, never a traceback.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Iterable
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
from posttrain.launch.demo import tail_sink
from posttrain.launch.hardware import GPUS_PER_NODE, Hardware, detect_hardware, parse_hardware
from posttrain.launch.plan import Plan
from posttrain.launch.planner import build_plan
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
)
_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(exc: Exception) -> NoReturn:
    # Text, not markup: messages hold brackets ("[0]*1+[1]*46") rich would eat as tags.
    _err.print(Text.assemble(("error: ", "red"), str(exc)))
    raise typer.Exit(code=2)


def _interrupted() -> NoReturn:
    _err.print("interrupted; stopped every process")
    raise typer.Exit(code=130) from None


def _fail_with_logs(exc: Exception, kept: Iterable[str] | None) -> NoReturn:
    """Fail, first showing the last process log lines kept (when not streaming them)."""
    if kept:
        _err.print(Text("\n".join(kept)))
    _fail(exc)


def _split(values: list[str] | None) -> tuple[str, ...]:
    """Each ``--engine-arg`` value may hold several tokens: ``"--mem-fraction-static 0.8"``."""
    return tuple(tok for v in values or [] for tok in shlex.split(v))


@app.command("plan")
def plan_command(
    model: Annotated[str, typer.Option("--model", help="model id, e.g. glm-4.7-flash")],
    hardware: Annotated[str, typer.Option("--hardware", help="h100, h200, b200, ... cpu")],
    attention_backend: Annotated[
        str | None,
        typer.Option(
            "--attention-backend",
            help="escape hatch: passed to the engine untouched; switches off backend rules",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    nodes: Annotated[int, typer.Option("--nodes", min=1)] = 1,
    precision: Annotated[str | None, typer.Option("--precision")] = None,
    rollout_tp: Annotated[int | None, typer.Option("--rollout-tp")] = None,
    model_path: Annotated[str | None, typer.Option("--model-path")] = None,
    engine_arg: Annotated[list[str] | None, typer.Option("--engine-arg")] = None,
    router_arg: Annotated[list[str] | None, typer.Option("--router-arg")] = None,
    session_router_arg: Annotated[list[str] | None, typer.Option("--session-router-arg")] = None,
    trainer_arg: Annotated[list[str] | None, typer.Option("--trainer-arg")] = None,
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
        typer.Option("--hardware", envvar="POSTTRAIN_HARDWARE", help="the declared hardware"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
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
    model_path: Annotated[Path, typer.Option("--model-path", help="checkpoint directory")],
    engines: Annotated[int, typer.Option("--engines", min=1)] = 2,
    lora: Annotated[list[str] | None, typer.Option("--lora", help="NAME=PATH")] = None,
    engine: Annotated[
        str | None, typer.Option("--engine", help="local-engine or sglang (default: auto)")
    ] = None,
    ready_timeout_s: Annotated[float, typer.Option("--ready-timeout-s")] = 300.0,
    dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
) -> None:
    """Start engines, the sgl-router and a session router on loopback; Ctrl-C stops all."""
    try:
        kind = EngineKind(engine) if engine else default_engine_kind()
    except ValueError:
        _fail(ValueError(f"--engine {engine!r} is not one of local-engine, sglang"))
    try:
        plan = build_local_stack(
            LocalStackConfig(
                model_path=str(model_path),
                engines=engines,
                loras=tuple(parse_assignments(lora or [], "--lora")),
                engine_kind=kind,
                ready_timeout_s=ready_timeout_s,
            )
        )
    except LaunchError as exc:
        _fail(exc)
    if dry_run:
        DryRun(plan, console=_out).run()
        return
    signal.signal(signal.SIGTERM, _raise_interrupt)
    runner = LocalRunner(plan, sink=console_sink(_err))
    try:
        with runner:
            runner.start()
            for name, url in runner.urls.items():
                sys.stdout.write(f"{name} {url}\n")
            sys.stdout.write("ready (Ctrl-C stops every process)\n")
            sys.stdout.flush()
            runner.wait()
    except KeyboardInterrupt:
        _err.print("interrupted; stopped every process")
    except LaunchError as exc:
        _fail(exc)


@app.command("demo")
def demo_command(
    model_path: Annotated[
        Path | None, typer.Option("--model-path", help="checkpoint (default: a fresh tiny one)")
    ] = None,
    engines: Annotated[int, typer.Option("--engines", min=1)] = 2,
    turns: Annotated[int, typer.Option("--turns", min=1, max=3)] = 2,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 12,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    verbose: Annotated[bool, typer.Option("--verbose", help="stream every process's log")] = False,
) -> None:
    """Run the CPU rollout path end to end: tiny model, engines, sgl-router, a session chat."""
    from posttrain.launch.demo import DemoConfig, run_demo

    sink, kept = (console_sink(_err), None) if verbose else tail_sink()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        report = run_demo(
            DemoConfig(model_path=model_path, engines=engines, turns=turns,
                       max_tokens=max_tokens, seed=seed),
            sink,
        )  # fmt: skip
    except KeyboardInterrupt:
        _interrupted()
    except LaunchError as exc:
        _fail_with_logs(exc, kept)
    table = Table(title=f"posttrain demo: {report.model_path}")
    for column in ("turn", "user", "reply (tiny random model)", "tokens", "sum logprob"):
        table.add_column(column)
    for i, turn in enumerate(report.turns):
        table.add_row(str(i + 1), turn.user, repr(turn.reply), str(turn.completion_tokens),
                      f"{turn.logprob_sum:.4f}")  # fmt: skip
    _out.print(table)
    for name, url in report.urls.items():
        _out.print(f"{name}: {url}")
    _out.print(
        f"training sample: {report.sample_tokens} tokens over {report.sample_turns} turn(s), "
        f"{report.sample_trained_tokens} trained (loss mask 1), status {report.sample_status}; "
        f"its rollout logprobs are exactly the engine's: {report.sample_logprobs_match_turns}"
    )
    if not report.sample_logprobs_match_turns:
        _fail(LaunchError("the assembled sample's logprobs differ from what the engine returned"))


@app.command(
    "grpo",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def grpo_command(
    ctx: typer.Context,
    train: Annotated[str, typer.Option("--train", help="lora (adapter only) or full")] = "lora",
    opd: Annotated[
        bool, typer.Option("--opd", help="distil from a stronger local teacher (OPD)")
    ] = False,
    teacher: Annotated[
        str | None, typer.Option("--teacher", help="teacher engine URL (implies --opd)")
    ] = None,
    rollout_quant: Annotated[
        str, typer.Option("--rollout-quant", help="none or nvfp4 (engines serve NVFP4 experts)")
    ] = "none",
    steps: Annotated[int | None, typer.Option("--steps", min=1, help="GRPO steps")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="checkpoint (or run) directory to continue")
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="metrics, plots, checkpoints")] = Path(
        "runs/grpo"
    ),
    verbose: Annotated[bool, typer.Option("--verbose", help="stream every process's log")] = False,
) -> None:
    """Run the embedded CPU GRPO recipe: tiny Dense/MoE policy, toy task, engines, trainer.

    Arguments after ``--`` go to the trainer (``python -m posttrain.grpo``) unchanged.
    """
    from posttrain.launch.grpo import GrpoRecipeConfig, run_grpo

    sink, kept = (console_sink(_err), None) if verbose else tail_sink()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        cfg = GrpoRecipeConfig(
            train=train,  # type: ignore[arg-type]
            opd=opd or teacher is not None,
            teacher_url=teacher,
            rollout_quant=rollout_quant,  # type: ignore[arg-type]
            steps=steps,
            seed=seed,
            resume=resume,
            out=out,
            trainer_args=tuple(ctx.args),
        )
        _err.print(
            "posttrain grpo: preparing the recipe's checkpoints (a first run warms up a tiny "
            "model, about 30 s), then starting the engines, sgl-router, the session router and "
            f"the trainer; metrics and plots go to {cfg.out}",
            highlight=False,
        )
        code = run_grpo(cfg, sink)
    except KeyboardInterrupt:
        _interrupted()
    except LaunchError as exc:
        _fail_with_logs(exc, kept)
    if code != 0:
        _fail_with_logs(LaunchError(f"the trainer exited with code {code}"), kept)


@app.command("run")
def run_command(
    plan_file: Annotated[Path, typer.Argument(help="a plan written by `posttrain plan --json`")],
    runner: Annotated[str, typer.Option("--runner", help="dry, local or ray")] = "dry",
    ray_address: Annotated[str, typer.Option("--ray-address")] = "auto",
    ray_strategy: Annotated[
        str, typer.Option("--ray-strategy", help="placement: SPREAD, STRICT_SPREAD, PACK")
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
