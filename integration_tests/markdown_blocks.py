"""The code blocks of the project's Markdown files, and how the doc tests run them.

Every fenced block in ``README.md``, ``packages/*/README.md`` and ``docs/**/*.md`` is one of:

- ``python``: a script, run by the workspace's Python in a fresh temporary directory;
- ``bash``: commands, run by ``bash -euo pipefail`` in a fresh temporary directory, with the
  workspace's ``bin/`` first on ``PATH``; ``uv run`` finds the workspace through ``UV_PROJECT``
  and does not sync;
- ``text``: not code (a layout, a formula, a usage synopsis, captured output): nothing to run.

A fence without a language is an error, so no block is skipped by accident. An HTML comment on
the line right above a fence says how the block runs, when that is not the default:

``<!-- doc-test: install -->``
    the package's install line; ``test_packages_alone`` runs it into a fresh venv (``pip`` is
    ``uv pip`` with the lock's versions as constraints) from the repository root;
``<!-- doc-test: standalone -->``
    the package's example; ``test_packages_alone`` runs it in that venv, which holds only the
    package, ``posttrain-interface`` (and ``posttrain-formats``) and what they require;
``<!-- doc-test: server ready="REGEX" -->``
    a long-running command: started, awaited until a line of its output matches, then stopped
    with SIGINT (it must then exit by itself);
``<!-- doc-test: free-port=30000 -->``
    the literal port is replaced by a free one (the example stays copyable, the test never
    collides with a server someone else runs);
``<!-- doc-test: benchmark -->``
    a measurement (minutes of CPU): run only with ``POSTTRAIN_DOCS_BENCHMARKS=1``, from the
    repository root (its commands name scripts by their path there);
``<!-- doc-test: skip="REASON" -->``
    cannot run here (a GPU, the test suite itself); the reason is the skip message;
``<!-- doc-test: timeout=SECONDS -->``
    the limit for the block (default 300 s).

Several keys may share one comment: ``<!-- doc-test: server ready="^ready" timeout=600 -->``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.interface.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
LANGUAGES = ("python", "bash", "text")
KEYS = ("install", "standalone", "server", "ready", "free-port", "benchmark", "skip", "timeout")
DEFAULT_TIMEOUT_S = 300.0

_FENCE = re.compile(r"^(`{3,})(.*)$")
_DIRECTIVE = re.compile(r"^<!--\s*doc-test:(.*)-->\s*$")


class MarkdownError(ValueError):
    """A Markdown file breaks the convention above (the message names the file and line)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def timeout_s(self) -> float:
        return float(self.directives.get("timeout", DEFAULT_TIMEOUT_S))


def markdown_files() -> list[Path]:
    """The files the convention covers, in a stable order."""
    files = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]
    return files + sorted((ROOT / "docs").rglob("*.md"))


def parse_directives(text: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for token in shlex.split(text):
        key, _, value = token.partition("=")
        if key not in KEYS:
            raise MarkdownError(f"{where}: unknown doc-test key {key!r} (known: {KEYS})")
        out[key] = value
    return out


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with the directives right above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        where = f"{path.relative_to(ROOT)}:{i + 1}"
        fence, lang = opening.group(1), opening.group(2).strip()
        if lang not in LANGUAGES:
            raise MarkdownError(f"{where}: a fence must say one of {LANGUAGES}, not {lang!r}")
        directives: dict[str, str] = {}
        previous = _DIRECTIVE.match(lines[i - 1]) if i else None
        if previous:
            directives = parse_directives(previous.group(1), where)
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != fence:
            end += 1
        if end == len(lines):
            raise MarkdownError(f"{where}: the fence is never closed")
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(path=path, line=i + 1, lang=lang, code=code, directives=directives))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in markdown_files() for b in parse_blocks(path)]


def prepared_code(block: Block) -> str:
    code = block.code
    port = block.directives.get("free-port")
    if port:
        if port not in code:
            raise MarkdownError(f"{block.id}: free-port={port} but the block never names it")
        code = re.sub(rf"\b{re.escape(port)}\b", str(free_port()), code)
    return code


def argv_for(block: Block, code: str, workdir: Path, python: str) -> list[str]:
    if block.lang == "python":
        script = workdir / "example.py"
        script.write_text(code, encoding="utf-8")
        return [python, str(script)]
    return ["bash", "-euo", "pipefail", "-c", code]


@dataclass(slots=True)
class Outcome:
    returncode: int
    output: str
    ready: bool = True


def run_block(
    block: Block, *, workdir: Path, env: dict[str, str], python: str = sys.executable
) -> Outcome:
    """Run one block; a server block is stopped with SIGINT once its ready line appears."""
    argv = argv_for(block, prepared_code(block), workdir, python)
    if "server" not in block.directives:
        done = subprocess.run(
            argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=block.timeout_s, check=False,
        )  # fmt: skip
        return Outcome(done.returncode, done.stdout + done.stderr)
    return _run_server(block, argv, workdir, env)


def _run_server(block: Block, argv: list[str], workdir: Path, env: dict[str, str]) -> Outcome:
    ready = re.compile(block.directives.get("ready") or "ready")
    proc = subprocess.Popen(
        argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    seen = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if ready.search(line):
                seen.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + block.timeout_s
    try:
        while not seen.is_set() and proc.poll() is None and time.monotonic() < deadline:
            seen.wait(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        code: int | None = None
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            lines.append("(did not stop within 60 s of SIGINT; killed)\n")
    finally:  # whatever happened (a timeout, pytest's own), nothing of the block outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    reader.join(timeout=10)
    # Stopped by our SIGINT: 0, 130 (a shell's or CLI's report) or -2 (killed by the signal).
    ok = seen.is_set() and code in (0, 130, -signal.SIGINT)
    return Outcome(0 if ok else (code or 1), "".join(lines), ready=seen.is_set())


def workspace_env() -> dict[str, str]:
    """The environment doc blocks run in: the workspace's tools first, ``uv run`` not syncing."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["UV_PROJECT"] = str(ROOT)
    env["UV_NO_SYNC"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env
