"""samples/1: training samples as one safetensors file (what ``POST /sessions/{id}/samples`` answers).

Tensors, for sample i:

    tokens.{i}             int64   prompt followed by response
    loss_mask.{i}          uint8   one 0/1 entry per response token
    rollout_log_probs.{i}  float64 one engine logprob per response token
    _samples_meta          uint8   UTF-8 JSON (below)

``_samples_meta`` is ``{"format": "posttrain-samples/1", "samples": [{"response_length",
"status", "weight_version", "reward", "metadata", "group_index", "index"}],
"session_metadata", "empty_reason"}``; ``weight_version`` is an int or null.

samples/2 (``MEDIA_SAMPLES_FORMAT``) is samples/1 plus one key per sample entry, ``"media"``: the
prompt's media references, ``[{"kind": "image"|"audio", "ref": str}]`` (``MediaRef``, the
reference exactly as the engine got it in ``image_data``/``audio_data``). A payload is written as
samples/2 only when a sample carries media, so text-only payloads stay samples/1 byte for byte
and every reader of samples/1 still reads them; a samples/1-only reader refuses a samples/2
payload by its format name instead of training on the text without its images. The decoder
reads both.

Reading needs only numpy and safetensors (no torch, no server). Decoding is strict: dtypes are
checked, never cast (a float token id or an int logprob is a ``SamplesFormatError`` naming the
tensor), leftover or missing tensors are rejected, every metadata field is type-checked, and
encoding refuses values a cast would change. ``decode_samples(data, base=...)`` overlays the
decoded fields onto a deep copy of the driver's own sample (keeping its reward and indices
unless the wire carries them).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from posttrain.formats._errors import SamplesFormatError
from posttrain.interface import ConfigError, MediaRef, Sample, SampleStatus

SAMPLES_FORMAT = "posttrain-samples/1"
MEDIA_SAMPLES_FORMAT = "posttrain-samples/2"
_READABLE_FORMATS = (SAMPLES_FORMAT, MEDIA_SAMPLES_FORMAT)
STUDENT_TOP_LOGPROBS_KEY = "opd_student_top_logprobs"
"""The sample metadata key holding the student's top-k logprob rows, one per response token
(SGLang's row layout, ``[]`` for a token the engine did not sample): the session router
writes it, on-policy distillation scoring reads it."""
META_KEY = "_samples_meta"
_DTYPES: Mapping[str, np.dtype[Any]] = {
    "tokens": np.dtype(np.int64),
    "loss_mask": np.dtype(np.uint8),
    "rollout_log_probs": np.dtype(np.float64),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedSamples:
    """What one samples/1 payload carries."""

    samples: list[Sample]
    session_metadata: dict[str, Any]
    empty_reason: str | None


def _exact_array(name: str, values: Sequence[Any], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    src = np.asarray(values)
    arr = np.ascontiguousarray(src.astype(dtype))
    if src.size and not np.array_equal(arr.astype(src.dtype), src):
        raise SamplesFormatError(f"{name}: values change when cast to {dtype}", field=name)
    return arr


def encode_samples(
    samples: Sequence[Sample],
    *,
    session_metadata: Mapping[str, Any] | None = None,
    empty_reason: str | None = None,
) -> bytes:
    """Serialize samples (and the session's metadata) to samples/1 safetensors bytes."""
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    metas: list[dict[str, Any]] = []
    with_media = any(s.media for s in samples)
    for i, s in enumerate(samples):
        for kind, values in (
            ("tokens", s.tokens),
            ("loss_mask", s.loss_mask),
            ("rollout_log_probs", s.rollout_logprobs),
        ):
            tensors[f"{kind}.{i}"] = _exact_array(f"{kind}.{i}", values, _DTYPES[kind])
        metas.append(
            {
                "response_length": s.response_length,
                "status": s.status.value,
                "weight_version": s.weight_version,
                "reward": s.reward,
                "metadata": s.metadata,
                "group_index": s.group_index,
                "index": s.index,
            }
        )
        if with_media:
            metas[-1]["media"] = [m.to_dict() for m in s.media]
    meta = {
        "format": MEDIA_SAMPLES_FORMAT if with_media else SAMPLES_FORMAT,
        "samples": metas,
        "session_metadata": dict(session_metadata or {}),
        "empty_reason": empty_reason,
    }
    try:
        meta_bytes = json.dumps(meta, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise SamplesFormatError(
            f"{META_KEY}: metadata is not JSON-serializable: {exc}", field=META_KEY
        ) from exc
    tensors[META_KEY] = np.frombuffer(meta_bytes, dtype=np.uint8).copy()
    return bytes(st_save(tensors))


def _take(tensors: dict[str, np.ndarray[Any, Any]], name: str, kind: str) -> np.ndarray[Any, Any]:
    if name not in tensors:
        raise SamplesFormatError(f"{name}: tensor missing", field=name)
    arr = tensors.pop(name)
    if arr.dtype != _DTYPES[kind]:
        raise SamplesFormatError(f"{name}: dtype {arr.dtype}, expected {_DTYPES[kind]}", field=name)
    if arr.ndim != 1:
        raise SamplesFormatError(f"{name}: expected 1-D, got shape {arr.shape}", field=name)
    return arr


def _typed(entry: Mapping[str, Any], key: str, types: tuple[type, ...], where: str) -> Any:
    """``entry[key]`` when it is None or of ``types`` (bools are not ints), else an error."""
    value = entry.get(key)
    if value is None or (isinstance(value, types) and not isinstance(value, bool)):
        return value
    names = " or ".join(t.__name__ for t in types)
    raise SamplesFormatError(
        f"{where}.{key}: expected {names} or null, got {value!r}", field=f"{where}.{key}"
    )


def _read_meta(tensors: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
    if META_KEY not in tensors:
        raise SamplesFormatError(f"{META_KEY}: tensor missing", field=META_KEY)
    raw_meta = tensors.pop(META_KEY)
    if raw_meta.dtype != np.uint8 or raw_meta.ndim != 1:
        raise SamplesFormatError(f"{META_KEY}: must be 1-D uint8", field=META_KEY)
    try:
        meta = json.loads(raw_meta.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SamplesFormatError(f"{META_KEY}: not UTF-8 JSON: {exc}", field=META_KEY) from exc
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE_FORMATS:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise SamplesFormatError(
            f"{META_KEY}.format: expected {SAMPLES_FORMAT!r} or {MEDIA_SAMPLES_FORMAT!r}, "
            f"got {got!r}",
            field=f"{META_KEY}.format",
        )
    for key, types in (
        ("samples", (list,)),
        ("session_metadata", (dict,)),
        ("empty_reason", (str,)),
    ):
        value = _typed(meta, key, types, META_KEY)
        if key == "samples" and value is None:
            raise SamplesFormatError(
                f"{META_KEY}.samples: must be a list", field=f"{META_KEY}.samples"
            )
    return meta


def _media(entry: Mapping[str, Any], where: str, *, allowed: bool) -> list[MediaRef]:
    """A samples/2 entry's media list (type-checked); samples/1 has none."""
    if not allowed:
        raise SamplesFormatError(
            f"{where}.media: only a {MEDIA_SAMPLES_FORMAT!r} payload carries media",
            field=f"{where}.media",
        )
    value = entry["media"]
    if not isinstance(value, list):
        raise SamplesFormatError(f"{where}.media: must be a list", field=f"{where}.media")
    try:
        return [MediaRef.from_dict(m, where=f"{where}.media[{j}]") for j, m in enumerate(value)]
    except ConfigError as exc:
        raise SamplesFormatError(str(exc), field=f"{where}.media") from exc


def _sample_fields(
    tensors: dict[str, np.ndarray[Any, Any]], i: int, entry: Any, *, media: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``Sample`` fields of entry i and its metadata (type-checked, not yet validated)."""
    where = f"{META_KEY}.samples[{i}]"
    if not isinstance(entry, dict):
        raise SamplesFormatError(f"{where}: must be an object", field=where)
    tokens = _take(tensors, f"tokens.{i}", "tokens")
    mask = _take(tensors, f"loss_mask.{i}", "loss_mask")
    logprobs = _take(tensors, f"rollout_log_probs.{i}", "rollout_log_probs")
    n = _typed(entry, "response_length", (int,), where)
    if n is None or not 0 <= n <= len(tokens):
        raise SamplesFormatError(
            f"{where}.response_length: {n!r} does not fit {len(tokens)} tokens",
            field=f"{where}.response_length",
        )
    fields: dict[str, Any] = {
        "prompt_ids": tokens[: len(tokens) - n].tolist(),
        "response_ids": tokens[len(tokens) - n :].tolist(),
        "rollout_logprobs": logprobs.tolist(),
        "loss_mask": mask.tolist(),
        "status": _typed(entry, "status", (str,), where) or SampleStatus.COMPLETED.value,
        "weight_version": _typed(entry, "weight_version", (int,), where),
    }
    if "media" in entry:  # absent: the sample's own (or base's) media stay as they are
        fields["media"] = _media(entry, where, allowed=media)
    for key, types in (("reward", (int, float)), ("group_index", (int,)), ("index", (int,))):
        value = _typed(entry, key, types, where)
        if value is not None:
            fields[key] = value
    return fields, dict(_typed(entry, "metadata", (dict,), where) or {})


def decode_samples(data: bytes, *, base: Sample | None = None) -> DecodedSamples:
    """Parse samples/1 bytes; with ``base`` the fields are overlaid onto a deep copy of it."""
    try:
        tensors = dict(st_load(data))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise SamplesFormatError(f"not a safetensors payload: {exc}", field=META_KEY) from exc
    meta = _read_meta(tensors)
    samples: list[Sample] = []
    for i, entry in enumerate(meta["samples"]):
        fields, metadata = _sample_fields(
            tensors, i, entry, media=meta["format"] == MEDIA_SAMPLES_FORMAT
        )
        try:
            fields["status"] = SampleStatus(fields["status"])
            if base is None:
                sample = Sample(metadata=metadata, **fields)
            else:
                sample = copy.deepcopy(base)
                for key, value in fields.items():
                    setattr(sample, key, value)
                sample.metadata = {**sample.metadata, **metadata}
                sample.__post_init__()
        except (ConfigError, ValueError) as exc:
            where = f"{META_KEY}.samples[{i}]"
            raise SamplesFormatError(f"{where}: {exc}", field=where) from exc
        samples.append(sample)
    if tensors:
        raise SamplesFormatError(f"unexpected tensors: {sorted(tensors)}", field=sorted(tensors)[0])
    return DecodedSamples(
        samples=samples,
        session_metadata=dict(meta.get("session_metadata") or {}),
        empty_reason=meta.get("empty_reason"),
    )
