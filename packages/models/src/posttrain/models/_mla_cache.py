"""The KV cache of MLA decode: per layer, one fixed-capacity row of compressed latents per sequence.

MLA caches, per token and layer, ``kv_lora_rank + qk_rope_head_dim`` floats: the latent
after ``kv_a_layernorm`` and the rope key after rope (SGLang's MLA cache holds the same
``[latent | rope key]`` vector). With DeepSeek-V3's shapes that is 576 floats against
``2 * 128 * 192`` for the expanded keys and values: the point of MLA.

Like ``_cache.KVCache`` (same row semantics, same errors): rows are independent sequences;
a row has exactly ``capacity`` slots (slot = position) because strict attention reduces over
that fixed capacity on every path, so a token's bits do not depend on how many tokens came
in one call; a reset zeroes the row so stale values never linger. ``placement`` turns one
call's ``(rows, sizes)`` into the per-token buffer row and position the attention needs,
and ``advance`` commits the call (after every layer ran), as ``DecoderModel.extend`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from posttrain.models._errors import CacheError
from posttrain.models._mla_config import MlaSpec


class MlaCache:
    """Per-layer fp32 buffers ``kv[layer][num_rows, capacity, kv_lora_rank + qk_rope_head_dim]``."""

    def __init__(
        self,
        spec: MlaSpec,
        num_layers: int,
        num_rows: int,
        capacity: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_rows", num_rows)):
            if value <= 0:
                raise CacheError(f"an MLA cache needs {name} >= 1, got {value}")
        if capacity <= 0:
            raise CacheError(f"an MLA cache needs capacity >= 1, got {capacity}")
        self.spec = spec
        shape = (num_rows, capacity, spec.cache_width)
        self.kv = [torch.zeros(shape, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_rows

    @property
    def num_rows(self) -> int:
        """Rows (concurrent sequences)."""
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """Slots per row (positions a sequence can reach)."""
        return self.kv[0].shape[1]

    def latent(self, layer: int) -> Tensor:
        """The cached latents of ``layer``: a view ``[num_rows, capacity, kv_lora_rank]``."""
        return self.kv[layer][..., : self.spec.kv_lora_rank]

    def rope_key(self, layer: int) -> Tensor:
        """The cached rope keys of ``layer``: a view ``[num_rows, capacity, qk_rope_head_dim]``."""
        return self.kv[layer][..., self.spec.kv_lora_rank :]

    def check_row(self, row: int) -> None:
        """Raise ``CacheError`` unless ``row`` is a row of this cache."""
        if not 0 <= row < self.num_rows:
            raise CacheError(f"MLA cache row {row} is out of range [0, {self.num_rows})")

    def reset(self, row: int) -> None:
        """Empty ``row`` (zeroes its buffers) so a new sequence can use it."""
        self.check_row(row)
        self.lengths[row] = 0
        for buf in self.kv:
            buf[row].zero_()

    def placement(self, rows: Sequence[int], sizes: Sequence[int]) -> tuple[Tensor, Tensor]:
        """``(buffer row, position)`` per token ``[T]`` for a call appending ``sizes[j]`` tokens
        to row ``rows[j]`` (tokens of a row contiguous, rows in the given order).

        Nothing changes until ``advance``; a call that would overflow a row is refused whole.
        """
        if len(rows) != len(sizes) or len(set(rows)) != len(rows):
            raise CacheError(f"rows {list(rows)} must be distinct and match {len(sizes)} sizes")
        buf_row: list[int] = []
        pos: list[int] = []
        for row, n in zip(rows, sizes, strict=True):
            self.check_row(row)
            if n <= 0:
                raise CacheError(f"a call appends no tokens to MLA cache row {row}")
            start = self.lengths[row]
            if start + n > self.capacity:
                raise CacheError(
                    f"MLA cache row {row} holds {start} tokens; {n} more exceed capacity "
                    f"{self.capacity}"
                )
            buf_row.extend([row] * n)
            pos.extend(range(start, start + n))
        device = self.kv[0].device
        return (
            torch.tensor(buf_row, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
        )

    def advance(self, rows: Sequence[int], sizes: Sequence[int]) -> None:
        """Commit a call placed with ``placement(rows, sizes)``: the rows grow by ``sizes``."""
        for row, n in zip(rows, sizes, strict=True):
            self.check_row(row)
            self.lengths[row] += n
