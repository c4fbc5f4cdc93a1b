"""Every SGLang engine argv in the golden plans parses with SGLang's own server parser.

Runs where ``sglang`` imports: CI runs it in the side environment ``.ci/sglang-conformance``
builds (a pinned sglang with ``--no-deps`` plus the light packages its parsers import), where it
must pass; the workspace's own suite skips it.
"""

import argparse
from pathlib import Path

import pytest

from posttrain.launch import Plan, Role
from posttrain.launch.plan import resolve_process

server_args = pytest.importorskip(
    "sglang.srt.server_args", reason="sglang is not importable here (optional test)"
)

GOLDEN = Path(__file__).parent / "golden"


def sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    server_args.ServerArgs.add_cli_args(parser)
    return parser


def engine_cases() -> list[tuple[str, list[str]]]:
    cases = []
    for path in sorted(GOLDEN.glob("*.json")):
        plan = Plan.from_json(path.read_text())
        for proc in plan.by_role(Role.ENGINE):
            argv, _, _ = resolve_process(proc, dict.fromkeys(range(plan.nodes), "127.0.0.1"), "py")
            if argv[1:3] == ["-m", "sglang.launch_server"]:
                cases.append((f"{path.stem}:{proc.name}", argv[3:]))
    return cases


CASES = engine_cases()


def test_there_are_sglang_engines_to_check() -> None:
    assert len(CASES) > 40


@pytest.mark.parametrize(("name", "argv"), CASES, ids=[c[0] for c in CASES])
def test_engine_argv_parses_with_sglang(name: str, argv: list[str]) -> None:
    ns = sglang_parser().parse_args(argv)
    assert ns.model_path == argv[argv.index("--model-path") + 1]
    assert ns.tp_size == int(argv[argv.index("--tp-size") + 1])
    assert ns.host == "127.0.0.1"
    if "--attention-backend" in argv:
        last = len(argv) - 1 - argv[::-1].index("--attention-backend")
        assert ns.attention_backend == argv[last + 1]
    assert ns.flashinfer_mla_disable_ragged == ("--flashinfer-mla-disable-ragged" in argv)
