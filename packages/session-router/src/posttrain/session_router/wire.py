"""The wire format of ``POST /sessions/{id}/samples``: one safetensors file.

Tensors, for sample i:

    tokens.{i}             int64   prompt followed by response
    loss_mask.{i}          uint8   one 0/1 entry per response token
    rollout_log_probs.{i}  float64 one engine logprob per response token
    _samples_meta          uint8   UTF-8 JSON (below)

``_samples_meta`` is ``{"format": "posttrain-samples/1", "samples": [{"response_length", "status",
"weight_version", "reward", "metadata", "group_index", "index"}], "session_metadata",
"empty_reason"}``. Decoding is strict: dtypes are checked, never cast (a float token id or an int
logprob is a ``WireFormatError`` naming the tensor), leftover or missing tensors are rejected, and
encoding refuses values a cast would change. ``decode_samples(data, base=...)`` overlays the
decoded fields onto a deep copy of the driver's own sample (keeping its reward and indices unless
the wire carries them).
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

from posttrain.interface import ConfigError, Sample, SampleStatus, WireFormatError

FORMAT = "posttrain-samples/1"
META_KEY = "_samples_meta"
_DTYPES: Mapping[str, np.dtype[Any]] = {
    "tokens": np.dtype(np.int64),
    "loss_mask": np.dtype(np.uint8),
    "rollout_log_probs": np.dtype(np.float64),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedSamples:
    """What one ``/samples`` reply carries."""

    samples: list[Sample]
    session_metadata: dict[str, Any]
    empty_reason: str | None


def _exact_array(name: str, values: Sequence[Any], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    src = np.asarray(values)
    arr = np.ascontiguousarray(src.astype(dtype))
    if src.size and not np.array_equal(arr.astype(src.dtype), src):
        raise WireFormatError(f"{name}: values change when cast to {dtype}", field=name)
    return arr


def encode_samples(
    samples: Sequence[Sample],
    *,
    session_metadata: Mapping[str, Any] | None = None,
    empty_reason: str | None = None,
) -> bytes:
    """Serialize samples (and the session's metadata) to safetensors bytes."""
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    metas: list[dict[str, Any]] = []
    for i, s in enumerate(samples):
        tensors[f"tokens.{i}"] = _exact_array(f"tokens.{i}", s.tokens, _DTYPES["tokens"])
        tensors[f"loss_mask.{i}"] = _exact_array(
            f"loss_mask.{i}", s.loss_mask, _DTYPES["loss_mask"]
        )
        tensors[f"rollout_log_probs.{i}"] = _exact_array(
            f"rollout_log_probs.{i}", s.rollout_logprobs, _DTYPES["rollout_log_probs"]
        )
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
    meta = {
        "format": FORMAT,
        "samples": metas,
        "session_metadata": dict(session_metadata or {}),
        "empty_reason": empty_reason,
    }
    try:
        meta_bytes = json.dumps(meta, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise WireFormatError(
            f"{META_KEY}: metadata is not JSON-serializable: {exc}", field=META_KEY
        ) from exc
    tensors[META_KEY] = np.frombuffer(meta_bytes, dtype=np.uint8).copy()
    return bytes(st_save(tensors))


def _take(tensors: dict[str, np.ndarray[Any, Any]], name: str, kind: str) -> np.ndarray[Any, Any]:
    if name not in tensors:
        raise WireFormatError(f"{name}: tensor missing", field=name)
    arr = tensors.pop(name)
    if arr.dtype != _DTYPES[kind]:
        raise WireFormatError(f"{name}: dtype {arr.dtype}, expected {_DTYPES[kind]}", field=name)
    if arr.ndim != 1:
        raise WireFormatError(f"{name}: expected 1-D, got shape {arr.shape}", field=name)
    return arr


def decode_samples(data: bytes, *, base: Sample | None = None) -> DecodedSamples:
    """Parse a ``/samples`` reply; with ``base`` the fields are overlaid onto a deep copy of it."""
    try:
        tensors = dict(st_load(data))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise WireFormatError(f"not a safetensors payload: {exc}", field=META_KEY) from exc
    if META_KEY not in tensors:
        raise WireFormatError(f"{META_KEY}: tensor missing", field=META_KEY)
    raw_meta = tensors.pop(META_KEY)
    if raw_meta.dtype != np.uint8 or raw_meta.ndim != 1:
        raise WireFormatError(f"{META_KEY}: must be 1-D uint8", field=META_KEY)
    try:
        meta = json.loads(raw_meta.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"{META_KEY}: not UTF-8 JSON: {exc}", field=META_KEY) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise WireFormatError(f"{META_KEY}.format: expected {FORMAT!r}", field=f"{META_KEY}.format")
    entries = meta.get("samples")
    if not isinstance(entries, list):
        raise WireFormatError(f"{META_KEY}.samples: must be a list", field=f"{META_KEY}.samples")
    samples: list[Sample] = []
    for i, entry in enumerate(entries):
        field_prefix = f"{META_KEY}.samples[{i}]"
        if not isinstance(entry, dict):
            raise WireFormatError(f"{field_prefix}: must be an object", field=field_prefix)
        tokens = _take(tensors, f"tokens.{i}", "tokens")
        mask = _take(tensors, f"loss_mask.{i}", "loss_mask")
        logprobs = _take(tensors, f"rollout_log_probs.{i}", "rollout_log_probs")
        n = entry.get("response_length")
        if not isinstance(n, int) or not 0 <= n <= len(tokens):
            raise WireFormatError(
                f"{field_prefix}.response_length: {n!r} does not fit {len(tokens)} tokens",
                field=f"{field_prefix}.response_length",
            )
        fields: dict[str, Any] = {
            "prompt_ids": tokens[: len(tokens) - n].tolist(),
            "response_ids": tokens[len(tokens) - n :].tolist(),
            "rollout_logprobs": logprobs.tolist(),
            "loss_mask": mask.tolist(),
            "status": entry.get("status", "completed"),
            "weight_version": entry.get("weight_version"),
        }
        for optional in ("reward", "group_index", "index"):
            if entry.get(optional) is not None:
                fields[optional] = entry[optional]
        try:
            fields["status"] = SampleStatus(fields["status"])
            if base is None:
                sample = Sample(metadata=dict(entry.get("metadata") or {}), **fields)
            else:
                sample = copy.deepcopy(base)
                for key, value in fields.items():
                    setattr(sample, key, value)
                sample.metadata = {**sample.metadata, **dict(entry.get("metadata") or {})}
                sample.__post_init__()
        except (ConfigError, ValueError) as exc:
            raise WireFormatError(f"{field_prefix}: {exc}", field=field_prefix) from exc
        samples.append(sample)
    if tensors:
        raise WireFormatError(f"unexpected tensors: {sorted(tensors)}", field=sorted(tensors)[0])
    return DecodedSamples(
        samples=samples,
        session_metadata=dict(meta.get("session_metadata") or {}),
        empty_reason=meta.get("empty_reason"),
    )
