"""The trainer's batch: a step's samples as the loss reads them, typed from ``Sample`` on.

A rollout ``Sample`` becomes a ``TrainSample`` (prompt + response ids and the per-response-token
arrays the loss needs: loss mask, rollout logprobs, advantages); a micro-batch of them is packed
into one ``PackedBatch`` (every sequence back to back, the logits row predicting each response
token, the response-token tensors flattened in sample order) or, under context parallel, one
``ContextParallelBatch`` (values on the token they score, each sequence padded at its end to the
zigzag layout's multiple, the aggregation applied as per-token weights). The objective
(``posttrain.grpo.objective``) reads the named fields; nothing in between is a ``dict``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.grpo._errors import GrpoInputError
from posttrain.grpo.losses import aggregation_weights
from posttrain.grpo.objective import LossSettings
from posttrain.interface import MediaRef
from posttrain.models import DecoderModel, MediaBatch, decode_media_refs, expand_media_tokens
from posttrain.models import context_parallel as cp

CP_LAYOUT = cp.CPLayout.ZIGZAG  # load-balanced: rank r holds chunks r and 2C-1-r of a sequence


@dataclass(kw_only=True, slots=True)
class TrainSample:
    """One sample as the trainer needs it (prompt + response ids, per-response-token arrays).

    ``tokens`` hold the prompt as the engine got it (one sentinel per media item); ``media``
    are the references of those items (``Sample.media``), expanded when the batch is packed.
    """

    tokens: list[int]
    prompt_len: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantages: list[float]
    media: list[MediaRef] = field(default_factory=list)

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """A micro-batch packed for one forward (no context parallel).

    ``ids``/``lengths``: the sequences back to back (media sentinels expanded); ``rows``: the
    logits row predicting each response token; ``targets``, ``mask``, ``rollout``,
    ``advantages``: one entry per response token, in sample order; ``response_lengths``: the
    response tokens of each sample; ``media``: the packed media (None: text only);
    ``shared_prefixes``: ``DecoderModel.forward_logits``' argument when samples share their
    prompt's tokens (None: every sample packed whole).
    """

    ids: Tensor
    lengths: list[int]
    rows: Tensor
    targets: Tensor
    mask: Tensor
    rollout: Tensor
    advantages: Tensor
    response_lengths: list[int]
    media: MediaBatch | None
    shared_prefixes: list[tuple[int, int]] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextParallelBatch:
    """A micro-batch packed for a context-parallel forward: every tensor has one entry per
    token of the padded stream (``lengths``: each sequence padded to the layout's multiple);
    ``weights``: the aggregation as per-token weights over whole sequences."""

    ids: Tensor
    lengths: tuple[int, ...]
    mask: Tensor
    rollout: Tensor
    advantages: Tensor
    weights: Tensor


def expand_sample_media(
    sample: TrainSample, model: DecoderModel
) -> tuple[list[int], int, MediaBatch | None]:
    """The sample's tokens with every media sentinel expanded into its placeholder run, the
    expanded prompt length and the runs (None for a text-only sample)."""
    if not sample.media:
        return list(sample.tokens), sample.prompt_len, None
    media = decode_media_refs(model.config, sample.media)
    prompt, batch = expand_media_tokens(sample.tokens[: sample.prompt_len], media, model.config)
    return prompt + list(sample.tokens[sample.prompt_len :]), len(prompt), batch


def pack(
    samples: Sequence[TrainSample],
    device: torch.device,
    model: DecoderModel,
    *,
    share_prompts: bool = False,
) -> PackedBatch:
    """``samples`` as one ``PackedBatch`` on ``device`` (media decoded and expanded).

    ``share_prompts`` (for a model that ``takes_shared_prefixes``; text-only batches): a sample
    whose prompt is the prompt of the last sample packed whole (a group's samples, consecutive)
    is packed as its response tokens only, sharing that sample's prompt tokens; its first
    response token is scored from the shared prompt's last row. The logits are the ones of
    every sample packed whole (in strict numerics the same bits), for each prompt's work done
    once."""
    expanded = [expand_sample_media(s, model) for s in samples]
    share_prompts = share_prompts and all(b is None for _, _, b in expanded)  # text only
    packed: list[list[int]] = []  # each sample's tokens in the stream
    shared: list[tuple[int, int]] = []
    rows: list[int] = []  # logits row predicting each response token
    start, root, root_start = 0, -1, 0
    for i, ((toks, prompt_len, _), s) in enumerate(zip(expanded, samples, strict=True)):
        prompt = toks[:prompt_len]
        child = (
            share_prompts and root >= 0 and s.response_len > 0
            and prompt == expanded[root][0][: expanded[root][1]]
        )  # fmt: skip
        if child:
            own = toks[prompt_len:]
            shared.append((root, prompt_len))
            rows.append(root_start + prompt_len - 1)
            rows.extend(range(start, start + len(own) - 1))
        else:
            own = toks
            shared.append((-1, 0))
            rows.extend(range(start + prompt_len - 1, start + len(toks) - 1))
            if share_prompts and prompt_len > 0:
                root, root_start = i, start
        packed.append(own)
        start += len(own)
    ids = torch.tensor([t for toks in packed for t in toks], dtype=torch.long)
    lengths = [len(toks) for toks in packed]
    media = None
    if any(b is not None for _, _, b in expanded):
        media = MediaBatch.pack([b for _, _, b in expanded], lengths)
    targets = torch.tensor([t for s in samples for t in s.tokens[s.prompt_len :]], dtype=torch.long)
    return PackedBatch(
        ids=ids.to(device),
        lengths=lengths,
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        targets=targets.to(device),
        mask=torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool).to(device),
        rollout=torch.tensor([v for s in samples for v in s.rollout_logprobs]).to(device),
        advantages=torch.tensor([v for s in samples for v in s.advantages]).to(device),
        response_lengths=[s.response_len for s in samples],
        media=media,
        shared_prefixes=shared if any(p >= 0 for p, _ in shared) else None,
    )


def pack_context_parallel(
    samples: Sequence[TrainSample],
    cp_size: int,
    settings: LossSettings,
    *,
    capacity: int,
    global_batch_size: int,
    global_token_count: int,
) -> ContextParallelBatch:
    """The whole packed micro-batch, per token of the stream, every sequence padded at its end
    to the layout's multiple (pad and prompt tokens are masked out; causal attention and
    convolutions never let a pad token change an earlier one). Values sit on the token they
    score: the model's logprob convention (``out[t] = log p(ids[t] | ids[:t])``)."""
    lengths = [len(s.tokens) for s in samples]
    padded = cp.padded_segment_lengths(lengths, cp_size, CP_LAYOUT)
    for i, (n, p) in enumerate(zip(lengths, padded, strict=True)):
        if p > capacity:
            raise GrpoInputError(
                f"sample {i} of the micro-batch has {n} tokens; context parallel pads it to {p} "
                f"(a multiple of 2 x context_parallel_size={cp_size}), more than the model's "
                f"KV capacity {capacity} (--context-length)"
            )
    ids: list[int] = []
    mask: list[int] = []
    rollout: list[float] = []
    advantages: list[float] = []
    for s, n in zip(samples, padded, strict=True):
        pad = n - len(s.tokens)
        ids += [*s.tokens, *[s.tokens[-1]] * pad]
        mask += [0] * s.prompt_len + [int(m != 0) for m in s.loss_mask] + [0] * pad
        rollout += [0.0] * s.prompt_len + list(s.rollout_logprobs) + [0.0] * pad
        advantages += [0.0] * s.prompt_len + list(s.advantages) + [0.0] * pad
    full_mask = torch.tensor(mask, dtype=torch.bool)
    weights = aggregation_weights(
        full_mask, padded, mode=settings.aggregation,
        global_batch_size=global_batch_size, global_token_count=global_token_count,
    )  # fmt: skip
    return ContextParallelBatch(
        ids=torch.tensor(ids, dtype=torch.long),
        lengths=padded,
        mask=full_mask,
        rollout=torch.tensor(rollout, dtype=torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        weights=weights,
    )


def micro_batches(samples: Sequence[TrainSample], size: int) -> list[list[TrainSample]]:
    """Consecutive micro-batches of at most ``size`` samples (0: one micro-batch)."""
    if size <= 0 or size >= len(samples):
        return [list(samples)]
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]
