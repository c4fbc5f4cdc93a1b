"""The Dense/MoE decoder: one forward for packed training and for KV-cache decode.

``DecoderModel`` holds its weights in a fused in-memory layout (``qkv``, ``fc1 = [gate; up]``,
stacked experts; see ``_convert`` for the HF names). Every path -- ``forward_logprobs`` over
packed segments, ``extend``/``prefill``/``decode_step`` over cache rows -- runs the same
``_forward`` on a flat list of tokens, each with a buffer row and a position. Keys and
values are written into a per-row buffer of fixed capacity ``C = max_position_embeddings``
and each query attends over all ``C`` slots with a mask, so in strict mode a token's bits do
not depend on how many tokens came in the same call (see ``_ops``). As an optimisation that
keeps every bit, a chunk of queries reduces over the first ``2**ceil(log2(max pos + 1))``
slots only: the rest are masked exact zeros, and ``x + 0 == x`` in the pairwise tree.

Departures from HF ``Qwen3MoeForCausalLM``: activations are fp32 whatever the parameter
dtype; experts are combined in ascending expert id order; top-k ties go to the lower id
(a stable sort), and no dropout exists (training mode equals eval mode, G4).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.models._cache import KVCache
from posttrain.models._config import ModelConfig
from posttrain.models._errors import CacheError, ModelInputError
from posttrain.models._lora import AdapterArg, LoraRouting
from posttrain.models._ops import FastOps, StrictOps, apply_rope, rope_tables
from posttrain.models._sites import LinearSite

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Elements of the per-chunk attention product tensor; bounds memory, never changes results.
_ATTN_CHUNK_ELEMENTS = 1 << 17


class Numerics(enum.StrEnum):
    """Kernel set: ``STRICT`` (bit-identical across paths) or ``FAST`` (plain torch)."""

    STRICT = "strict"
    FAST = "fast"


class Step(NamedTuple):
    """Logits and log-softmax (both fp32, ``[n, vocab]``) for the tokens of one call."""

    logits: Tensor
    logprobs: Tensor


class _Layer(nn.Module):
    """Attention parameters shared by dense and MoE layers."""

    attn_norm: nn.Parameter
    qkv: nn.Parameter
    q_norm: nn.Parameter
    k_norm: nn.Parameter
    proj: nn.Parameter
    mlp_norm: nn.Parameter

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        nq, nkv = config.num_attention_heads * hd, config.num_key_value_heads * hd
        dt = config.dtype
        self.index = index
        self.is_moe = config.is_moe_layer(index)
        self.attn_norm = nn.Parameter(torch.ones(h, dtype=dt))
        self.qkv = nn.Parameter(torch.zeros(nq + 2 * nkv, h, dtype=dt))
        self.q_norm = nn.Parameter(torch.ones(hd, dtype=dt))
        self.k_norm = nn.Parameter(torch.ones(hd, dtype=dt))
        self.proj = nn.Parameter(torch.zeros(h, nq, dtype=dt))
        self.mlp_norm = nn.Parameter(torch.ones(h, dtype=dt))
        self.sites = nn.ModuleDict()  # filled by DecoderModel (sites need the model's kernel)


class DenseLayer(_Layer):
    """A layer with a dense SwiGLU MLP: ``fc1 = [gate_proj; up_proj]``, ``fc2 = down_proj``."""

    fc1: nn.Parameter
    fc2: nn.Parameter

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        h, i, dt = config.hidden_size, config.intermediate_size, config.dtype
        self.fc1 = nn.Parameter(torch.zeros(2 * i, h, dtype=dt))
        self.fc2 = nn.Parameter(torch.zeros(h, i, dtype=dt))


class MoeLayer(_Layer):
    """A layer with a routed MoE: ``router[E, H]``, ``experts_fc1[E, 2I, H]``, ``experts_fc2[E, H, I]``."""

    router: nn.Parameter
    experts_fc1: nn.Parameter
    experts_fc2: nn.Parameter

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        h, i, e, dt = (
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.dtype,
        )
        self.router = nn.Parameter(torch.zeros(e, h, dtype=dt))
        self.experts_fc1 = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dt))
        self.experts_fc2 = nn.Parameter(torch.zeros(e, h, i, dtype=dt))


class DecoderModel(nn.Module):
    """A Qwen3-MoE-layout decoder with strict (bit-identical) and fast numerics."""

    output: nn.Parameter | None
    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, config: ModelConfig, *, numerics: Numerics = Numerics.STRICT) -> None:
        super().__init__()
        self.config = config
        self.numerics = Numerics(numerics)
        v, h, dt = config.vocab_size, config.hidden_size, config.dtype
        self.embedding = nn.Parameter(torch.zeros(v, h, dtype=dt))
        self.layers = nn.ModuleList(
            MoeLayer(config, i) if config.is_moe_layer(i) else DenseLayer(config, i)
            for i in range(config.num_hidden_layers)
        )
        self.final_norm = nn.Parameter(torch.ones(h, dtype=dt))
        if config.tie_word_embeddings:
            self.register_parameter("output", None)
        else:
            self.output = nn.Parameter(torch.zeros(v, h, dtype=dt))
        from posttrain.models._convert import lora_targets

        self._lora_targets = lora_targets(config)
        self.sites = nn.ModuleDict()
        self._add_sites()
        cos, sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def ops(self) -> type[FastOps]:
        """The kernel set of the current numerics mode."""
        return StrictOps if self.numerics is Numerics.STRICT else FastOps

    # ------------------------------------------------------------------ public forwards

    def forward_logits(
        self, input_ids: Tensor, segment_lengths: Sequence[int], *, lora: AdapterArg = None
    ) -> Tensor:
        """fp32 logits ``[T, vocab]`` for packed segments (positions restart per segment)."""
        ids, seg, pos = self._pack(input_ids, segment_lengths)
        routing = LoraRouting(lora, seg, len(segment_lengths), self._lora_targets)
        return self._forward(ids, seg, pos, seg, len(segment_lengths), None, routing)

    def forward(
        self, input_ids: Tensor, segment_lengths: Sequence[int], *, lora: AdapterArg = None
    ) -> Tensor:
        """Same as ``forward_logprobs`` (the training forward)."""
        return self.forward_logprobs(input_ids, segment_lengths, lora=lora)

    def forward_logprobs(
        self, input_ids: Tensor, segment_lengths: Sequence[int], *, lora: AdapterArg = None
    ) -> Tensor:
        """Per-token fp32 logprobs ``[T]`` for packed segments.

        ``out[t] = log p(ids[t] | ids[start:t])`` within ``t``'s segment; a segment's first
        position has no prediction and holds 0.0. Differentiable.
        """
        logits = self.forward_logits(input_ids, segment_lengths, lora=lora)
        logprobs = self.ops.log_softmax(logits)
        ids = input_ids.reshape(-1).long().to(logprobs.device)
        out = torch.zeros(ids.shape[0], dtype=torch.float32, device=logprobs.device)
        if ids.shape[0] > 1:
            picked = logprobs[:-1].gather(1, ids[1:, None])[:, 0]
            starts = torch.zeros(ids.shape[0], dtype=torch.bool, device=logprobs.device)
            starts[_segment_starts(segment_lengths)] = True
            out = torch.cat([out[:1], torch.where(starts[1:], 0.0, picked)])
        return out

    def new_kv_cache(self, num_rows: int = 1) -> KVCache:
        """An empty KV cache with ``num_rows`` rows, on the model's device."""
        return KVCache(self.config, num_rows, device=self.embedding.device)

    @torch.no_grad()
    def extend(
        self,
        cache: KVCache,
        rows: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        *,
        lora: AdapterArg = None,
    ) -> list[Step]:
        """Append ``token_ids[j]`` to cache row ``rows[j]``; return each row's ``Step``.

        ``Step.logprobs[n]`` is the log-softmax of the distribution after the row's n-th new
        token, i.e. of the token that follows it. ``lora`` is one adapter or one per row.
        """
        if len(rows) != len(token_ids) or len(set(rows)) != len(rows):
            raise CacheError(
                f"rows {list(rows)} must be distinct and match {len(token_ids)} inputs"
            )
        flat: list[int] = []
        seg: list[int] = []
        pos: list[int] = []
        for j, (row, toks) in enumerate(zip(rows, token_ids, strict=True)):
            cache._check_row(row)
            start = cache.lengths[row]
            if not toks:
                raise CacheError(f"extend got no tokens for cache row {row}")
            if start + len(toks) > cache.capacity:
                raise CacheError(
                    f"cache row {row} holds {start} tokens; {len(toks)} more exceed "
                    f"capacity {cache.capacity}"
                )
            flat.extend(int(t) for t in toks)
            seg.extend([j] * len(toks))
            pos.extend(range(start, start + len(toks)))
        dev = self.embedding.device
        ids = self._check_ids(torch.tensor(flat, dtype=torch.long, device=dev))
        seg_t = torch.tensor(seg, dtype=torch.long, device=dev)
        buf_row = torch.tensor(rows, dtype=torch.long, device=dev)[seg_t]
        routing = LoraRouting(lora, seg_t, len(rows), self._lora_targets)
        logits = self._forward(
            ids, seg_t, torch.tensor(pos, dtype=torch.long, device=dev), buf_row, 0, cache, routing
        )
        logprobs = self.ops.log_softmax(logits)
        for row, toks in zip(rows, token_ids, strict=True):
            cache.lengths[row] += len(toks)
        sizes = [len(t) for t in token_ids]
        return [
            Step(lg, lp)
            for lg, lp in zip(torch.split(logits, sizes), torch.split(logprobs, sizes), strict=True)
        ]

    def prefill(
        self, cache: KVCache, row: int, token_ids: Sequence[int], *, lora: AdapterArg = None
    ) -> Step:
        """Append a prompt to one cache row; ``Step`` tensors are ``[len(token_ids), vocab]``."""
        return self.extend(cache, [row], [token_ids], lora=lora)[0]

    def decode_step(
        self,
        cache: KVCache,
        rows: Sequence[int],
        token_ids: Sequence[int],
        *,
        lora: AdapterArg = None,
    ) -> Step:
        """Append one token to each row; ``Step`` tensors are ``[len(rows), vocab]``."""
        steps = self.extend(cache, rows, [[t] for t in token_ids], lora=lora)
        return Step(torch.cat([s.logits for s in steps]), torch.cat([s.logprobs for s in steps]))

    # ------------------------------------------------------------------ weights and files

    def linear_sites(self) -> dict[str, LinearSite]:
        """Every linear site by module path (``layers.0.sites.qkv``, ``sites.lm_head``).

        A site may have been replaced by a wrapper (e.g. ``lora-core``'s ``LoraLinear``);
        this lists the sites themselves, found through the wrapper's ``base``.
        """
        out: dict[str, LinearSite] = {}
        for path, module in self.named_modules():
            if isinstance(module, LinearSite):
                out[path.removesuffix(".base")] = module
        return out

    def lora_targets(self) -> dict[str, tuple[int, int]]:
        """PEFT module names a ``LoraAdapter`` may target, with their ``(in, out)`` dims."""
        return dict(self._lora_targets)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The weights under their HF (Qwen3-MoE, per-expert) names."""
        from posttrain.models._convert import to_hf_state_dict

        return to_hf_state_dict(dict(self.named_parameters()), self.config)

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, Tensor], *, partial: bool = False) -> None:
        """Copy HF-named weights in (dtype and shape must match exactly; see ``_convert``)."""
        from posttrain.models._convert import from_hf_state_dict

        params = dict(self.named_parameters())
        for name, value in from_hf_state_dict(tensors, self.config, partial=partial).items():
            params[name].copy_(value)

    def save_pretrained(
        self, path: str | Path, *, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        """Write ``config.json`` and ``model.safetensors`` (HF layout), plus the tokenizer."""
        from posttrain.models._checkpoint import save_pretrained

        save_pretrained(self, path, tokenizer=tokenizer)

    # ------------------------------------------------------------------ internals

    def _add_sites(self) -> None:
        cfg = self.config
        hd = cfg.head_dim
        nq, nk = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            a, m = f"model.layers.{layer.index}.self_attn.", f"model.layers.{layer.index}.mlp."
            specs = {
                "qkv": ((a + "q_proj", nq), (a + "k_proj", nk), (a + "v_proj", nk)),
                "proj": ((a + "o_proj", cfg.hidden_size),),
            }
            if isinstance(layer, MoeLayer):
                specs["router"] = ((m + "gate", cfg.num_experts),)
            else:
                i = cfg.intermediate_size
                specs["fc1"] = ((m + "gate_proj", i), (m + "up_proj", i))
                specs["fc2"] = ((m + "down_proj", cfg.hidden_size),)
            for param, parts in specs.items():
                layer.sites[param] = LinearSite(self, layer, param, parts=parts)
        head = "embedding" if self.output is None else "output"
        self.sites["lm_head"] = LinearSite(self, self, head, parts=(("lm_head", cfg.vocab_size),))

    def _check_ids(self, ids: Tensor) -> Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            bad = int(((ids < 0) | (ids >= self.config.vocab_size)).nonzero()[0, 0])
            raise ModelInputError(
                f"input_ids[{bad}]={int(ids[bad])} is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        return ids

    def _pack(self, input_ids: Tensor, lengths: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        dev = self.embedding.device
        ids = self._check_ids(input_ids.reshape(-1).long().to(dev))
        cap = self.config.max_position_embeddings
        if ids.numel() == 0:
            raise ModelInputError("input_ids is empty: a forward needs at least one token")
        for j, n in enumerate(lengths):
            if not 0 < n <= cap:
                raise ModelInputError(f"segment_lengths[{j}]={n} is not in [1, {cap}]")
        if sum(lengths) != ids.shape[0]:
            raise ModelInputError(
                f"segment_lengths sum to {sum(lengths)} but input_ids has {ids.shape[0]} tokens"
            )
        seg = torch.repeat_interleave(
            torch.arange(len(lengths), device=dev),
            torch.tensor(list(lengths), dtype=torch.long, device=dev),
        )
        starts = torch.tensor(_segment_starts(lengths), dtype=torch.long, device=dev)
        pos = torch.arange(ids.shape[0], device=dev) - starts[seg]
        return ids, seg, pos

    def _forward(
        self,
        ids: Tensor,
        seg: Tensor,
        pos: Tensor,
        buf_row: Tensor,
        num_buffers: int,
        cache: KVCache | None,
        lora: LoraRouting,
    ) -> Tensor:
        cfg, ops = self.config, self.ops
        h = self.embedding[ids].float()
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            prefix = f"model.layers.{layer.index}."
            h = h + self._attention(layer, h, pos, buf_row, num_buffers, cache, lora, prefix)
            m = ops.rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
            if isinstance(layer, MoeLayer):
                h = h + self._moe(layer, m, lora, prefix)
            else:
                assert isinstance(layer, DenseLayer)
                h = h + self._dense(layer, m, lora, prefix)
        h = ops.rms_norm(h, self.final_norm, cfg.rms_norm_eps)
        logits = self.sites["lm_head"](h)
        return lora.apply(ops, h, logits, [("lm_head", 0, cfg.vocab_size)])

    def _attention(
        self,
        layer: _Layer,
        h: Tensor,
        pos: Tensor,
        buf_row: Tensor,
        num_buffers: int,
        cache: KVCache | None,
        lora: LoraRouting,
        prefix: str,
    ) -> Tensor:
        cfg, ops = self.config, self.ops
        t, hd, nh, nkv = h.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        nq, nk = nh * hd, nkv * hd
        a = ops.rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
        qkv = layer.sites["qkv"](a)
        names = [
            (prefix + "self_attn.q_proj", 0, nq),
            (prefix + "self_attn.k_proj", nq, nq + nk),
            (prefix + "self_attn.v_proj", nq + nk, nq + 2 * nk),
        ]
        qkv = lora.apply(ops, a, qkv, names)
        q = ops.rms_norm(qkv[:, :nq].reshape(t, nh, hd), layer.q_norm, cfg.rms_norm_eps)
        k = ops.rms_norm(qkv[:, nq : nq + nk].reshape(t, nkv, hd), layer.k_norm, cfg.rms_norm_eps)
        v = qkv[:, nq + nk :].reshape(t, nkv, hd)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cap = cfg.max_position_embeddings
        if cache is None and self.numerics is Numerics.FAST:
            o = _causal_sdpa(q, k, v, buf_row, nh // nkv)
            y = layer.sites["proj"](o)
            return lora.apply(ops, o, y, [(prefix + "self_attn.o_proj", 0, cfg.hidden_size)])
        if cache is None:
            shape = (num_buffers, cap, nkv, hd)
            kbuf = h.new_zeros(shape).index_put((buf_row, pos), k)
            vbuf = h.new_zeros(shape).index_put((buf_row, pos), v)
        else:
            kbuf, vbuf = cache.keys[layer.index], cache.values[layer.index]
            kbuf[buf_row, pos] = k
            vbuf[buf_row, pos] = v
        group = nh // nkv
        qg = q.reshape(t, nkv, group, hd)
        slots = torch.arange(cap, device=h.device)
        step = max(1, _ATTN_CHUNK_ELEMENTS // (nh * cap * hd))
        outs = []
        for i in range(0, t, step):
            rows, p = buf_row[i : i + step], pos[i : i + step]
            # Reduce over the first W = 2**ceil(log2(max pos + 1)) slots only: slots past the
            # chunk's last position are masked, contribute exact zeros, and in the pairwise
            # tree ``x + 0 == x``, so the bits equal those of the full-C reduction.
            width = min(cap, 1 << int(p.max()).bit_length())
            valid = slots[None, :width] <= p[:, None]
            outs.append(
                ops.attention(
                    qg[i : i + step], kbuf[rows, :width], vbuf[rows, :width], valid, hd**-0.5
                )
            )
        o = torch.cat(outs).reshape(t, nq)
        y = layer.sites["proj"](o)
        return lora.apply(ops, o, y, [(prefix + "self_attn.o_proj", 0, cfg.hidden_size)])

    def _dense(self, layer: DenseLayer, m: Tensor, lora: LoraRouting, prefix: str) -> Tensor:
        ops, i = self.ops, self.config.intermediate_size
        gu = layer.sites["fc1"](m)
        gu = lora.apply(
            ops, m, gu, [(prefix + "mlp.gate_proj", 0, i), (prefix + "mlp.up_proj", i, 2 * i)]
        )
        act = ops.silu_mul(gu[:, :i], gu[:, i:])
        y = layer.sites["fc2"](act)
        return lora.apply(ops, act, y, [(prefix + "mlp.down_proj", 0, self.config.hidden_size)])

    def _moe(self, layer: MoeLayer, m: Tensor, lora: LoraRouting, prefix: str) -> Tensor:
        cfg, ops = self.config, self.ops
        i, k, hsz = cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.hidden_size
        logits = layer.sites["router"](m)
        logits = lora.apply(ops, m, logits, [(prefix + "mlp.gate", 0, cfg.num_experts)])
        probs = ops.softmax(logits)
        # Top-k by a stable descending sort (ties go to the lower id), then ids ascending:
        # the combine order is a function of the chosen set only (G5).
        top = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
        ids = torch.sort(top, dim=-1).values
        weights = probs.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / ops.sum_last(weights)[:, None]
        outputs = m.new_zeros(m.shape[0], k, hsz)
        for e in range(cfg.num_experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            ep = f"{prefix}mlp.experts.{e}."
            xe = m[tok]
            gu = ops.linear(xe, layer.experts_fc1[e])
            gu = lora.apply(
                ops, xe, gu, [(ep + "gate_proj", 0, i), (ep + "up_proj", i, 2 * i)], tok
            )
            act = ops.silu_mul(gu[:, :i], gu[:, i:])
            ye = ops.linear(act, layer.experts_fc2[e])
            ye = lora.apply(ops, act, ye, [(ep + "down_proj", 0, hsz)], tok)
            outputs = outputs.index_put((tok, slot), ye)
        return ops.moe_combine(weights, outputs)


def _causal_sdpa(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, group: int) -> Tensor:
    """Fast-mode training attention: torch SDPA per segment (no fixed-capacity buffer)."""
    outs = []
    for s in torch.unique_consecutive(seg).tolist():
        idx = (seg == s).nonzero().flatten()
        qs = q[idx].transpose(0, 1)[None]  # [1, nh, L, hd]
        ks = k[idx].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        vs = v[idx].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        outs.append(o[0].transpose(0, 1).reshape(idx.shape[0], -1))
    return torch.cat(outs)


def _segment_starts(lengths: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def build_model(
    config: ModelConfig, seed: int = 0, *, numerics: Numerics = Numerics.STRICT
) -> DecoderModel:
    """A model with weights drawn from ``seed`` (normal(0, initializer_range); norms = 1)."""
    model = DecoderModel(config, numerics=numerics)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1].endswith("norm"):
                param.fill_(1.0)
            else:
                draw = torch.randn(param.shape, generator=gen) * config.initializer_range
                param.copy_(draw.to(param.dtype))
    return model
