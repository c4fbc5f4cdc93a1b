"""The LoRA hook: low-rank deltas on named linear layers, applied inside the forward.

A ``LoraAdapter`` maps PEFT-style module names (``model.layers.0.self_attn.q_proj``,
``model.layers.1.mlp.experts.3.down_proj``, ``lm_head``; see ``DecoderModel.lora_targets``)
to ``(A[r, in], B[out, r])`` and a scaling. Forward calls take one adapter for every
segment, or one per segment (per cache row in ``extend``), so an engine can serve several
adapters in one batch. The delta is ``posttrain.formats.lora_delta``, the one LoRA op that
``lora-core`` computes too:

    y = base(x) + linear(linear(x, A), B) * scaling

with both matmuls through the active kernel set (``StrictOps.linear`` in strict mode), so
adapter deltas keep training/decode parity. The fused in-memory weights (``qkv``, ``fc1``,
stacked experts) get the delta on the output slice that the HF module owns. A trainer gets
the same bits by wrapping the model's ``LinearSite``s with ``lora-core`` (the site hands its
kernel to the wrapper), see ``_sites``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.formats import PeftFormatError, lora_delta, peft_modules
from posttrain.models._errors import LoraError
from posttrain.models._ops import FastOps


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraAdapter:
    """Low-rank deltas for named linear layers: ``weights[name] = (A[r, in], B[out, r])``."""

    weights: Mapping[str, tuple[Tensor, Tensor]]
    scaling: float
    name: str = ""

    @classmethod
    def from_peft_state_dict(
        cls, tensors: Mapping[str, Tensor], *, scaling: float, name: str = ""
    ) -> LoraAdapter:
        """Build from PEFT keys (``base_model.model.<module>.lora_{A,B}[.default].weight``).

        The keys and factors are checked by ``posttrain.formats.peft_modules`` (both factors
        of every module, float dtypes, finite values, matching ranks); a failure raises
        ``LoraError`` with its message.
        """
        try:
            weights = peft_modules(tensors, where=f"adapter {name!r}" if name else "adapter")
        except PeftFormatError as e:
            raise LoraError(str(e)) from e
        return cls(weights=weights, scaling=scaling, name=name)


AdapterArg = LoraAdapter | Sequence[LoraAdapter | None] | None


class LoraRouting:
    """Which adapter each token uses; applies deltas at the named linears of one forward."""

    def __init__(
        self,
        adapters: AdapterArg,
        segment_of_token: Tensor,
        num_segments: int,
        targets: Mapping[str, tuple[int, int]],
    ) -> None:
        if adapters is None:
            per_segment: list[LoraAdapter | None] = [None] * num_segments
        elif isinstance(adapters, LoraAdapter):
            per_segment = [adapters] * num_segments
        else:
            per_segment = list(adapters)
            if len(per_segment) != num_segments:
                raise LoraError(f"got {len(per_segment)} adapters for {num_segments} segments/rows")
        self.adapters: list[LoraAdapter] = []
        index_of: dict[int, int] = {}
        seg_adapter = []
        for adapter in per_segment:
            if adapter is None:
                seg_adapter.append(-1)
                continue
            if id(adapter) not in index_of:
                _check_adapter(adapter, targets)
                index_of[id(adapter)] = len(self.adapters)
                self.adapters.append(adapter)
            seg_adapter.append(index_of[id(adapter)])
        self.token_adapter = torch.tensor(
            seg_adapter, dtype=torch.long, device=segment_of_token.device
        )[segment_of_token]

    @property
    def active(self) -> bool:
        """Whether any token uses an adapter."""
        return bool(self.adapters)

    def touches(self, prefix: str) -> bool:
        """Whether any adapter has a delta on a module whose name starts with ``prefix``."""
        return any(name.startswith(prefix) for a in self.adapters for name in a.weights)

    def apply(
        self,
        ops: type[FastOps],
        x: Tensor,
        y: Tensor,
        names: Sequence[tuple[str, int, int]],
        token_index: Tensor | None = None,
    ) -> Tensor:
        """Add each adapter's delta to ``y[:, start:stop]`` for the named modules.

        ``x``/``y`` hold the rows ``token_index`` of the forward (all rows when None).
        """
        if not self.adapters:
            return y
        which = self.token_adapter if token_index is None else self.token_adapter[token_index]
        out = y
        for a_index, adapter in enumerate(self.adapters):
            hits = [(n, s, e) for n, s, e in names if n in adapter.weights]
            if not hits:
                continue
            rows = (which == a_index).nonzero().flatten()
            if rows.numel() == 0:
                continue
            xr = x[rows]
            for name, start, stop in hits:
                a, b = adapter.weights[name]
                delta = lora_delta(xr, a, b, adapter.scaling, linear=ops.linear)
                if out is y:
                    out = y.clone()
                out[rows, start:stop] = y[rows, start:stop] + delta
        return out


def _check_adapter(adapter: LoraAdapter, targets: Mapping[str, tuple[int, int]]) -> None:
    for name, (a, b) in adapter.weights.items():
        if name not in targets:
            raise LoraError(f"adapter {adapter.name!r} targets unknown module {name!r}")
        d_in, d_out = targets[name]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape[0] != d_out:
            raise LoraError(
                f"adapter {adapter.name!r} module {name!r}: A{tuple(a.shape)} B{tuple(b.shape)} "
                f"do not fit in={d_in} out={d_out}"
            )
        if a.shape[0] != b.shape[1]:
            raise LoraError(
                f"adapter {adapter.name!r} module {name!r}: rank of A ({a.shape[0]}) != "
                f"rank of B ({b.shape[1]})"
            )
