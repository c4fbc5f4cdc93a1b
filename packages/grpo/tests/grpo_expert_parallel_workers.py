"""Rank functions for the expert-parallel MoE tests (forked gloo ranks, see conftest).

The single-process reference is ``DecoderModel.moe`` of a tiny ``posttrain.models`` decoder
(the engine's own MoE forward, with ``LoraAdapter`` routing for LoRA) on all tokens of all
data-parallel shards; its loss is the mean over shards of ``sum(y * c)``. Each rank runs an
``ExpertParallelMoe`` on its shard's tokens (its TP share with sequence parallel) and the
results are compared row for row and parameter for parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.formats import peft_key
from posttrain.grpo import GrpoConfigError
from posttrain.grpo.megatron.expert_parallel import (
    LORA_TARGETS,
    ExpertParallelGroups,
    ExpertParallelLayout,
    ExpertParallelMoe,
    expert_parallel_grad_norm_sq,
    export_expert_lora,
    gather_moe_weights,
    new_expert_parallel_groups,
    reduce_expert_parallel_grads,
)
from posttrain.lora import LoraConfig
from posttrain.models import (
    DecoderModel,
    LoraAdapter,
    ModelConfig,
    build_model,
    to_hf_state_dict,
)
from posttrain.models._lora import LoraRouting
from posttrain.models._model import MoeLayer

LAYER = 1
SHARD_TOKENS = (9, 6, 11, 7)
LORA = LoraConfig(r=4, alpha=8.0, export_dtype=torch.float32)

CONFIGS = {
    # softmax router without top-k renormalisation, a routed scale
    "softmax": ModelConfig.tiny(norm_topk_prob=False, routed_scaling_factor=1.5),
    # sigmoid router with its fixed bias, 2 shared experts, 8 experts top-3
    "sigmoid": ModelConfig.tiny(
        num_experts=8,
        num_experts_per_tok=3,
        router_score_function="sigmoid",
        n_shared_experts=2,
        shared_expert_intermediate_size=16,
        routed_scaling_factor=2.5,
    ),
    # bfloat16 parameters (activations stay fp32): byte-exact gathers, fp32 grad reduction
    "bf16": ModelConfig.tiny(torch_dtype="bfloat16", num_experts=8, num_experts_per_tok=2),
}


def rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def share(n: int, parts: int, index: int) -> tuple[int, int]:
    sizes = [n // parts + (1 if r < n % parts else 0) for r in range(parts)]
    return sum(sizes[:index]), sizes[index]


def adapter_tensors(cfg: ModelConfig) -> dict[str, tuple[Tensor, Tensor]]:
    """Random factors (B non-zero) for every expert-layer LoRA target of layer LAYER."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for name, (d_in, d_out) in sorted(build_model(cfg).lora_targets().items()):
        if name.startswith(f"model.layers.{LAYER}.mlp."):
            a = torch.randn(LORA.r, d_in, generator=gen) * 0.3
            b = torch.randn(d_out, LORA.r, generator=gen) * 0.3
            out[name] = (a, b)
    return out


def skewed(model: DecoderModel) -> None:
    """Bias the sigmoid router so every token picks experts 0..k-1 (all on EP rank 0)."""
    cfg = model.config
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer, MoeLayer):
                ids = torch.arange(cfg.num_experts)
                layer.expert_bias.copy_(torch.where(ids < cfg.num_experts_per_tok, 10.0, -10.0))


def reference(
    cfg_name: str, shard_tokens: tuple[int, ...], train: str, *, skew: bool = False
) -> dict[str, Any]:
    """Output, loss grads (params or LoRA factors) and input grad of the single-process MoE."""
    cfg = CONFIGS[cfg_name]
    model = build_model(cfg, seed=3)
    if skew:
        skewed(model)
    layer = model.layers[LAYER]
    shards = len(shard_tokens)
    n = sum(shard_tokens)
    gen = torch.Generator().manual_seed(11)
    m = torch.randn(n, cfg.hidden_size, generator=gen).requires_grad_(True)
    c = torch.randn(n, cfg.hidden_size, generator=gen)
    adapter = None
    factors: dict[str, tuple[Tensor, Tensor]] = {}
    if train == "lora":
        model.requires_grad_(False)
        factors = {
            k: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
            for k, (a, b) in adapter_tensors(cfg).items()
        }
        adapter = LoraAdapter(weights=factors, scaling=LORA.scaling)
    routing = LoraRouting(adapter, torch.zeros(n, dtype=torch.long), 1, model.lora_targets())
    y = model.moe(layer, m, routing, f"model.layers.{LAYER}.")
    ((y * c).sum() / shards).backward()
    grads: dict[str, Tensor] = {}
    if train == "full":
        grads = {
            name: torch.zeros_like(p) if p.grad is None else p.grad
            for name, p in layer.named_parameters()
            if name in ("router", "experts_fc1", "experts_fc2", "shared_fc1", "shared_fc2")
        }
    else:
        for name, (a, b) in factors.items():  # an expert no token reached has no grad: 0
            for factor, t in (("A", a), ("B", b)):
                grads[peft_key(name, factor)] = torch.zeros_like(t) if t.grad is None else t.grad
    norm_sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
    return {
        "model": model,
        "m": m.detach(),
        "c": c,
        "y": y.detach(),
        "dm": m.grad,
        "grads": grads,
        "norm_sq": norm_sq,
    }


def module_grads(module: ExpertParallelMoe, ref: dict[str, Any], train: str) -> dict[str, float]:
    """Relative L2 of every trainable parameter's grad against the reference's."""
    out = {}
    lo, hi = module.first_expert, module.first_expert + module.num_local_experts
    if train == "full":
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            want = ref["grads"][name]
            if name.startswith("experts_"):
                want = want[lo:hi]
            out[name] = rel(p.grad, want)
        return out
    for key in module.lora_A:
        for factor, p in (("A", module.lora_A[key]), ("B", module.lora_B[key])):
            count = p.shape[0] if p.ndim == 3 else 0
            got = [p.grad[j] for j in range(count)] if count else [p.grad]
            names = [module.lora_module_name(key, j) for j in range(max(count, 1))]
            want = [ref["grads"][peft_key(nm, factor)] for nm in names]
            out[f"lora_{factor}.{key}"] = rel(torch.stack(got), torch.stack(want))
    return out


def run_case(
    layout: ExpertParallelLayout,
    groups: ExpertParallelGroups,
    cfg_name: str,
    train: str,
    *,
    shard_tokens: tuple[int, ...] = SHARD_TOKENS,
    skew: bool = False,
) -> dict[str, Any]:
    rank, tp = dist.get_rank(), layout.tensor_parallel_size
    shards = layout.data_parallel_size
    shard_tokens = shard_tokens[:shards]
    ref = reference(cfg_name, shard_tokens, train, skew=skew)
    cfg, model = CONFIGS[cfg_name], ref["model"]
    # this rank's tokens: its DP shard, or the TP share of it with sequence parallel
    start = sum(shard_tokens[: rank // tp])
    count = shard_tokens[rank // tp]
    if groups.sequence_parallel and tp > 1:
        offset, count = share(count, tp, rank % tp)
        start += offset
    rows = slice(start, start + count)
    module = ExpertParallelMoe(cfg, LAYER, groups)
    hf = to_hf_state_dict(dict(model.named_parameters()), cfg)
    module.load_hf_weights(hf)
    if train == "lora":
        module.attach_lora(LORA, LORA_TARGETS)
        peft = {
            peft_key(nm, f): t
            for nm, (a, b) in adapter_tensors(cfg).items()
            for f, t in (("A", a), ("B", b))
        }
        module.load_lora(peft)
    m = ref["m"][rows].clone().requires_grad_(True)
    y = module(m)
    (y * ref["c"][rows]).sum().backward()
    unreduced_router = None
    if train == "full":
        got = module.router.grad  # None on a rank without tokens
        unreduced_router = rel(torch.zeros(1) if got is None else got, ref["grads"]["router"])
    reduce_expert_parallel_grads([module])
    with torch.no_grad():
        again = module(m.detach())
    result: dict[str, Any] = {
        "tokens": count,
        "no_grad_bitwise": torch.equal(again, y.detach()),
        "forward_bitwise": torch.equal(y.detach(), ref["y"][rows]),
        "forward_rel": rel(y.detach(), ref["y"][rows]),
        "dm_rel": rel(torch.zeros_like(m) if m.grad is None else m.grad / shards, ref["dm"][rows]),
        "grads": module_grads(module, ref, train),
        "norm_sq": expert_parallel_grad_norm_sq([module]),
        "ref_norm_sq": ref["norm_sq"],
        "unreduced_router_rel": unreduced_router,
    }
    if train == "full":
        full = gather_moe_weights(module)
        mine = {k: v for k, v in hf.items() if k.startswith(f"model.layers.{LAYER}.mlp.")}
        result["gather_bitwise"] = sorted(full) == sorted(mine) and all(
            torch.equal(full[k], mine[k]) for k in mine
        )
        single = ExpertParallelMoe(cfg, LAYER)  # EP1: loads what EP2 saved
        single.load_hf_weights(full)
        with torch.no_grad():
            result["ep1_reload_bitwise"] = torch.equal(single(m.detach()), y.detach())
        stacked = ExpertParallelMoe(cfg, LAYER, groups)
        stacked.load_hf_weights(
            to_hf_state_dict(dict(model.named_parameters()), cfg, stacked_experts=True)
        )
        result["stacked_load_bitwise"] = all(
            torch.equal(a, b)
            for a, b in zip(stacked.parameters(), module.parameters(), strict=True)
        )
    else:
        exported = export_expert_lora([module])
        result["export_bitwise"] = sorted(exported) == sorted(peft) and all(
            torch.equal(exported[k], peft[k]) for k in peft
        )
        init_cfg = LoraConfig(r=4, alpha=8.0, b_init="normal", seed=5, export_dtype=torch.float32)
        fresh = ExpertParallelMoe(cfg, LAYER, groups)
        fresh.attach_lora(init_cfg, LORA_TARGETS)
        single = ExpertParallelMoe(cfg, LAYER)
        single.attach_lora(init_cfg, LORA_TARGETS)
        a, b = export_expert_lora([fresh]), export_expert_lora([single])
        result["init_invariant"] = sorted(a) == sorted(b) and all(
            torch.equal(a[k], b[k]) for k in a
        )
    return result


def _error(fn: Any) -> str:
    try:
        fn()
    except GrpoConfigError as err:
        return f"{err.field}: {err}"
    return "no error"


def suite(rank: int, world: int) -> dict[str, Any]:
    """Every layout of this world size, both configs, full-parameter and LoRA."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    layouts: list[tuple[str, ExpertParallelLayout, bool]] = []
    if world == 2:
        layouts.append(("ep2", ExpertParallelLayout(world_size=2, expert_parallel_size=2), False))
    else:
        tp2ep2 = ExpertParallelLayout(world_size=4, tensor_parallel_size=2, expert_parallel_size=2)
        layouts += [
            ("tp2ep2_sp", tp2ep2, True),
            ("tp2ep2", tp2ep2, False),
            ("ep2dp2", ExpertParallelLayout(world_size=4, expert_parallel_size=2), False),
        ]
    for name, layout, sp in layouts:
        groups = new_expert_parallel_groups(layout, sequence_parallel=sp)
        for cfg_name in ("softmax", "sigmoid"):
            for train in ("full", "lora"):
                out[f"{name}/{cfg_name}/{train}"] = run_case(layout, groups, cfg_name, train)
    if world == 2:
        out["ep2/bf16/full"] = run_case(layouts[0][1], groups, "bf16", "full")
    if world == 2:
        groups = new_expert_parallel_groups(layouts[0][1])
        for train in ("full", "lora"):  # rank 1 routes no token and its experts get none
            out[f"skewed/{train}"] = run_case(
                layouts[0][1], groups, "sigmoid", train, shard_tokens=(9, 0), skew=True
            )
        out["decoder"] = decoder_logprobs(rank, groups)
    if world == 4:
        out["errors"] = bad_layouts(rank)
    return out


def decoder_logprobs(rank: int, groups: ExpertParallelGroups) -> dict[str, Any]:
    """A whole decoder whose MoE layers are EP2 ``ExpertParallelMoe``s (loaded from the HF
    weights) gives the single-process logprobs bit for bit; each rank runs its own sequences."""
    cfg = CONFIGS["sigmoid"]
    reference_model = build_model(cfg, seed=3)
    hf = reference_model.hf_state_dict()
    layers = {}
    for index in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(index):
            layers[index] = ExpertParallelMoe(cfg, index, groups)
            layers[index].load_hf_weights(hf)
    model = build_model(cfg, seed=3)
    # the seam meg-tp's decoder fills: the MoE block of each layer
    model.moe = lambda layer, m, lora, prefix: layers[layer.index](m)  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(20 + rank)
    lengths = [7, 5] if rank == 0 else [9]
    ids = torch.randint(4, cfg.vocab_size, (sum(lengths),), generator=gen)
    with torch.no_grad():
        got = model.forward_logprobs(ids, lengths)
        want = reference_model.forward_logprobs(ids, lengths)
    return {"bitwise": torch.equal(got, want), "rel": rel(got, want)}


def bad_layouts(rank: int) -> dict[str, str]:
    """Groups that must be refused, with the field each error names."""
    cfg = CONFIGS["softmax"]
    pair = dist.new_group([0, 1])
    world = dist.new_group([0, 1, 2, 3])
    out = {
        "outside": _error(lambda: ExpertParallelMoe(cfg, LAYER, ExpertParallelGroups(ep=pair)))
        if rank >= 2
        else "member",
        "indivisible": _error(
            lambda: ExpertParallelMoe(
                ModelConfig.tiny(num_experts=6), LAYER, ExpertParallelGroups(ep=world, dp=world)
            )
        ),
        # ep over 4 ranks but no dp group: the gradient scaling would be wrong
        "sizes": _error(lambda: ExpertParallelMoe(cfg, LAYER, ExpertParallelGroups(ep=world))),
    }
    if rank < 2:  # expert_dp = the EP group itself: its members hold different experts
        groups = ExpertParallelGroups(ep=pair, expert_dp=pair, dp=world)
        out["expert_dp"] = _error(lambda: ExpertParallelMoe(cfg, LAYER, groups))
    return out
