"""The exclusion list (config ``ignore`` = hf_quant_config ``exclude_modules``), compact or explicit.

Every BF16 Linear and every fully-BF16 FusedMoE must be excluded and no quantized module may
be, under SGLang's ``modelopt_fp4`` rules (:mod:`sglang_rules`). Two styles, both checked
exact against those rules for every module of the checkpoint before they are returned:

* ``compact`` (default): the shortest list we can find that SGLang decides identically.
  Candidates are drawn from the modules' own names (dotted components such as ``self_attn``,
  dotted prefixes with and without ``.*``, suffix globs ``*.mlp.gate``, component paths, and
  each of those with the layer index as ``*``); a candidate is valid if it excludes no
  quantized module and splits no fused Linear. A greedy set cover picks from them, then
  redundant entries are pruned. On a Qwen3-30B-A3B-shaped checkpoint with its last 8 layers
  BF16 that is 11 entries (``self_attn``, ``gate``, ``lm_head`` and one container per BF16
  layer; with ``*`` as the only wildcard, the 8 containers cannot share an entry without
  also catching layer 4), where earlier tooling wrote 499.
* ``explicit``: every kept module by name, for loaders that match only exact names or dotted
  prefixes: each BF16 Linear under its checkpoint name(s) and SGLang's fused name
  (``q/k/v_proj`` and ``qkv_proj``), embeddings, and each fully-BF16 FusedMoE container.
  Unlike miles it omits norms (no loader quantizes them) and the ``model.layers.N.`` prefixes
  (the containers cover those layers' experts for prefix matchers).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from posttrain.quant_convert._errors import CheckpointError, ExclusionError
from posttrain.quant_convert.selection import TensorInfo
from posttrain.quant_convert.sglang_rules import (
    MLA_FUSED_PIECES,
    Module,
    build_modules,
    is_excluded,
)

__all__ = ["ExclusionPlan", "ExclusionStyle", "plan_exclusions"]

ExclusionStyle = Literal["compact", "explicit"]
_NUMERIC = re.compile(r"^\d+$")


@dataclass(slots=True, frozen=True)
class ExclusionPlan:
    """The emitted entries and the per-module decisions they were checked against."""

    entries: tuple[str, ...]
    style: ExclusionStyle
    excluded_modules: tuple[str, ...]
    quantized_modules: tuple[str, ...]


def _wanted(modules: Sequence[Module], quantized: frozenset[str]) -> dict[str, bool]:
    wanted: dict[str, bool] = {}
    for m in modules:
        q = [w for w in m.weights if w in quantized]
        if q and len(q) != len(m.weights):
            kept = next(w for w in m.weights if w not in quantized)
            raise CheckpointError(
                f"{m.name}: {q[0]} is quantized but {kept} stays BF16; SGLang loads "
                f"{'a FusedMoE' if m.kind == 'fused_moe' else 'a fused Linear'} in one precision"
            )
        wanted[m.name] = not q
    return wanted


def _candidates(m: Module) -> set[str]:
    parts = m.name.split(".")
    n = len(parts)
    layer_positions = [i for i, p in enumerate(parts) if _NUMERIC.match(p)]
    variants = [parts]
    for i in layer_positions:
        variants.append([*parts[:i], "*", *parts[i + 1 :]])
    out: set[str] = set()
    for ps in variants:
        for i in range(n):
            if ps[i] != "*" and not _NUMERIC.match(ps[i]):
                out.add(ps[i])
            head = ".".join(ps[: i + 1])
            if i >= 1:
                out.add(head)
            if i < n - 1:
                out.add(head + ".*")
            if i >= 1:
                tail = ".".join(ps[i:])
                out.add("*." + tail)
                if m.kind == "linear" and "*" not in tail:
                    out.add(tail)
    return out


class _Index:
    """Which modules an entry can possibly touch: entries are built from whole dotted
    components, so every literal component of an entry must be a component of the module's
    name or of one of its weights (the SGLang rules never match across a component)."""

    def __init__(self, modules: Sequence[Module]) -> None:
        self.modules = modules
        self.by_component: dict[str, set[int]] = {}
        for i, m in enumerate(modules):
            # the glob rule sees only the module prefix; the path rule also its shards' names
            texts = (m.name,) if m.kind == "fused_moe" else (m.name, *m.weights)
            for t in texts:
                for part in t.split("."):
                    self.by_component.setdefault(part, set()).add(i)
        self.expert_linears = {
            i for i, m in enumerate(modules) if m.kind == "linear" and "experts" in m.name
        }

    def candidates(self, entry: str) -> Iterable[Module]:
        tokens = [t for t in entry.replace("*", "").split(".") if t]
        if not tokens or tokens[-1] in MLA_FUSED_PIECES:
            return self.modules
        hits = set.intersection(*(self.by_component.get(t, set()) for t in tokens))
        if "experts" in entry:  # SGLang's expert rule: the prefix is a substring of the entry
            hits |= self.expert_linears
        return [self.modules[i] for i in sorted(hits)]


def _coverage(entry: str, index: _Index) -> frozenset[str] | None:
    covered = set()
    for m in index.candidates(entry):
        try:
            if is_excluded(m, [entry]):
                covered.add(m.name)
        except ValueError:
            return None  # would split a fused Linear's shards
    return frozenset(covered)


def _compact(modules: Sequence[Module], wanted: dict[str, bool]) -> list[str]:
    positive = {name for name, w in wanted.items() if w}
    negative = {name for name, w in wanted.items() if not w}
    cover: dict[str, frozenset[str]] = {}
    index = _Index(modules)
    for m in modules:
        if not wanted[m.name]:
            continue
        for c in _candidates(m):
            if c in cover:
                continue
            cov = _coverage(c, index)
            if cov is not None and not (cov & negative):
                cover[c] = cov
    todo = set(positive)
    chosen: list[str] = []
    while todo:
        useful = [c for c in cover if cover[c] & todo]
        if not useful:
            raise ExclusionError(f"{min(todo)}: no entry excludes it without a quantized module")
        best = min(useful, key=lambda c: (-len(cover[c] & todo), "*" in c, -len(c), c))
        chosen.append(best)
        todo -= cover[best]
    for c in sorted(chosen, key=lambda c: len(cover[c])):  # prune entries others cover
        rest = set().union(*(cover[o] for o in chosen if o != c))
        if cover[c] <= rest:
            chosen.remove(c)
    return sorted(chosen)


def _explicit(
    modules: Sequence[Module], wanted: dict[str, bool], tensors: Sequence[TensorInfo]
) -> list[str]:
    linear_or_moe = {w for m in modules for w in m.weights}
    out: set[str] = set()
    for m in modules:
        if not wanted[m.name]:
            continue
        out.add(m.name)
        if m.kind == "linear":
            out.update(w.removesuffix(".weight") for w in m.weights)
    for t in tensors:  # embeddings and other 2-D+ weights that are no SGLang Linear
        if t.name.endswith(".weight") and len(t.shape) >= 2 and t.name not in linear_or_moe:
            out.add(t.name.removesuffix(".weight"))
    return sorted(out)


def plan_exclusions(
    tensors: Iterable[TensorInfo], quantized: frozenset[str], style: ExclusionStyle = "compact"
) -> ExclusionPlan:
    """The exclusion list for a checkpoint whose ``quantized`` tensors become NVFP4."""
    infos = list(tensors)
    modules = build_modules(infos)
    wanted = _wanted(modules, quantized)
    if style == "compact":
        entries = _compact(modules, wanted)
    elif style == "explicit":
        entries = _explicit(modules, wanted, infos)
    else:
        raise ExclusionError(f"exclusion style {style!r}: use compact or explicit")
    verify_exclusions(modules, wanted, entries)
    return ExclusionPlan(
        entries=tuple(entries),
        style=style,
        excluded_modules=tuple(sorted(n for n, w in wanted.items() if w)),
        quantized_modules=tuple(sorted(n for n, w in wanted.items() if not w)),
    )


def verify_exclusions(
    modules: Sequence[Module], wanted: dict[str, bool], entries: Sequence[str]
) -> None:
    """Raise :class:`ExclusionError` naming the first module SGLang would decide wrongly."""
    for m in modules:
        try:
            got = is_excluded(m, entries)
        except ValueError as exc:
            raise ExclusionError(f"{m.name}: SGLang would reject the list: {exc}") from exc
        if got != wanted[m.name]:
            what = "excluded" if got else "quantized"
            raise ExclusionError(f"{m.name}: SGLang would treat it as {what}, which is wrong")
