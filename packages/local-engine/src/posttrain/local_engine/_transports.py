"""Engine-side readers of weight buckets: safetensors bytes over HTTP, shared memory.

HTTP: the body of ``POST /update_weights_from_safetensors`` is a safetensors file
whose ``__metadata__["manifest"]`` is the bucket manifest as JSON (safetensors
metadata values are strings). The tensors in the file must be exactly the
manifest's, with its dtypes and shapes; offsets describe the trainer's flat
layout and matter only for the optional sha256, which is checked by rebuilding
that layout.

Shared memory: the trainer owns a file under the shm directory holding a ring of
two slots; ``POST /update_weights_from_shm {manifest, shm_path, slot, slot_bytes}``
names the slot that holds the bucket. The engine maps each file once (paths
outside the shm directory are refused) and copies tensors out of the slot into
staging before replying, so the trainer may reuse the slot as soon as it has
the reply.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from posttrain.interface import BucketManifest, WireFormatError
from posttrain.local_engine._buckets import dtype_name, unpack_bucket

__all__ = ["ShmMaps", "read_safetensors_bucket", "safetensors_metadata"]


def safetensors_metadata(body: bytes) -> dict[str, str]:
    if len(body) < 8:
        raise WireFormatError("body: too short for a safetensors file", field="body")
    (n,) = struct.unpack("<Q", body[:8])
    if n > len(body) - 8:
        raise WireFormatError(f"body: safetensors header of {n} bytes overruns", field="body")
    try:
        header = json.loads(body[8 : 8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WireFormatError(f"body: safetensors header is not JSON ({e})", field="body") from e
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise WireFormatError("body: __metadata__ is not an object", field="__metadata__")
    return {str(k): str(v) for k, v in meta.items()}


def read_safetensors_bucket(body: bytes) -> tuple[BucketManifest, dict[str, torch.Tensor]]:
    """Decode a bucket sent as safetensors bytes; check it against its manifest."""
    meta = safetensors_metadata(body)
    if "manifest" not in meta:
        raise WireFormatError(
            "__metadata__.manifest: missing (the bucket manifest as JSON)",
            field="__metadata__.manifest",
        )
    manifest = BucketManifest.from_json(meta["manifest"])
    try:
        tensors = load_safetensors(body)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise WireFormatError(f"body: not a valid safetensors file ({e})", field="body") from e
    names = [entry.name for entry in manifest.tensors]
    extra = sorted(set(tensors) - set(names))
    absent = sorted(set(names) - set(tensors))
    if extra or absent:
        raise WireFormatError(
            f"body: tensors {extra} are not in the manifest, manifest tensors {absent} are not "
            "in the body",
            field="manifest.tensors",
        )
    for i, entry in enumerate(manifest.tensors):
        t = tensors[entry.name]
        if dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != tuple(entry.shape):
            raise WireFormatError(
                f"manifest.tensors[{i}]: tensor {entry.name!r} is {dtype_name(t.dtype)} "
                f"{list(t.shape)} in the body, {entry.dtype} {list(entry.shape)} in the manifest",
                field=f"manifest.tensors[{i}]",
            )
    if manifest.sha256 is not None:
        flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
        for entry in manifest.tensors:
            if entry.nbytes:
                src = tensors[entry.name].contiguous().reshape(-1).view(torch.uint8)
                flat[entry.offset : entry.end].copy_(src)
        unpack_bucket(manifest, flat)  # checks the digest
    return manifest, tensors


class ShmMaps:
    """Files under ``shm_dir`` mapped once each, by resolved path."""

    def __init__(self, shm_dir: str) -> None:
        self.root = Path(shm_dir).resolve()
        self._maps: dict[Path, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _resolve(self, shm_path: str) -> Path:
        p = Path(shm_path).resolve()
        if self.root not in p.parents:
            raise WireFormatError(
                f"shm_path: {shm_path!r} is outside the engine's shm directory {self.root}",
                field="shm_path",
            )
        if not p.is_file():
            raise WireFormatError(f"shm_path: {shm_path!r} does not exist", field="shm_path")
        return p

    def slot(self, shm_path: str, slot: int, slot_bytes: int | None) -> torch.Tensor:
        """A uint8 view of slot ``slot`` (default slot size: half the file, a 2-slot ring)."""
        p = self._resolve(shm_path)
        with self._lock:
            buf = self._maps.get(p)
            size = os.path.getsize(p)
            if buf is None or buf.numel() != size:
                buf = torch.from_file(str(p), shared=True, size=size, dtype=torch.uint8)
                self._maps[p] = buf
        n = slot_bytes if slot_bytes is not None else size // 2
        if n <= 0 or slot < 0 or (slot + 1) * n > size:
            raise WireFormatError(
                f"slot: slot {slot} of {n} bytes does not fit the {size}-byte file {shm_path!r}",
                field="slot",
            )
        return buf[slot * n : (slot + 1) * n]

    def release_unlinked(self) -> None:
        """Drop the mappings of files the trainer has unlinked (their pages then go).

        A ring that still exists stays mapped, so the next update reuses warm pages.
        """
        with self._lock:
            for p in [p for p in self._maps if not p.exists()]:
                del self._maps[p]
