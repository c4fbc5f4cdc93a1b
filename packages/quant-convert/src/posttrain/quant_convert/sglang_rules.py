"""How SGLang's ``modelopt_fp4`` loader decides that a module stays unquantized (a mirror).

Restated from SGLang's ``ModelOptQuantConfig.is_layer_excluded`` (modelopt_quant.py) and
``is_layer_skipped`` (quantization/utils.py, with the dot-boundary path match):

* glob rule (every module): an entry, with ``.`` literal and ``*`` as ``.*``, full-matches the
  module prefix or any one of its dotted components; a ``language_model.`` head is also tried
  stripped; an entry whose last component is a known MLA fused piece (``q_a_proj`` ...) matches
  when it is a substring of the prefix's last component;
* path rule (Linear only): an entry equals the prefix, is a dotted-path prefix of it, or
  appears as a dotted component path inside it (``.entry.`` in ``.prefix.``); a fused Linear
  (``qkv_proj``, ``gate_up_proj``) is decided on its checkpoint shards, which must agree
  (else SGLang raises); a Linear whose prefix contains ``experts`` is also skipped when its
  prefix is a substring of an entry that mentions ``experts``.

A Linear is unquantized if either rule fires, a FusedMoE (``...mlp.experts``) only by the
glob rule. The module universe comes from checkpoint names: 1-D tensors (norms, biases)
and embeddings are not quantizable layers; ``q/k/v_proj`` become ``qkv_proj`` and dense or
shared ``gate/up_proj`` become ``gate_up_proj`` as in SGLang's Qwen/Llama models.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from posttrain.quant_convert.selection import TensorInfo, expert_container

__all__ = [
    "FUSED_LINEARS",
    "MLA_FUSED_PIECES",
    "Module",
    "build_modules",
    "is_excluded",
    "is_layer_excluded",
    "is_layer_skipped",
]

FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_SHARD_TO_FUSED = {s: f for f, shards in FUSED_LINEARS.items() for s in shards}
MLA_FUSED_PIECES = frozenset({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
_EMBEDDINGS = frozenset({"embed_tokens", "wte", "word_embeddings", "embed_positions", "wpe"})


@lru_cache(maxsize=65536)
def _glob_regex(entry: str) -> re.Pattern[str]:
    # SGLang escapes only the dots; other characters keep their regex meaning there too.
    return re.compile(entry.replace(".", r"\.").replace("*", ".*"))


def is_layer_excluded(prefix: str, entries: Iterable[str]) -> bool:
    """SGLang's glob rule (``ModelOptQuantConfig.is_layer_excluded``)."""
    prefixes = [prefix]
    if prefix.startswith("language_model."):
        prefixes.append(prefix.removeprefix("language_model."))
    for entry in entries:
        rx = _glob_regex(entry)
        for p in prefixes:
            if rx.fullmatch(p) or any(rx.fullmatch(part) for part in p.split(".")):
                return True
        tail = entry.rsplit(".", 1)[-1]
        if tail in MLA_FUSED_PIECES and any(tail in p.rsplit(".", 1)[-1] for p in prefixes):
            return True
    return False


def _path_match(entry: str, prefix: str) -> bool:
    entry, prefix = entry.rstrip("."), prefix.rstrip(".")
    return entry == prefix or prefix.startswith(entry + ".") or f".{entry}." in f".{prefix}."


def is_layer_skipped(
    prefix: str,
    entries: Sequence[str],
    fused: dict[str, tuple[str, ...]] = FUSED_LINEARS,
) -> bool:
    """SGLang's path rule (``quantization.utils.is_layer_skipped``); raises on split shards."""
    proj = prefix.split(".")[-1]
    if proj in fused:
        decisions = {
            any(_path_match(e, prefix.replace(proj, shard)) for e in entries)
            for shard in fused[proj]
        }
        if len(decisions) > 1:
            raise ValueError(f"some but not all shards of {prefix} are excluded")
        return decisions.pop()
    skipped = any(_path_match(e, prefix) for e in entries)
    if "experts" in prefix:
        skipped = skipped or any(prefix in e for e in entries if "experts" in e)
    return skipped


@dataclass(slots=True, frozen=True)
class Module:
    """A layer SGLang builds: a Linear (possibly fused) or a FusedMoE container."""

    name: str
    kind: Literal["linear", "fused_moe"]
    weights: tuple[str, ...]  # the checkpoint tensors that load into it


def is_excluded(module: Module, entries: Sequence[str]) -> bool:
    """Whether SGLang leaves ``module`` unquantized under exclusion list ``entries``."""
    if module.kind == "fused_moe":
        return is_layer_excluded(module.name, entries)
    return is_layer_skipped(module.name, entries) or is_layer_excluded(module.name, entries)


def build_modules(tensors: Iterable[TensorInfo]) -> list[Module]:
    """The Linear and FusedMoE modules SGLang would build for these checkpoint tensors."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for t in tensors:
        parts = t.name.split(".")
        if parts[-1] != "weight" or len(t.shape) < 2 or len(parts) < 2:
            continue
        if parts[-2] in _EMBEDDINGS:
            continue
        cont = expert_container(t.name)
        if cont is not None:
            grouped.setdefault((cont, "fused_moe"), []).append(t.name)
            continue
        mod = ".".join(parts[:-1])
        fused = _SHARD_TO_FUSED.get(parts[-2])
        if fused is not None:
            mod = ".".join([*parts[:-2], fused])
        grouped.setdefault((mod, "linear"), []).append(t.name)
    return [
        Module(name, kind, tuple(sorted(ws)))  # type: ignore[arg-type]
        for (name, kind), ws in sorted(grouped.items())
    ]
