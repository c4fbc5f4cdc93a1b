"""Token choice and the logprob lists SGLang reports.

Reported logprobs are the full-vocabulary fp32 log-softmax of the raw logits
(temperature 1), the quantity the trainer recomputes; SGLang does the same
unless told to return temperature-scaled values. Temperature, top-k and top-p
shape only the *sampling* distribution. Sampling is reproducible per request:
a request's ``seed`` (else the engine's random seed plus a request counter)
seeds a private ``torch.Generator`` that draws one uniform per step, so a
token never depends on which other requests share its batch.

``pick_tokens`` chooses a whole decode step's tokens at once: the rows that sample from the
full distribution (no top-k, top-p or min-p cut: the GRPO recipe's case) go through the same
operations as ``pick_token`` on a stacked ``[B, V]`` tensor (softmax, stable argsort and cumsum
along the row, a per-row binary search; each row's total mass summed alone, as a 1-D tensor),
each row still drawing its uniform from its own generator, so every token is ``pick_token``'s
to the bit (``test_pick_tokens_equals_pick_token_row_by_row``) at a fraction of the per-row op
overhead; every other row takes ``pick_token`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "pick_token", "pick_tokens", "top_logprobs"]


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


def _full_distribution(cfg: SamplingConfig) -> bool:
    """Whether ``cfg`` samples from the whole tempered distribution (no cut, not greedy)."""
    return cfg.temperature > 0.0 and cfg.top_k <= 0 and cfg.top_p >= 1.0 and cfg.min_p <= 0.0


def pick_tokens(
    rows: Sequence[torch.Tensor],
    cfgs: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """``pick_token(rows[i], cfgs[i], generators[i])`` for every i, the same tokens, with the
    rows that sample the full distribution at one temperature chosen together."""
    out = [-1] * len(rows)  # every slot is set below
    by_temperature: dict[float, list[int]] = {}
    for i, cfg in enumerate(cfgs):
        if _full_distribution(cfg):
            by_temperature.setdefault(cfg.temperature, []).append(i)
        else:
            out[i] = pick_token(rows[i], cfg, generators[i])
    for temperature, picked in by_temperature.items():
        if len(picked) == 1:
            i = picked[0]
            out[i] = pick_token(rows[i], cfgs[i], generators[i])
            continue
        logprobs = torch.stack([rows[i] for i in picked])
        scaled = torch.softmax(logprobs.double() / temperature, dim=-1)
        order = torch.argsort(-scaled, dim=-1, stable=True)
        probs = torch.gather(scaled, 1, order)
        # Each row's mass summed as pick_token sums it (a 1-D reduction of its own), so no
        # reduction ever spans two rows or depends on how many rows there are.
        total = torch.stack([row.sum() for row in probs]).unsqueeze(1)
        cdf = torch.cumsum(probs / total, dim=-1)
        u = torch.stack([torch.rand((), generator=generators[i], dtype=torch.float64)
                         for i in picked]).unsqueeze(1)  # fmt: skip
        idx = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)
        for i, tok in zip(picked, torch.gather(order, 1, idx).squeeze(1).tolist(), strict=True):
            out[i] = int(tok)
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The k most likely ``(logprob, id)`` pairs, descending, ties broken by lower id."""
    if k <= 0:
        return []
    order = torch.argsort(-logprobs, stable=True)[:k]
    return [(float(logprobs[i].item()), int(i.item())) for i in order]
