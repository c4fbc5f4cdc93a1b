"""Dense/MoE decoders in the Qwen3-MoE HF layout whose training and decode logprobs agree bit for bit.

``DecoderModel`` holds its weights in a fused in-memory layout (``qkv``, ``fc1 = [gate; up]``,
stacked experts; see ``_convert`` for the HF names). Every path -- ``forward_logprobs`` over
packed segments, ``extend``/``prefill``/``decode_step`` over cache rows, and
``forward_with_layout`` (a context-parallel caller's own layout) -- runs the same
``_forward`` on a flat list of tokens, each with a segment and a position; the only steps
that look at other tokens (attention and the optional short convolutions) go through a
``TokenLayout`` (``_blocks``). Keys and values are written into a per-row buffer of fixed
capacity ``C = config.capacity`` and each query attends over all ``C`` slots with a
mask, so in strict mode a token's bits do not depend on how many tokens came in the same call
(see ``_ops``). As an optimisation that keeps every bit, a chunk of queries reduces over the
first ``2**ceil(log2(max pos + 1))`` slots only: the rest are masked exact zeros, and
``x + 0 == x`` in the pairwise tree.

Optional Inkling-style blocks (``ModelConfig`` extension fields): residual short convolutions
at four sites per layer, a relative position bias from an extra projected stream, sliding-window
layers with their own shape, a sigmoid router with a fixed expert bias and shared experts, an
embedding RMSNorm and a logits divisor.

MLA families (DeepSeek-V3, GLM-4.x-MoE-Lite; ``config.is_mla``): every layer is an
``MlaLayer`` (``_mla.MlaAttention`` over the same layouts: ``forward_packed`` for training,
``forward_cached`` over the ``MlaCache`` that ``KVCache`` holds for decode, then a dense MLP or
``_ds_moe.DeepseekMoe``); its projections are ``LinearSite``s with the LoRA hook.

Optional multimodal towers (``ModelConfig`` tower fields, ``_towers``): a frozen vision
tower and/or audio tower whose outputs overwrite the embedding rows of the placeholder runs
a ``MediaBatch`` records (``_media``). Only the tower forwards run under ``torch.no_grad``;
the overwrite is an out-of-place ``index_put`` on the text embedding output, so every other
row keeps its autograd path to ``embedding`` (trap 2 of issue 25: a ``no_grad`` that also
covered the scatter detached the whole embedding output).

Departures from HF ``Qwen3MoeForCausalLM``: activations are fp32 whatever the parameter
dtype; experts are combined in ascending expert id order; top-k ties go to the lower id
(a stable sort), and no dropout exists (training mode equals eval mode, G4).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import Tensor, nn

from posttrain.models._blocks import (
    CacheLayout,
    PackedLayout,
    SharedPrefixLayout,
    TokenLayout,
    rel_logits_of,
)
from posttrain.models._cache import KVCache
from posttrain.models._compile import layers_compiled
from posttrain.models._config import ModelConfig
from posttrain.models._errors import CacheError, ModelInputError
from posttrain.models._expert_rows import expert_rows
from posttrain.models._logprobs import DEFAULT_CHUNK_TOKENS, chunked_token_logprobs
from posttrain.models._lora import AdapterArg, LoraAdapter, LoraRouting
from posttrain.models._media import MediaBatch, MediaKind, check_media_positions
from posttrain.models._ops import Bf16FastOps, FastOps, StrictOps
from posttrain.models._rope import rope_tables
from posttrain.models._sites import LinearSite
from posttrain.models._towers import MediaTower, build_towers, image_patches, mel_features

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Numerics(enum.StrEnum):
    """Kernel set: ``STRICT`` (bit-identical across paths) or ``FAST`` (plain torch)."""

    STRICT = "strict"
    FAST = "fast"


StrictKernels = Literal["auto", "torch", "triton"]
"""Which strict kernel set runs: ``auto`` (Triton's ``CudaStrictOps`` on CUDA, ``StrictOps``
elsewhere), ``torch`` (``StrictOps`` everywhere) or ``triton`` (``CudaStrictOps`` everywhere;
on CPU tensors only under Triton's interpreter, for tests)."""


def strict_ops_for(
    device: torch.device,
    kernels: StrictKernels = "auto",
    weight_dtype: torch.dtype = torch.float32,
) -> type[FastOps]:
    """The strict kernel set for tensors on ``device``: ``CudaStrictOps`` (Triton) on CUDA or
    when ``kernels == "triton"`` (``CudaStrictBf16Ops``, bf16 tensor-core dots, for bf16
    weights), ``StrictOps`` otherwise. Triton is imported only then.

    Anything that computes part of a model's forward outside ``DecoderModel`` (an expert
    layer split over ranks, say) takes its kernels from here, so its bits stay the model's.
    """
    if kernels == "triton" or (kernels == "auto" and device.type == "cuda"):
        from posttrain.models._strict_cuda import CudaStrictBf16Ops, CudaStrictOps

        return CudaStrictBf16Ops if weight_dtype == torch.bfloat16 else CudaStrictOps
    return StrictOps


class Step(NamedTuple):
    """Logits and log-softmax (both fp32, ``[n, vocab]``) for the tokens of one call."""

    logits: Tensor
    logprobs: Tensor


def layer_prefix(index: int) -> str:
    """The PEFT/HF name prefix of decoder layer ``index``: ``model.layers.{index}.``.

    Layers keep it as a plain string (``prefix``): a compiled layer under FSDP2 sees its
    ``index`` as a symbolic int (``dynamic=True``), and formatting one into a string is a graph
    break, so the forward reads the string instead."""
    return f"model.layers.{index}."


class LayerCall(NamedTuple):
    """What a decoder layer's ``forward(h, call)`` needs besides the residual stream: the model
    (its kernels and the layer computation), the token layout and the LoRA routing.

    Each layer's compute goes through the layer module's ``__call__``, so module hooks (FSDP2's
    per-layer all-gather and reshard, activation checkpointing) see one call per layer.
    """

    model: DecoderModel
    layout: TokenLayout
    lora: LoraRouting


class _Layer(nn.Module):
    """Attention parameters shared by dense and MoE layers (plus the optional blocks).

    ``qkv`` is ``[q; k; v; r]`` (``r``, the relative-bias stream, only with ``rel_pos_dim``);
    ``q_norm``/``k_norm`` are ``[head_dim]`` or, with ``qk_norm_per_head``, one row per head
    (flattened ``[heads * head_dim]``). With sconv: ``k_conv``/``v_conv[kv_heads * hd, k]``,
    ``attn_out_conv``/``mlp_out_conv[H, k]``; with the bias: frozen ``rel_proj[d_rel, extent]``.
    """

    attn_norm: nn.Parameter
    qkv: nn.Parameter
    qkv_bias: nn.Parameter
    q_norm: nn.Parameter
    k_norm: nn.Parameter
    proj: nn.Parameter
    mlp_norm: nn.Parameter
    rel_proj: nn.Parameter
    k_conv: nn.Parameter
    v_conv: nn.Parameter
    attn_out_conv: nn.Parameter
    mlp_out_conv: nn.Parameter

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        shape = config.attention_shape(index)
        h, hd = config.hidden_size, shape.head_dim
        nq, nkv = shape.num_heads * hd, shape.num_kv_heads * hd
        nr = shape.num_heads * config.rel_pos_dim
        dt = config.dtype
        self.index = index
        self.prefix = layer_prefix(index)
        self.is_moe = config.is_moe_layer(index)
        self.attn_norm = nn.Parameter(torch.ones(h, dtype=dt))
        self.qkv = nn.Parameter(torch.zeros(nq + 2 * nkv + nr, h, dtype=dt))
        if config.qkv_bias:
            self.qkv_bias = nn.Parameter(torch.zeros(nq + 2 * nkv, dtype=dt))
        if config.qk_norm:
            per_head = config.qk_norm_per_head
            self.q_norm = nn.Parameter(torch.ones(nq if per_head else hd, dtype=dt))
            self.k_norm = nn.Parameter(torch.ones(nkv if per_head else hd, dtype=dt))
        if config.rel_pos_dim:
            extent = config.rel_extent(index)
            table = torch.zeros(config.rel_pos_dim, extent, dtype=dt)
            self.rel_proj = nn.Parameter(table, requires_grad=False)  # frozen, but saved
        width = config.sconv_kernel_size
        if width:
            self.k_conv = nn.Parameter(torch.zeros(nkv, width, dtype=dt))
            self.v_conv = nn.Parameter(torch.zeros(nkv, width, dtype=dt))
        self.proj = nn.Parameter(torch.zeros(h, nq, dtype=dt))
        if width:
            self.attn_out_conv = nn.Parameter(torch.zeros(h, width, dtype=dt))
        self.mlp_norm = nn.Parameter(torch.ones(h, dtype=dt))
        if width:
            self.mlp_out_conv = nn.Parameter(torch.zeros(h, width, dtype=dt))
        self.sites = nn.ModuleDict()  # filled by DecoderModel (sites need the model's kernel)

    def forward(self, h: Tensor, call: LayerCall) -> Tensor:
        """The residual stream ``[T, H]`` after this layer (``DecoderModel._layer_forward``)."""
        return call.model._layer_forward(self, h, call.layout, call.lora)


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
    """A layer with a routed MoE: ``router[E, H]``, ``experts_fc1[E, 2I, H]``, ``experts_fc2[E, H, I]``.

    With ``n_shared_experts = S``: ``router[E + S, H]`` (routed gates, then shared gates),
    ``shared_fc1[S, 2Is, H]``, ``shared_fc2[S, H, Is]``. With the sigmoid router: a frozen
    fp32 ``expert_bias[E]`` that only steers top-k selection.
    """

    router: nn.Parameter
    experts_fc1: nn.Parameter
    experts_fc2: nn.Parameter
    expert_bias: nn.Parameter
    shared_fc1: nn.Parameter
    shared_fc2: nn.Parameter

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        h, i, e, dt = (
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.dtype,
        )
        ns, si = config.n_shared_experts, config.shared_intermediate_size
        self.router = nn.Parameter(torch.zeros(e + ns, h, dtype=dt))
        if config.router_score_function == "sigmoid":
            bias = torch.zeros(e, dtype=torch.float32)
            self.expert_bias = nn.Parameter(bias, requires_grad=False)  # fixed, kept in fp32
        self.experts_fc1 = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dt))
        self.experts_fc2 = nn.Parameter(torch.zeros(e, h, i, dtype=dt))
        if ns:
            self.shared_fc1 = nn.Parameter(torch.zeros(ns, 2 * si, h, dtype=dt))
            self.shared_fc2 = nn.Parameter(torch.zeros(ns, h, si, dtype=dt))


class MlaLayer(nn.Module):
    """A DeepSeek-V3 / GLM-4.x-MoE-Lite layer: multi-head latent attention (``self_attn``,
    ``_mla``), then a dense SwiGLU MLP (``fc1 = [gate; up]``, ``fc2``) or a DeepSeek-style MoE
    (``moe``, ``_ds_moe``: group-limited sigmoid routing and ungated shared experts)."""

    attn_norm: nn.Parameter
    mlp_norm: nn.Parameter
    fc1: nn.Parameter
    fc2: nn.Parameter

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        from posttrain.models._ds_moe import DeepseekMoe
        from posttrain.models._mla import MlaAttention

        h, i, dt = config.hidden_size, config.intermediate_size, config.dtype
        self.index = index
        self.prefix = layer_prefix(index)
        self.is_moe = config.is_moe_layer(index)
        self.attn_norm = nn.Parameter(torch.ones(h, dtype=dt))
        self.mlp_norm = nn.Parameter(torch.ones(h, dtype=dt))
        if not self.is_moe:
            self.fc1 = nn.Parameter(torch.zeros(2 * i, h, dtype=dt))
            self.fc2 = nn.Parameter(torch.zeros(h, i, dtype=dt))
        self.self_attn = MlaAttention(config.mla_spec, dtype=dt)
        if self.is_moe:
            self.moe = DeepseekMoe(config.deepseek_moe_spec, dtype=dt)
        self.sites = nn.ModuleDict()  # filled by DecoderModel

    def forward(self, h: Tensor, call: LayerCall) -> Tensor:
        """The residual stream ``[T, H]`` after this layer (``DecoderModel._mla_layer``)."""
        return call.model._mla_layer(self, h, call.layout, call.lora)


MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
"""The linear projections of MLA attention (``q_proj`` without ``q_lora_rank``, else ``q_a/q_b``)."""


def moe_routing(
    ops: type[FastOps], cfg: ModelConfig, logits: Tensor, expert_bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """A MoE layer's routing: ``(ids [T, k], weights [T, S + k])`` from router ``logits``.

    ``logits[T, E + S]`` (S shared-expert gates last). Top-k by a stable descending sort (ties
    go to the lower id), then ids ascending, so the combine order is a function of the chosen
    set only (G5). ``weights``: the S shared gates first, then the chosen routed experts' in
    id order (normalised together when there are shared experts, or by ``norm_topk_prob``),
    times ``routed_scaling_factor``. ``expert_bias`` (sigmoid routers) shifts only the choice.
    Every trainer-side MoE (this model's, an expert-parallel one) routes through this.
    """
    k, e, ns = cfg.num_experts_per_tok, cfg.num_experts, cfg.n_shared_experts
    if cfg.router_score_function == "sigmoid":
        scores = ops.sigmoid(logits)
        select = scores[:, :e].detach()
        if expert_bias is not None:
            select = select + expert_bias.float()
    else:
        scores = ops.softmax(logits)
        select = scores.detach()
    top = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
    ids = torch.sort(top, dim=-1).values
    weights = scores[:, :e].gather(1, ids)
    if ns:
        # shared gates first, normalised together with the chosen routed ones
        weights = torch.cat([scores[:, e:], weights], dim=1)
        weights = weights / ops.sum_last(weights)[:, None]
    elif cfg.norm_topk_prob:
        weights = weights / ops.sum_last(weights)[:, None]
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return ids, weights


GROUPED_MM_ALIGN = 16
"""Rows each expert's group is padded to a multiple of for ``torch._grouped_mm``."""


def use_grouped_mm(x: Tensor, dtype: torch.dtype, inter: int) -> bool:
    """Whether ``grouped_experts`` takes ``torch._grouped_mm``: CUDA, bf16, aligned dims."""
    return (
        x.device.type == "cuda"
        and dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and x.shape[1] % 8 == 0
        and inter % 8 == 0
    )


def grouped_experts(ops: type[FastOps], x: Tensor, ids: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor:
    """Routed expert outputs ``[T, k, H]`` for ``x[T, H]`` and ``ids[T, k]`` (fast numerics).

    The ``T * k`` (token, slot) pairs are sorted by expert id once (one gather), so each
    expert's tokens are one contiguous slice. On CUDA with bf16 compute (dims multiples of 8)
    ``torch._grouped_mm`` runs every expert in one call, each group padded to a multiple of
    ``GROUPED_MM_ALIGN`` rows in a buffer of static size (no host sync; the pad rows are
    zeros that nothing reads); elsewhere one matmul per expert over its slice.
    ``fc1[E, 2I, H] = [gate; up]``, ``fc2[E, H, I]``. Same math as expert by expert.
    """
    t, k = ids.shape
    e, inter = fc1.shape[0], fc2.shape[2]
    dt = ops.compute_dtype
    if use_grouped_mm(x, dt, inter) and not _GROUPED_MM_FAILED:
        try:
            return _grouped_mm_experts(x, ids, fc1, fc2, ops).reshape(t, k, -1)
        except RuntimeError as err:  # a build or device without the kernel: the loop, once told
            _GROUPED_MM_FAILED.append(str(err))
            warnings.warn(
                f"torch._grouped_mm failed ({err}); routed experts run one matmul each",
                RuntimeWarning,
                stacklevel=2,
            )
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = x[order // k]  # [T * k, H], grouped by expert
    counts = torch.zeros(e, dtype=torch.long, device=x.device).index_add_(
        0, flat, torch.ones_like(flat)
    )
    ys = _experts_eager(ops, xs, counts, fc1, fc2)
    # back to (token, slot) order: row ``order[i]`` of the output is sorted row ``i`` (one
    # scatter, where ``ys[argsort(order)]`` took a sort and a gather)
    return torch.empty_like(ys).index_copy(0, order, ys).reshape(t, k, -1)


def _experts_one_by_one(
    ops: type[FastOps], xs: Tensor, counts: Tensor, fc1: Tensor, fc2: Tensor
) -> Tensor:
    """``grouped_experts``' loop: one matmul pair per expert over its slice of the sorted rows.

    Its slice sizes are data (a host sync), so a compiled layer runs it eagerly (a clean graph
    break, ``_experts_eager``) instead of recompiling for every routing."""
    sizes = counts.tolist()
    parts = []
    for j, (xj, size) in enumerate(zip(torch.split(xs, sizes), sizes, strict=True)):
        if size == 0:
            continue
        gu = ops.linear(xj, fc1[j])
        parts.append(ops.linear(ops.silu_mul_halves(gu), fc2[j]))
    return torch.cat(parts) if parts else xs.new_zeros((0, fc2.shape[1]))


_experts_eager: Callable[..., Tensor] = _experts_one_by_one
"""``_experts_one_by_one`` as ``grouped_experts`` calls it; ``run_experts_loop_eagerly`` (the
seam ``compile_layers`` uses) swaps in its ``torch.compiler.disable`` form."""


def run_experts_loop_eagerly() -> None:
    """Run ``grouped_experts``' per-expert loop outside any compiled region from now on (a clean
    graph break in a compiled layer, instead of a recompile for every routing); idempotent,
    process-wide. ``compile_layers`` calls it. Not done at import: ``torch.compiler.disable``
    imports dynamo (and Triton) into every process that loads models."""
    global _experts_eager
    if _experts_eager is _experts_one_by_one:
        _experts_eager = torch.compiler.disable(_experts_one_by_one)  # type: ignore[no-untyped-call]


_GROUPED_MM_FAILED: list[str] = []
"""The error of a failed ``torch._grouped_mm`` call, if one failed in this process."""


def _grouped_mm_experts(
    x: Tensor, ids: Tensor, fc1: Tensor, fc2: Tensor, ops: type[FastOps]
) -> Tensor:
    """``grouped_experts``' CUDA branch: the pairs of ``ids`` through every expert in one
    ``torch._grouped_mm`` per projection, each group padded to ``GROUPED_MM_ALIGN`` rows
    (``expert_rows``); returns the outputs in (token, slot) order, read straight from the
    padded rows (one gather, no sort back)."""
    dt, k = ops.compute_dtype, ids.shape[1]
    layout = expert_rows(ids, fc1.shape[0], GROUPED_MM_ALIGN)
    xs = x[layout.order // k].to(dt)
    xp = xs.new_zeros((layout.rows, xs.shape[1])).index_copy(0, layout.dest, xs)
    offs = layout.ends.to(torch.int32)
    gu = torch._grouped_mm(xp, fc1.to(dt).transpose(-2, -1), offs=offs)
    act = ops.silu_mul_halves(gu)
    out = torch._grouped_mm(act, fc2.to(dt).transpose(-2, -1), offs=offs)
    return out[layout.row_of_pair]


class DecoderModel(nn.Module):
    """A Qwen3-MoE-layout decoder with strict (bit-identical) and fast numerics."""

    output: nn.Parameter | None
    embed_norm: nn.Parameter
    vision_tower: MediaTower
    audio_tower: MediaTower
    rope_cos: Tensor
    rope_sin: Tensor
    rope_cos_swa: Tensor
    rope_sin_swa: Tensor

    def __init__(
        self,
        config: ModelConfig,
        *,
        numerics: Numerics = Numerics.STRICT,
        strict_kernels: StrictKernels = "auto",
    ) -> None:
        super().__init__()
        self.config = config
        self.numerics = Numerics(numerics)
        self.strict_kernels = strict_kernels
        self.activation_checkpointing = False
        """Recompute each layer's activations in the backward (``torch.utils.checkpoint``)."""
        self.compute_dtype: torch.dtype = torch.float32
        """Fast numerics' matmul dtype: ``torch.bfloat16`` runs ``Bf16FastOps`` (bf16 linears
        and attention, fp32 norms, residual stream, logits and log-softmax). Strict numerics
        always compute in fp32."""
        v, h, dt = config.vocab_size, config.hidden_size, config.dtype
        self.embedding = nn.Parameter(torch.zeros(v, h, dtype=dt))
        if config.embedding_rms_norm:
            self.embed_norm = nn.Parameter(torch.ones(h, dtype=dt))
        self.layers = nn.ModuleList(
            MlaLayer(config, i)
            if config.is_mla
            else MoeLayer(config, i)
            if config.is_moe_layer(i)
            else DenseLayer(config, i)
            for i in range(config.num_hidden_layers)
        )
        self.final_norm = nn.Parameter(torch.ones(h, dtype=dt))
        if config.tie_word_embeddings:
            self.register_parameter("output", None)
        else:
            self.output = nn.Parameter(torch.zeros(v, h, dtype=dt))
        for name, tower in build_towers(config).items():  # after every decoder parameter
            self.add_module(name, tower)
        from posttrain.models._convert import lora_targets

        self._lora_targets = lora_targets(config)
        self.sites = nn.ModuleDict()
        self._add_sites()
        cap, theta, scaling = config.capacity, config.rope_theta, config.rope_scaling
        if config.is_mla:  # the rope part only, with MLA's YaRN factors (``_mla_config``)
            cos, sin = config.mla_spec.rope_tables(cap)
        else:
            cos, sin = rope_tables(config.head_dim, cap, theta, scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        swa_hd = config.swa_shape.head_dim
        if config.sliding_window_layers and swa_hd != config.head_dim:
            cos, sin = rope_tables(swa_hd, cap, theta, scaling)
            self.register_buffer("rope_cos_swa", cos, persistent=False)
            self.register_buffer("rope_sin_swa", sin, persistent=False)

    @property
    def strict_kernels(self) -> StrictKernels:
        """Which strict kernel set runs (see ``StrictKernels``); settable."""
        return self._strict_kernels

    @strict_kernels.setter
    def strict_kernels(self, value: StrictKernels) -> None:
        if value not in ("auto", "torch", "triton"):
            raise ModelInputError(f"strict_kernels={value!r}: use 'auto', 'torch' or 'triton'")
        self._strict_kernels: StrictKernels = value

    @property
    def ops(self) -> type[FastOps]:
        """The kernel set of the current numerics mode (strict on CUDA: ``CudaStrictOps``).

        Triton is imported only here, and only for the Triton set, so CPU work never needs it.
        """
        if self.numerics is not Numerics.STRICT:
            return Bf16FastOps if self.compute_dtype == torch.bfloat16 else FastOps
        emb = self.embedding
        return strict_ops_for(emb.device, self._strict_kernels, emb.dtype)

    # ------------------------------------------------------------------ public forwards

    def forward_logits(
        self,
        input_ids: Tensor,
        segment_lengths: Sequence[int],
        *,
        lora: AdapterArg = None,
        media: MediaBatch | None = None,
        inputs_embeds: Tensor | None = None,
        rows: Tensor | None = None,
        shared_prefixes: Sequence[tuple[int, int]] | None = None,
    ) -> Tensor:
        """fp32 logits ``[T, vocab]`` for packed segments (positions restart per segment).

        ``rows``: only the logits of these packed positions, ``[len(rows), vocab]`` (what
        ``forward_logits(...)[rows]`` holds: the same bits in strict numerics, where every row
        is computed alone); the LM head then reads those rows only (a trainer scores the
        response tokens, a small share of a packed batch).

        ``media``: the placeholder runs of the packed ids (``MediaBatch.pack`` of each
        sample's ``expand_media_tokens`` result); their embedding rows are the towers'
        outputs. ``inputs_embeds`` (``[T, hidden]`` fp32, e.g. from ``embed_inputs``) replaces
        the embedding step altogether (``media`` must then be None).

        ``shared_prefixes`` (where ``takes_shared_prefixes()``): one ``(parent, n)`` per segment;
        ``n > 0`` says the segment begins with the first ``n`` tokens of the earlier segment
        ``parent`` (one that shares none itself), which ``input_ids`` does not repeat: the
        segment's ``segment_lengths`` entry counts its own tokens, at positions ``n, n+1, ...``.
        ``(-1, 0)``: a segment packed whole. Every token's logits are the ones it gets with its
        segment packed whole (in strict numerics the same bits), for the shared tokens' work
        done once: the samples of one prompt share the prompt.
        """
        ids, layout, routing = self._packed_layout(
            input_ids, segment_lengths, lora, shared_prefixes
        )
        if shared_prefixes is not None and media is not None:
            raise ModelInputError(
                "shared_prefixes: not with media (the towers read whole segments)"
            )
        if inputs_embeds is not None:
            if media is not None:
                raise ModelInputError("pass media or inputs_embeds, not both")
            want = (ids.shape[0], self.config.hidden_size)
            if tuple(inputs_embeds.shape) != want or inputs_embeds.dtype != torch.float32:
                raise ModelInputError(
                    f"inputs_embeds is {inputs_embeds.dtype} {list(inputs_embeds.shape)}, "
                    f"expected torch.float32 {list(want)}"
                )
            return self._forward(ids, layout, routing, embeds=inputs_embeds, rows=rows)
        return self._forward(ids, layout, routing, media=media, rows=rows)

    def embed_inputs(self, input_ids: Tensor, media: MediaBatch | None = None) -> Tensor:
        """The embedding output ``[T, hidden]`` fp32 that the decoder layers see (before the
        optional embedding norm): the text embedding rows, with the tower outputs written
        over the placeholder rows of ``media``.

        Only the tower forwards run without grad; the write is out of place, so the text rows
        keep their gradient path to ``embedding`` (issue 25, trap 2).
        """
        ids = self._check_ids(input_ids.reshape(-1).long().to(self.embedding.device))
        return self._embed(ids, media)

    def _embed(self, ids: Tensor, media: MediaBatch | None) -> Tensor:
        """``embed_inputs`` for ids already checked and on the model's device."""
        h = self.embedding[ids].float()
        if media is None or not len(media):
            return h
        check_media_positions(ids, media, self.config)
        rows = self.media_embeddings(media)
        index = torch.tensor(media.positions(), dtype=torch.long, device=h.device)
        return h.index_put((index,), rows.to(h.dtype))

    def media_embeddings(self, media: MediaBatch) -> Tensor:
        """Tower outputs ``[media.num_tokens, hidden]`` fp32, span after span, computed under
        ``torch.no_grad`` (the towers are frozen; nothing flows back into them).

        Each kind's items go through their tower in one call; in strict numerics a row's bits
        do not depend on the other rows, so packing and batching change nothing.
        """
        cfg = self.config
        feats: dict[MediaKind, list[Tensor]] = {MediaKind.IMAGE: [], MediaKind.AUDIO: []}
        order: list[tuple[MediaKind, int, int]] = []  # (kind, first row, rows) per span
        sizes = {MediaKind.IMAGE: 0, MediaKind.AUDIO: 0}
        for span in media.spans:
            item = span.item
            n = item.num_tokens(cfg)
            if item.kind is MediaKind.IMAGE:
                f = image_patches(item.data, cfg.vision_patch_size)
            else:
                f = mel_features(item.data)
            feats[item.kind].append(f.to(self.embedding.device))
            order.append((item.kind, sizes[item.kind], n))
            sizes[item.kind] += n
        towers = {MediaKind.IMAGE: "vision_tower", MediaKind.AUDIO: "audio_tower"}
        out: dict[MediaKind, Tensor] = {}
        with torch.no_grad():  # the tower forwards only: never the write into the embeddings
            for kind, parts in feats.items():
                if parts:
                    tower = getattr(self, towers[kind])
                    assert isinstance(tower, MediaTower)
                    out[kind] = tower.encode(self.ops, torch.cat(parts))
        return torch.cat([out[kind][start : start + n] for kind, start, n in order])

    def forward_with_layout(
        self, input_ids: Tensor, layout: TokenLayout, *, lora: LoraAdapter | None = None
    ) -> Tensor:
        """fp32 logits ``[T, vocab]`` of tokens arranged by ``layout`` (see ``_blocks``).

        The seam for context parallel: a CP layout (a ``PackedLayout`` subclass holding this
        rank's tokens, their positions and global segment ids) exchanges sconv halos and
        gathers keys/values; everything else in the forward is per token.
        """
        ids = self._check_ids(input_ids.reshape(-1).long().to(self.embedding.device))
        if ids.shape[0] != layout.seg.shape[0] or ids.shape[0] != layout.pos.shape[0]:
            raise ModelInputError(
                f"input_ids has {ids.shape[0]} tokens but the layout has "
                f"{layout.seg.shape[0]} segment ids and {layout.pos.shape[0]} positions"
            )
        if ids.numel() == 0:
            raise ModelInputError("input_ids is empty: a forward needs at least one token")
        cap = self.config.capacity
        if int(layout.pos.min()) < 0 or int(layout.pos.max()) >= cap:
            raise ModelInputError(f"layout positions must lie in [0, {cap})")
        if int(layout.seg.min()) < 0:
            raise ModelInputError("layout segment ids must be >= 0")
        num_segments = int(layout.seg.max()) + 1
        routing = LoraRouting(lora, layout.seg, num_segments, self._lora_targets)
        return self._forward(ids, layout, routing)

    def forward(
        self, input_ids: Tensor, segment_lengths: Sequence[int], *, lora: AdapterArg = None
    ) -> Tensor:
        """Same as ``forward_logprobs`` (the training forward)."""
        return self.forward_logprobs(input_ids, segment_lengths, lora=lora)

    def forward_logprobs(
        self,
        input_ids: Tensor,
        segment_lengths: Sequence[int],
        *,
        lora: AdapterArg = None,
        media: MediaBatch | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Per-token fp32 logprobs ``[T]`` for packed segments.

        ``out[t] = log p(ids[t] | ids[start:t])`` within ``t``'s segment; a segment's first
        position has no prediction and holds 0.0. Differentiable. ``media`` and
        ``inputs_embeds``: see ``forward_logits``.
        """
        logits = self.forward_logits(
            input_ids, segment_lengths, lora=lora, media=media, inputs_embeds=inputs_embeds
        )
        logprobs = self.ops.log_softmax(logits)
        ids = input_ids.reshape(-1).long().to(logprobs.device)
        out = torch.zeros(ids.shape[0], dtype=torch.float32, device=logprobs.device)
        if ids.shape[0] > 1:
            picked = logprobs[:-1].gather(1, ids[1:, None])[:, 0]
            starts = torch.zeros(ids.shape[0], dtype=torch.bool, device=logprobs.device)
            starts[_segment_starts(segment_lengths)] = True
            out = torch.cat([out[:1], torch.where(starts[1:], 0.0, picked)])
        return out

    def forward_token_logprobs(
        self,
        input_ids: Tensor,
        segment_lengths: Sequence[int],
        rows: Tensor,
        targets: Tensor,
        *,
        media: MediaBatch | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> tuple[Tensor, Tensor]:
        """``(logprob [N], entropy [N])`` fp32: ``log p(targets[i])`` under the distribution of
        packed position ``rows[i]`` (its logits row, as ``forward_logits(...)[rows]``) and that
        distribution's entropy. Differentiable.

        Fast numerics with a plain LM head: ``chunked_token_logprobs`` over the picked rows'
        hidden states, so full-vocabulary fp32 logits never exist for all tokens at once (same
        values up to fp32 rounding). Otherwise (strict numerics, a wrapped head) the logits of
        every token, the kernel set's log-softmax and the rows picked, as the engine computes.
        """
        ids, layout, routing = self._packed_layout(input_ids, segment_lengths, None)
        h = self._hidden(ids, layout, routing, media=media)
        rows, targets = rows.to(h.device).long(), targets.to(h.device).long()
        site = self.sites["lm_head"]
        if self.numerics is Numerics.FAST and type(site) is LinearSite:
            return chunked_token_logprobs(
                h[rows],
                site.weight,
                targets,
                chunk_tokens=chunk_tokens,
                compute_dtype=self.ops.compute_dtype,
                logits_divisor=self.config.logits_divisor,
            )
        logits = self._head(h, routing)[rows]
        logp = self.ops.log_softmax(logits)
        full = torch.log_softmax(logits, dim=-1)
        return logp.gather(1, targets[:, None])[:, 0], -(full.exp() * full).sum(-1)

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
        media: Sequence[MediaBatch | None] | None = None,
    ) -> list[Step]:
        """Append ``token_ids[j]`` to cache row ``rows[j]``; return each row's ``Step``.

        ``Step.logprobs[n]`` is the log-softmax of the distribution after the row's n-th new
        token, i.e. of the token that follows it. ``lora`` is one adapter or one per row.
        ``media`` is one ``MediaBatch`` (or None) per row, its positions relative to that
        row's new tokens: placeholder runs lie inside one call (prefill media in one piece).
        """
        if len(rows) != len(token_ids) or len(set(rows)) != len(rows):
            raise CacheError(
                f"rows {list(rows)} must be distinct and match {len(token_ids)} inputs"
            )
        if media is not None and len(media) != len(rows):
            raise ModelInputError(f"media has {len(media)} entries for {len(rows)} cache rows")
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
        routing = LoraRouting(lora, seg_t, len(rows), self._lora_targets)
        sizes = [len(t) for t in token_ids]
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        layout = CacheLayout(cache, list(rows), sizes, seg_t, pos_t)
        packed = None if media is None else MediaBatch.pack(media, sizes)
        logits = self._forward(ids, layout, routing, media=packed)
        logprobs = self.ops.log_softmax(logits)
        for row, toks in zip(rows, token_ids, strict=True):
            cache.lengths[row] += len(toks)
        return [
            Step(lg, lp)
            for lg, lp in zip(torch.split(logits, sizes), torch.split(logprobs, sizes), strict=True)
        ]

    def prefill(
        self,
        cache: KVCache,
        row: int,
        token_ids: Sequence[int],
        *,
        lora: AdapterArg = None,
        media: MediaBatch | None = None,
    ) -> Step:
        """Append a prompt to one cache row; ``Step`` tensors are ``[len(token_ids), vocab]``.

        ``media``: the placeholder runs of ``token_ids`` (``expand_media_tokens``' batch).
        """
        return self.extend(
            cache, [row], [token_ids], lora=lora, media=None if media is None else [media]
        )[0]

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

    def _add_mla_sites(self, layer: MlaLayer) -> None:
        cfg, a = self.config, f"model.layers.{layer.index}.self_attn."
        attn = layer.self_attn
        for name in MLA_PROJECTIONS:
            weight = getattr(attn, name, None)
            if weight is not None:
                rows = ((a + name, int(weight.shape[0])),)
                layer.sites[name] = LinearSite(self, attn, name, parts=rows)
        if not layer.is_moe:
            m, i = f"model.layers.{layer.index}.mlp.", cfg.intermediate_size
            parts = ((m + "gate_proj", i), (m + "up_proj", i))
            layer.sites["fc1"] = LinearSite(self, layer, "fc1", parts=parts)
            layer.sites["fc2"] = LinearSite(
                self, layer, "fc2", parts=((m + "down_proj", cfg.hidden_size),)
            )

    def _add_sites(self) -> None:
        cfg = self.config
        for layer in self.layers:
            if isinstance(layer, MlaLayer):
                self._add_mla_sites(layer)
                continue
            assert isinstance(layer, _Layer)
            shape = cfg.attention_shape(layer.index)
            hd = shape.head_dim
            nq, nk = shape.num_heads * hd, shape.num_kv_heads * hd
            a, m = f"model.layers.{layer.index}.self_attn.", f"model.layers.{layer.index}.mlp."
            qkv: tuple[tuple[str, int], ...] = (
                (a + "q_proj", nq),
                (a + "k_proj", nk),
                (a + "v_proj", nk),
            )
            if cfg.rel_pos_dim:
                qkv += ((a + "r_proj", shape.num_heads * cfg.rel_pos_dim),)
            specs = {"qkv": qkv, "proj": ((a + "o_proj", cfg.hidden_size),)}
            biases = {"qkv": "qkv_bias"} if cfg.qkv_bias else {}
            if isinstance(layer, MoeLayer):
                specs["router"] = ((m + "gate", cfg.num_experts + cfg.n_shared_experts),)
            else:
                i = cfg.intermediate_size
                specs["fc1"] = ((m + "gate_proj", i), (m + "up_proj", i))
                specs["fc2"] = ((m + "down_proj", cfg.hidden_size),)
            for param, parts in specs.items():
                layer.sites[param] = LinearSite(
                    self, layer, param, parts=parts, bias=biases.get(param)
                )
        head = "embedding" if self.output is None else "output"
        self.sites["lm_head"] = LinearSite(self, self, head, parts=(("lm_head", cfg.vocab_size),))

    def _check_ids(self, ids: Tensor) -> Tensor:
        """``ids`` when every id is in the vocabulary (one host sync on a device: the check
        reads one bool back; ids still on the CPU are checked before they move)."""
        outside = (ids < 0) | (ids >= self.config.vocab_size)
        if ids.numel() and bool(outside.any()):
            bad = int(outside.nonzero()[0, 0])
            raise ModelInputError(
                f"input_ids[{bad}]={int(ids[bad])} is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        return ids

    def _pack(self, input_ids: Tensor, lengths: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        dev = self.embedding.device
        ids = self._check_ids(input_ids.reshape(-1).long()).to(dev)  # checked where it lies
        cap = self.config.capacity
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
            output_size=ids.shape[0],  # known here: no read-back of the repeats' sum
        )
        starts = torch.tensor(_segment_starts(lengths), dtype=torch.long, device=dev)
        pos = torch.arange(ids.shape[0], device=dev) - starts[seg]
        return ids, seg, pos

    def takes_shared_prefixes(self) -> bool:
        """Whether ``forward_logits`` takes ``shared_prefixes``: strict numerics (where a shared
        token's row has the bits it has in each segment alone), a config without short
        convolutions or a relative position bias (they read whole packed segments)."""
        cfg = self.config
        return self.ops.batch_invariant and not cfg.sconv_kernel_size and not cfg.rel_pos_dim

    def _packed_layout(
        self,
        input_ids: Tensor,
        segment_lengths: Sequence[int],
        lora: AdapterArg,
        shared_prefixes: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[Tensor, PackedLayout, LoraRouting]:
        """Checked ids, the packed layout and the LoRA routing of a training forward."""
        if shared_prefixes is not None:
            return self._shared_prefix_layout(input_ids, segment_lengths, lora, shared_prefixes)
        ids, seg, pos = self._pack(input_ids, segment_lengths)
        routing = LoraRouting(lora, seg, len(segment_lengths), self._lora_targets)
        # buffers only as long as the longest segment needs (rounded up to a power of two, as
        # attend_buffers reduces): the same bits as full capacity, at a cost independent of it.
        # The longest segment comes from the host lengths, never from the device (no sync).
        longest = max(segment_lengths)
        width = min(self.config.capacity, 1 << (longest - 1).bit_length())
        layout = PackedLayout(seg, pos, len(segment_lengths), width, longest=longest)
        return ids, layout, routing

    def _shared_prefix_layout(
        self,
        input_ids: Tensor,
        lengths: Sequence[int],
        lora: AdapterArg,
        shared: Sequence[tuple[int, int]],
    ) -> tuple[Tensor, PackedLayout, LoraRouting]:
        """``_packed_layout`` for ``forward_logits``' ``shared_prefixes`` (checked here, each
        error naming the segment): a ``SharedPrefixLayout``."""
        if not self.takes_shared_prefixes():
            raise ModelInputError(
                "shared_prefixes: this model computes a shared token differently per segment "
                "(fast numerics, short convolutions or a relative position bias)"
            )
        if not isinstance(lora, LoraAdapter | None):
            raise ModelInputError("shared_prefixes: one adapter (or none) for every segment")
        if len(shared) != len(lengths):
            raise ModelInputError(
                f"shared_prefixes has {len(shared)} entries for {len(lengths)} segments"
            )
        entries = []
        for s, entry in enumerate(shared):  # lists (from JSON) as well as tuples
            if len(entry) != 2 or not all(isinstance(v, int) for v in entry):
                raise ModelInputError(f"shared_prefixes[{s}]={entry!r}: not a (parent, n) pair")
            entries.append((int(entry[0]), int(entry[1])))
        shared = entries
        ids, seg, own_pos = self._pack(input_ids, lengths)
        cap, starts = self.config.capacity, _segment_starts(lengths)
        rows: list[int] = []
        key_start: list[int] = []
        key_seg: list[int] = []
        key_pos: list[int] = []
        for s, ((parent, n), own) in enumerate(zip(shared, lengths, strict=True)):
            if (parent, n) != (-1, 0):
                if not 0 <= parent < s or shared[parent] != (-1, 0):
                    raise ModelInputError(
                        f"shared_prefixes[{s}]=({parent}, {n}): the parent must be an earlier "
                        "segment that shares no prefix itself"
                    )
                if not 0 < n <= lengths[parent] or n + own > cap:
                    raise ModelInputError(
                        f"shared_prefixes[{s}]=({parent}, {n}): n must be in [1, "
                        f"{lengths[parent]}] (segment {parent}'s tokens) with n + {own} own "
                        f"tokens at most the capacity {cap}"
                    )
                rows.extend(range(starts[parent], starts[parent] + n))
            key_start.append(len(key_seg))
            rows.extend(range(starts[s], starts[s] + own))
            key_seg.extend([s] * (n + own))
            key_pos.extend(range(n + own))
        dev = ids.device
        base = torch.tensor([n for _, n in shared], dtype=torch.long, device=dev)
        longest = max(n + own for (_, n), own in zip(shared, lengths, strict=True))
        layout = SharedPrefixLayout(
            seg, own_pos + base[seg], len(lengths), min(cap, 1 << (longest - 1).bit_length()),
            key_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            key_start=torch.tensor(key_start, dtype=torch.long, device=dev)[seg],
            key_seg=torch.tensor(key_seg, dtype=torch.long, device=dev),
            key_pos=torch.tensor(key_pos, dtype=torch.long, device=dev),
        )  # fmt: skip
        return ids, layout, LoraRouting(lora, seg, len(lengths), self._lora_targets)

    def _forward(
        self,
        ids: Tensor,
        layout: TokenLayout,
        lora: LoraRouting,
        *,
        media: MediaBatch | None = None,
        embeds: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> Tensor:
        h = self._hidden(ids, layout, lora, media=media, embeds=embeds)
        if rows is None:
            return self._head(h, lora)
        rows = rows.to(h.device).long()
        if lora.active:  # a per-request adapter on the head routes by every token's segment
            return self._head(h, lora)[rows]
        return self._head(h[rows], lora)

    def _hidden(
        self,
        ids: Tensor,
        layout: TokenLayout,
        lora: LoraRouting,
        *,
        media: MediaBatch | None = None,
        embeds: Tensor | None = None,
    ) -> Tensor:
        """The last hidden states ``[T, H]`` (after the final norm) that the LM head reads."""
        cfg, ops = self.config, self.ops
        h = self._embed(ids, media) if embeds is None else embeds  # ids checked by the caller
        if cfg.embedding_rms_norm:
            h = ops.rms_norm(h, self.embed_norm, cfg.rms_norm_eps)
        h = self.scatter_sequence(h)
        call = LayerCall(self, layout, lora)
        if isinstance(layout, PackedLayout) and layers_compiled(self):
            layout.prepare()  # its host syncs here, not inside a compiled layer
        checkpointed = self.activation_checkpointing and torch.is_grad_enabled()
        if checkpointed:  # imported here: torch.utils.checkpoint imports dynamo (and Triton)
            from torch.utils.checkpoint import checkpoint
        for layer in self.layers:
            h = checkpoint(layer, h, call, use_reentrant=False) if checkpointed else layer(h, call)
        h = self.gather_sequence(h)
        return ops.rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def _head(self, h: Tensor, lora: LoraRouting) -> Tensor:
        """fp32 logits ``[T, vocab]`` of the last hidden states ``h``."""
        cfg, ops = self.config, self.ops
        logits = self.sites["lm_head"](h).float()  # fp32 logits whatever the compute dtype
        logits = lora.apply(ops, h, logits, [("lm_head", 0, cfg.vocab_size)])
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        return logits

    # ------------------------------------------------------------------ extension points
    # The four methods below are the decoder's documented parallelism seams (README, "Extension
    # points"): a subclass that splits the model over ranks overrides them, and the decoder
    # calls nothing else of a subclass. Here each is the identity or the single-process
    # computation.

    def scatter_sequence(self, h: Tensor) -> Tensor:
        """Seam: the residual stream ``h[T, H]`` (embedded, after the optional embedding norm)
        entering the layers; returns the rows the layers see. The identity here.

        A sequence-parallel subclass keeps its rank's contiguous slice of the tokens (its
        parallel linears gather and scatter tokens themselves); its backward must give the
        gradient of every token back. A pure selection, never arithmetic: strict numerics stay
        bit for bit the single-process rows.
        """
        return h

    def gather_sequence(self, h: Tensor) -> Tensor:
        """Seam: the residual stream leaving the layers (``scatter_sequence``'s rows); returns
        the whole stream ``[T, H]`` that the final norm and the LM head read. The identity here;
        with ``scatter_sequence`` it must compose to the identity in forward (a concatenation
        of the ranks' rows in token order)."""
        return h

    def gather_layer_tokens(self, x: Tensor) -> Tensor:
        """Seam: an activation ``x[T_local, ...]`` computed from this rank's tokens that
        attention reads for every token (MLA's rope key, which no parallel linear gathers);
        returns ``[T, ...]``. The identity here. A sequence-parallel subclass all-gathers the
        tokens and sums the gradient over the ranks in backward (megatron-core's
        ``gather_from_sequence_parallel_region``)."""
        return x

    def moe(self, layer: MoeLayer | MlaLayer, m: Tensor, lora: LoraRouting, prefix: str) -> Tensor:
        """Seam: a MoE layer's output ``[T_local, H]`` for its post-norm input ``m[T_local, H]``
        (the rows ``scatter_sequence`` kept). ``layer``: the ``MoeLayer`` (router site, stacked
        experts) or ``MlaLayer`` (its DeepSeek-style ``layer.moe`` block, no LoRA hook);
        ``lora``: the forward's ``LoraRouting`` (deltas on ``{prefix}mlp.gate``,
        ``{prefix}mlp.experts.{j}.*``, ``{prefix}mlp.shared_experts.{s}.*``); ``prefix``: the
        layer's PEFT name prefix, ``model.layers.{i}.``.

        Row-wise: a token's output depends on its own row only (so any split of the rows is
        legal). An override that replaces it (expert parallelism) keeps strict numerics' bits:
        routing ties to the lower id, experts combined in ascending id order, shared experts
        first (``ops.moe_combine``)."""
        cfg, ops = self.config, self.ops
        if isinstance(layer, MlaLayer):
            out: Tensor = layer.moe(ops, m)
            return out
        e, ns = cfg.num_experts, cfg.n_shared_experts
        logits = layer.sites["router"](m)
        logits = lora.apply(ops, m, logits, [(prefix + "mlp.gate", 0, e + ns)])
        ids, weights = moe_routing(ops, cfg, logits, getattr(layer, "expert_bias", None))
        fused = None
        if not lora.touches(prefix + "mlp.experts."):  # a fused set's op takes no expert LoRA
            fused = ops.routed_experts(m, ids, layer.experts_fc1, layer.experts_fc2)
        if fused is not None:
            outputs = fused
        elif not ops.batch_invariant and not lora.active:
            outputs = grouped_experts(ops, m, ids, layer.experts_fc1, layer.experts_fc2)
        else:
            outputs = self._experts_by_id(layer, m, ids, lora, prefix)
        if ns:
            shared = [
                self._expert(
                    layer.shared_fc1[s],
                    layer.shared_fc2[s],
                    m,
                    lora,
                    f"{prefix}mlp.shared_experts.{s}.",
                    None,
                )
                for s in range(ns)
            ]
            # fixed fp32 order: shared experts 0..S-1, then routed experts by ascending id
            outputs = torch.cat([torch.stack(shared, dim=1).to(outputs.dtype), outputs], dim=1)
        return ops.moe_combine(weights, outputs)

    # ------------------------------------------------------------------ layer computation

    def _layer_forward(
        self, layer: _Layer, h: Tensor, layout: TokenLayout, lora: LoraRouting
    ) -> Tensor:
        """The residual stream ``[T, H]`` after one (non-MLA) layer: attention, then its MLP."""
        cfg, ops = self.config, self.ops
        prefix = layer.prefix
        h = h + self._attention(layer, h, layout, lora, prefix)
        m = ops.rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
        if isinstance(layer, MoeLayer):
            y = self.moe(layer, m, lora, prefix)
        else:
            assert isinstance(layer, DenseLayer)
            y = self._dense(layer, m, lora, prefix)
        if cfg.sconv_kernel_size:
            y = layout.sconv(ops, layer.index, "mlp", y, layer.mlp_out_conv)
        return h + y

    def _rope(self, head_dim: int) -> tuple[Tensor, Tensor]:
        if head_dim == self.config.head_dim:
            return self.rope_cos, self.rope_sin
        return self.rope_cos_swa, self.rope_sin_swa

    def _attention(
        self, layer: _Layer, h: Tensor, layout: TokenLayout, lora: LoraRouting, prefix: str
    ) -> Tensor:
        cfg, ops = self.config, self.ops
        i = layer.index
        nh, nkv, hd = cfg.attention_shape(i)
        nq, nk, nr = nh * hd, nkv * hd, nh * cfg.rel_pos_dim
        a = ops.rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
        qkv = layer.sites["qkv"](a)
        t = qkv.shape[0]  # all tokens: a sequence-parallel site gathers them (``h`` is a slice)
        names = [
            (prefix + "self_attn.q_proj", 0, nq),
            (prefix + "self_attn.k_proj", nq, nq + nk),
            (prefix + "self_attn.v_proj", nq + nk, nq + 2 * nk),
        ]
        if nr:
            names.append((prefix + "self_attn.r_proj", nq + 2 * nk, nq + 2 * nk + nr))
        qkv = lora.apply(ops, a, qkv, names)
        k_raw, v_raw = qkv[:, nq : nq + nk], qkv[:, nq + nk : nq + 2 * nk]
        if cfg.sconv_kernel_size:
            k_raw = layout.sconv(ops, i, "k", k_raw, layer.k_conv)
            v_raw = layout.sconv(ops, i, "v", v_raw, layer.v_conv)
        q, k = qkv[:, :nq].reshape(t, nh, hd), k_raw.reshape(t, nkv, hd)
        q_w: Tensor | None = None
        k_w: Tensor | None = None
        if cfg.qk_norm:
            q_w, k_w = layer.q_norm, layer.k_norm
            if cfg.qk_norm_per_head:
                q_w, k_w = q_w.reshape(nh, hd), k_w.reshape(nkv, hd)
        v = v_raw.reshape(t, nkv, hd)
        cos_t, sin_t = self._rope(hd)
        cos, sin = cos_t[layout.pos], sin_t[layout.pos]
        eps = cfg.rms_norm_eps
        q, k = ops.norm_rope(q, q_w, eps, cos, sin), ops.norm_rope(k, k_w, eps, cos, sin)
        rel = None
        if nr:
            r = qkv[:, nq + 2 * nk :].reshape(t, nh, cfg.rel_pos_dim)
            rel = rel_logits_of(ops, r, layer.rel_proj)
        o = layout.attend(
            ops,
            i,
            q,
            k,
            v,
            scale=cfg.softmax_scale(i),
            window=cfg.attention_window(i),
            rel_logits=rel,
        )
        y = layer.sites["proj"](o)
        y = lora.apply(ops, o, y, [(prefix + "self_attn.o_proj", 0, cfg.hidden_size)])
        if cfg.sconv_kernel_size:
            y = layout.sconv(ops, i, "attn", y, layer.attn_out_conv)
        return y

    def _mla_layer(
        self, layer: MlaLayer, h: Tensor, layout: TokenLayout, lora: LoraRouting
    ) -> Tensor:
        """The residual stream ``[T, H]`` after one MLA layer (attention, then its MLP or MoE).

        Decode (a ``CacheLayout``) caches the compressed latent and rope key (``MlaCache``):
        strict numerics use the expanded form (bit-identical to training), fast numerics the
        absorbed form unless an adapter is active (absorption reads ``kv_b_proj`` directly,
        past its LoRA delta).
        """
        cfg, ops = self.config, self.ops
        prefix = layer.prefix
        sites = layer.sites

        n_tok = h.shape[0]
        expanded_index: list[Tensor] = []  # decode: the token whose adapter each cached slot uses

        def linear(name: str, x: Tensor) -> Tensor:
            y = sites[name](x)
            index = None
            if lora.active and x.shape[0] != n_tok:  # decode's kv_b expansion [rows * W]
                index = _cached_slot_tokens(layout, x.shape[0], expanded_index)
            return lora.apply(ops, x, y, [(f"{prefix}self_attn.{name}", 0, y.shape[1])], index)

        a = ops.rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
        cos, sin = self.rope_cos[layout.pos], self.rope_sin[layout.pos]
        attn = layer.self_attn
        if isinstance(layout, CacheLayout):
            if layout.cache.mla is None:
                raise CacheError("an MLA model decodes with an MLA cache (model.new_kv_cache)")
            y = attn.forward_cached(
                ops,
                a,
                layout.cache.mla,
                layer.index,
                rows=layout.buf_row,
                pos=layout.pos,
                cos=cos,
                sin=sin,
                absorbed=False if lora.active else None,
                linear=linear,
            )
        else:
            assert isinstance(layout, PackedLayout)
            y = attn.forward_packed(
                ops, a, layout, cos=cos, sin=sin, layer=layer.index, linear=linear,
                rope_key_tokens=self.gather_layer_tokens,
            )  # fmt: skip
        h = h + y
        m = ops.rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps)
        if layer.is_moe:
            return h + self.moe(layer, m, lora, prefix)
        return h + self._dense(layer, m, lora, prefix)

    def _dense(
        self, layer: DenseLayer | MlaLayer, m: Tensor, lora: LoraRouting, prefix: str
    ) -> Tensor:
        ops, i = self.ops, self.config.intermediate_size
        gu = layer.sites["fc1"](m)
        gu = lora.apply(
            ops, m, gu, [(prefix + "mlp.gate_proj", 0, i), (prefix + "mlp.up_proj", i, 2 * i)]
        )
        act = ops.silu_mul_halves(gu)
        y = layer.sites["fc2"](act)
        return lora.apply(ops, act, y, [(prefix + "mlp.down_proj", 0, self.config.hidden_size)])

    def _experts_by_id(
        self, layer: MoeLayer, m: Tensor, ids: Tensor, lora: LoraRouting, prefix: str
    ) -> Tensor:
        """Routed expert outputs ``[T, k, H]`` (the slot order of ``ids``), expert by expert
        with each expert's LoRA deltas: the strict path (and any path with adapters)."""
        k, e = self.config.num_experts_per_tok, self.config.num_experts
        outputs = m.new_zeros(m.shape[0], k, self.config.hidden_size)
        # (token, slot) pairs grouped by expert, each group in row-major order (what
        # ``(ids == j).nonzero()`` gives), with one host transfer for the group sizes
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sizes = torch.bincount(flat, minlength=e).tolist()
        start = 0
        for j, size in enumerate(sizes):
            pairs = order[start : start + size]
            start += size
            if size == 0:
                continue
            tok, slot = pairs // k, pairs % k
            ep = f"{prefix}mlp.experts.{j}."
            ye = self._expert(layer.experts_fc1[j], layer.experts_fc2[j], m[tok], lora, ep, tok)
            outputs = outputs.index_put((tok, slot), ye.to(outputs.dtype))
        return outputs

    def _expert(
        self,
        fc1: Tensor,
        fc2: Tensor,
        x: Tensor,
        lora: LoraRouting,
        prefix: str,
        tok: Tensor | None,
    ) -> Tensor:
        ops = self.ops
        i, hsz = fc2.shape[1], fc2.shape[0]
        gu = ops.linear(x, fc1)
        gu = lora.apply(
            ops, x, gu, [(prefix + "gate_proj", 0, i), (prefix + "up_proj", i, 2 * i)], tok
        )
        act = ops.silu_mul_halves(gu)
        y = ops.linear(act, fc2)
        return lora.apply(ops, act, y, [(prefix + "down_proj", 0, hsz)], tok)


def _cached_slot_tokens(layout: TokenLayout, slots: int, memo: list[Tensor]) -> Tensor:
    """For decode's expansion of the cached latents of the call's rows (``MlaAttention``:
    ``[rows used, W]`` flattened, rows ascending), the index of a token of each slot's row,
    so the slot's ``kv_b_proj`` gets that row's adapter."""
    if not memo:
        rows = layout.buf_row if isinstance(layout, CacheLayout) else layout.seg
        used, local = torch.unique(rows, return_inverse=True)
        order = torch.arange(rows.shape[0], device=rows.device)
        first = torch.full((used.shape[0],), rows.shape[0], dtype=torch.long, device=rows.device)
        first = first.scatter_reduce(0, local, order, reduce="amin")
        memo.append(first.repeat_interleave(slots // used.shape[0]))
    return memo[0]


def _segment_starts(lengths: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def build_model(
    config: ModelConfig,
    seed: int = 0,
    *,
    numerics: Numerics = Numerics.STRICT,
    strict_kernels: StrictKernels = "auto",
    device: torch.device | str = "cpu",
) -> DecoderModel:
    """A model with weights drawn from ``seed`` (normal(0, initializer_range); norms = 1;
    sconv weights 0, so each residual convolution starts as the identity).

    ``device``: where the model lives and the draws are made (a generator on that device: a
    large model on a GPU initialises there in a second; the values differ from a CPU draw)."""
    model = DecoderModel(config, numerics=numerics, strict_kernels=strict_kernels).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("norm"):
                param.fill_(1.0)
            elif leaf.endswith("_conv"):
                param.zero_()  # sconv starts as the identity
            else:
                draw = torch.randn(param.shape, generator=gen, device=device)
                param.copy_((draw * config.initializer_range).to(param.dtype))
    return model
