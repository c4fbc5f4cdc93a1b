"""``StackProgress``: a finished step gets a tick; a failed or unfinished one never does."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from posttrain.launch.progress import StackProgress


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=120, color_system=None), buf


def test_a_finished_step_gets_a_tick_and_its_time() -> None:
    console, buf = _console()
    with StackProgress(console) as progress, progress.step("writing a checkpoint"):
        pass
    lines = [line for line in buf.getvalue().splitlines() if "writing a checkpoint" in line]
    assert len(lines) == 1
    assert lines[0].lstrip().startswith("✓")
    assert lines[0].rstrip().endswith(" s")


def test_a_failing_step_ends_with_a_cross_not_a_spinner_or_a_tick() -> None:
    console, buf = _console()
    with (
        pytest.raises(RuntimeError, match="boom"),
        StackProgress(console) as progress,
        progress.step("chat turn 1 through the session"),
    ):
        raise RuntimeError("boom")
    lines = [line for line in buf.getvalue().splitlines() if "chat turn 1" in line]
    assert len(lines) == 1, buf.getvalue()
    assert lines[0].startswith("✗ chat turn 1 through the session failed ")
    assert "✓" not in buf.getvalue()


def test_an_interrupted_step_says_so() -> None:
    console, buf = _console()
    with (
        pytest.raises(KeyboardInterrupt),
        StackProgress(console) as progress,
        progress.step("collecting the training sample"),
    ):
        raise KeyboardInterrupt
    assert "✗ collecting the training sample interrupted " in buf.getvalue()


def test_a_process_that_never_got_ready_is_closed_when_the_display_closes() -> None:
    console, buf = _console()

    def engine_0_never_ready() -> None:
        with StackProgress(console) as progress:
            progress.on_event("engine-0", "starting")
            progress.on_event("engine-1", "starting")
            progress.on_event("engine-1", "ready")
            raise TimeoutError("engine-0 not ready")

    with pytest.raises(TimeoutError):
        engine_0_never_ready()
    out = buf.getvalue()
    assert "✗ starting engine-0 did not finish " in out
    assert "starting engine-1" not in out  # its line became "engine-1 ready", with a tick
    ready = [line for line in out.splitlines() if "engine-1 ready" in line]
    assert len(ready) == 1, out
    assert ready[0].lstrip().startswith("✓"), out
