"""Media in the token sequence: sentinel expansion and the placeholder positions of each item.

The convention, the same for the trainer and the engine:

1. A prompt holds **one sentinel token per media item**: ``config.image_token_id`` for an
   image, ``config.audio_token_id`` for an audio clip. The ``i``-th image sentinel (in
   token order) belongs to the ``i``-th image of the media list, the ``j``-th audio sentinel
   to the ``j``-th audio item (images and audio are matched separately, as SGLang matches
   ``image_data`` and ``audio_data``).
2. ``expand_media_tokens`` replaces each sentinel by a run of placeholder tokens (the
   sentinel id repeated), one per tower output: ``(H/p) * (W/p)`` patches of an image,
   ``frames`` of an audio clip. It returns the expanded ids and a ``MediaBatch`` that
   records where each run starts.
3. A forward (``DecoderModel.forward_logprobs``, ``extend``/``prefill``) takes those ids and
   the ``MediaBatch``; the tower outputs overwrite the embedding rows of the runs.
   Packed training batches use ``MediaBatch.pack`` (each sample's runs offset by the
   tokens before it); a response appended after the prompt needs no change.

``MediaBatch`` positions index the token sequence the forward receives: the packed ids of
``forward_logprobs``, or the new tokens of one cache row in ``extend`` (a run must lie
inside one ``extend`` call: prefill a prompt with media in one piece).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.interface import MediaKind as MediaKind  # the one enum (re-exported)
from posttrain.models._config import ModelConfig
from posttrain.models._errors import MediaError, ModelInputError


@dataclass(frozen=True, slots=True, eq=False)
class MediaItem:
    """One decoded media item: an image ``[H, W, 3]`` or mel bins ``[frames, n_mels]``, uint8.

    Build one from a reference with ``decode_image`` / ``decode_audio`` (``_media_io``) or
    directly from a tensor. Equality is by identity (``eq=False``); compare ``data`` with
    ``torch.equal``.
    """

    kind: MediaKind
    data: Tensor

    def __post_init__(self) -> None:
        kind = MediaKind(self.kind)
        object.__setattr__(self, "kind", kind)
        d = self.data
        if not isinstance(d, Tensor) or d.dtype != torch.uint8:
            raise MediaError(
                f"{kind} media data must be a uint8 tensor, got "
                f"{d.dtype if isinstance(d, Tensor) else type(d).__name__}"
            )
        if kind is MediaKind.IMAGE and (d.ndim != 3 or d.shape[2] != 3):
            raise MediaError(f"an image must be [H, W, 3] uint8, got shape {list(d.shape)}")
        if kind is MediaKind.AUDIO and d.ndim != 2:
            raise MediaError(f"audio mel bins must be [frames, n_mels] uint8, got {list(d.shape)}")
        if d.numel() == 0:
            raise MediaError(f"{kind} media data is empty (shape {list(d.shape)})")

    def num_tokens(self, config: ModelConfig) -> int:
        """Placeholder tokens (tower outputs) of this item under ``config``; checks the shape."""
        d = self.data
        if self.kind is MediaKind.IMAGE:
            if not config.has_vision_tower:
                raise MediaError(
                    "the model has no vision tower: it cannot take an image", kind="image"
                )
            p = config.vision_patch_size
            if d.shape[0] % p or d.shape[1] % p:
                raise MediaError(
                    f"image of {d.shape[0]}x{d.shape[1]} pixels is not a multiple of the "
                    f"vision patch size {p} in both dimensions",
                    kind="image",
                )
            return (d.shape[0] // p) * (d.shape[1] // p)
        if not config.has_audio_tower:
            raise MediaError("the model has no audio tower: it cannot take audio", kind="audio")
        if d.shape[1] != config.audio_num_mel_bins:
            raise MediaError(
                f"audio has {d.shape[1]} mel bins per frame, the audio tower takes "
                f"{config.audio_num_mel_bins}",
                kind="audio",
            )
        return int(d.shape[0])


def sentinel_id(config: ModelConfig, kind: MediaKind) -> int:
    """The sentinel (and placeholder) token id of ``kind`` under ``config``."""
    token = config.image_token_id if kind is MediaKind.IMAGE else config.audio_token_id
    if token is None:
        tower = "vision" if kind is MediaKind.IMAGE else "audio"
        raise MediaError(f"the model has no {tower} tower: it cannot take {kind} media")
    return token


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One media item placed in a token sequence: its run is ``[start, start + length)``."""

    item: MediaItem
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class MediaBatch:
    """The media of one token sequence (one sample, a packed batch, or one cache row's
    new tokens): spans in increasing ``start`` order, non-overlapping."""

    spans: tuple[MediaSpan, ...] = ()

    def __post_init__(self) -> None:
        end = 0
        for j, s in enumerate(self.spans):
            if s.start < end or s.length <= 0:
                raise MediaError(
                    f"MediaBatch.spans[{j}] (start {s.start}, length {s.length}) overlaps the "
                    "span before it or is empty: spans must be sorted and disjoint"
                )
            end = s.start + s.length

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self) -> Iterator[MediaSpan]:
        return iter(self.spans)

    @property
    def items(self) -> tuple[MediaItem, ...]:
        """The media items in sequence order."""
        return tuple(s.item for s in self.spans)

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens over all spans."""
        return sum(s.length for s in self.spans)

    def positions(self) -> list[int]:
        """Every placeholder position, span after span."""
        return [p for s in self.spans for p in range(s.start, s.start + s.length)]

    def shifted(self, offset: int) -> MediaBatch:
        """The same spans ``offset`` tokens later (for packing after other tokens)."""
        return MediaBatch(tuple(MediaSpan(s.item, s.start + offset, s.length) for s in self.spans))

    @classmethod
    def pack(
        cls, batches: Sequence[MediaBatch | None], segment_lengths: Sequence[int]
    ) -> MediaBatch:
        """One batch for packed segments: batch ``j``'s spans offset by the tokens of the
        segments before it (``None`` = a text-only segment). Each segment's spans must fit in
        its own length."""
        if len(batches) != len(segment_lengths):
            raise MediaError(
                f"MediaBatch.pack got {len(batches)} media batches for "
                f"{len(segment_lengths)} segments"
            )
        spans: list[MediaSpan] = []
        offset = 0
        for j, (batch, n) in enumerate(zip(batches, segment_lengths, strict=True)):
            if batch is not None:
                for s in batch.spans:
                    if s.start + s.length > n:
                        raise MediaError(
                            f"segment {j} has {n} tokens but a media run ends at "
                            f"{s.start + s.length}"
                        )
                spans.extend(batch.shifted(offset).spans)
            offset += n
        return cls(tuple(spans))


def expand_media_tokens(
    prompt_ids: Sequence[int], media: Sequence[MediaItem], config: ModelConfig
) -> tuple[list[int], MediaBatch]:
    """Expand each media sentinel of ``prompt_ids`` into its placeholder run.

    ``media`` is the list of items in prompt order; the ``i``-th image sentinel takes the
    ``i``-th image of ``media`` and the ``j``-th audio sentinel the ``j``-th audio item.
    Returns ``(expanded_ids, MediaBatch)``. Raises ``MediaError`` when the number of
    sentinels of a kind differs from the number of items of that kind, or the model has no
    tower for an item (or for a sentinel found in the prompt).
    """
    queues: dict[MediaKind, list[MediaItem]] = {MediaKind.IMAGE: [], MediaKind.AUDIO: []}
    for item in media:
        if not isinstance(item, MediaItem):
            raise MediaError(f"media holds a {type(item).__name__}, not a MediaItem")
        item.num_tokens(config)  # the model has a tower for it and the shape fits
        queues[item.kind].append(item)
    sentinels = {
        tok: kind
        for kind, tok in (
            (MediaKind.IMAGE, config.image_token_id),
            (MediaKind.AUDIO, config.audio_token_id),
        )
        if tok is not None
    }
    counts = {kind: sum(1 for t in prompt_ids if sentinels.get(int(t)) is kind) for kind in queues}
    for kind, items in queues.items():
        if counts[kind] != len(items):
            raise MediaError(
                f"the prompt has {counts[kind]} {kind} sentinel token(s) but "
                f"{len(items)} {kind} item(s) were given",
                kind=kind,
            )
    out: list[int] = []
    spans: list[MediaSpan] = []
    taken = {MediaKind.IMAGE: 0, MediaKind.AUDIO: 0}
    for t in prompt_ids:
        found = sentinels.get(int(t))
        if found is None:
            out.append(int(t))
            continue
        item = queues[found][taken[found]]
        taken[found] += 1
        n = item.num_tokens(config)
        spans.append(MediaSpan(item, len(out), n))
        out.extend([int(t)] * n)
    return out, MediaBatch(tuple(spans))


def check_media_positions(ids: Tensor, media: MediaBatch, config: ModelConfig) -> None:
    """Refuse a ``MediaBatch`` whose runs leave ``ids`` or do not sit on their sentinel id."""
    n = int(ids.shape[0])
    for j, s in enumerate(media.spans):
        if s.start < 0 or s.start + s.length > n:
            raise ModelInputError(
                f"media span {j} covers tokens [{s.start}, {s.start + s.length}) of a "
                f"sequence of {n} tokens"
            )
        want = s.item.num_tokens(config)
        if want != s.length:
            raise ModelInputError(
                f"media span {j} has {s.length} placeholder tokens, its {s.item.kind} needs {want}"
            )
        tok = sentinel_id(config, s.item.kind)
        run = ids[s.start : s.start + s.length]
        if bool((run != tok).any()):
            bad = s.start + int((run != tok).nonzero()[0, 0])
            raise ModelInputError(
                f"media span {j} ({s.item.kind}) covers token {bad} = {int(ids[bad])}, "
                f"not the placeholder id {tok}"
            )
