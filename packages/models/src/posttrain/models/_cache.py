"""The KV cache of incremental decode: fixed-capacity fp32 buffers per layer and row.

Rows are independent sequences (an engine's concurrent requests). A row's buffer has
exactly ``C = config.capacity`` slots because strict attention reduces over that
fixed capacity on every path; a reset zeroes the row so stale values never linger.
Layers may differ in shape (sliding-window layers have their own heads and head dim).

With ``sconv_kernel_size = k`` the cache also holds, per layer, each sconv site's state:
the last ``k - 1`` inputs of every row (``[num_rows, k - 1, channels]``, zeros at a row's
start, which is what the training forward uses for taps before a segment starts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.models._config import ModelConfig
from posttrain.models._errors import CacheError
from posttrain.models._mla_cache import MlaCache


class KVCache:
    """Per-layer fp32 key/value buffers ``[num_rows, C, kv_heads, head_dim]`` and row lengths.

    For an MLA model (``config.is_mla``) the buffers are those of an ``MlaCache`` (``mla``):
    ``keys[layer][num_rows, C, kv_lora_rank + qk_rope_head_dim]``, no ``values``.

    The capacity ``C`` is the model's ``config.capacity`` (``kv_capacity``, else
    ``max_position_embeddings``): positions lie in ``[0, C)``.
    """

    def __init__(
        self, config: ModelConfig, num_rows: int, *, device: torch.device | str | None = None
    ) -> None:
        if num_rows <= 0:
            raise CacheError(f"a KV cache needs at least one row, got num_rows={num_rows}")
        cap = config.capacity
        self.mla: MlaCache | None = None
        self.lengths = [0] * num_rows
        self.conv: list[dict[str, torch.Tensor]] = []
        if config.is_mla:  # the compressed latent and rope key per token (``_mla_cache``)
            self.mla = MlaCache(config.mla_spec, config.num_hidden_layers, num_rows, cap,
                                device=device)  # fmt: skip
            self.keys, self.values = self.mla.kv, []
            return
        shapes = [
            (num_rows, cap, s.num_kv_heads, s.head_dim)
            for s in (config.attention_shape(i) for i in range(config.num_hidden_layers))
        ]
        self.keys = [torch.zeros(shape, device=device) for shape in shapes]
        self.values = [torch.zeros(shape, device=device) for shape in shapes]
        width = config.sconv_kernel_size
        if width:
            for i in range(config.num_hidden_layers):
                kv = config.attention_shape(i).num_kv_heads * config.attention_shape(i).head_dim
                channels = {"k": kv, "v": kv, "attn": config.hidden_size, "mlp": config.hidden_size}
                self.conv.append(
                    {
                        site: torch.zeros((num_rows, width - 1, c), device=device)
                        for site, c in channels.items()
                    }
                )

    @staticmethod
    def row_bytes(config: ModelConfig) -> int:
        """Bytes one row of a cache for ``config`` holds (fp32 keys/values or MLA latents over
        ``config.capacity`` slots, plus sconv states): what an engine's batch size multiplies."""
        cap, layers = config.capacity, config.num_hidden_layers
        if config.is_mla:
            return 4 * layers * cap * config.mla_spec.cache_width
        total = 0
        for i in range(layers):
            s = config.attention_shape(i)
            kv = s.num_kv_heads * s.head_dim
            total += 2 * cap * kv
            if config.sconv_kernel_size:
                total += (config.sconv_kernel_size - 1) * (2 * kv + 2 * config.hidden_size)
        return 4 * total

    def conv_state(self, layer: int, site: str) -> torch.Tensor:
        """The sconv state ``[num_rows, k - 1, channels]`` of ``site`` (k, v, attn, mlp)."""
        if not self.conv:
            raise CacheError("this cache has no sconv states (sconv_kernel_size is 0)")
        states = self.conv[layer]
        if site not in states:
            raise CacheError(f"unknown sconv site {site!r}; sites are {sorted(states)}")
        return states[site]

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
        self.reset_rows([row])

    def reset_rows(self, rows: Sequence[int]) -> None:
        """``reset`` of every row in ``rows``: one fill per buffer for all of them."""
        for row in rows:
            self._check_row(row)
        if not rows:
            return
        index = torch.tensor(list(rows), dtype=torch.long, device=self.keys[0].device)
        for row in rows:
            self.lengths[row] = 0
        for buf in (*self.keys, *self.values):
            buf.index_fill_(0, index, 0.0)
        for states in self.conv:
            for buf in states.values():
                buf.index_fill_(0, index, 0.0)

    def copy_row(self, src: int, dst: int) -> None:
        """Make row ``dst`` hold exactly what row ``src`` holds (keys, values, sconv states,
        length): ``n`` samples of one prompt share its prefill this way. A row's buffers hold
        per-token values that do not depend on the other rows, so the copy equals what
        prefilling the same tokens into ``dst`` writes."""
        self.copy_rows([src], [dst])

    def copy_rows(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """``copy_row(sources[i], targets[i])`` for every i (no target also a source): one
        gather and one scatter per buffer for all of them."""
        if len(sources) != len(targets):
            raise CacheError(f"{len(sources)} source rows for {len(targets)} target rows")
        for row in (*sources, *targets):
            self._check_row(row)
        pairs = [(s, d) for s, d in zip(sources, targets, strict=True) if s != d]
        if not pairs:
            return
        if {d for _, d in pairs} & {s for s, _ in pairs}:
            raise CacheError("a cache row cannot be both a copy's source and a target")
        device = self.keys[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for buf in (*self.keys, *self.values):
            buf.index_copy_(0, dst, buf.index_select(0, src))
        for states in self.conv:
            for buf in states.values():
                buf.index_copy_(0, dst, buf.index_select(0, src))
        for s, d in pairs:
            self.lengths[d] = self.lengths[s]
            if self.mla is not None:
                self.mla.lengths[d] = self.mla.lengths[s]

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise CacheError(f"cache row {row} is out of range [0, {self.num_rows})")
