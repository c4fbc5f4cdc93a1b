"""The engine side of a weight update: one session, buckets in order, all or nothing.

``begin`` declares the update id, the new version, the kind (base or lora) and the
expected tensors (name, dtype, shape). Buckets arrive in index order over any
transport; each tensor is checked against the expectation and copied into staging
(the transport's buffer is reused for the next bucket). ``finish`` reports
``missing``, ``unexpected`` and ``duplicates``; only a clean update is committed.

Departure from SGLang: SGLang applies each bucket to the live weights as it
arrives and never checks completeness, so a dropped bucket leaves a silently mixed
model. Here nothing touches the live weights before ``finish`` succeeds.

Refused versus abandoned (what the engine serves afterwards):

* An update the engine *refuses* (a bucket with an unknown, duplicate, mis-typed,
  mis-shaped or non-finite tensor, a checksum mismatch, an out-of-order bucket, a body or
  slot whose tensors cannot be decoded) ends the session at once with a 4xx naming the
  fault. Only staging held its tensors, so the engine keeps serving the version it served,
  and ``/generate`` stays 200: the trainer got the error on the very call. A base bucket is
  checked for NaN/Inf as it arrives; a LoRA session's factors when ``end`` builds the
  adapter from them (``posttrain.formats``' PEFT checks, once, off the worker thread), and
  a refusal there is a refusal too.
* An update the trainer *abandons* after opening it (``abort``, ``end`` with tensors
  missing or before the last bucket, a new ``begin`` while one is open) leaves the
  engine *unavailable* (``/generate`` answers 503) until a full update succeeds, the
  wsync/1 rule: the trainer announced a version it did not deliver, and a driver that
  labels rollouts with the trainer's version would otherwise mistake old weights for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.formats import check_finite, dtype_name
from posttrain.interface import (
    BucketManifest,
    IncompleteUpdateError,
    StaleVersionError,
    WeightUpdateResult,
)
from posttrain.local_engine._errors import NonFiniteWeightsError, UpdateSessionError

__all__ = ["TensorSpec", "UpdateSession", "check_version_increases"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the engine expects of one tensor: its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def check_version_increases(current: int | None, new: int) -> None:
    """Raise StaleVersionError unless ``new`` is greater than ``current``.

    An engine that never received a versioned update (``current`` None; SGLang
    reports it as ``"default"``) takes any version.
    """
    if current is not None and new <= current:
        raise StaleVersionError(
            f"weight_version {new!r} does not increase over the engine's {current!r}"
        )


@dataclass(slots=True)
class UpdateSession:
    """One open update. Not thread-safe: the engine serialises calls to it.

    ``pool`` holds staging buffers by name that outlive the session: the engine keeps
    them so that the next update writes into memory that is already mapped (fresh
    pages cost more than the copy itself on small CPU machines). The price is one
    extra copy of the updated tensors held between updates.
    """

    update_id: str
    weight_version: int
    kind: str
    expected: Mapping[str, TensorSpec]
    lora_name: str | None = None
    lora_config: dict[str, Any] = field(default_factory=dict)
    pool: dict[str, torch.Tensor] = field(default_factory=dict)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    next_bucket: int = 0
    saw_last: bool = False
    failed: str | None = None

    def add_bucket(
        self, manifest: BucketManifest, tensors: Mapping[str, torch.Tensor], *, owned: bool = False
    ) -> None:
        """Check one bucket and stage its tensors; raise on the first fault.

        ``owned`` tensors (freshly decoded, not views of a reused buffer) are kept as
        they are; others are copied into staging.

        A fault marks the session failed (its ``finish`` will report failure), so a
        client that ignores one error reply still cannot commit a broken update.
        """
        try:
            self._add_bucket(manifest, tensors, owned)
        except (UpdateSessionError, IncompleteUpdateError, NonFiniteWeightsError) as e:
            self.failed = self.failed or str(e)
            raise

    def _add_bucket(
        self, manifest: BucketManifest, tensors: Mapping[str, torch.Tensor], owned: bool
    ) -> None:
        if manifest.update_id != self.update_id:
            raise UpdateSessionError(
                f"manifest.update_id {manifest.update_id!r} is not the open update "
                f"{self.update_id!r}"
            )
        if manifest.weight_version != self.weight_version or manifest.kind != self.kind:
            raise UpdateSessionError(
                f"manifest (weight_version {manifest.weight_version!r}, kind {manifest.kind!r}) "
                f"disagrees with begin ({self.weight_version!r}, {self.kind!r})"
            )
        if self.saw_last:
            raise UpdateSessionError(
                f"bucket {manifest.bucket_index} of update {self.update_id!r} after the last one"
            )
        if manifest.bucket_index != self.next_bucket:
            raise UpdateSessionError(
                f"manifest.bucket_index {manifest.bucket_index} of update {self.update_id!r}: "
                f"expected bucket {self.next_bucket}"
            )
        for entry in manifest.tensors:  # the manifest itself holds no name twice
            name = entry.name
            if name in self.staged:
                self.duplicates.append(name)
                raise IncompleteUpdateError(
                    f"tensor {name!r} sent twice in update {self.update_id!r}"
                )
            spec = self.expected.get(name)
            if spec is None:
                self.unexpected.append(name)
                raise IncompleteUpdateError(
                    f"tensor {name!r} is not expected by update {self.update_id!r} ({self.kind})"
                )
            t = tensors[name]
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                self.mismatched.append(name)
                raise IncompleteUpdateError(
                    f"tensor {name!r}: got {dtype_name(t.dtype)} {list(t.shape)}, the engine "
                    f"holds {dtype_name(spec.dtype)} {list(spec.shape)} (no implicit casts)"
                )
        if self.kind == "base":  # a lora session's factors are checked once, at its end
            check_finite(
                ((e.name, tensors[e.name]) for e in manifest.tensors),
                what=f"update {self.update_id!r} bucket {manifest.bucket_index}",
                error=NonFiniteWeightsError,
            )
        for entry in manifest.tensors:
            src = tensors[entry.name]
            if owned:
                self.staged[entry.name] = src
                continue
            buf = self.pool.get(entry.name)
            if buf is None or buf.dtype != src.dtype or buf.shape != src.shape:
                buf = self.pool[entry.name] = torch.empty_like(src)
            self.staged[entry.name] = buf.copy_(src)
        self.next_bucket += 1
        self.saw_last = manifest.is_last

    def finish(self) -> WeightUpdateResult:
        """The outcome: success only if every expected tensor arrived exactly once, in order."""
        missing = sorted(set(self.expected) - set(self.staged))
        ok = (
            self.failed is None
            and self.saw_last
            and not missing
            and not self.unexpected
            and not self.duplicates
            and not self.mismatched
        )
        if ok:
            message = f"update {self.update_id!r} complete: {len(self.staged)} tensors"
        elif self.failed is not None:
            message = f"update {self.update_id!r} failed: {self.failed}"
        elif not self.saw_last:
            message = f"update {self.update_id!r} ended before its last bucket"
        else:
            message = f"update {self.update_id!r} incomplete: {len(missing)} tensors missing"
        return WeightUpdateResult(
            success=ok,
            weight_version=self.weight_version if ok else None,
            missing=missing,
            unexpected=sorted(set(self.unexpected)),
            duplicates=sorted(set(self.duplicates)),
            message=message,
        )
