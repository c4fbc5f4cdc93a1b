"""Step metrics: one JSON line per step, a live terminal display, and the end-of-run report.

``<out>/metrics.jsonl`` holds one object per step (``step`` first, then the metric names below,
seconds per phase under ``time/<phase>``). A resumed run first drops the lines after its
checkpoint, so the file reads as if the run had never stopped. At the end ``<out>/summary.json``
(first and last reward, the best, mean parity gap, phase totals) and ``<out>/reward_curve.png``
(matplotlib, Agg backend) are written, each to a temporary name and renamed.

The terminal display is rich: a progress bar with the step's headline numbers and a table of
the latest metrics, redrawn in place on a terminal and printed as plain lines otherwise.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from posttrain.formats import AtomicFile, write_text_atomic

# Shown in the live table, in this order (missing ones are skipped).
HEADLINE = (
    "reward_mean",
    "reward_std",
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_max_abs_diff",
    "ppo_kl",
    "pg_clipfrac",
    "grad_norm",
    "entropy",
    "opd_reverse_kl",
    "opd_teacher_retries",
    "tis_weight_mean",
    "tokens_per_s",
)


def is_timing(key: str) -> bool:
    """Whether a metric measures wall time (``time/<phase>``, ``*_per_s``), not the computation."""
    return key.startswith("time/") or key.endswith("per_s")


def deterministic(record: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics record without its timing fields (what two identical runs must agree on)."""
    return {k: v for k, v in record.items() if not is_timing(k)}


class MetricsLog:
    """Appends step records to ``metrics.jsonl`` and drives the terminal display (rank 0)."""

    def __init__(self, out_dir: Path, *, total_steps: int, start_step: int = 0,
                 console: Console | None = None) -> None:  # fmt: skip
        self.path = out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self._truncate(start_step)
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("starting", total=total_steps, completed=start_step)
        self.live = Live(self._render(), console=self.console, refresh_per_second=4,
                         transient=False)  # fmt: skip

    def _truncate(self, start_step: int) -> None:
        """Keep the records of steps before ``start_step`` (a resumed run rewrites the rest)."""
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if int(record["step"]) < start_step:
                    kept.append(record)
        self.records = kept
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def __enter__(self) -> MetricsLog:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(None, None, None)

    def log(self, record: dict[str, Any]) -> None:
        """Append one step's record and refresh the display."""
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        desc = (
            f"reward {record.get('reward_mean', math.nan):.3f}  "
            f"|Δlogp| {record.get('train_rollout_logprob_abs_diff', math.nan):.3g}"
        )
        self.progress.update(self.task, completed=int(record["step"]) + 1, description=desc)
        self.live.update(self._render())
        if not self.console.is_terminal:
            self.console.print(_line(record), soft_wrap=True)

    def _render(self) -> Group:
        table = Table(show_header=True, header_style="bold", expand=False)
        table.add_column("metric")
        table.add_column("value", justify="right")
        last = self.records[-1] if self.records else {}
        for key in HEADLINE:
            if key in last:
                table.add_row(key, _fmt(last[key]))
        phases = {k: v for k, v in last.items() if k.startswith("time/")}
        if phases:
            table.add_row("seconds", "  ".join(f"{k[5:]} {v:.2f}" for k, v in phases.items()))
        return Group(self.progress, table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if value != 0.0 else "0"
    return str(value)


def _line(record: Mapping[str, Any]) -> str:
    keys = ("reward_mean", "train_rollout_logprob_abs_diff", "ppo_kl", "grad_norm",
            "opd_reverse_kl", "time/step")  # fmt: skip
    parts = [f"step {record['step']}"] + [f"{k} {_fmt(record[k])}" for k in keys if k in record]
    return "  ".join(parts)


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's summary: reward at the start and end, parity, OPD, phase totals."""
    if not records:
        return {"steps": 0}
    rewards = [float(r["reward_mean"]) for r in records]
    diffs = [float(r.get("train_rollout_logprob_abs_diff", math.nan)) for r in records]
    out: dict[str, Any] = {
        "steps": len(records),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_best": max(rewards),
        "reward_gain": rewards[-1] - rewards[0],
        "train_rollout_logprob_abs_diff_max": max(diffs),
        "train_rollout_logprob_abs_diff_all_zero": all(d == 0.0 for d in diffs),
    }
    rkl = [float(r["opd_reverse_kl"]) for r in records if "opd_reverse_kl" in r]
    if rkl:
        out["opd_reverse_kl_first"], out["opd_reverse_kl_last"] = rkl[0], rkl[-1]
    retries = [float(r["opd_teacher_retries"]) for r in records if "opd_teacher_retries" in r]
    if retries:  # requests the teacher failed (429/5xx, dropped) that a retry then got through
        out["opd_teacher_retries"] = sum(retries)
    phases: dict[str, float] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("time/"):
                phases[k[5:]] = phases.get(k[5:], 0.0) + float(v)
    out["seconds_by_phase"] = {k: round(v, 3) for k, v in phases.items()}
    return out


def write_report(
    out_dir: Path, records: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]
) -> dict[str, Any]:
    """Write ``summary.json`` and ``reward_curve.png``; returns the summary."""
    summary = {**summarize(records), **extra}
    write_text_atomic(out_dir / "summary.json", json.dumps(summary, indent=2, sort_keys=True))
    if records:
        plot_rewards(records, out_dir / "reward_curve.png")
    return summary


def plot_rewards(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Reward mean (± std) per step, each eval metric (``eval/<set>/...``) at the steps it was
    measured, and the OPD reverse KL when present, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in records]
    mean = [float(r["reward_mean"]) for r in records]
    std = [float(r.get("reward_std", 0.0)) for r in records]
    rkl = [float(r["opd_reverse_kl"]) for r in records if "opd_reverse_kl" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, marker="o", label="reward mean")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)], alpha=0.2)  # fmt: skip
    for key in sorted({k for r in records for k in r if k.startswith("eval/")}):
        points = [(int(r["step"]), float(r[key])) for r in records if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="s", linestyle=":",
                label=key)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if len(rkl) == len(steps):
        twin = ax.twinx()
        twin.plot(steps, rkl, color="tab:red", linestyle="--", label="OPD reverse KL")
        twin.set_ylabel("reverse KL to the teacher")
        twin.legend(loc="lower right")
    ax.legend(loc="upper left")
    ax.set_title("GRPO reward")
    fig.tight_layout()
    with AtomicFile(path) as out:
        fig.savefig(out.file, format="png", dpi=100)
    plt.close(fig)
