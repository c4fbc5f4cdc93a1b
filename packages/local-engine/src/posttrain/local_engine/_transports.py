"""The engine side of wsync/1 over shared memory: trainer ring files, mapped once each.

The bucket formats themselves (the packed layout, the safetensors HTTP body) are
``posttrain.formats``'; this module only maps memory. The trainer owns a file under the
shm directory holding a ring of two slots; ``POST /update_weights_from_shm``
(``ShmBucketRequest``: manifest, shm_path, slot, slot_bytes) names the slot that holds the
bucket. The engine maps each file once (paths
outside the shm directory are refused) and copies tensors out of the slot into
staging before replying, so the trainer may reuse the slot as soon as it has
the reply.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from posttrain.interface import WireFormatError

__all__ = ["ShmMaps"]


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
