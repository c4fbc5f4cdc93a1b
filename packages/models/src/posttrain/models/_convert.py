"""Weight-name conversion between the fused in-memory layout and the Qwen3-MoE HF layout.

The conversion is a list of ``WeightGroup``s: one in-memory tensor and the HF tensors it is
made of, with how (``copy``; ``cat``: row blocks concatenated; ``experts_cat``: per-expert
row blocks concatenated then stacked over experts; ``experts``: stacked over experts).
A group is atomic for weight sync: its HF tensors must travel together (an N->1 merge).
Both directions check that every tensor is used exactly once and that shapes and dtypes
match; nothing is cast (G1).

    in-memory                       HF
    embedding                       model.embed_tokens.weight
    layers.{i}.attn_norm            model.layers.{i}.input_layernorm.weight
    layers.{i}.qkv                  ...self_attn.{q,k,v}_proj.weight       (cat rows)
    layers.{i}.q_norm / k_norm      ...self_attn.{q,k}_norm.weight
    layers.{i}.proj                 ...self_attn.o_proj.weight
    layers.{i}.mlp_norm             model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.fc1 / fc2            ...mlp.{gate,up}_proj.weight (cat) / mlp.down_proj.weight
    layers.{i}.router               ...mlp.gate.weight
    layers.{i}.experts_fc1          ...mlp.experts.{e}.{gate,up}_proj.weight  (cat, stack)
    layers.{i}.experts_fc2          ...mlp.experts.{e}.down_proj.weight       (stack)
    final_norm / output             model.norm.weight / lm_head.weight (absent when tied)

Expert groups also accept (and can emit) the stacked form that ``transformers`` v5 keeps in
memory: ``...mlp.experts.gate_up_proj[E, 2I, H]`` and ``...mlp.experts.down_proj[E, H, I]``.
Checkpoints on disk use the per-expert names, which SGLang and ``quant-convert`` read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from posttrain.models._config import ModelConfig
from posttrain.models._errors import (
    DuplicateTensorError,
    MissingTensorError,
    TensorSpecMismatchError,
    UnknownTensorError,
)

GroupKind = Literal["copy", "cat", "experts_cat", "experts"]


@dataclass(kw_only=True, slots=True, frozen=True)
class WeightGroup:
    """One in-memory tensor, the HF tensors that make it, and how they combine."""

    name: str
    hf_names: tuple[str, ...]
    kind: GroupKind
    shape: tuple[int, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    stacked_name: str | None = None
    """For expert groups: the single stacked HF name that may stand for all ``hf_names``."""


def weight_groups(config: ModelConfig) -> list[WeightGroup]:
    """All groups of ``config``'s model, in parameter order; every HF name occurs once."""
    c = config
    h, hd = c.hidden_size, c.head_dim
    nq, nk = c.num_attention_heads * hd, c.num_key_value_heads * hd
    groups = [_copy("embedding", "model.embed_tokens.weight", (c.vocab_size, h))]
    for i in range(c.num_hidden_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        a = hp + "self_attn."
        groups += [
            _copy(p + "attn_norm", hp + "input_layernorm.weight", (h,)),
            WeightGroup(
                name=p + "qkv",
                hf_names=(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                kind="cat",
                shape=(nq + 2 * nk, h),
                hf_shapes=((nq, h), (nk, h), (nk, h)),
            ),
            _copy(p + "q_norm", a + "q_norm.weight", (hd,)),
            _copy(p + "k_norm", a + "k_norm.weight", (hd,)),
            _copy(p + "proj", a + "o_proj.weight", (h, nq)),
            _copy(p + "mlp_norm", hp + "post_attention_layernorm.weight", (h,)),
        ]
        m = hp + "mlp."
        if c.is_moe_layer(i):
            e, im = c.num_experts, c.moe_intermediate_size
            fc1_names: list[str] = []
            for j in range(e):
                fc1_names += [f"{m}experts.{j}.gate_proj.weight", f"{m}experts.{j}.up_proj.weight"]
            groups += [
                _copy(p + "router", m + "gate.weight", (e, h)),
                WeightGroup(
                    name=p + "experts_fc1",
                    hf_names=tuple(fc1_names),
                    kind="experts_cat",
                    shape=(e, 2 * im, h),
                    hf_shapes=((im, h),) * (2 * e),
                    stacked_name=m + "experts.gate_up_proj",
                ),
                WeightGroup(
                    name=p + "experts_fc2",
                    hf_names=tuple(f"{m}experts.{j}.down_proj.weight" for j in range(e)),
                    kind="experts",
                    shape=(e, h, im),
                    hf_shapes=((h, im),) * e,
                    stacked_name=m + "experts.down_proj",
                ),
            ]
        else:
            im = c.intermediate_size
            groups += [
                WeightGroup(
                    name=p + "fc1",
                    hf_names=(m + "gate_proj.weight", m + "up_proj.weight"),
                    kind="cat",
                    shape=(2 * im, h),
                    hf_shapes=((im, h), (im, h)),
                ),
                _copy(p + "fc2", m + "down_proj.weight", (h, im)),
            ]
    groups.append(_copy("final_norm", "model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        groups.append(_copy("output", "lm_head.weight", (c.vocab_size, h)))
    return groups


def _copy(name: str, hf_name: str, shape: tuple[int, ...]) -> WeightGroup:
    return WeightGroup(name=name, hf_names=(hf_name,), kind="copy", shape=shape, hf_shapes=(shape,))


def _pairs(tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out: dict[str, Tensor] = {}
    for name, value in items:
        if name in out:
            raise DuplicateTensorError(f"tensor {name!r} was given twice")
        out[name] = value
    return out


def _check(name: str, value: Tensor, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
    if tuple(value.shape) != shape:
        raise TensorSpecMismatchError(
            f"tensor {name!r} has shape {tuple(value.shape)}, expected {shape}"
        )
    if dtype is not None and value.dtype != dtype:
        raise TensorSpecMismatchError(
            f"tensor {name!r} has dtype {value.dtype}, expected {dtype} (dtypes are never cast)"
        )


def to_hf_state_dict(
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    config: ModelConfig,
    *,
    stacked_experts: bool = False,
) -> dict[str, Tensor]:
    """In-memory names -> HF names (split fused blocks, unstack experts); all used once.

    With ``stacked_experts`` the expert groups keep the stacked ``transformers`` v5 form.
    """
    given = _pairs(tensors)
    groups = weight_groups(config)
    known = {g.name for g in groups}
    unknown = sorted(set(given) - known)
    if unknown:
        raise UnknownTensorError(f"unknown in-memory tensors: {unknown}")
    out: dict[str, Tensor] = {}
    for g in groups:
        if g.name not in given:
            raise MissingTensorError(f"in-memory tensor {g.name!r} is missing")
        value = given[g.name]
        _check(g.name, value, g.shape, None)
        if stacked_experts and g.stacked_name is not None:
            out[g.stacked_name] = value
        else:
            out.update(zip(g.hf_names, _split(g, value), strict=True))
    return out


def _split(g: WeightGroup, value: Tensor) -> list[Tensor]:
    if g.kind == "copy":
        return [value]
    if g.kind == "cat":
        return list(torch.split(value, [s[0] for s in g.hf_shapes]))
    if g.kind == "experts":
        return list(value.unbind(0))
    half = value.shape[1] // 2
    return [part for expert in value.unbind(0) for part in (expert[:half], expert[half:])]


def from_hf_state_dict(
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    config: ModelConfig,
    *,
    partial: bool = False,
    check_dtype: bool = True,
) -> dict[str, Tensor]:
    """HF names -> in-memory names; every HF tensor used exactly once.

    With ``partial`` only complete groups must be present (a weight update of some
    groups); a group given in part raises MissingTensorError. Dtypes must equal
    ``config.torch_dtype`` unless ``check_dtype`` is False.
    """
    given = _pairs(tensors)
    groups = weight_groups(config)
    owner = {n: g for g in groups for n in g.hf_names}
    owner.update({g.stacked_name: g for g in groups if g.stacked_name is not None})
    unknown = sorted(set(given) - set(owner))
    if unknown:
        raise UnknownTensorError(f"unknown HF tensors: {unknown}")
    dtype = config.dtype if check_dtype else None
    used: set[str] = set()
    out: dict[str, Tensor] = {}
    for g in groups:
        present = [n for n in g.hf_names if n in given]
        if g.stacked_name is not None and g.stacked_name in given:
            if present:
                raise DuplicateTensorError(
                    f"{g.stacked_name!r} and per-expert tensors {present[:2]}... both given"
                )
            used.add(g.stacked_name)
            _check(g.stacked_name, given[g.stacked_name], g.shape, dtype)
            out[g.name] = given[g.stacked_name]
            continue
        if not present and partial:
            continue
        if len(present) != len(g.hf_names):
            missing = [n for n in g.hf_names if n not in given]
            raise MissingTensorError(f"HF tensors missing for {g.name!r}: {missing}")
        parts = []
        for n, shape in zip(g.hf_names, g.hf_shapes, strict=True):
            if n in used:
                raise DuplicateTensorError(f"HF tensor {n!r} consumed twice")
            used.add(n)
            _check(n, given[n], shape, dtype)
            parts.append(given[n])
        out[g.name] = _merge(g, parts)
    assert used == set(given), "every given tensor is consumed exactly once"
    return out


def _merge(g: WeightGroup, parts: list[Tensor]) -> Tensor:
    if g.kind == "copy":
        return parts[0]
    if g.kind == "cat":
        return torch.cat(parts, dim=0)
    if g.kind == "experts":
        return torch.stack(parts, dim=0)
    pairs = [torch.cat(parts[j : j + 2], dim=0) for j in range(0, len(parts), 2)]
    return torch.stack(pairs, dim=0)


def lora_targets(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module names of every linear layer, with ``(in_features, out_features)``."""
    out: dict[str, tuple[int, int]] = {}
    for g in weight_groups(config):
        for n, shape in zip(g.hf_names, g.hf_shapes, strict=True):
            if len(shape) == 2 and "embed_tokens" not in n:
                out[n.removesuffix(".weight")] = (shape[1], shape[0])
    return out
