"""Checks a run makes before it starts any process, run by ``--dry-run`` too.

``CHECKS`` is a list of ``Check(name, flag, run)``: ``run(config)`` raises a ``PosttrainError``
(or an ``OSError``) whose message says what is wrong; ``run_preflight`` runs every check,
collects each failure as one line that starts with the check's flag, and raises one
``PreflightError`` holding them all (the CLI prints it and exits 2). The trainer CLI runs
``run_preflight`` for ``--dry-run``, and ``loop.run`` runs it at the start of a real run,
before any rank starts (under torchrun, on rank 0 alone, which broadcasts the outcome: every
rank raises the same ``PreflightError``), so a dry run says "valid" only for what the run would
accept.

Adding a check is one call: ``register(Check("name", "--flag", fn))`` (or append to
``CHECKS``). The checks here: the model gate (``model_check.check_model``: ``--model-path`` and
``--engine-model-path``, the family, the LoRA targets), the prompts, the reward and the eval
sets (``inputs_check``: ``--task``/``--prompt-data``, ``--reward``, ``--eval-data``), the output
directory (``--out-dir``: writable, probed without creating it), the key file
(``--api-key-file``) and the resume checkpoint (``--resume``: found, its manifest, its
``meta.json`` and the values of its weight files; ``checkpoint.verify``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.inputs_check import check_data, check_eval, check_reward
from posttrain.grpo.model_check import check_model
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


def check_out_dir(cfg: GrpoConfig) -> None:
    """``--out-dir``: a directory this process can write (or can create), probed by writing a
    temporary file in it (or in its nearest existing parent, which is left as it was)."""
    out = Path(cfg.out_dir).absolute()
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise GrpoConfigError(f"{out}: {probe} is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".posttrain-preflight-"):
            pass
    except OSError as exc:  # named by the directory the user gave, not the probe's file
        why = exc.strerror or type(exc).__name__
        raise GrpoConfigError(f"{out}: cannot write in {probe} ({why})") from exc


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
    Check("model", "--model-path", check_model),
    Check("data", "--prompt-data", check_data),
    Check("reward", "--reward", check_reward),
    Check("eval", "--eval-data", check_eval),
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
    if text.startswith("--"):  # a message that names its flag already
        return text
    return f"{flag}: {text}"


def run_preflight(
    cfg: GrpoConfig, checks: Sequence[Check] | None = None, *, skip: Collection[str] = ()
) -> None:
    """Run every check (but those named in ``skip``); a ``PreflightError`` with one line per
    failure (each naming its flag)."""
    failures = []
    for check in CHECKS if checks is None else checks:
        if check.name in skip:
            continue
        try:
            check.run(cfg)
        except (PosttrainError, OSError, ValueError) as exc:
            line = _line(check.flag, exc)
            if line not in failures:  # the reward check reads the data too: one line for both
                failures.append(line)
    if failures:
        raise PreflightError(failures)
