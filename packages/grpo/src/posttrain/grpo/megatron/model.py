"""The ``posttrain.models`` decoder split over a tensor-parallel group (Megatron's layout).

``TensorParallelDecoder`` is a ``DecoderModel`` built on the *local* shape of one TP rank
(``num_attention_heads / tp`` query heads, ``num_key_value_heads / tp`` KV heads,
``intermediate_size / tp``), whose four fused linears per layer are megatron-core parallel
linears (``layers``):

    qkv  -> column parallel   rank r holds [q_r; k_r; v_r]: its query heads and the KV heads
                              they read (GQA: KV heads split over TP, each part alone)
    proj -> row parallel      o_proj columns of the rank's query heads; output all-reduced
    fc1  -> column parallel   rank r holds [gate_r; up_r] (gate and up split alone)
    fc2  -> row parallel      down_proj columns of the rank's intermediate slice

Everything else (embedding, norms, the MoE router and experts, the LM head) is replicated.
Attention runs the model's own code and kernels on the rank's heads, so in strict numerics a
rank's q, k, v and attention output are bit for bit the single-process model's rows for those
heads; the row all-reduce adds two partial sums where the single process runs one tree, so
logits differ in the last bits (train/rollout logprob differences are expected and reported).

Sequence parallel (``sequence_parallel=True``): between the parallel linears the residual
stream holds ``T / tp`` tokens per rank (the decoder's ``scatter_sequence`` /
``gather_sequence`` extension points): the column linears all-gather tokens, the row linears
reduce-scatter them; the packed batch is padded with one short extra segment to a multiple of
``tp`` tokens and the padding's logits dropped. Norms, router and experts then see a rank's
tokens only, so their gradients are partial sums over TP (``grads.tp_partial_parameters``).

Checkpoints: ``load_hf_state_dict`` takes the HF tensors the single-process model loads and
keeps this rank's slices; ``hf_state_dict`` (collective over TP) gathers the shards back to the
HF names, bit for bit the single-process model's weights (a pure concatenation). So a
checkpoint saved under one TP size loads under another.

Expert parallel (``groups.ep_size > 1``): each MoE layer's router and experts become an
``expert_parallel.ExpertParallelMoe`` (``layer.expert_parallel``; routed experts split over the
EP group, tokens dispatched with explicit all-to-alls, the model's own kernels); its routed
experts are gathered over EP on export and sliced on load like the TP shards.

MLA models (DeepSeek-V3, GLM-4.x-MoE-Lite: ``config.is_mla``) split their heads as
megatron-core's MLA does: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` column parallel (their
rows are head-major), ``o_proj`` row parallel; ``q_a_proj``, ``kv_a_proj_with_mqa``, the latent
norms and the DeepSeek-style MoE replicated. The rope key, shared by all heads, is the one
replicated activation read by per-rank heads only: ``RopeKeyGradSum`` sums its gradient over TP
(the latents' gradients are summed by the column layers). With sequence parallel the latent
projections and norms run on the rank's tokens (as megatron-core's MLA under SP): ``q_b_proj``
and ``kv_b_proj`` all-gather the latents, and the rope key is all-gathered on its own
(``gather_layer_tokens``, whose backward reduce-scatter also sums its gradient over TP). With
expert parallel the DeepSeek-style MoE layers become ``ExpertParallelMoe`` layers in their
DeepSeek form (``layer.expert_parallel`` replacing ``layer.moe``; weights keep the
``layers.{i}.moe.*`` names).

Refused under TP > 1 (a ``GrpoConfigError`` naming the field): head counts or the dense
intermediate size that TP does not divide, and the Inkling-style blocks whose weights would need
their own split (``sconv_kernel_size``, ``rel_pos_dim``, ``qk_norm_per_head``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.grpo._errors import GrpoConfigError, GrpoInputError
from posttrain.grpo.megatron._mappings import (
    gather_tokens,
    gather_tokens_keep_grad,
    split_tokens,
)
from posttrain.grpo.megatron.groups import ParallelGroups
from posttrain.grpo.megatron.layers import (
    KernelColumnParallelLinear,
    KernelRowParallelLinear,
    ParallelSite,
    parallel_config,
)
from posttrain.lora import all_gather_flat
from posttrain.models import (
    DecoderModel,
    ModelConfig,
    Numerics,
    from_hf_state_dict,
    to_hf_state_dict,
    weight_groups,
)

if TYPE_CHECKING:  # the decoder's public types, for the extension points' signatures
    from posttrain.models import AdapterArg, LoraRouting, MediaBatch, MlaLayer, MoeLayer

# Inkling-style blocks whose weights are laid out per head / per channel of a sharded dim.
_UNSHARDED_EXTENSIONS = ("sconv_kernel_size", "rel_pos_dim", "qk_norm_per_head")


def check_tensor_parallel_config(config: ModelConfig, tp_size: int) -> None:
    """Refuse a model that ``tp_size`` cannot split (see the module docstring)."""
    if tp_size == 1:
        return
    where = f"tensor_model_parallel_size={tp_size}"
    for name in _UNSHARDED_EXTENSIONS:
        if getattr(config, name):
            raise GrpoConfigError(
                f"the model's {name}={getattr(config, name)!r} has no tensor-parallel split in "
                f"the megatron backend; train it with {where} -> 1 (or the fsdp backend)",
                field="tensor_model_parallel_size",
            )
    for i in range(config.num_hidden_layers):
        nh, nkv, _ = config.attention_shape(i)
        for field, value in (("num_attention_heads", nh), ("num_key_value_heads", nkv)):
            if value % tp_size:
                raise GrpoConfigError(
                    f"the model's {field}={value} (layer {i}) is not divisible by {where}: "
                    "each rank must hold whole heads",
                    field="tensor_model_parallel_size",
                )
    dense = any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if dense and config.intermediate_size % tp_size:
        raise GrpoConfigError(
            f"the model's intermediate_size={config.intermediate_size} is not divisible by "
            f"{where}: gate_proj/up_proj rows and down_proj columns are split over TP",
            field="tensor_model_parallel_size",
        )


def local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The shape one TP rank computes: its share of heads and of the dense intermediate size."""
    check_tensor_parallel_config(config, tp_size)
    if tp_size == 1:
        return config
    changes: dict[str, object] = {
        "num_attention_heads": config.num_attention_heads // tp_size,
        "num_key_value_heads": config.num_key_value_heads // tp_size,
        "intermediate_size": max(config.intermediate_size // tp_size, 1),
    }
    for name in ("swa_num_attention_heads", "swa_num_key_value_heads"):
        value = getattr(config, name)
        if value:
            changes[name] = value // tp_size
    return config.replace(**changes)


@dataclass(frozen=True, slots=True)
class Shard:
    """How one fused in-memory weight is split over TP: its site and the full part sizes."""

    site: ParallelSite
    kind: str  # "column" (dim 0, each part alone) or "row" (dim 1)
    full_parts: tuple[int, ...]


class TensorParallelDecoder(DecoderModel):
    """A ``DecoderModel`` whose attention and dense MLP are split over ``groups.tp``."""

    def __init__(
        self,
        config: ModelConfig,
        groups: ParallelGroups,
        *,
        sequence_parallel: bool = False,
        numerics: Numerics = Numerics.STRICT,
        device: torch.device | None = None,
    ) -> None:
        """``device``: where the expert-parallel layers check their groups (NCCL needs the
        rank's GPU); the rest is built on the CPU, then moved with ``.to(device)``."""
        if config.image_token_id is not None or config.audio_token_id is not None:
            raise GrpoConfigError(
                "backend: the megatron backend does not train multimodal models (this config "
                "has vision/audio towers: image_token_id/audio_token_id set); train them with "
                "--backend fsdp"
            )
        tp = groups.tp_size
        self._build_device = device
        super().__init__(local_config(config, tp), numerics=numerics)
        self.full_config = config
        self.groups = groups
        self.sequence_parallel = sequence_parallel and tp > 1
        self.shards: dict[str, Shard] = {}
        mcfg = parallel_config(
            tp_size=tp, sequence_parallel=self.sequence_parallel, dtype=config.dtype
        )

        def kernel() -> Callable[[Tensor, Tensor], Tensor]:
            return self.ops.linear

        h = config.hidden_size
        for layer in self.layers:
            i: int = getattr(layer, "index")  # noqa: B009 (nn.Module's __getattr__ is untyped)
            sites: nn.ModuleDict = getattr(layer, "sites")  # noqa: B009
            if config.is_moe_layer(i) and groups.ep_size > 1:
                self._split_experts(layer, i, numerics)
            if config.is_mla:
                self._split_mla(layer, i, mcfg, kernel)
                continue
            nh, nkv, hd = config.attention_shape(i)
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            specs: list[tuple[str, str, tuple[tuple[str, int], ...]]] = [
                ("qkv", "column", ((a + "q_proj", nh * hd), (a + "k_proj", nkv * hd),
                                   (a + "v_proj", nkv * hd))),
                ("proj", "row", ((a + "o_proj", h),)),
            ]  # fmt: skip
            if not config.is_moe_layer(i):
                n = config.intermediate_size
                specs += [
                    ("fc1", "column", ((m + "gate_proj", n), (m + "up_proj", n))),
                    ("fc2", "row", ((m + "down_proj", h),)),
                ]
            for param, kind, parts in specs:
                full = sum(rows for _, rows in parts)
                delattr(layer, param)  # the megatron layer owns the weight now
                if kind == "column":
                    linear: nn.Module = KernelColumnParallelLinear(
                        h, full, config=mcfg, tp_group=groups.tp, kernel=kernel
                    )
                else:
                    fan_in = nh * hd if param == "proj" else config.intermediate_size
                    linear = KernelRowParallelLinear(
                        fan_in, h, config=mcfg, tp_group=groups.tp, kernel=kernel
                    )
                site = ParallelSite(linear, kind=kind, parts=parts)
                sites[param] = site
                self.shards[f"layers.{i}.{param}"] = Shard(
                    site, kind, tuple(rows for _, rows in parts)
                )

    def _split_mla(
        self,
        layer: nn.Module,
        i: int,
        mcfg: Any,
        kernel: Callable[[], Callable[[Tensor, Tensor], Tensor]],
    ) -> None:
        """Split MLA layer ``i`` over TP by heads, as megatron-core's MLA does: ``q_b_proj`` (or
        ``q_proj``) and ``kv_b_proj`` column parallel (rows are head-major), ``o_proj`` row
        parallel; ``q_a_proj``, ``kv_a_proj_with_mqa`` and the latent norms replicated (they
        compute the latents every head reads). A dense MLP splits as in the other layers."""
        config, tp_group = self.full_config, self.groups.tp
        s, h, nh = config.mla_spec, config.hidden_size, config.num_attention_heads
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        attn: nn.Module = getattr(layer, "self_attn")  # noqa: B009
        sites: nn.ModuleDict = getattr(layer, "sites")  # noqa: B009
        q = "q_proj" if s.q_lora_rank is None else "q_b_proj"
        specs: list[tuple[nn.Module, str, str, int, tuple[tuple[str, int], ...], str]] = [
            (attn, q, "column", s.q_lora_rank or h, ((a + q, nh * s.qk_head_dim),), "self_attn."),
            (attn, "kv_b_proj", "column", s.kv_lora_rank,
             ((a + "kv_b_proj", nh * (s.qk_nope_head_dim + s.v_head_dim)),), "self_attn."),
            (attn, "o_proj", "row", nh * s.v_head_dim, ((a + "o_proj", h),), "self_attn."),
        ]  # fmt: skip
        if not config.is_moe_layer(i):
            n = config.intermediate_size
            specs += [
                (layer, "fc1", "column", h, ((m + "gate_proj", n), (m + "up_proj", n)), ""),
                (layer, "fc2", "row", n, ((m + "down_proj", h),), ""),
            ]
        # the rope key is shared by every head: its gradient is a sum over all heads, i.e.
        # over the TP ranks (the latent's is summed by kv_b_proj's column layer); with sequence
        # parallel the rope key's all-gather sums it in backward (``gather_layer_tokens``)
        if self.groups.tp_size > 1 and not self.sequence_parallel:
            sites["kv_a_proj_with_mqa"] = RopeKeyGradSum(
                sites["kv_a_proj_with_mqa"], s.kv_lora_rank, tp_group
            )
        for owner, param, kind, fan_in, parts, where in specs:
            full = sum(rows for _, rows in parts)
            delattr(owner, param)  # the megatron layer owns the weight now
            linear: nn.Module
            if kind == "column":
                linear = KernelColumnParallelLinear(
                    fan_in, full, config=mcfg, tp_group=tp_group, kernel=kernel
                )
            else:
                linear = KernelRowParallelLinear(
                    fan_in, h, config=mcfg, tp_group=tp_group, kernel=kernel
                )
            site = ParallelSite(linear, kind=kind, parts=parts)
            sites[param] = site
            self.shards[f"layers.{i}.{where}{param}"] = Shard(
                site, kind, tuple(rows for _, rows in parts)
            )

    def _split_experts(self, layer: nn.Module, index: int, numerics: Numerics) -> None:
        """Replace MoE layer ``index``'s router and experts by an ``ExpertParallelMoe``
        (``layer.expert_parallel``): routed experts split over ``groups.ep``."""
        from posttrain.grpo.megatron.expert_parallel import (
            ExpertParallelGroups,
            ExpertParallelMoe,
        )

        g = self.groups
        groups = getattr(self, "_expert_groups", None)  # one object for every layer
        if groups is None:
            groups = ExpertParallelGroups(
                ep=g.ep,
                expert_dp=g.expert_dp,
                dp=g.dp,
                tp=g.tp if g.tp_size > 1 else None,
                sequence_parallel=self.sequence_parallel,
            )
            self._expert_groups = groups
        if self.full_config.is_mla:
            delattr(layer, "moe")  # the DeepSeek-style block (router and experts)
        else:
            for name in _MOE_PARAMETERS:
                if hasattr(layer, name):
                    delattr(layer, name)
            sites: nn.ModuleDict = getattr(layer, "sites")  # noqa: B009
            del sites["router"]  # the router is the expert-parallel layer's now
        layer.expert_parallel = ExpertParallelMoe(
            self.full_config, index, groups, numerics=numerics, device=self._build_device
        )

    def expert_parallel_layers(self) -> list[nn.Module]:
        """The ``ExpertParallelMoe`` layers (empty unless ``expert_model_parallel_size > 1``)."""
        found = [getattr(layer, "expert_parallel", None) for layer in self.layers]
        return [m for m in found if m is not None]

    def moe(self, layer: MoeLayer | MlaLayer, m: Tensor, lora: LoraRouting, prefix: str) -> Tensor:
        """The decoder's MoE seam: the layer's ``ExpertParallelMoe`` where it has one."""
        experts: nn.Module | None = getattr(layer, "expert_parallel", None)
        if experts is None:
            return super().moe(layer, m, lora, prefix)
        out: Tensor = experts(m)
        return out

    # ------------------------------------------------------------------ forwards

    def takes_shared_prefixes(self) -> bool:
        """Never: this decoder's forwards pack every segment whole."""
        return False

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
        """fp32 logits ``[T, vocab]`` (on every TP rank) for packed segments (text only);
        ``rows``: only those packed positions' logits (``DecoderModel.forward_logits``).
        ``shared_prefixes`` is refused (``takes_shared_prefixes``: never)."""
        if shared_prefixes is not None:
            raise GrpoInputError(
                "TensorParallelDecoder: shared_prefixes are not taken (every segment packed whole)"
            )
        if media is not None or inputs_embeds is not None:
            raise GrpoInputError(
                "TensorParallelDecoder: media / inputs_embeds are not taken by the megatron "
                "backend (text-only models); train multimodal models with --backend fsdp"
            )
        if lora is not None:
            raise GrpoInputError(
                "TensorParallelDecoder: per-request LoRA adapters are an engine feature; train "
                "adapters with lora-core (attach_lora) instead"
            )
        if not self.sequence_parallel:
            return super().forward_logits(input_ids, segment_lengths, rows=rows)
        ids = input_ids.reshape(-1)
        n, tp = ids.shape[0], self.groups.tp_size
        pad = -n % tp
        lengths = list(segment_lengths)
        if pad:  # one short segment of its own: it sees nothing and nothing sees it
            ids = torch.cat([ids, ids.new_zeros(pad)])
            lengths.append(pad)
        logits = super().forward_logits(ids, lengths)[:n]
        return logits if rows is None else logits[rows.to(logits.device).long()]

    def scatter_sequence(self, h: Tensor) -> Tensor:
        """The decoder's seam: this rank's slice of the tokens under sequence parallel."""
        if not self.sequence_parallel:
            return h
        # every rank embedded all tokens: keep this rank's slice (backward all-gathers)
        return split_tokens(h, self.groups.tp)

    def gather_sequence(self, h: Tensor) -> Tensor:
        """The decoder's seam: every rank's tokens back, in order, under sequence parallel."""
        if not self.sequence_parallel:
            return h
        # every rank computes the head and the loss on all tokens: backward keeps its slice
        return gather_tokens_keep_grad(h, self.groups.tp)

    def gather_layer_tokens(self, x: Tensor) -> Tensor:
        """The decoder's seam: MLA's rope key of every token under sequence parallel."""
        if not self.sequence_parallel:
            return x
        # MLA's rope key: each rank's heads read every token's; backward sums over TP
        return gather_tokens(x, self.groups.tp)

    # ------------------------------------------------------------------ weights

    def replicated_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters every TP rank holds whole, by their in-memory names."""
        out: dict[str, nn.Parameter] = {}
        for name, p in self.named_parameters():
            # site parameters: TP shards and LoRA factors; expert-parallel layers: their own
            if ".sites." not in name and ".expert_parallel." not in name:
                out[name] = p
        return out

    def expert_parameters(self) -> dict[str, nn.Parameter]:
        """The base weights of the expert-parallel layers by their in-memory names
        (``experts_fc1/fc2``: this rank's experts only)."""
        out: dict[str, nn.Parameter] = {}
        block = "moe." if self.full_config.is_mla else ""  # MLA: the DeepSeek block's names
        for name, p in self.named_parameters():
            layer, sep, leaf = name.partition(".expert_parallel.")
            if sep and not leaf.startswith("lora_"):
                out[f"{layer}.{block}{leaf}"] = p
        return out

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """Every base weight by its in-memory (fused, single-process) name: shards for the
        split linears, whole tensors for the rest."""
        out = self.replicated_parameters()
        out.update(self.expert_parameters())
        for name, shard in self.shards.items():
            weight = shard.site.weight
            assert isinstance(weight, nn.Parameter)
            out[name] = weight
        return out

    def shard_of(self, name: str, full: Tensor) -> Tensor:
        """This rank's slice of the full in-memory tensor ``name`` (itself when replicated)."""
        if self.groups.ep_size > 1 and _is_routed_expert(name) and name in self.expert_parameters():
            return full.chunk(self.groups.ep_size, dim=0)[self.groups.ep_rank]
        shard = self.shards.get(name)
        tp, rank = self.groups.tp_size, self.groups.tp_rank
        if shard is None or tp == 1:
            return full
        if shard.kind == "row":
            return full.chunk(tp, dim=1)[rank]
        parts = torch.split(full, list(shard.full_parts), dim=0)
        return torch.cat([p.chunk(tp, dim=0)[rank] for p in parts])

    @torch.no_grad()
    def load_full_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy full in-memory-named tensors in, keeping this rank's slices (every name once)."""
        params = self.local_parameters()
        missing = sorted(set(params) - set(tensors))
        unknown = sorted(set(tensors) - set(params))
        if missing or unknown:
            raise GrpoInputError(
                f"load_full_state_dict: missing {missing[:4]}, unknown {unknown[:4]}"
            )
        for name, param in params.items():
            value = self.shard_of(name, tensors[name])
            if value.shape != param.shape:
                raise GrpoInputError(
                    f"{name}: the full tensor {tuple(tensors[name].shape)} gives a shard "
                    f"{tuple(value.shape)}, the parameter is {tuple(param.shape)}"
                )
            param.copy_(value)

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, Tensor], *, partial: bool = False) -> None:
        """Copy HF-named weights in (the single-process model's files), keeping this rank's
        slices; dtypes and shapes are checked against the full config as for one process."""
        full = from_hf_state_dict(tensors, self.full_config, partial=partial)
        if partial:
            params = self.local_parameters()
            for name, value in full.items():
                params[name].copy_(self.shard_of(name, value))
            return
        self.load_full_state_dict(full)

    def full_state_dict(
        self, *, grads: bool = False, device: torch.device | str = "cpu"
    ) -> dict[str, Tensor]:
        """Every weight (or its gradient, zeros where none) at full size under its in-memory
        name, on every rank, moved to ``device``; collective over TP and EP.

        One tensor at a time (gathered, assembled, moved), so the accelerator holds at most one
        full tensor beyond the model, never a second copy of it."""
        local = self.local_parameters()
        gather_experts = self.groups.ep_size > 1
        out: dict[str, Tensor] = {}
        for name in (g.name for g in weight_groups(self.full_config)):
            p = local.get(name)
            if p is None:
                continue
            t = p.grad if grads else p
            value = (torch.zeros_like(p) if t is None else t).detach().contiguous()
            if name in self.shards and self.groups.tp_size > 1:
                value = self._gather_shard(name, value)
            elif gather_experts and _is_routed_expert(name):
                value = self._gather_expert(value)
            out[name] = value.to(device)
        return out

    def hf_state_dict(self, *, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """The weights under their HF names, full size, on every rank, on ``device``
        (collective over TP and EP)."""
        return to_hf_state_dict(self.full_state_dict(device=device), self.full_config)

    def _gather_expert(self, local: Tensor) -> Tensor:
        """A routed-expert tensor ``[E/ep, ...]`` gathered over EP to ``[E, ...]``."""
        gathered = local.new_empty((self.groups.ep_size * local.shape[0], *local.shape[1:]))
        all_gather_flat(gathered, local, self.groups.ep)
        return gathered

    def _gather_shard(self, name: str, local: Tensor) -> Tensor:
        """A tensor-parallel shard gathered over TP to the full tensor (``shards[name]``'s
        layout: row-split along dim 1, column-split per fused part along dim 0)."""
        tp = self.groups.tp_size
        gathered = local.new_empty((tp * local.numel(),))
        all_gather_flat(gathered, local.reshape(-1), self.groups.tp)
        pieces = [c.view_as(local) for c in gathered.chunk(tp)]
        shard = self.shards[name]
        if shard.kind == "row":
            return torch.cat(pieces, dim=1)
        local_parts = [rows // tp for rows in shard.full_parts]
        split = [torch.split(p, local_parts, dim=0) for p in pieces]
        return torch.cat(
            [torch.cat([split[r][k] for r in range(tp)]) for k in range(len(local_parts))]
        )


class _SumColumnsGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's columns ``start:`` over ``group``."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, start: int, group: Any) -> Tensor:
        ctx.start, ctx.group = start, group
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        part = grad[:, ctx.start :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        return torch.cat([grad[:, : ctx.start], part], dim=1), None, None


class RopeKeyGradSum(nn.Module):
    """MLA's replicated ``kv_a_proj_with_mqa`` site under TP: the output ``[latent | rope key]``
    as computed, with the rope key's gradient summed over the TP group (each rank's heads add
    their share, as megatron-core's MLA reduces it). ``base`` is the site itself."""

    def __init__(self, base: nn.Module, start: int, group: Any) -> None:
        super().__init__()
        self.base = base
        self.start = start
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.base(x)
        out: Tensor = _SumColumnsGrad.apply(y, self.start, self.group)  # type: ignore[no-untyped-call]
        return out


_MOE_PARAMETERS = (
    "router",
    "expert_bias",
    "experts_fc1",
    "experts_fc2",
    "shared_fc1",
    "shared_fc2",
)


def _is_routed_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("experts_fc1", "experts_fc2")
