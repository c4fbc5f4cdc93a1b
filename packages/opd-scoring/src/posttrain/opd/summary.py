"""Compact score summaries for logs and metrics (never payloads or whole tensors)."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.opd.client import OPDSignals

__all__ = ["summarize_batch"]


def _stats(xs: list[torch.Tensor]) -> dict[str, float] | None:
    flat = [x for x in xs if x.numel()]
    if not flat:
        return None
    t = torch.cat(flat).to(torch.float64)
    return {
        "mean": float(t.mean()),
        "min": float(t.min()),
        "max": float(t.max()),
        "tokens": t.numel(),
    }


def summarize_batch(signals: Sequence[OPDSignals]) -> dict[str, Any]:
    """One flat dict per scored batch: counts per teacher, wire cost, retries, signal ranges."""
    lat = [s.stats.latency_s for s in signals]
    return {
        "samples": len(signals),
        "teachers": dict(collections.Counter(s.teacher_name for s in signals)),
        "request_bytes": sum(s.stats.request_bytes for s in signals),
        "response_bytes": sum(s.stats.response_bytes for s in signals),
        "attempts": sum(s.stats.attempts for s in signals),
        "retried_samples": sum(1 for s in signals if s.stats.attempts > s.stats.requests),
        "latency_s": {"median": statistics.median(lat), "max": max(lat)} if lat else None,
        "teacher_log_probs": _stats(
            [s.teacher_log_probs for s in signals if s.teacher_log_probs is not None]
        ),
        "reverse_kl": _stats([s.reverse_kl for s in signals if s.reverse_kl is not None]),
    }
