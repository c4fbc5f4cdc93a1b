"""PEFT adapter files: ``save_peft`` / ``load_peft`` (strict, re-sharding) / ``merge_into_base``.

The PEFT format itself (``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``, ``adapter_config.json``,
the atomic directory write, and every check of a file read from disk) is
``posttrain.formats``'; this module adds what needs a ``LoraHandle``: the expected keys and
shapes of this model, and re-sharding the full adapter onto this rank's TP/EP layout.

Departures: PEFT only warns on missing keys and ignores unknown ones; ``load_peft(strict=True)``
raises ``AdapterFormatError`` naming the key. Shape mismatches always raise, and so does every
problem the formats reader finds (corrupt file, NaN/Inf, integer dtypes, a config that is not an
object or disagrees with the tensors). A padded vocab-parallel head is zero-padded back on load
(slicing an unpadded file by ``rank * V_loc`` breaks the last rank). A fused site has one A, so
its parts' A tensors must be equal.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.formats import (
    MoeConvention,
    PeftAdapter,
    PeftFormatError,
    parse_peft_key,
    peft_key,
    read_peft_adapter,
    write_peft_adapter,
)
from posttrain.interface import LoraSpec
from posttrain.lora._errors import AdapterFormatError
from posttrain.lora.attach import LoraHandle, fused_local_rows
from posttrain.lora.comm import group_rank, group_size
from posttrain.lora.config import LoraConfig
from posttrain.lora.experts import LoraExpertLinear
from posttrain.lora.layers import LoraLinear
from posttrain.lora.stacked import LoraStackedExperts


def _default_targets(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted({parse_peft_key(key)[0].rsplit(".", 1)[-1] for key in tensors})


def save_peft(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    config: LoraConfig,
    *,
    target_modules: Sequence[str] | str | None = None,
    base_model_name_or_path: str = "",
    moe_convention: MoeConvention = "per_expert",
) -> Path:
    """Write a PEFT adapter directory atomically (replacing any old one); returns its path.

    ``target_modules`` defaults to the leaf names of the modules in ``tensors``. The formats
    writer refuses, before writing anything, what its reader would refuse. ``moe_convention``
    picks how MoE experts and dense MLP targets are written (``posttrain.formats``'
    ``_peft_moe``): ``"per_expert"`` modules (SGLang, PEFT on transformers 4) or PEFT's
    ``"target_parameters"`` (PEFT on transformers 5, whose config rewrite would otherwise
    drop a dense layer's MLP targets). ``load_peft`` reads either.
    """
    target = Path(directory)
    if not tensors:
        raise AdapterFormatError(f"save_peft: no tensors to write to {target}")
    try:
        spec = config.to_spec(target_modules or _default_targets(tensors))
        return write_peft_adapter(
            target,
            tensors,
            spec,
            base_model_name_or_path=base_model_name_or_path,
            moe_convention=moe_convention,
        )
    except PeftFormatError as e:
        raise AdapterFormatError(f"save_peft: {e}") from e


def _read(directory: str | os.PathLike[str]) -> PeftAdapter:
    try:
        return read_peft_adapter(directory)
    except PeftFormatError as e:
        raise AdapterFormatError(f"load_peft: {e}") from e


def read_peft(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config dict, tensors)`` of a PEFT adapter directory, keys normalised.

    Every check of ``posttrain.formats.read_peft_adapter`` runs; a failure is an
    ``AdapterFormatError`` naming the file and the key or field.
    """
    adapter = _read(directory)
    return dict(adapter.config), adapter.tensors


def _check_spec(spec: LoraSpec, config: LoraConfig, where: Path) -> None:
    for field, theirs, ours in (
        ("r", spec.r, config.r),
        ("lora_alpha", spec.alpha, config.alpha),
        ("use_rslora", spec.use_rslora, config.use_rslora),
    ):
        if theirs != ours:
            raise AdapterFormatError(
                f"load_peft: {where}: adapter_config {field}={theirs!r} but LoraConfig has {ours!r}"
            )


def _expert_keys(site: LoraExpertLinear, r: int) -> dict[str, tuple[int, ...]]:
    n, fin, fout = site.base.num_experts, site.base.in_features, site.base.out_features
    if site.shared is None:
        shapes: dict[str, tuple[int, ...]] = {}
        for e in range(n):
            shapes[peft_key(site.hf_name.format(expert=e), "A")] = (r, fin)
            shapes[peft_key(site.hf_name.format(expert=e), "B")] = (fout, r)
        return shapes
    return {
        peft_key(site.hf_name, "A"): (1 if site.shared == "A" else n, r, fin),
        peft_key(site.hf_name, "B"): (1 if site.shared == "B" else n, fout, r),
    }


def _stacked_keys(site: LoraStackedExperts) -> dict[str, tuple[int, ...]]:
    _, _, r, fin = site.lora_A.shape
    out_part = site.lora_B.shape[2]
    shapes: dict[str, tuple[int, ...]] = {}
    for e in range(site.num_experts):
        for p in range(len(site.parts)):
            shapes[peft_key(site.hf_name(e, p), "A")] = (r, fin)
            shapes[peft_key(site.hf_name(e, p), "B")] = (out_part, r)
    return shapes


def _expected_shapes(handle: LoraHandle) -> dict[str, tuple[int, ...]]:
    r = handle.config.r
    shapes: dict[str, tuple[int, ...]] = {}
    for site in handle.sites.values():
        if isinstance(site, LoraStackedExperts):
            shapes.update(_stacked_keys(site))
            continue
        if isinstance(site, LoraExpertLinear):
            shapes.update(_expert_keys(site, r))
            continue
        info = site.site
        for name, size in info.parts:
            shapes[peft_key(name, "A")] = (r, info.in_features)
            shapes[peft_key(name, "B")] = (info.unpadded_out or size, r)
    return shapes


def _expert_local(
    site: LoraExpertLinear, tensors: dict[str, torch.Tensor], ep_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n_loc = site.base.weight.shape[0]
    local = range(ep_rank * n_loc, (ep_rank + 1) * n_loc)
    if site.shared is None:
        a = torch.stack([tensors[peft_key(site.hf_name.format(expert=e), "A")] for e in local])
        b = torch.stack([tensors[peft_key(site.hf_name.format(expert=e), "B")] for e in local])
        return a, b
    a, b = tensors[peft_key(site.hf_name, "A")], tensors[peft_key(site.hf_name, "B")]
    a = a[0] if site.shared == "A" else a[local.start : local.stop]
    b = b[0] if site.shared == "B" else b[local.start : local.stop]
    return a, b


def _dense_local(
    site: LoraLinear, tensors: dict[str, torch.Tensor], rank: int, tp: int, where: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    info = site.site
    a_keys = [peft_key(n, "A") for n, _ in info.parts]
    b_keys = [peft_key(n, "B") for n, _ in info.parts]
    a_full = tensors[a_keys[0]].float()
    for k in a_keys[1:]:
        if not torch.equal(tensors[k].float(), a_full):
            raise AdapterFormatError(
                f"load_peft: {where}: {k} differs from {a_keys[0]}, but {info.path} is a fused "
                "site with one shared A"
            )
    b_parts = []
    for k, (_, size) in zip(b_keys, info.parts, strict=True):
        b = tensors[k].float()
        if b.shape[0] < size:
            b = torch.cat([b, b.new_zeros(size - b.shape[0], b.shape[1])])
        b_parts.append(b)
    if info.layout == "column":
        return a_full, fused_local_rows(b_parts, info.groups, rank, tp)
    if info.layout == "row":
        return a_full.chunk(tp, dim=1)[rank], torch.cat(b_parts)
    return a_full, fused_local_rows(b_parts, info.groups, 0, 1)


def load_peft(
    handle: LoraHandle, directory: str | os.PathLike[str], *, strict: bool = True
) -> list[str]:
    """Load a PEFT adapter into ``handle``'s factors, re-sharded for this rank's layout.

    Collective over ``pp`` when it has more than one stage (to judge unknown keys). Returns the
    keys loaded here. ``strict``: missing and unknown keys raise; shape errors always raise.
    """
    where = Path(directory)
    adapter = _read(where)
    _check_spec(adapter.spec, handle.config, where)
    tensors = adapter.tensors
    shapes = _expected_shapes(handle)
    known = set(shapes)
    pp = handle.groups.pp
    if pp is not None and group_size(pp) > 1:
        stages: list[set[str] | None] = [None] * group_size(pp)
        dist.all_gather_object(stages, known, group=pp)
        known = set().union(*(s or set() for s in stages))
    if strict:
        missing = sorted(set(shapes) - set(tensors))
        unknown = sorted(set(tensors) - known)
        if missing:
            raise AdapterFormatError(
                f"load_peft: {where}: missing {len(missing)} keys, e.g. {missing[0]}"
            )
        if unknown:
            raise AdapterFormatError(
                f"load_peft: {where}: unknown {len(unknown)} keys, e.g. {unknown[0]}"
            )
    for key, shape in shapes.items():
        if key in tensors and tuple(tensors[key].shape) != shape:
            raise AdapterFormatError(
                f"load_peft: {where}: {key} has shape {tuple(tensors[key].shape)}, expected {shape}"
            )
    rank, tp = group_rank(handle.groups.tp), group_size(handle.groups.tp)
    loaded: list[str] = []
    r = handle.config.r
    for site in handle.sites.values():
        if isinstance(site, LoraStackedExperts):
            keys = list(_stacked_keys(site))
            if not all(k in tensors for k in keys):
                continue
            n, parts = site.num_experts, range(len(site.parts))
            a_all = [[tensors[peft_key(site.hf_name(e, p), "A")] for p in parts] for e in range(n)]
            b_all = [[tensors[peft_key(site.hf_name(e, p), "B")] for p in parts] for e in range(n)]
            with torch.no_grad():
                site.lora_A.copy_(torch.stack([torch.stack(row) for row in a_all]))
                site.lora_B.copy_(torch.stack([torch.stack(row) for row in b_all]))
            loaded.extend(keys)
            continue
        if isinstance(site, LoraExpertLinear):
            keys = list(_expert_keys(site, r))
        else:
            keys = [peft_key(n, f) for n, _ in site.site.parts for f in ("A", "B")]
        if not all(k in tensors for k in keys):
            continue  # non-strict: leave a partially given site untouched
        if isinstance(site, LoraExpertLinear):
            a_loc, b_loc = _expert_local(site, tensors, group_rank(handle.groups.ep))
        else:
            a_loc, b_loc = _dense_local(site, tensors, rank, tp, where)
        with torch.no_grad():
            site.lora_A.copy_(a_loc)
            site.lora_B.copy_(b_loc)
        loaded.extend(keys)
    return loaded


def merge_into_base(handle: LoraHandle) -> None:
    """Fold every adapter into its local base weight (fp32, no comms) for evaluation.

    There is no unmerge: subtracting a bf16 delta does not restore the base bitwise.
    """
    for site in handle.sites.values():
        site.merge()
