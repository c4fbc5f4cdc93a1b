"""SGLang's ``/update_weights_from_tensor`` body for colocated engines (same GPUs as the trainer).

SGLang reads each entry of ``serialized_named_tensors`` (one per TP rank, base64 over HTTP) with
its ``MultiprocessingSerializer``: a pickle written by ``multiprocessing``'s ``ForkingPickler``
with torch's ``torch.multiprocessing`` reductions registered, so a tensor's storage travels as
a handle, not by value: a CUDA IPC handle for a GPU tensor (the engine maps the trainer's own
memory), a shared-memory file descriptor for a CPU one. The engine's restricted unpickler
accepts exactly those rebuild functions, plain containers and ``types.SimpleNamespace``.

``tensor_update_requests`` builds one request per bucket. With ``flattened`` (SGLang's
``load_format="flattened_bucket"``) a bucket is one ``uint8`` tensor holding every tensor's
bytes (each start aligned to 16 bytes, so SGLang's ``view(dtype)`` of its slice is valid) and
``metadata``, one record per tensor with ``name``, ``shape``, ``dtype``, ``start_idx``,
``end_idx`` and ``numel`` (the byte count): what ``FlattenedTensorBucket`` reconstructs from.
Without it a bucket is SGLang's default, a list of ``(name, tensor)`` pairs. The last bucket
carries ``flush_cache`` and ``weight_version``.

The handles are only valid while the trainer keeps the tensors alive: the caller holds them
until the engine answered. Nothing here unpickles: posttrain's CPU engine refuses this route by
name (it will not unpickle network input).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing

from posttrain.formats._buckets import FLATTENED_BUCKET, plan_buckets
from posttrain.formats._sglang_requests import UpdateWeightsFromTensorReq

__all__ = ["FLATTENED_BUCKET", "flatten_bucket", "serialize_for_engine", "tensor_update_requests"]

_ALIGN = 16  # bytes: every dtype's itemsize divides it


def serialize_for_engine(obj: Any) -> bytes:
    """``obj`` pickled as SGLang's ``MultiprocessingSerializer`` reads it (``ForkingPickler``
    with torch's reductions: tensor storages as IPC handles)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One bucket as SGLang's flattened form: ``{"flattened_tensor": uint8 tensor, "metadata":
    [record, ...]}``, on the tensors' device (they must share one)."""
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"a flattened bucket's tensors must share one device, got {devices}")
    records: list[SimpleNamespace] = []
    parts: list[torch.Tensor] = []
    offset = 0
    (device,) = devices
    for name, t in named:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -offset % _ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            offset += pad
        records.append(
            SimpleNamespace(
                name=name,
                shape=torch.Size(t.shape),
                dtype=t.dtype,
                start_idx=offset,
                end_idx=offset + raw.numel(),
                numel=raw.numel(),
            )
        )
        parts.append(raw)
        offset += raw.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return {"flattened_tensor": flat, "metadata": records}


def tensor_update_requests(
    named: Sequence[tuple[str, torch.Tensor]],
    *,
    weight_version: int | None,
    tp_size: int = 1,
    flattened: bool = True,
    bucket_bytes: int = 256 * 1024 * 1024,
) -> tuple[list[UpdateWeightsFromTensorReq], list[Any]]:
    """The requests of one update (one per bucket, the last ending it) and the objects whose
    storages they hand over (keep them alive until every engine answered)."""
    if tp_size < 1:
        raise ValueError(f"tp_size: {tp_size} < 1")
    buckets = plan_buckets([(n, t.detach().contiguous()) for n, t in named], bucket_bytes)
    requests: list[UpdateWeightsFromTensorReq] = []
    held: list[Any] = []
    for k, bucket in enumerate(buckets):
        payload: Any = flatten_bucket(bucket) if flattened else list(bucket)
        held.append(payload)
        blob = serialize_for_engine(payload)
        last = k == len(buckets) - 1
        requests.append(
            UpdateWeightsFromTensorReq(
                serialized_named_tensors=[blob] * tp_size,
                load_format=FLATTENED_BUCKET if flattened else None,
                flush_cache=last,
                weight_version=str(weight_version) if last and weight_version is not None else None,
            )
        )
    return requests, held
