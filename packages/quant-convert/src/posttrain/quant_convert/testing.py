"""Synthetic Qwen3-MoE-named checkpoints for tests and benchmarks (import only there).

Shards are cut right after a ``gate_proj`` so that gate/up pairs straddle every shard
boundary; a VLM-style prefix, dense (non-MoE) layers, shared experts, a tokenizer file and a
subdirectory exercise the converter's other paths. Tensors are generated one shard at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from posttrain.quant_convert.selection import TensorInfo

__all__ = ["SyntheticSpec", "qwen3_moe_tensor_infos", "write_synthetic_checkpoint"]


@dataclass(kw_only=True, slots=True, frozen=True)
class SyntheticSpec:
    layers: int = 4
    experts: int = 4
    hidden: int = 32
    intermediate: int = 32
    vocab: int = 64
    shards: int = 3
    prefix: str = "model."  # e.g. "model.language_model." for a VLM layout
    dense_layers: Sequence[int] = ()
    shared_experts: bool = False
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0


def _shapes(spec: SyntheticSpec) -> list[tuple[str, tuple[int, ...]]]:
    h, i, p = spec.hidden, spec.intermediate, spec.prefix
    out: list[tuple[str, tuple[int, ...]]] = [(f"{p}embed_tokens.weight", (spec.vocab, h))]
    for n in range(spec.layers):
        lp = f"{p}layers.{n}."
        out += [
            (f"{lp}input_layernorm.weight", (h,)),
            (f"{lp}post_attention_layernorm.weight", (h,)),
        ]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((f"{lp}self_attn.{proj}.weight", (h, h)))
        out += [(f"{lp}self_attn.q_norm.weight", (h,)), (f"{lp}self_attn.k_norm.weight", (h,))]
        if n in spec.dense_layers:
            out += [(f"{lp}mlp.gate_proj.weight", (i, h)), (f"{lp}mlp.up_proj.weight", (i, h)),
                    (f"{lp}mlp.down_proj.weight", (h, i))]  # fmt: skip
            continue
        out.append((f"{lp}mlp.gate.weight", (spec.experts, h)))
        for e in range(spec.experts):
            ep = f"{lp}mlp.experts.{e}."
            out += [(ep + "gate_proj.weight", (i, h)), (ep + "up_proj.weight", (i, h)),
                    (ep + "down_proj.weight", (h, i))]  # fmt: skip
        if spec.shared_experts:
            sp = f"{lp}mlp.shared_experts."
            out += [(sp + "gate_proj.weight", (i, h)), (sp + "up_proj.weight", (i, h)),
                    (sp + "down_proj.weight", (h, i))]  # fmt: skip
    out += [(f"{p}norm.weight", (h,)), ("lm_head.weight", (spec.vocab, h))]
    return out


def _cuts(shapes: list[tuple[str, tuple[int, ...]]], shards: int) -> list[int]:
    sizes = [torch.Size(s).numel() for _, s in shapes]
    total = sum(sizes)
    cuts, acc, k = [], 0, 1
    for idx, n in enumerate(sizes):
        acc += n
        if k < shards and acc >= total * k / shards and shapes[idx][0].endswith("gate_proj.weight"):
            cuts.append(idx + 1)  # cut between a gate and its up
            k += 1
    return [0, *cuts, len(shapes)]


def write_synthetic_checkpoint(path: Path, spec: SyntheticSpec | None = None) -> Path:
    """Write config.json, sharded safetensors with an index, and two extra files."""
    spec = spec or SyntheticSpec()
    path.mkdir(parents=True, exist_ok=True)
    shapes = _shapes(spec)
    cuts = _cuts(shapes, spec.shards)
    g = torch.Generator().manual_seed(spec.seed)
    weight_map: dict[str, str] = {}
    total = 0
    n_files = len(cuts) - 1
    for k in range(n_files):
        fname = f"model-{k + 1:05d}-of-{n_files:05d}.safetensors"
        tensors = {}
        for name, shape in shapes[cuts[k] : cuts[k + 1]]:
            t = torch.randn(shape, generator=g) * 0.02
            if len(shape) == 1:
                t = t + 1.0
            tensors[name] = t.to(spec.dtype)
            weight_map[name] = fname
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": spec.layers,
        "hidden_size": spec.hidden,
        "moe_intermediate_size": spec.intermediate,
        "num_experts": spec.experts,
        "vocab_size": spec.vocab,
        "torch_dtype": "bfloat16",
    }
    if spec.prefix != "model.":
        config = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "text_config": config}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (path / "extra").mkdir(exist_ok=True)
    (path / "extra" / "chat_template.jinja").write_text("{{ messages }}")
    return path


def qwen3_moe_tensor_infos(
    layers: int,
    experts: int,
    *,
    prefix: str = "model.",
    dense: frozenset[int] = frozenset(),
    shared: bool = False,
) -> list[TensorInfo]:
    """Header-only tensor list of a Qwen3-MoE-named checkpoint (tiny shapes; names count)."""
    out = [
        TensorInfo(prefix + "embed_tokens.weight", "BF16", (64, 32)),
        TensorInfo(prefix + "norm.weight", "BF16", (32,)),
        TensorInfo("lm_head.weight", "BF16", (64, 32)),
    ]
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        out += [
            TensorInfo(p + f"self_attn.{n}.weight", "BF16", (32, 32))
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        out += [
            TensorInfo(p + f"self_attn.{n}.weight", "BF16", (32,)) for n in ("q_norm", "k_norm")
        ]
        out += [
            TensorInfo(p + f"{n}.weight", "BF16", (32,))
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
        if i in dense:
            out += [
                TensorInfo(p + f"mlp.{n}.weight", "BF16", (32, 32))
                for n in ("gate_proj", "up_proj", "down_proj")
            ]
            continue
        out.append(TensorInfo(p + "mlp.gate.weight", "BF16", (experts, 32)))
        for e in range(experts):
            out += [
                TensorInfo(p + f"mlp.experts.{e}.{n}.weight", "BF16", (32, 32))
                for n in ("gate_proj", "up_proj", "down_proj")
            ]
        if shared:
            out += [
                TensorInfo(p + f"mlp.shared_experts.{n}.weight", "BF16", (32, 32))
                for n in ("gate_proj", "up_proj", "down_proj")
            ]
    return out  # fmt: skip
