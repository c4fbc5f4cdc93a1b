"""Token choice and the logprob lists SGLang reports.

Reported logprobs are the full-vocabulary fp32 log-softmax of the raw logits
(temperature 1), the quantity the trainer recomputes; SGLang does the same
unless told to return temperature-scaled values. Temperature, top-k and top-p
shape only the *sampling* distribution. Sampling is reproducible per request:
a request's ``seed`` (else the engine's random seed plus a request counter)
seeds a private ``torch.Generator`` that draws one uniform per step, so a
token never depends on which other requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "pick_token", "top_logprobs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingConfig:
    """The sampling knobs of one request (SGLang names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0


def pick_token(logprobs: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> int:
    """Choose the next token from fp32 logprobs ``[V]``.

    Temperature 0 (or top_k 1) is greedy with ties to the lowest id. Otherwise the
    distribution ``softmax(logprobs / T)`` is cut to the top-k ids, then to the
    smallest prefix (by descending probability, ties by id) whose mass reaches top_p,
    renormalised, and inverted at one uniform draw from ``generator``.
    """
    if cfg.temperature <= 0.0 or cfg.top_k == 1:
        return int(torch.argmax(logprobs).item())
    scaled = torch.softmax(logprobs.double() / cfg.temperature, dim=-1)
    # A stable order (descending probability, then ascending id) makes the cut deterministic.
    order = torch.argsort(-scaled, stable=True)
    probs = scaled[order]
    keep = probs.numel()
    if cfg.top_k > 0:
        keep = min(keep, cfg.top_k)
    if cfg.top_p < 1.0:
        cum = torch.cumsum(probs[:keep], dim=0)
        # keep tokens until the mass before them reaches top_p (the first always stays)
        keep = max(1, int(((cum - probs[:keep]) < cfg.top_p).sum().item()))
    if cfg.min_p > 0.0:
        keep = max(1, min(keep, int((probs >= cfg.min_p * probs[0]).sum().item())))
    kept = probs[:keep]
    cdf = torch.cumsum(kept / kept.sum(), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    idx = min(int(torch.searchsorted(cdf, u, right=True).item()), keep - 1)
    return int(order[idx].item())


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The k most likely ``(logprob, id)`` pairs, descending, ties broken by lower id."""
    if k <= 0:
        return []
    order = torch.argsort(-logprobs, stable=True)[:k]
    return [(float(logprobs[i].item()), int(i.item())) for i in order]
