"""Train vs serve logprobs of the same tokens, for checking that the two agree bit for bit.

``packed_logprobs`` scores segments the way a trainer does (one packed ``forward_logprobs``);
``decoded_logprobs`` scores them the way an engine serves them: each segment's prompt is
prefilled into its own KV-cache row, then every row is decoded together one token at a time,
the batch shrinking as rows finish (teacher-forced: the next token is the segment's own).
Both return one fp32 tensor on the CPU aligned like ``forward_logprobs`` (0.0 at each segment's
first token), so in strict numerics ``torch.equal(packed, decoded)`` is the parity check.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from posttrain.models._cache import KVCache
from posttrain.models._errors import ModelInputError
from posttrain.models._lora import AdapterArg, LoraAdapter
from posttrain.models._model import DecoderModel


def packed_logprobs(
    model: DecoderModel, segments: Sequence[Sequence[int]], *, lora: AdapterArg = None
) -> Tensor:
    """The training forward over the packed ``segments`` (``lora``: one adapter or one per
    segment), without autograd."""
    ids = torch.tensor([t for s in segments for t in s])
    with torch.no_grad():
        return model.forward_logprobs(ids, [len(s) for s in segments], lora=lora).cpu()


def decoded_logprobs(
    model: DecoderModel,
    segments: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    *,
    lora: AdapterArg = None,
    chunked_prefill: bool = False,
    after_prefill: Callable[[KVCache, list[int]], None] | None = None,
) -> Tensor:
    """Serve every segment from one KV cache: prefill its first ``prompt_lens[j]`` tokens (in
    two chunks with ``chunked_prefill``), then decode the rest in batched steps.

    Segment ``j`` lives in cache row ``j + 1`` (row 0 stays unused: rows are independent).
    ``after_prefill(cache, rows)`` runs once every prompt is in (e.g. a negative control that
    disturbs the cache).
    """
    per_row: list[LoraAdapter | None] = (
        [lora] * len(segments) if lora is None or isinstance(lora, LoraAdapter) else list(lora)
    )
    cache = model.new_kv_cache(len(segments) + 1)
    rows = [j + 1 for j in range(len(segments))]
    out = [torch.zeros(len(seg)) for seg in segments]
    dist: list[Tensor] = []
    for j, (seg, p) in enumerate(zip(segments, prompt_lens, strict=True)):
        if not 0 < p <= len(seg):
            raise ModelInputError(
                f"prompt_lens[{j}]={p} must be in [1, {len(seg)}] (segment length)"
            )
        cuts = [0, p // 2, p] if chunked_prefill and p > 1 else [0, p]
        last: Tensor | None = None
        for a, b in itertools.pairwise(cuts):
            step = model.prefill(cache, rows[j], list(seg[a:b]), lora=per_row[j])
            if last is not None:
                out[j][a] = last[seg[a]]
            for n in range(a + 1, b):
                out[j][n] = step.logprobs[n - a - 1, seg[n]]
            last = step.logprobs[-1]
        assert last is not None
        dist.append(last)
    if after_prefill is not None:
        after_prefill(cache, rows)
    pos = list(prompt_lens)
    while active := [j for j in range(len(segments)) if pos[j] < len(segments[j])]:
        toks = [segments[j][pos[j]] for j in active]
        for j, tok in zip(active, toks, strict=True):
            out[j][pos[j]] = dist[j][tok]
        adapters = [per_row[j] for j in active]
        step = model.decode_step(cache, [rows[j] for j in active], toks, lora=adapters)
        for n, j in enumerate(active):
            dist[j] = step.logprobs[n]
            pos[j] += 1
    return torch.cat(out)
