"""The engine side of SGLang's distributed weight update: staged, then committed all at once.

``/init_weights_update_group`` joins the trainer's group (gloo on this CPU engine) at rank
``rank_offset``. Each ``/update_weights_from_distributed`` request names one bucket's tensors
(``names``/``dtypes``/``shapes``) while group rank 0 broadcasts them in order; the engine always
receives the bucket (so the trainer's broadcast never hangs on a refusal), checks it (a known
tensor, its served dtype and shape, sent once, finite) and stages it. The bucket with
``flush_cache: true`` ends the update: only then, and only if no bucket was refused, the staged
tensors replace the live ones between batches, and the request's ``weight_version`` is installed.

Departure from SGLang, which writes each bucket into the live weights as it arrives: here
nothing touches the served weights before the end, so an update that is refused, or begun and
never completed (the trainer died, the group was destroyed or re-created), leaves the engine
serving exactly what it served (version, weights, greedy outputs). A refused bucket marks the
update failed: its later buckets are still received and dropped, and its last bucket answers the
first fault, so a partial update can never be committed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from posttrain.formats import check_finite, dtype_name
from posttrain.interface import IncompleteUpdateError, StaleVersionError
from posttrain.local_engine._errors import NonFiniteWeightsError

__all__ = ["StagedUpdate", "TensorSpec", "check_version_increases"]


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
class StagedUpdate:
    """The buckets of one update received so far (not thread-safe: the engine serialises)."""

    specs: Mapping[str, TensorSpec]
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    buckets: int = 0
    failed: str | None = None

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check one received bucket and stage it; the first fault fails the whole update."""
        if self.failed is not None:
            raise IncompleteUpdateError(f"this update was already refused: {self.failed}")
        try:
            self._add(tensors)
        except (IncompleteUpdateError, NonFiniteWeightsError) as exc:
            self.failed = str(exc)
            self.staged.clear()
            raise

    def _add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self.staged:
                raise IncompleteUpdateError(f"tensor {name!r} sent twice in one update")
            spec = self.specs.get(name)
            if spec is None:
                raise IncompleteUpdateError(f"tensor {name!r} is not a weight of this engine")
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise IncompleteUpdateError(
                    f"tensor {name!r}: got {dtype_name(t.dtype)} {list(t.shape)}, the engine "
                    f"holds {dtype_name(spec.dtype)} {list(spec.shape)} (no implicit casts)"
                )
        check_finite(
            tensors.items(), what=f"update bucket {self.buckets}", error=NonFiniteWeightsError
        )
        self.staged.update(tensors)
        self.buckets += 1
