"""The KV cache of incremental decode: fixed-capacity fp32 buffers per layer and row.

Rows are independent sequences (an engine's concurrent requests). A row's buffer has
exactly ``C = max_position_embeddings`` slots because strict attention reduces over that
fixed capacity on every path; a reset zeroes the row so stale values never linger.
"""

from __future__ import annotations

import torch

from posttrain.models._config import ModelConfig
from posttrain.models._errors import CacheError


class KVCache:
    """Per-layer fp32 key/value buffers ``[num_rows, C, kv_heads, head_dim]`` and row lengths.

    The capacity ``C`` is the model's ``max_position_embeddings``: strict attention reduces
    over exactly ``C`` slots on every path, so it is not a free choice.
    """

    def __init__(
        self, config: ModelConfig, num_rows: int, *, device: torch.device | str | None = None
    ) -> None:
        if num_rows <= 0:
            raise CacheError(f"a KV cache needs at least one row, got num_rows={num_rows}")
        shape = (
            num_rows,
            config.max_position_embeddings,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.keys = [torch.zeros(shape, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device) for _ in range(config.num_hidden_layers)]
        self.lengths = [0] * num_rows

    @property
    def num_rows(self) -> int:
        """Number of rows (concurrent sequences)."""
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """Slots per row (positions a sequence can reach)."""
        return self.keys[0].shape[1]

    def reset(self, row: int) -> None:
        """Empty ``row`` (zeroes its buffers) so a new sequence can use it."""
        self._check_row(row)
        self.lengths[row] = 0
        for buf in (*self.keys, *self.values):
            buf[row].zero_()

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise CacheError(f"cache row {row} is out of range [0, {self.num_rows})")
