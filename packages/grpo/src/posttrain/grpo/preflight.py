"""Checks a run makes before it starts any process, run by ``--dry-run`` too.

``CHECKS`` is a list of ``Check(name, flag, run)``: ``run(config)`` raises a ``PosttrainError``
(or an ``OSError``) whose message says what is wrong; ``run_preflight`` runs every check,
collects each failure as one line that starts with the check's flag, and raises one
``PreflightError`` holding them all (the CLI prints it and exits 2). The trainer CLI runs
``run_preflight`` for ``--dry-run`` and at the start of a real run, before any rank starts, so
a dry run says "valid" only for what the run would accept.

Adding a check is one call: ``register(Check("name", "--flag", fn))`` (or append to
``CHECKS``). The checks here: the model config (``--model-path``, ``--engine-model-path``: a
directory whose ``config.json`` ``posttrain.models`` reads), the task (``--task``), the output
directory (``--out-dir``: writable, probed without creating it), the key file
(``--api-key-file``) and the resume checkpoint (``--resume``: found, its manifest, its
``meta.json`` and the values of its weight files; ``checkpoint.verify``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.config import GrpoConfig
from posttrain.interface import PosttrainError

__all__ = ["CHECKS", "Check", "PreflightError", "register", "run_preflight"]


class PreflightError(GrpoConfigError):
    """One or more preflight checks failed; ``failures`` holds one line per failure."""

    def __init__(self, failures: Sequence[str]) -> None:
        self.failures = tuple(failures)
        super().__init__("\n".join(self.failures))


@dataclass(frozen=True, slots=True)
class Check:
    """A named check of a config, reported under ``flag``."""

    name: str
    flag: str
    run: Callable[[GrpoConfig], None]


def _hub_id(path: Path) -> bool:
    """``org/name`` that names no local path: a hub id, fetched by the run, not checked here."""
    text = str(path)
    return not path.is_absolute() and not text.startswith(".") and len(path.parts) == 2


def _model_dir(path: Path | None) -> None:
    if path is None or (not path.exists() and _hub_id(path)):
        return
    if not path.exists():
        raise GrpoConfigError(f"{path} does not exist")
    if not path.is_dir():
        raise GrpoConfigError(f"{path} is a file, not a checkpoint directory")
    if not any(path.iterdir()):
        raise GrpoConfigError(f"{path} is an empty directory, not a checkpoint")
    from posttrain.models import load_config

    load_config(path)


def check_model(cfg: GrpoConfig) -> None:
    """``--model-path``: a checkpoint directory whose config ``posttrain.models`` reads."""
    _model_dir(cfg.model_path)


def check_engine_model(cfg: GrpoConfig) -> None:
    """``--engine-model-path``: as ``--model-path``."""
    _model_dir(cfg.engine_model_path)


def check_task(cfg: GrpoConfig) -> None:
    """``--task``: a task this build has."""
    from posttrain.grpo.rewards import TASK_NAMES

    if cfg.task not in TASK_NAMES:
        raise GrpoConfigError(f"{cfg.task!r} is not one of {', '.join(TASK_NAMES)}")


def check_out_dir(cfg: GrpoConfig) -> None:
    """``--out-dir``: a directory this process can write (or can create), probed by writing a
    temporary file in it (or in its nearest existing parent, which is left as it was)."""
    out = Path(cfg.out_dir).absolute()
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise GrpoConfigError(f"{out}: {probe} is a file, not a directory")
    with tempfile.NamedTemporaryFile(dir=probe, prefix=".posttrain-preflight-"):
        pass


def check_api_key_file(cfg: GrpoConfig) -> None:
    """``--api-key-file``: readable, one token."""
    cfg.api_key()


def check_resume(cfg: GrpoConfig) -> None:
    """``--resume``: a checkpoint that ``checkpoint.load`` would accept, checked without loading
    it into a model: found, manifest, ``meta.json`` (with the loop's ``extra``), weight values."""
    if cfg.resume is None:
        return
    from posttrain.grpo import checkpoint

    path = checkpoint.find(cfg.resume)
    meta = checkpoint.verify(path)
    for key in ("next_step", "data_position"):
        value = meta.extra.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise GrpoConfigError(f"{path}: meta.json extra.{key} is {value!r}, not a step count")


CHECKS: list[Check] = [
    Check("model config", "--model-path", check_model),
    Check("engine model config", "--engine-model-path", check_engine_model),
    Check("task", "--task", check_task),
    Check("output directory", "--out-dir", check_out_dir),
    Check("API key file", "--api-key-file", check_api_key_file),
    Check("resume checkpoint", "--resume", check_resume),
]


def register(check: Check) -> Check:
    """Add ``check`` to ``CHECKS`` (run after those already there); returns it."""
    CHECKS.append(check)
    return check


def _line(flag: str, exc: BaseException) -> str:
    text = str(exc) if not isinstance(exc, OSError) else (exc.strerror or "cannot be used")
    if isinstance(exc, OSError) and exc.filename:
        text = f"{exc.filename}: {text}"
    text = text.splitlines()[0] if text else "refused"
    for prefix in (f"{flag}: ", f"{flag} "):  # a message that names the flag already
        if text.startswith(prefix):
            return text
    if text.startswith("--resume"):
        return text
    return f"{flag}: {text}"


def run_preflight(cfg: GrpoConfig, checks: Sequence[Check] | None = None) -> None:
    """Run every check; a ``PreflightError`` with one line per failure (each naming its flag)."""
    failures = []
    for check in CHECKS if checks is None else checks:
        try:
            check.run(cfg)
        except (PosttrainError, OSError, ValueError) as exc:
            failures.append(_line(check.flag, exc))
    if failures:
        raise PreflightError(failures)
