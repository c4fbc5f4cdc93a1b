"""The server's allocator: mimalloc preloaded by one re-exec of the CLI, and a light package import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from posttrain.interface.testing import ServerProcess, free_port
from posttrain.session_router import LoopbackWorker
from posttrain.session_router import allocator as alloc


def test_the_wheel_ships_a_preloadable_mimalloc() -> None:
    library = alloc.mimalloc_library()
    assert library is not None
    assert library.name == "libmimalloc.so"
    assert library.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("caller", [None, "", "/opt/libother.so"])
def test_preload_environment_round_trips_the_callers_ld_preload(caller: str | None) -> None:
    environ = {"PATH": "/bin"} | ({} if caller is None else {"LD_PRELOAD": caller})
    env = alloc.preload_environment(Path("/lib/libmimalloc.so"), environ)
    assert env["LD_PRELOAD"].split()[0] == "/lib/libmimalloc.so"
    if caller:
        assert env["LD_PRELOAD"].split()[1:] == [caller]
    assert alloc.REEXEC_MARKER in env
    assert alloc.restore_environment(env) is True
    assert env == environ
    assert alloc.restore_environment(env) is False  # not the re-executed process


def test_requested_allocator_reads_both_spellings() -> None:
    assert alloc.requested_allocator(["--upstream", "http://x"]) == alloc.DEFAULT_ALLOCATOR
    assert alloc.requested_allocator(["--allocator", "system"]) == "system"
    assert alloc.requested_allocator(["--port", "1", "--allocator=system"]) == "system"
    assert alloc.requested_allocator(["--alloc", "system"]) == "system"  # as argparse reads it
    assert alloc.requested_allocator(["--allocator"]) == alloc.DEFAULT_ALLOCATOR  # cli reports it


def test_loaded_allocator_reads_the_memory_map(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert alloc.loaded_allocator(maps) == "system"
    maps.write_text("7f00-7f01 r-xp 0 08:01 2 /venv/cmeel.prefix/lib/libmimalloc.so\n")
    assert alloc.loaded_allocator(maps) == "mimalloc"
    assert alloc.loaded_allocator(tmp_path / "missing") == "system"


class _ExecedError(Exception):
    pass


def _record_execve(calls: list[tuple[Any, ...]]) -> Any:
    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        calls.append((path, argv, env))
        raise _ExecedError

    return execve


def test_reexec_happens_once_and_only_when_mimalloc_is_wanted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(os, "execve", _record_execve(calls))
    monkeypatch.setattr(alloc, "loaded_allocator", lambda: "system")
    monkeypatch.delenv(alloc.REEXEC_MARKER, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/libother.so")

    alloc.reexec_with_allocator("system")
    assert calls == []

    with pytest.raises(_ExecedError):
        alloc.reexec_with_allocator("mimalloc")
    ((path, argv, env),) = calls
    assert path == sys.executable
    assert argv == sys.orig_argv
    assert env["LD_PRELOAD"] == f"{alloc.mimalloc_library()} /opt/libother.so"
    assert env[alloc.REEXEC_MARKER] == "set:/opt/libother.so"

    # The re-executed process: never again, even when the preload did not take.
    monkeypatch.setenv("LD_PRELOAD", env["LD_PRELOAD"])
    monkeypatch.setenv(alloc.REEXEC_MARKER, env[alloc.REEXEC_MARKER])
    alloc.reexec_with_allocator("mimalloc")
    assert len(calls) == 1
    assert os.environ["LD_PRELOAD"] == "/opt/libother.so"
    assert alloc.REEXEC_MARKER not in os.environ


def test_without_the_library_it_warns_and_serves_on_the_system_allocator(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(os, "execve", _record_execve(calls))
    monkeypatch.setattr(alloc, "loaded_allocator", lambda: "system")
    monkeypatch.setattr(alloc, "mimalloc_library", lambda: None)
    monkeypatch.delenv(alloc.REEXEC_MARKER, raising=False)
    alloc.reexec_with_allocator("mimalloc")
    assert calls == []
    assert "system allocator" in capsys.readouterr().err


def test_a_library_path_ld_preload_cannot_name_is_not_preloaded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(os, "execve", _record_execve(calls))
    monkeypatch.setattr(alloc, "loaded_allocator", lambda: "system")
    monkeypatch.setattr(alloc, "mimalloc_library", lambda: Path("/my venv/libmimalloc.so"))
    monkeypatch.delenv(alloc.REEXEC_MARKER, raising=False)
    alloc.reexec_with_allocator("mimalloc")
    assert calls == []
    assert "/my venv/libmimalloc.so" in capsys.readouterr().err


def test_importing_the_package_does_not_import_the_server() -> None:
    code = (
        "import sys, posttrain.session_router as s; "
        "heavy = [m for m in ('uvicorn', 'tokenizers', 'starlette', 'jinja2') if m in sys.modules]; "
        "print(heavy); s.SessionRouterConfig; print('uvicorn' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "False"  # the config does not need the server either


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("choice", ["mimalloc", "system"])
def test_cli_serves_on_the_allocator_it_was_asked_for(tok_dir: Path, choice: str) -> None:
    with LoopbackWorker() as worker:  # no /workers API: an engine, so no probe
        port = free_port()
        argv = [
            sys.executable, "-m", "posttrain.session_router", "--upstream", worker.url,
            "--tokenizer", str(tok_dir), "--port", str(port), "--allocator", choice,
        ]  # fmt: skip
        with ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=60) as server:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            assert health["allocator"] == choice
            # The re-exec keeps the pid the caller holds, so stopping by pid still works.
            maps = Path(f"/proc/{server.pid}/maps").read_text()
            assert ("libmimalloc" in maps) is (choice == "mimalloc")


def test_cli_rejects_an_unknown_allocator(tok_dir: Path) -> None:
    argv = [
        sys.executable, "-m", "posttrain.session_router", "--upstream", "http://127.0.0.1:9",
        "--tokenizer", str(tok_dir), "--allocator", "jemalloc",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--allocator" in done.stderr
    assert "jemalloc" in done.stderr
