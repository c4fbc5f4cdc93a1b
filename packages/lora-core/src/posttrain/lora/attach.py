"""``attach_lora``: find target modules, wrap them in ``LoraLinear`` and tag the factors.

Supported bases: ``torch.nn.Linear`` (replicated), this package's ``ColumnShardedLinear`` /
``RowShardedLinear``, and megatron-core's ``ColumnParallelLinear`` (``gather_output=False``) /
``RowParallelLinear`` (``input_is_parallel=True``), with or without sequence parallelism.
A *linear site* counts as a replicated linear too: any module that declares a
``linear_kernel`` (``x, w -> x @ w.T``), int ``in_features`` / ``out_features`` and a 2-D
``weight [out, in]``, and computes ``linear_kernel(x, weight)``. ``posttrain.models`` exposes
its fused linears that way; the LoRA branch then runs on the site's kernel (``layers``).
Process groups come in a ``LoraGroups``; nothing is read from Megatron's globals.

Stacked MoE experts (transformers 5: ``...mlp.experts.gate_up_proj [E, 2I, H]`` and
``...mlp.experts.down_proj [E, H, I]``, 3-D parameters, not modules) are found by the PEFT
names of their parts: the suffixes ``gate_proj`` + ``up_proj`` select ``gate_up_proj`` (both or
neither), ``down_proj`` selects ``down_proj`` (also by the parameter's own path or suffix,
``experts.down_proj``). They get a ``LoraStackedExperts`` parametrization (``stacked``) with
per-expert factors that export as ``...experts.<e>.gate_proj`` etc.

Fused outputs (QKV, gate/up) are one site with one A and a B whose local rows hold each part's
shard; ``Target.parts`` names the PEFT modules they export to. Init is drawn for the full
factors (seeded per PEFT name) and sliced, so it is bitwise the same for every TP degree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.utils import parametrize

from posttrain.lora._errors import LayoutError, LoraConfigError
from posttrain.lora.comm import group_rank, group_size
from posttrain.lora.config import LoraConfig, init_full_factor
from posttrain.lora.experts import ExpertLinear, LoraExpertLinear
from posttrain.lora.layers import Layout, LoraLinear, LoraParamTag, SiteInfo, tag_parameter
from posttrain.lora.parallel import ColumnShardedLinear, RowShardedLinear
from posttrain.lora.stacked import STACKED_PARTS, LoraStackedExperts

Site = LoraLinear | LoraExpertLinear | LoraStackedExperts


@dataclass(kw_only=True, slots=True)
class LoraGroups:
    """The process groups LoRA needs; ``None`` means that axis has size 1.

    ``expert_dp`` reduces expert (EP-sharded) grads; it defaults to ``dp`` when ``ep`` is None.
    """

    tp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    ep: ProcessGroup | None = None
    expert_dp: ProcessGroup | None = None
    pp: ProcessGroup | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Target:
    """How one module exports: its PEFT module path(s) and padding.

    ``hf_name``: PEFT module path (default: the module's path in the model). ``parts``: for a
    fused column output, ``(PEFT module path, full output rows)`` in storage order; ``groups``:
    their interleave group count (Megatron QKV: the number of query groups; ``None``: each part
    sharded alone, as gate/up). ``unpadded_out``: rows past it are padding (vocab-parallel head).
    ``shared``: for an ``ExpertLinear``, the factor shared by all experts (shared-outer layout;
    ``None``: per-expert adapters, and ``hf_name`` must contain ``{expert}``).
    """

    hf_name: str | None = None
    parts: tuple[tuple[str, int], ...] = ()
    groups: int | None = None
    unpadded_out: int | None = None
    shared: Literal["A", "B"] | None = None


@dataclass(kw_only=True, slots=True)
class LoraHandle:
    """The adapted model, its config and groups, and its LoRA sites by module path."""

    model: nn.Module
    config: LoraConfig
    groups: LoraGroups
    sites: dict[str, Site] = field(default_factory=dict)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every LoRA factor (A then B per site, in site order)."""
        for site in self.sites.values():
            yield site.lora_A
            yield site.lora_B

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(<module path>.lora_A|lora_B, parameter)`` for every factor."""
        for path, site in self.sites.items():
            yield f"{path}.lora_A", site.lora_A
            yield f"{path}.lora_B", site.lora_B

    def set_enabled(self, enabled: bool) -> None:
        """Turn every LoRA branch on or off (off: the frozen base, e.g. for a reference policy)."""
        for site in self.sites.values():
            site.enabled = enabled


def _megatron_classes(module: nn.Module) -> tuple[type[nn.Module], type[nn.Module]] | None:
    # Importing megatron-core costs ~20 s: only do it for modules that come from it (or
    # subclass one of its classes, as a model's own kernel-carrying parallel linears do).
    if not any(c.__module__.startswith("megatron.") for c in type(module).__mro__):
        return None
    try:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    except ImportError:  # the megatron extra is not installed
        return None
    return ColumnParallelLinear, RowParallelLinear


def _int_attr(module: nn.Module, name: str) -> int:
    value: int = getattr(module, name)
    return int(value)


def _is_linear_site(module: nn.Module) -> bool:
    """A module that declares its kernel, its dims and a 2-D weight (see the module docstring)."""
    weight = getattr(module, "weight", None)
    return (
        callable(getattr(module, "linear_kernel", None))
        and isinstance(getattr(module, "in_features", None), int)
        and isinstance(getattr(module, "out_features", None), int)
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
    )


def _classify(path: str, module: nn.Module) -> tuple[Layout, bool, int, int]:
    """(layout, sequence_parallel, full in, full out) of a supported base module."""
    if isinstance(module, ColumnShardedLinear):
        return "column", module.sequence_parallel, module.in_features, module.out_features
    if isinstance(module, RowShardedLinear):
        return "row", module.sequence_parallel, module.in_features, module.out_features
    mcls = _megatron_classes(module)
    if mcls is not None and isinstance(module, mcls[0]):
        if getattr(module, "gather_output", False):
            raise LayoutError(
                f"{path}: ColumnParallelLinear with gather_output=True is not supported"
            )
        return (
            "column",
            bool(module.sequence_parallel),
            _int_attr(module, "input_size"),
            _int_attr(module, "output_size"),
        )
    if mcls is not None and isinstance(module, mcls[1]):
        if not getattr(module, "input_is_parallel", True):
            raise LayoutError(f"{path}: RowParallelLinear needs input_is_parallel=True")
        return (
            "row",
            bool(module.sequence_parallel),
            _int_attr(module, "input_size"),
            _int_attr(module, "output_size"),
        )
    if isinstance(module, nn.Linear) or _is_linear_site(module):
        return (
            "replicated",
            False,
            _int_attr(module, "in_features"),
            _int_attr(module, "out_features"),
        )
    raise LayoutError(f"{path}: cannot attach LoRA to {type(module).__name__}")


def fused_local_rows(
    parts: Sequence[torch.Tensor], groups: int | None, rank: int, tp: int
) -> torch.Tensor:
    """The rows this TP rank stores of a fused output made of full ``parts``."""
    g = groups or tp
    if g % tp:
        raise LayoutError(f"fused groups {g} not divisible by TP {tp}")
    blocks = []
    for p in parts:
        if p.shape[0] % g:
            raise LayoutError(f"fused part of {p.shape[0]} rows not divisible by {g} groups")
        blocks.append(p.chunk(g, dim=0))
    per = g // tp
    return torch.cat([b[i] for i in range(rank * per, (rank + 1) * per) for b in blocks])


def fused_local_parts(
    local: torch.Tensor, sizes: Sequence[int], groups: int | None, tp: int
) -> list[torch.Tensor]:
    """Inverse of ``fused_local_rows``: this rank's rows of each part (concat over TP = full)."""
    g = groups or tp
    per = g // tp
    block = [s // g for s in sizes]
    chunks = torch.split(local, [b for _ in range(per) for b in block], dim=0)
    return [torch.cat(chunks[j :: len(sizes)]) for j in range(len(sizes))]


def _site_info(
    path: str, target: Target, layout: Layout, sp: bool, fin: int, fout: int
) -> SiteInfo:
    hf = target.hf_name or path
    parts = target.parts or ((hf, fout),)
    if sum(s for _, s in parts) != fout:
        raise LayoutError(f"{path}: Target.parts sizes {[s for _, s in parts]} != out {fout}")
    if len(parts) > 1 and layout == "row":
        raise LayoutError(f"{path}: fused parts are only meaningful on a column layout")
    if target.unpadded_out is not None and (len(parts) > 1 or not 0 < target.unpadded_out <= fout):
        raise LayoutError(f"{path}: unpadded_out {target.unpadded_out} invalid for out {fout}")
    return SiteInfo(
        path=path,
        layout=layout,
        sequence_parallel=sp,
        in_features=fin,
        out_features=fout,
        parts=parts,
        groups=target.groups,
        unpadded_out=target.unpadded_out,
    )


def _initial_factors(
    info: SiteInfo, config: LoraConfig, rank: int, tp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    a_full = init_full_factor(config, info.parts[0][0], "A", (config.r, info.in_features))
    b_parts = []
    for name, size in info.parts:
        rows = info.unpadded_out or size
        b = init_full_factor(config, name, "B", (rows, config.r))
        if rows < size:
            b = torch.cat([b, b.new_zeros(size - rows, config.r)])
        b_parts.append(b)
    if info.layout == "column":
        return a_full, fused_local_rows(b_parts, info.groups, rank, tp)
    if info.layout == "row":
        return a_full.chunk(tp, dim=1)[rank].clone(), torch.cat(b_parts)
    return a_full, fused_local_rows(b_parts, info.groups, 0, 1)


def _tags(info: SiteInfo) -> tuple[LoraParamTag, LoraParamTag]:
    sp = info.sequence_parallel
    if info.layout == "column":
        return (
            LoraParamTag(
                site=info.path, factor="A", shard_axis=None, shard_dim=None, tp_partial=sp
            ),
            LoraParamTag(site=info.path, factor="B", shard_axis="tp", shard_dim=0),
        )
    if info.layout == "row":
        return (
            LoraParamTag(site=info.path, factor="A", shard_axis="tp", shard_dim=1),
            LoraParamTag(
                site=info.path, factor="B", shard_axis=None, shard_dim=None, tp_partial=sp
            ),
        )
    return (
        LoraParamTag(site=info.path, factor="A", shard_axis=None, shard_dim=None),
        LoraParamTag(site=info.path, factor="B", shard_axis=None, shard_dim=None),
    )


def _stacked_expert_params(model: nn.Module) -> dict[str, nn.Module]:
    """``{"<module>.<param>": module}`` for every 3-D ``gate_up_proj`` / ``down_proj`` parameter."""
    out: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if name in STACKED_PARTS and param.ndim == 3:
                out[f"{path}.{name}" if path else name] = module
    return out


def _matches(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("." + suffix)


def _resolve_targets(
    model: nn.Module, targets: Sequence[str] | Mapping[str, Target]
) -> tuple[dict[str, Target], list[str]]:
    """(module targets, stacked expert parameter paths)."""
    modules = dict(model.named_modules())
    stacked = _stacked_expert_params(model)
    if isinstance(targets, Mapping):
        found_params = [p for p in targets if p in stacked and p not in modules]
        for path in targets:
            if path not in modules and path not in stacked:
                raise LoraConfigError(f"attach_lora: target module {path!r} not found in the model")
        return {p: t for p, t in targets.items() if p not in found_params}, found_params
    found: dict[str, Target] = {}
    params: set[str] = set()
    for suffix in targets:
        hits = [p for p in modules if _matches(p, suffix)]
        param_hits = [
            p
            for p in stacked
            if _matches(p, suffix) or suffix in STACKED_PARTS[p.rsplit(".", 1)[-1]]
        ]
        if not hits and not param_hits:
            raise LoraConfigError(f"attach_lora: no module matches target {suffix!r}")
        found.update({p: Target() for p in hits})
        params.update(param_hits)
    for path in sorted(params):
        parts = STACKED_PARTS[path.rsplit(".", 1)[-1]]
        named = [t for t in parts if t in targets]
        if named and len(named) != len(parts):
            raise LoraConfigError(
                f"attach_lora: {path} stacks {' and '.join(parts)}; target both or neither "
                f"(got {named[0]!r} alone)"
            )
    return found, sorted(params)


def attach_lora(
    model: nn.Module,
    config: LoraConfig,
    targets: Sequence[str] | Mapping[str, Target],
    groups: LoraGroups | None = None,
) -> LoraHandle:
    """Wrap each target module in a ``LoraLinear`` in place and freeze every base parameter.

    ``targets``: module-name suffixes (PEFT style, exported under their own paths) or a mapping
    from exact module path to ``Target``. Only the LoRA factors are trainable afterwards.
    """
    groups = groups or LoraGroups()
    rank, tp = group_rank(groups.tp), group_size(groups.tp)
    handle = LoraHandle(model=model, config=config, groups=groups)
    for p in model.parameters():
        p.requires_grad_(False)
    module_targets, stacked_params = _resolve_targets(model, targets)
    for path in stacked_params:
        handle.sites[path] = _attach_stacked(model, path, config)
    for path, target in sorted(module_targets.items()):
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, leaf)
        if isinstance(base, LoraLinear | LoraExpertLinear):
            raise LayoutError(f"{path}: LoRA is already attached")
        if isinstance(base, ExpertLinear):
            expert_site = _attach_experts(path, base, target, config, groups)
            setattr(parent, leaf, expert_site)
            handle.sites[path] = expert_site
            continue
        layout, sp, fin, fout = _classify(path, base)
        info = _site_info(path, target, layout, sp, fin, fout)
        a, b = _initial_factors(info, config, rank, tp)
        weight = base.weight
        device = weight.device
        expect_b = fout // tp if layout == "column" else fout
        expect_a = fin // tp if layout == "row" else fin
        local_out = weight.shape[0]
        local_in = weight.shape[1]
        if (local_out, local_in) != (expect_b, expect_a):
            raise LayoutError(
                f"{path}: local weight {tuple(weight.shape)} does not match layout {layout} "
                f"with TP={tp} (expected {(expect_b, expect_a)}); wrong tp group?"
            )
        site = LoraLinear(
            base,
            site=info,
            config=config,
            lora_a=a.to(device),
            lora_b=b.to(device),
            tp_group=groups.tp,
        )
        tag_a, tag_b = _tags(info)
        tag_parameter(site.lora_A, tag_a)
        tag_parameter(site.lora_B, tag_b)
        setattr(parent, leaf, site)
        handle.sites[path] = site
    if not handle.sites:
        raise LoraConfigError("attach_lora: no target modules given")
    return handle


def _attach_stacked(model: nn.Module, path: str, config: LoraConfig) -> LoraStackedExperts:
    container, _, name = path.rpartition(".")
    owner = model.get_submodule(container) if container else model
    if getattr(owner, "is_transposed", False):
        raise LayoutError(
            f"{path}: stacked experts stored [E, in, out] (is_transposed) unsupported"
        )
    if parametrize.is_parametrized(owner, name):
        raise LayoutError(f"{path}: LoRA is already attached (the parameter is parametrized)")
    weight: torch.Tensor = getattr(owner, name)
    parts = STACKED_PARTS[name]
    n, out, fin = weight.shape
    if out % len(parts):
        raise LayoutError(f"{path}: {out} rows do not split into parts {parts}")
    out_part = out // len(parts)
    r = config.r
    a = torch.stack(
        [
            torch.stack(
                [init_full_factor(config, f"{container}.{e}.{p}", "A", (r, fin)) for p in parts]
            )
            for e in range(n)
        ]
    )
    b = torch.stack(
        [
            torch.stack(
                [
                    init_full_factor(config, f"{container}.{e}.{p}", "B", (out_part, r))
                    for p in parts
                ]
            )
            for e in range(n)
        ]
    )
    site = LoraStackedExperts(
        path=path,
        container=container,
        parts=parts,
        config=config,
        lora_a=a.to(weight.device),
        lora_b=b.to(weight.device),
    )
    parametrize.register_parametrization(owner, name, site, unsafe=True)
    parametrizations: nn.ModuleDict = getattr(owner, "parametrizations")  # noqa: B009
    site.bind_original(getattr(parametrizations[name], "original"))  # noqa: B009
    tag_parameter(site.lora_A, LoraParamTag(site=path, factor="A", shard_axis=None, shard_dim=None))
    tag_parameter(site.lora_B, LoraParamTag(site=path, factor="B", shard_axis=None, shard_dim=None))
    return site


def _attach_experts(
    path: str, base: ExpertLinear, target: Target, config: LoraConfig, groups: LoraGroups
) -> LoraExpertLinear:
    ep_rank, ep = group_rank(groups.ep), group_size(groups.ep)
    if base.ep_group is not groups.ep and group_size(base.ep_group) != ep:
        raise LayoutError(
            f"{path}: ExpertLinear EP size {group_size(base.ep_group)} != groups.ep {ep}"
        )
    hf = target.hf_name or (path if target.shared else f"{path}.{{expert}}")
    if target.shared is None and "{expert}" not in hf:
        raise LoraConfigError(f"{path}: per-expert Target.hf_name {hf!r} needs an {{expert}} field")
    n, r, fin, fout = base.num_experts, config.r, base.in_features, base.out_features
    a_shape = (r, fin) if target.shared == "A" else (n, r, fin)
    b_shape = (fout, r) if target.shared == "B" else (n, fout, r)
    a = init_full_factor(config, hf, "A", a_shape)
    b = init_full_factor(config, hf, "B", b_shape)
    if target.shared != "A":
        a = a.chunk(ep)[ep_rank].clone()
    if target.shared != "B":
        b = b.chunk(ep)[ep_rank].clone()
    device = base.weight.device
    site = LoraExpertLinear(
        base,
        path=path,
        hf_name=hf,
        shared=target.shared,
        config=config,
        lora_a=a.to(device),
        lora_b=b.to(device),
    )
    factors: tuple[tuple[Literal["A", "B"], nn.Parameter], ...] = (
        ("A", site.lora_A),
        ("B", site.lora_B),
    )
    for factor, param in factors:
        if target.shared == factor:
            tag = LoraParamTag(
                site=path,
                factor=factor,
                shard_axis=None,
                shard_dim=None,
                ep_partial=ep > 1,
                expert=True,
            )
        else:
            tag = LoraParamTag(site=path, factor=factor, shard_axis="ep", shard_dim=0, expert=True)
        tag_parameter(param, tag)
    return site
