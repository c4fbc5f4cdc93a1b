"""Step records, the resume truncation, the summary and the reward-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from posttrain.grpo.metrics import MetricsLog, deterministic, summarize, write_report


def _record(step: int, reward: float, **extra: float) -> dict[str, float]:
    return {"step": step, "reward_mean": reward, "reward_std": 0.1,
            "train_rollout_logprob_abs_diff": 0.0, "time/rollout": 1.5, "time/train": 0.5,
            "tokens_per_s": 10.0, **extra}  # fmt: skip


def test_log_appends_and_a_resume_drops_the_later_steps(tmp_path: Path) -> None:
    quiet = Console(file=open(tmp_path / "tty.txt", "w"), force_terminal=False)  # noqa: SIM115
    with MetricsLog(tmp_path, total_steps=4, console=quiet) as log:
        for step in range(4):
            log.log(_record(step, 0.1 * step))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]
    resumed = MetricsLog(tmp_path, total_steps=4, start_step=2, console=quiet)
    assert [r["step"] for r in resumed.records] == [0, 1]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert "step 3" in (tmp_path / "tty.txt").read_text()  # plain lines off a terminal


def test_summary_and_report(tmp_path: Path) -> None:
    records = [_record(0, 0.2, opd_reverse_kl=1.5), _record(1, 0.7, opd_reverse_kl=0.4)]
    summary = summarize(records)
    assert summary["reward_first"] == 0.2
    assert summary["reward_last"] == 0.7
    assert summary["reward_gain"] == 0.7 - 0.2
    assert summary["train_rollout_logprob_abs_diff_all_zero"] is True
    assert summary["opd_reverse_kl_first"] == 1.5
    assert summary["opd_reverse_kl_last"] == 0.4
    assert summary["seconds_by_phase"] == {"rollout": 3.0, "train": 1.0}
    written = write_report(tmp_path, records, {"train": "lora"})
    assert json.loads((tmp_path / "summary.json").read_text()) == written
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summarize([]) == {"steps": 0}
    assert "opd_teacher_retries" not in summary  # no OPD record counted retries


def test_summary_totals_the_teacher_retries() -> None:
    records = [_record(0, 0.2, opd_reverse_kl=1.5, opd_teacher_retries=3.0),
               _record(1, 0.3, opd_reverse_kl=1.0, opd_teacher_retries=0.0),
               _record(2, 0.4, opd_reverse_kl=0.9, opd_teacher_retries=2.0)]  # fmt: skip
    assert summarize(records)["opd_teacher_retries"] == 5.0


def test_deterministic_drops_timing_only() -> None:
    kept = deterministic({**_record(3, 0.5), "train_tokens_per_s": 3.0})
    assert "time/rollout" not in kept
    assert "tokens_per_s" not in kept
    assert "train_tokens_per_s" not in kept
    assert kept["reward_mean"] == 0.5
    assert kept["step"] == 3
