"""Which tensors become NVFP4: routed experts outside the BF16 layer ranges and keep patterns.

Works on names, dtypes and shapes only (safetensors headers), so a plan never reads weights.
Departures from miles' converter, each deliberate:

* shared experts stay BF16 unless ``include_shared_experts`` (any component starting with
  ``shared_expert``, singular or plural, marks a shared expert);
* the layer index is found by pattern (``...layers.N.``), so VLM prefixes such as
  ``model.language_model.layers.N.`` work;
* an expert weight with an unexpected dtype, a gate without its up, a pair split across
  precisions and a layer whose experts are only partly kept all raise instead of being
  quantized or kept silently;
* keep patterns are substrings like miles (``mlp.experts.1`` also hits experts 10-19 and
  100+), plus ``re:`` (``re.search``) and ``glob:`` (``fnmatchcase`` on the whole name).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from posttrain.interface import ConfigError
from posttrain.quant_convert._errors import CheckpointError

__all__ = [
    "QuantPolicy",
    "TensorInfo",
    "expert_container",
    "gate_up_role",
    "layer_index",
    "layer_prefix",
    "select_tensors",
]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_PROJ = ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj", "gate_up_proj")
_GATE_UP = {"gate_proj": ("gate", "gate_proj/up_proj"), "up_proj": ("up", "gate_proj/up_proj"),
            "w1": ("gate", "w1/w3"), "w3": ("up", "w1/w3")}  # fmt: skip
FLOAT_DTYPES = ("F16", "BF16", "F32")


@dataclass(kw_only=True, slots=True, frozen=True)
class QuantPolicy:
    """Selection options (the CLI's ``--num-layers-at-*-in-bf16``, keep patterns, ...)."""

    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0
    keep_patterns: tuple[str, ...] = ()
    include_shared_experts: bool = False
    quantize_3d_experts: bool = False

    def __post_init__(self) -> None:
        for pat in self.keep_patterns:
            if pat.startswith("re:"):
                try:
                    re.compile(pat[3:])
                except re.error as exc:
                    raise ConfigError(f"keep pattern {pat!r} is not a valid regex: {exc}") from None

    def bf16_layers(self, num_layers: int) -> frozenset[int]:
        start, end = self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
        if start < 0 or end < 0:
            raise ConfigError(f"BF16 layer counts must be >= 0, got start={start} end={end}")
        if start + end > num_layers:
            raise ConfigError(
                f"num_layers_at_start_in_bf16={start} + num_layers_at_end_in_bf16={end} "
                f"exceeds num_hidden_layers={num_layers}"
            )
        return frozenset(range(start)) | frozenset(range(num_layers - end, num_layers))

    def keeps(self, name: str) -> bool:
        for pat in self.keep_patterns:
            if pat.startswith("re:"):
                if re.search(pat[3:], name):
                    return True
            elif pat.startswith("glob:"):
                if fnmatch.fnmatchcase(name, pat[5:]):
                    return True
            elif pat in name:
                return True
        return False


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """A tensor as its safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def layer_prefix(name: str) -> str | None:
    """``model.layers.7.`` (with its VLM prefix and trailing dot) for a name inside a layer."""
    m = _LAYER_RE.search(name)
    if m is None:
        return None
    return name[: m.end()].lstrip(".")


def _parts(name: str) -> list[str]:
    return name.split(".")


def _is_shared(parts: Sequence[str]) -> bool:
    return any(p.startswith("shared_expert") for p in parts)


def expert_container(name: str) -> str | None:
    """``...mlp.experts`` for a routed-expert tensor name, else None."""
    parts = _parts(name)
    if _is_shared(parts) or "experts" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("experts")
    return ".".join(parts[: i + 1])


def gate_up_role(name: str) -> tuple[str, str] | None:
    """``(pair_key, "gate"|"up")`` for a gate/up weight: the key joins the two members."""
    parts = _parts(name)
    if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in _GATE_UP:
        return None
    role, family = _GATE_UP[parts[-2]]
    return ".".join(parts[:-2]) + "|" + family, role


def _is_candidate(info: TensorInfo, policy: QuantPolicy) -> bool:
    parts = _parts(info.name)
    if parts[-1] != "weight" or len(parts) < 2 or parts[-2] not in _EXPERT_PROJ:
        return False
    if _is_shared(parts):
        return policy.include_shared_experts
    return "experts" in parts


def select_tensors(
    tensors: Iterable[TensorInfo], policy: QuantPolicy, num_layers: int
) -> frozenset[str]:
    """Names of the tensors to quantize; raises naming the tensor for every invalid case."""
    bf16 = policy.bf16_layers(num_layers)
    infos = list(tensors)
    chosen: set[str] = set()
    for info in infos:
        if not _is_candidate(info, policy):
            continue
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{info.name}: expert weight has dtype {info.dtype}; expected F16, BF16 or F32"
            )
        rank = len(info.shape)
        if rank == 3 and not policy.quantize_3d_experts:
            continue  # fused [E, N, K] layouts are opt-in: some HF models store [E, K, N]
        if rank not in (2, 3):
            continue
        idx = layer_index(info.name)
        if idx is not None and idx in bf16:
            continue
        if policy.keeps(info.name):
            continue
        if info.shape[-1] % 16 != 0:
            raise CheckpointError(
                f"{info.name}: input dim K={info.shape[-1]} is not a multiple of 16 (shape {info.shape})"
            )
        chosen.add(info.name)
    _check_pairs(infos, chosen)
    _check_containers(infos, chosen)
    return frozenset(chosen)


def _check_pairs(infos: Sequence[TensorInfo], chosen: set[str]) -> None:
    members: dict[str, dict[str, str]] = {}
    for info in infos:
        role = gate_up_role(info.name)
        if role is None:
            continue
        key, which = role
        slot = members.setdefault(key.split("|")[0], {})
        if which in slot:
            raise CheckpointError(
                f"{info.name}: duplicate {which} role (also {slot[which]}) for the same module"
            )
        slot[which] = info.name
    for slot in members.values():
        names = list(slot.values())
        quantized = [n for n in names if n in chosen]
        if not quantized:
            continue
        if len(slot) < 2:
            missing = "up" if "gate" in slot else "gate"
            raise CheckpointError(
                f"{quantized[0]}: quantized without its {missing} partner; a gate/up pair must "
                "share one global amax"
            )
        if len(quantized) != len(names):
            kept = next(n for n in names if n not in chosen)
            raise CheckpointError(
                f"{quantized[0]} would be NVFP4 but its partner {kept} stays BF16: a gate/up pair "
                "must have one precision"
            )


def _check_containers(infos: Sequence[TensorInfo], chosen: set[str]) -> None:
    status: dict[str, tuple[list[str], list[str]]] = {}
    for info in infos:
        if not _is_candidate(info, QuantPolicy()):
            continue
        cont = expert_container(info.name)
        if cont is None:
            continue
        q, k = status.setdefault(cont, ([], []))
        (q if info.name in chosen else k).append(info.name)
    for cont, (q, k) in sorted(status.items()):
        if q and k:
            raise CheckpointError(
                f"{cont}: partial FusedMoE exclusion ({len(k)} expert weights kept BF16, e.g. "
                f"{k[0]}, {len(q)} quantized); SGLang loads a FusedMoE in one precision"
            )
