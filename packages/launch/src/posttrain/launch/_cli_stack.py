"""``posttrain up`` and ``posttrain demo``: the commands that run a local stack.

Registered on the ``posttrain`` app in ``cli.py`` (see its docstring for the CLI's conventions).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from posttrain.launch._console import err as _err
from posttrain.launch._console import fail as _fail
from posttrain.launch._console import fail_with_logs, interrupted, require
from posttrain.launch._console import out as _out
from posttrain.launch._console import stop_on_signals as _stop_on_signals
from posttrain.launch._errors import LaunchConfigError, LaunchError
from posttrain.launch.args import parse_assignments
from posttrain.launch.keys import new_api_key, remove_key_file, write_key_file
from posttrain.launch.planner import ENGINE_MODULES
from posttrain.launch.progress import StackProgress
from posttrain.launch.runners import DryRun, LocalRunner, console_sink, tail_sink
from posttrain.launch.stack import LocalStackConfig, build_local_stack, default_engine_kind
from posttrain.launch.tables import EngineKind

__all__ = ["demo_command", "up_command"]


# The options of `posttrain up`, one alias each, so the command's signature reads as a list.
_UpModelPath = Annotated[
    Path, typer.Option("--model-path", metavar="DIR", help="checkpoint directory to serve")
]

_UpEngines = Annotated[int, typer.Option("--engines", min=1, metavar="N", help="engine processes")]

_UpLora = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="NAME=PATH",
        help="a PEFT adapter every engine loads and every session uses [default: none]",
    ),
]

_UpEngine = Annotated[
    str | None,
    typer.Option(
        "--engine",
        metavar="KIND",
        help="local-engine or sglang [default: sglang "
        "where it imports and a GPU answers, else local-engine]",
    ),
]

_UpReadyTimeoutS = Annotated[
    float,
    typer.Option(
        "--ready-timeout-s",
        metavar="S",
        help="seconds each process may take to answer its health check",
    ),
]

_UpDryRun = Annotated[
    bool, typer.Option("--dry-run", help="print the plan, start nothing [default: off]")
]

_UpSessionRouterPort = Annotated[
    int,
    typer.Option(
        "--session-router-port",
        metavar="PORT",
        min=0,
        help="the session router's port (0: a free one)",
    ),
]

_UpRouterPort = Annotated[
    int,
    typer.Option("--router-port", metavar="PORT", min=0, help="sgl-router's port (0: a free one)"),
]

_UpRouterMetricsPort = Annotated[
    int,
    typer.Option(
        "--router-metrics-port",
        metavar="PORT",
        min=0,
        help="sgl-router's Prometheus port (0: a free one)",
    ),
]

_UpApiKey = Annotated[
    bool,
    typer.Option(
        "--api-key/--no-api-key",
        show_default=False,  # the help says it; typer's own would read "[default: api-key]"
        help="require a random per-stack key (stored 0600, path printed) on the "
        "engines' state-changing routes and on the session router [default: on]",
    ),
]


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _check_model_path(model_path: Path) -> None:
    """Refuse a --model-path that is neither a directory nor a hub id (org/name) before any
    process starts: otherwise each engine fails on it and the stack stops."""
    if model_path.is_dir() or (not model_path.exists() and _HUB_ID.fullmatch(str(model_path))):
        return
    what = "not a directory" if model_path.exists() else "no such directory"
    _fail(LaunchConfigError(f"--model-path {model_path}: {what} (nor a hub id org/name)"))


def _stack_modules(kind: EngineKind) -> list[str]:
    """The modules a local stack of ``kind`` engines runs (as processes) or imports."""
    engine = ENGINE_MODULES[kind].removesuffix(".launch_server")  # sglang.launch_server: sglang
    return ["posttrain.formats", "sglang_router", engine, "posttrain.session_router"]


def up_command(
    model_path: _UpModelPath,
    engines: _UpEngines = 2,
    lora: _UpLora = None,
    engine: _UpEngine = None,
    ready_timeout_s: _UpReadyTimeoutS = 300.0,
    dry_run: _UpDryRun = False,
    session_router_port: _UpSessionRouterPort = 0,
    router_port: _UpRouterPort = 0,
    router_metrics_port: _UpRouterMetricsPort = 0,
    api_key: _UpApiKey = True,
) -> None:
    """Start engines, the sgl-router and a session router on loopback; Ctrl-C stops all."""
    try:
        kind = EngineKind(engine) if engine else default_engine_kind()
    except ValueError:
        _fail(ValueError(f"--engine {engine!r} is not one of local-engine, sglang"))
    if not dry_run:
        _check_model_path(model_path)
        require("posttrain up", _stack_modules(kind))
    key = new_api_key() if api_key else None
    key_file = None
    if key is not None and not dry_run:  # the file exists before any process reads it
        key_file = write_key_file(key, f"stack-{os.getpid()}")
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
                api_key_file=(
                    "<the key file made at start>"
                    if key and dry_run
                    else None
                    if key_file is None
                    else str(key_file)
                ),
            )
        )
    except LaunchError as exc:
        if key_file is not None:
            remove_key_file(key_file)
        _fail(exc)
    if dry_run:
        DryRun(plan, console=_out).run()
        return
    _stop_on_signals()
    try:
        if key_file is not None:
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
    if model_path is not None:
        _check_model_path(model_path)
    require("posttrain demo", ["posttrain.models", *_stack_modules(EngineKind.LOCAL)])
    from posttrain.launch.demo import DemoConfig, run_demo

    sink, kept = (console_sink(_err), None) if verbose else tail_sink()
    _stop_on_signals()
    try:
        config = DemoConfig(model_path=model_path, engines=engines, turns=turns,
                            max_tokens=max_tokens, seed=seed)  # fmt: skip
        if verbose:
            report = run_demo(config, sink)
        else:
            with StackProgress(_err) as progress:
                report = run_demo(config, sink, progress)
    except KeyboardInterrupt:
        interrupted()
    except LaunchError as exc:
        fail_with_logs(exc, kept)
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
