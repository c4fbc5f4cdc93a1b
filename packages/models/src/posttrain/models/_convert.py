"""Weight-name conversion between the fused in-memory layout and the HF layout of each family.

Qwen3, Qwen3-MoE, Qwen2/2.5, Llama and Mistral share these names; Qwen2 adds the
``q/k/v_proj.bias`` tensors and has no ``q/k_norm`` (nor have Llama and Mistral).

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
    layers.{i}.qkv_bias             ...self_attn.{q,k,v}_proj.bias         (cat; qkv_bias only)
    layers.{i}.q_norm / k_norm      ...self_attn.{q,k}_norm.weight          (qk_norm only)
    layers.{i}.proj                 ...self_attn.o_proj.weight
    layers.{i}.mlp_norm             model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.fc1 / fc2            ...mlp.{gate,up}_proj.weight (cat) / mlp.down_proj.weight
    layers.{i}.router               ...mlp.gate.weight
    layers.{i}.experts_fc1          ...mlp.experts.{e}.{gate,up}_proj.weight  (cat, stack)
    layers.{i}.experts_fc2          ...mlp.experts.{e}.down_proj.weight       (stack)
    final_norm / output             model.norm.weight / lm_head.weight (absent when tied)

Optional blocks (``ModelConfig`` extension fields) add, when on:

    embed_norm                      model.embed_norm.weight
    layers.{i}.qkv                  ...self_attn.{q,k,v,r}_proj.weight     (r: relative bias)
    layers.{i}.rel_proj             ...self_attn.rel_proj.weight            (frozen table)
    layers.{i}.k_conv / v_conv      ...self_attn.{k,v}_conv.weight          (sconv [C, k])
    layers.{i}.attn_out_conv        model.layers.{i}.attn_out_conv.weight
    layers.{i}.mlp_out_conv         model.layers.{i}.mlp_out_conv.weight
    layers.{i}.router [E+S, H]      ...mlp.gate.weight (routed rows, then shared-expert gates)
    layers.{i}.expert_bias          ...mlp.gate.e_score_correction_bias     (fp32, frozen)
    layers.{i}.shared_fc1 / fc2     ...mlp.shared_experts.{s}.{gate,up,down}_proj.weight

MLA families (``deepseek_v3``, ``glm4_moe_lite``: ``_model.MlaLayer``), per layer:

    layers.{i}.attn_norm / mlp_norm    ...input_layernorm / post_attention_layernorm.weight
    layers.{i}.fc1 / fc2               ...mlp.{gate,up}_proj (cat) / mlp.down_proj (dense layers)
    layers.{i}.self_attn.{n}           ...self_attn.{n}.weight for n in q_proj or q_a_proj,
                                       q_a_layernorm, q_b_proj; kv_a_proj_with_mqa,
                                       kv_a_layernorm, kv_b_proj, o_proj
    layers.{i}.moe.router              ...mlp.gate.weight                     (fp32 always)
    layers.{i}.moe.expert_bias         ...mlp.gate.e_score_correction_bias    (fp32 always)
    layers.{i}.moe.experts_fc1 / fc2   ...mlp.experts.{e}.{gate,up,down}_proj.weight
    layers.{i}.moe.shared_fc1 / fc2    ...mlp.shared_experts.{gate,up}_proj (cat) / down_proj

The MoE tensors of MLA layers are not LoRA targets (their forward has no LoRA hook).

Multimodal towers (``ModelConfig`` tower fields, see ``_towers``) add, when on, with
``T`` = ``vision_tower`` (input ``patch_embed``) or ``audio_tower`` (input ``frame_embed``):

    T.input_proj                    model.T.{patch_embed,frame_embed}.weight
    T.input_norm / T.output_norm    model.T.input_norm.weight / model.T.output_norm.weight
    T.fc1 / T.fc2                   model.T.mlp.{gate,up}_proj.weight (cat) / mlp.down_proj.weight
    T.proj                          model.T.projector.weight

Tower tensors are not LoRA targets (``linear=False``: the towers are frozen).

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
    dtype: str | None = None
    """A dtype this tensor always has (``"float32"``), whatever the config's ``torch_dtype``."""
    linear: bool = True
    """Whether its 2-D HF tensors are linear layers (LoRA targets); False for conv and tables."""


def weight_groups(config: ModelConfig) -> list[WeightGroup]:
    """All groups of ``config``'s model, in parameter order; every HF name occurs once."""
    c = config
    h, width = c.hidden_size, c.sconv_kernel_size
    groups = [_copy("embedding", "model.embed_tokens.weight", (c.vocab_size, h))]
    if c.embedding_rms_norm:
        groups.append(_copy("embed_norm", "model.embed_norm.weight", (h,)))
    for i in range(c.num_hidden_layers):
        if c.is_mla:
            groups += _mla_layer_groups(c, i)
            continue
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        a = hp + "self_attn."
        nh, nkv, hd = c.attention_shape(i)
        nq, nk, nr = nh * hd, nkv * hd, nh * c.rel_pos_dim
        qkv_names: tuple[str, ...] = (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        qkv_shapes: tuple[tuple[int, ...], ...] = ((nq, h), (nk, h), (nk, h))
        if nr:
            qkv_names += (a + "r_proj.weight",)
            qkv_shapes += ((nr, h),)
        norm_q, norm_k = (nq, nk) if c.qk_norm_per_head else (hd, hd)
        groups += [
            _copy(p + "attn_norm", hp + "input_layernorm.weight", (h,)),
            WeightGroup(
                name=p + "qkv",
                hf_names=qkv_names,
                kind="cat",
                shape=(nq + 2 * nk + nr, h),
                hf_shapes=qkv_shapes,
            ),
        ]
        if c.qkv_bias:
            groups.append(
                WeightGroup(
                    name=p + "qkv_bias",
                    hf_names=(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                    kind="cat",
                    shape=(nq + 2 * nk,),
                    hf_shapes=((nq,), (nk,), (nk,)),
                    linear=False,
                )
            )
        if c.qk_norm:
            groups += [
                _copy(p + "q_norm", a + "q_norm.weight", (norm_q,)),
                _copy(p + "k_norm", a + "k_norm.weight", (norm_k,)),
            ]
        if nr:
            extent = c.rel_extent(i)
            groups.append(
                _copy(p + "rel_proj", a + "rel_proj.weight", (c.rel_pos_dim, extent), linear=False)
            )
        if width:
            groups += [
                _copy(p + "k_conv", a + "k_conv.weight", (nk, width), linear=False),
                _copy(p + "v_conv", a + "v_conv.weight", (nk, width), linear=False),
            ]
        groups.append(_copy(p + "proj", a + "o_proj.weight", (h, nq)))
        if width:
            groups.append(
                _copy(p + "attn_out_conv", hp + "attn_out_conv.weight", (h, width), linear=False)
            )
        groups.append(_copy(p + "mlp_norm", hp + "post_attention_layernorm.weight", (h,)))
        m = hp + "mlp."
        if c.is_moe_layer(i):
            e, im, ns = c.num_experts, c.moe_intermediate_size, c.n_shared_experts
            groups.append(_copy(p + "router", m + "gate.weight", (e + ns, h)))
            if c.router_score_function == "sigmoid":
                groups.append(_expert_bias_group(p + "expert_bias", m, e))
            groups += _routed_expert_groups(p, m, e, im, h)
            if ns:
                si = c.shared_intermediate_size
                shared_fc1: list[str] = []
                for s in range(ns):
                    sp = f"{m}shared_experts.{s}."
                    shared_fc1 += [sp + "gate_proj.weight", sp + "up_proj.weight"]
                groups += [
                    WeightGroup(
                        name=p + "shared_fc1",
                        hf_names=tuple(shared_fc1),
                        kind="experts_cat",
                        shape=(ns, 2 * si, h),
                        hf_shapes=((si, h),) * (2 * ns),
                    ),
                    WeightGroup(
                        name=p + "shared_fc2",
                        hf_names=tuple(
                            f"{m}shared_experts.{s}.down_proj.weight" for s in range(ns)
                        ),
                        kind="experts",
                        shape=(ns, h, si),
                        hf_shapes=((h, si),) * ns,
                    ),
                ]
        else:
            groups += _dense_mlp_groups(p, m, h, c.intermediate_size)
        if width:
            groups.append(
                _copy(p + "mlp_out_conv", hp + "mlp_out_conv.weight", (h, width), linear=False)
            )
    groups.append(_copy("final_norm", "model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        groups.append(_copy("output", "lm_head.weight", (c.vocab_size, h)))
    if c.has_vision_tower:
        ps = c.vision_patch_size
        groups += _tower_groups(
            "vision", ps * ps * 3, c.vision_hidden_size, c.vision_intermediate_size, h
        )
    if c.has_audio_tower:
        groups += _tower_groups(
            "audio", c.audio_num_mel_bins, c.audio_hidden_size, c.audio_intermediate_size, h
        )
    return groups


def _dense_mlp_groups(p: str, m: str, h: int, im: int) -> list[WeightGroup]:
    """A dense SwiGLU MLP: ``p + fc1`` = ``[gate_proj; up_proj]`` and ``p + fc2`` = ``down_proj``."""
    return [
        WeightGroup(
            name=p + "fc1",
            hf_names=(m + "gate_proj.weight", m + "up_proj.weight"),
            kind="cat",
            shape=(2 * im, h),
            hf_shapes=((im, h), (im, h)),
        ),
        _copy(p + "fc2", m + "down_proj.weight", (h, im)),
    ]


def _expert_bias_group(name: str, m: str, e: int) -> WeightGroup:
    """The sigmoid router's fixed correction bias (fp32 whatever the checkpoint dtype)."""
    return WeightGroup(
        name=name,
        hf_names=(m + "gate.e_score_correction_bias",),
        kind="copy",
        shape=(e,),
        hf_shapes=((e,),),
        dtype="float32",
    )


def _routed_expert_groups(
    p: str, m: str, e: int, im: int, h: int, *, linear: bool = True
) -> list[WeightGroup]:
    """Stacked routed experts: ``p + experts_fc1`` (per-expert ``[gate; up]``) and ``experts_fc2``."""
    fc1_names = [f"{m}experts.{j}.{w}_proj.weight" for j in range(e) for w in ("gate", "up")]
    return [
        WeightGroup(
            name=p + "experts_fc1",
            hf_names=tuple(fc1_names),
            kind="experts_cat",
            shape=(e, 2 * im, h),
            hf_shapes=((im, h),) * (2 * e),
            stacked_name=m + "experts.gate_up_proj",
            linear=linear,
        ),
        WeightGroup(
            name=p + "experts_fc2",
            hf_names=tuple(f"{m}experts.{j}.down_proj.weight" for j in range(e)),
            kind="experts",
            shape=(e, h, im),
            hf_shapes=((h, im),) * e,
            stacked_name=m + "experts.down_proj",
            linear=linear,
        ),
    ]


def _mla_layer_groups(c: ModelConfig, i: int) -> list[WeightGroup]:
    """The groups of MLA layer ``i`` (``_model.MlaLayer``), in its parameter order."""
    p, hp = f"layers.{i}.", f"model.layers.{i}."
    a, m = hp + "self_attn.", hp + "mlp."
    h, s, nh = c.hidden_size, c.mla_spec, c.num_attention_heads
    groups = [
        _copy(p + "attn_norm", hp + "input_layernorm.weight", (h,)),
        _copy(p + "mlp_norm", hp + "post_attention_layernorm.weight", (h,)),
    ]
    moe = c.is_moe_layer(i)
    if not moe:
        groups += _dense_mlp_groups(p, m, h, c.intermediate_size)
    q_rows = nh * s.qk_head_dim
    attn: list[tuple[str, tuple[int, ...]]] = []
    if s.q_lora_rank is None:
        attn.append(("q_proj", (q_rows, h)))
    else:
        r = s.q_lora_rank
        attn += [("q_a_proj", (r, h)), ("q_a_layernorm", (r,)), ("q_b_proj", (q_rows, r))]
    attn += [
        ("kv_a_proj_with_mqa", (s.cache_width, h)),
        ("kv_a_layernorm", (s.kv_lora_rank,)),
        ("kv_b_proj", (nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)),
        ("o_proj", (h, nh * s.v_head_dim)),
    ]
    groups += [_copy(f"{p}self_attn.{n}", f"{a}{n}.weight", shape) for n, shape in attn]
    if not moe:
        return groups
    # DeepSeek-style MoE (``_ds_moe.DeepseekMoe``): router and correction bias always fp32
    # (transformers keeps them so); experts and shared experts are not LoRA targets
    e, im, si = c.num_experts, c.moe_intermediate_size, c.deepseek_moe_spec.shared_intermediate_size
    d = p + "moe."
    groups += [
        WeightGroup(
            name=d + "router",
            hf_names=(m + "gate.weight",),
            kind="copy",
            shape=(e, h),
            hf_shapes=((e, h),),
            dtype="float32",
            linear=False,
        ),
        _expert_bias_group(d + "expert_bias", m, e),
        *_routed_expert_groups(d, m, e, im, h, linear=False),
    ]
    if si:
        sp = m + "shared_experts."
        groups += [
            WeightGroup(
                name=d + "shared_fc1",
                hf_names=(sp + "gate_proj.weight", sp + "up_proj.weight"),
                kind="cat",
                shape=(2 * si, h),
                hf_shapes=((si, h), (si, h)),
                linear=False,
            ),
            _copy(d + "shared_fc2", sp + "down_proj.weight", (h, si), linear=False),
        ]
    return groups


def _tower_groups(kind: str, n_in: int, width: int, inter: int, h: int) -> list[WeightGroup]:
    """The groups of one media tower, in its parameter order (see ``_towers``)."""
    from posttrain.models._towers import INPUT_PROJ_NAME, TOWER_PREFIX

    p, hp = f"{kind}_tower.", TOWER_PREFIX[kind]
    return [
        _copy(p + "input_proj", f"{hp}{INPUT_PROJ_NAME[kind]}.weight", (width, n_in), linear=False),
        _copy(p + "input_norm", hp + "input_norm.weight", (width,), linear=False),
        WeightGroup(
            name=p + "fc1",
            hf_names=(hp + "mlp.gate_proj.weight", hp + "mlp.up_proj.weight"),
            kind="cat",
            shape=(2 * inter, width),
            hf_shapes=((inter, width), (inter, width)),
            linear=False,
        ),
        _copy(p + "fc2", hp + "mlp.down_proj.weight", (width, inter), linear=False),
        _copy(p + "output_norm", hp + "output_norm.weight", (width,), linear=False),
        _copy(p + "proj", hp + "projector.weight", (h, width), linear=False),
    ]


def _copy(name: str, hf_name: str, shape: tuple[int, ...], *, linear: bool = True) -> WeightGroup:
    return WeightGroup(
        name=name, hf_names=(hf_name,), kind="copy", shape=shape, hf_shapes=(shape,), linear=linear
    )


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

    Tensors come out in the HF layout's dtype: ``config.torch_dtype`` (or a group's fixed
    dtype). Only fp32 tensors are rounded to it (a trainer's fp32 master weights of a bf16
    checkpoint); any other dtype mismatch raises ``TensorSpecMismatchError``.
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
        value = _to_layout_dtype(g, given[g.name], config)
        _check(g.name, value, g.shape, None)
        if stacked_experts and g.stacked_name is not None:
            out[g.stacked_name] = value
        else:
            out.update(zip(g.hf_names, _split(g, value), strict=True))
    return out


def _to_layout_dtype(g: WeightGroup, value: Tensor, config: ModelConfig) -> Tensor:
    """``value`` in the group's HF dtype: fp32 masters rounded to it, anything else as is
    when it already matches, else a ``TensorSpecMismatchError``."""
    want = getattr(torch, g.dtype) if g.dtype is not None else config.dtype
    if value.dtype == want:
        return value
    if value.dtype == torch.float32:
        return value.to(want)
    raise TensorSpecMismatchError(
        f"in-memory tensor {g.name!r} is {value.dtype}; the layout holds {want} "
        "(only fp32 masters are rounded to it)"
    )


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
    default_dtype = config.dtype if check_dtype else None
    used: set[str] = set()
    out: dict[str, Tensor] = {}
    for g in groups:
        dtype = default_dtype
        if check_dtype and g.dtype is not None:
            dtype = getattr(torch, g.dtype)
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
        if not g.linear:
            continue
        for n, shape in zip(g.hf_names, g.hf_shapes, strict=True):
            if len(shape) == 2 and "embed_tokens" not in n:
                out[n.removesuffix(".weight")] = (shape[1], shape[0])
    return out
