"""The two PEFT conventions for LoRA on MoE experts, and the conversion between them.

* ``"per_expert"``: one PEFT module per expert and projection,
  ``<...>.mlp.experts.<e>.gate_proj|up_proj|down_proj`` with ``lora_A [r, in]`` and
  ``lora_B [out, r]``, selected by ``target_modules``. SGLang's LoRA loader and PEFT on
  transformers 4 (whose experts are ``nn.Linear`` modules) read it. This is the canonical
  form: ``read_peft_adapter`` hands every adapter back in it.
* ``"target_parameters"``: what PEFT 0.21 on transformers 5 applies. Transformers 5 keeps a
  Qwen3-MoE layer's experts as two stacked parameters of ``...mlp.experts``:
  ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``. PEFT adapts
  them with a ``ParamWrapper`` per parameter, listed in ``target_parameters``. When both are
  adapted the wrappers nest (``gate_up_proj`` inner), so their keys are
  ``...mlp.experts.base_layer.lora_A.weight`` (gate_up) and ``...mlp.experts.lora_A.weight``
  (down); with one of them only, it has the ``...mlp.experts`` key. Shapes for ``E`` experts at
  rank ``r``: ``lora_A [E*r, in]`` (expert-major rows: expert ``e`` owns rows ``e*r:(e+1)*r``)
  and ``lora_B [out, r*E]`` (rank-major columns: ``B_e[:, k]`` is column ``k*E + e``).
  Separate gate and up adapters become one gate_up adapter of rank ``2r``: ``A_e = [A_gate;
  A_up]``, ``B_e = blockdiag(B_gate, B_up)``, with ``rank_pattern`` ``2r`` and an
  ``alpha_pattern`` that keeps the scale (``2*alpha``; ``sqrt(2)*alpha`` with rsLoRA).

Why the dense MLP needs care in the second form: on transformers 5, PEFT rewrites the
adapter config of every model type whose weight conversion is Qwen2-MoE's (``qwen3_moe``,
``mellum``, ``qwen2_moe``, ... in ``transformers.conversion_mapping``) before it injects
(``peft.utils.transformers_weight_conversion._convert_peft_config_moe``): each
``target_modules`` entry equal to or ending in ``.gate_proj``/``.up_proj``/``.down_proj`` is
removed and ``gate_up_proj``/``down_proj`` are added to ``target_parameters``, because in a v4
adapter those names meant the experts. A dense layer's ``mlp.gate_proj`` (still an
``nn.Linear``) is then targeted by nothing and its LoRA tensors are silently dropped. No
``target_modules`` entry escapes that rewrite (PEFT matches a module only by a name it ends
in). So the second form names the dense MLP weights as parameters instead:
``target_parameters`` ``gate_proj.weight``/``up_proj.weight``/``down_proj.weight``. PEFT wraps the
2-D weight in a ``ParamWrapper`` whose keys (``...mlp.gate_proj.lora_A.weight``) and math
(``W + s * B @ A``) are those of a module adapter, and the rewrite leaves ``target_parameters``
alone. (On transformers 4 that entry would wrap the dense weight a second time, and
``target_parameters`` needs v5's stacked experts anyway: the second form is for transformers 5,
the first for transformers 4 and SGLang.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal

import torch

from posttrain.formats._errors import PeftConfigError, PeftTensorError

__all__ = [
    "MOE_CONVENTIONS",
    "MoeConvention",
    "expert_modules",
    "is_target_parameters_config",
    "stack_expert_adapter",
    "unstack_expert_adapter",
]

MoeConvention = Literal["per_expert", "target_parameters"]
MOE_CONVENTIONS: tuple[MoeConvention, ...] = ("per_expert", "target_parameters")

_EXPERT = re.compile(
    r"^(?P<container>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)$"
)
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
GATE_UP, DOWN = "gate_up_proj", "down_proj"
_STACKED_TARGETS = {GATE_UP: f"experts.{GATE_UP}", DOWN: f"experts.{DOWN}"}
_PATTERN = r".*\.gate_up_proj"
"""The ``rank_pattern``/``alpha_pattern`` key PEFT itself writes for a fused gate_up."""

Pair = tuple[torch.Tensor, torch.Tensor]


def expert_modules(modules: Mapping[str, Any]) -> dict[str, dict[str, dict[int, str]]]:
    """``{container: {part: {expert: module}}}`` of the per-expert module names in ``modules``."""
    out: dict[str, dict[str, dict[int, str]]] = {}
    for module in modules:
        m = _EXPERT.match(module)
        if m is not None:
            parts = out.setdefault(m["container"], {})
            parts.setdefault(m["part"], {})[int(m["expert"])] = module
    return out


def is_target_parameters_config(config: Mapping[str, Any]) -> bool:
    """Whether an ``adapter_config.json`` object uses ``target_parameters``."""
    return bool(config.get("target_parameters"))


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _fused_alpha(alpha: float, parts: int, rslora: bool) -> float:
    # scale alpha/r (rsLoRA: alpha/sqrt(r)) kept when the rank grows to parts*r
    return alpha * (math.sqrt(parts) if rslora else parts)


def _block_diag(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
    out = top.new_zeros(top.shape[0] + bottom.shape[0], top.shape[1] + bottom.shape[1])
    out[: top.shape[0], : top.shape[1]] = top
    out[top.shape[0] :, top.shape[1] :] = bottom
    return out


def _stack(modules: Mapping[str, Pair], experts: dict[int, str]) -> Pair:
    a = torch.stack([modules[experts[e]][0] for e in sorted(experts)])
    b = torch.stack([modules[experts[e]][1] for e in sorted(experts)])
    return a, b


def stack_expert_adapter(
    config: Mapping[str, Any], modules: Mapping[str, Pair], *, where: str = "adapter"
) -> tuple[dict[str, Any], dict[str, Pair]]:
    """Per-expert form -> ``target_parameters`` form (config object and ``{module: (A, B)}``).

    ``modules`` holds 2-D factors. Each experts container must have every expert ``0..E-1``
    for each adapted projection, and gate and up together (they are one stacked parameter).
    """
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora", False))
    groups = expert_modules(modules)
    out: dict[str, Pair] = {}
    expert_names = {n for parts in groups.values() for e in parts.values() for n in e.values()}
    target_modules: set[str] = set()
    target_parameters: set[str] = set()
    for module, pair in modules.items():
        if module in expert_names:
            continue
        if pair[0].dim() != 2:
            raise PeftTensorError(f"{where}: {module} is stacked (3-D); expected per-expert 2-D")
        out[module] = pair
        leaf = _leaf(module)
        if leaf in _MLP_PARTS:
            target_parameters.add(f"{leaf}.weight")
        else:
            target_modules.add(leaf)
    fused = False
    for container, parts in sorted(groups.items()):
        if ("gate_proj" in parts) != ("up_proj" in parts):
            have = "gate_proj" if "gate_proj" in parts else "up_proj"
            raise PeftConfigError(
                f"{where}: {container} adapts {have} of the experts but not its pair; "
                "transformers 5 stacks gate and up in one parameter, adapt both or neither"
            )
        counts = {len(e) for e in parts.values()}
        n = max(counts)
        for part, experts in parts.items():
            if sorted(experts) != list(range(n)):
                raise PeftTensorError(
                    f"{where}: {container}.<e>.{part} has experts {sorted(experts)}; "
                    f"expected every expert 0..{n - 1}"
                )

        stacked: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        if "gate_proj" in parts:
            ag, bg = _stack(modules, parts["gate_proj"])
            au, bu = _stack(modules, parts["up_proj"])
            a = torch.cat([ag, au], dim=1)  # [E, 2r, H]
            b = torch.stack([_block_diag(bg[e], bu[e]) for e in range(n)])  # [E, 2I, 2r]
            stacked.append((GATE_UP, a, b))
            fused = True
        if "down_proj" in parts:
            a, b = _stack(modules, parts["down_proj"])
            stacked.append((DOWN, a, b))
        for i, (param, a, b) in enumerate(stacked):
            # the first-wrapped parameter (gate_up) ends up innermost, under base_layer
            key = container + ".base_layer" * (len(stacked) - 1 - i)
            flat_a = a.reshape(-1, a.shape[-1])  # [E*rank, in], expert-major
            flat_b = b.permute(1, 2, 0).reshape(b.shape[1], -1)  # [out, rank*E], rank-major
            out[key] = (flat_a.contiguous(), flat_b.contiguous())
            target_parameters.add(_STACKED_TARGETS[param])
    cfg = dict(config)
    cfg["target_modules"] = sorted(target_modules) or None
    cfg["target_parameters"] = sorted(target_parameters)
    cfg["rank_pattern"] = {_PATTERN: 2 * r} if fused else {}
    cfg["alpha_pattern"] = {_PATTERN: _fused_alpha(alpha, 2, rslora)} if fused else {}
    return cfg, out


def _pattern_value(config: Mapping[str, Any], field: str, default: float, where: str) -> float:
    pattern = config.get(field) or {}
    if not isinstance(pattern, Mapping):
        raise PeftConfigError(f"{where}: {field} must be an object, got {pattern!r}")
    for key, value in pattern.items():
        if not isinstance(key, str):
            raise PeftConfigError(f"{where}: {field} key {key!r} is not a string")
        if re.fullmatch(key, "model.layers.0.mlp.experts.gate_up_proj") is None and key != GATE_UP:
            raise PeftConfigError(
                f"{where}: {field} key {key!r} does not select experts.gate_up_proj; "
                "only the fused gate_up's rank and alpha may differ"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise PeftConfigError(f"{where}: {field}[{key!r}] must be a positive number")
        return float(value)
    return default


def unstack_expert_adapter(
    config: Mapping[str, Any], modules: Mapping[str, Pair], *, where: str = "adapter"
) -> tuple[dict[str, Any], dict[str, Pair]]:
    """``target_parameters`` form -> per-expert form (config object and ``{module: (A, B)}``).

    A gate_up adapter of rank ``2r`` must be block-diagonal (separate gate and up adapters,
    as ``stack_expert_adapter`` writes); one of rank ``r`` (PEFT trained the fused parameter)
    gives gate and up the same A. A gate_up scale that differs from ``alpha / r`` is folded into
    B. Raises PeftConfigError / PeftTensorError naming the field or key.
    """
    r, alpha = config["r"], config["lora_alpha"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise PeftConfigError(f"{where}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise PeftConfigError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    rslora = bool(config.get("use_rslora", False))
    raw = config.get("target_parameters")
    if not isinstance(raw, list) or not all(isinstance(t, str) and t for t in raw):
        raise PeftConfigError(f"{where}: target_parameters must be a list of names, got {raw!r}")
    params = set(raw)
    stacked = [p for p in (GATE_UP, DOWN) if any(t == p or t.endswith("." + p) for t in params)]
    dense_leaves = set()
    for t in params:
        leaf = t.removesuffix(".weight")
        if t.endswith(".weight") and _leaf(leaf) in _MLP_PARTS:
            dense_leaves.add(_leaf(leaf))
        elif not any(t == p or t.endswith("." + p) for p in stacked):
            raise PeftConfigError(
                f"{where}: target_parameters entry {t!r} is neither a stacked expert parameter "
                "(gate_up_proj, down_proj) nor a dense MLP weight (gate_proj.weight, ...)"
            )
    r_gu = _pattern_value(config, "rank_pattern", r, where)
    alpha_gu = _pattern_value(config, "alpha_pattern", float(alpha), where)
    if r_gu != int(r_gu):
        raise PeftConfigError(f"{where}: rank_pattern gives gate_up rank {r_gu}, not an integer")
    scale = (alpha / math.sqrt(r)) if rslora else alpha / r
    scale_gu = (alpha_gu / math.sqrt(r_gu)) if rslora else alpha_gu / r_gu
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise PeftConfigError(
            f"{where}: target_modules {targets!r} is a string; with target_parameters give a list"
        )
    target_modules = set(targets) | dense_leaves
    out: dict[str, Pair] = {}
    for module, (a, b) in modules.items():
        if not module.endswith(".experts") and not module.endswith(".experts.base_layer"):
            out[module] = (a, b)
            continue
        if not stacked:
            raise PeftConfigError(
                f"{where}: {module} holds stacked experts but no "
                "target_parameters entry names gate_up_proj or down_proj"
            )
        inner = module.endswith(".base_layer")
        container = module.removesuffix(".base_layer")
        if inner and len(stacked) != 2:
            raise PeftTensorError(f"{where}: {module} is nested, but only {stacked} is targeted")
        param = GATE_UP if (inner or stacked == [GATE_UP]) else DOWN
        rank = int(r_gu) if param == GATE_UP else r
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or a.shape[0] != b.shape[1]:
            raise PeftTensorError(
                f"{where}: {module} ({param}) factors {list(a.shape)}, {list(b.shape)} are not "
                f"[E*{rank}, in] and [out, {rank}*E]"
            )
        n = a.shape[0] // rank
        a_e = a.reshape(n, rank, a.shape[1])
        b_e = b.reshape(b.shape[0], rank, n).permute(2, 0, 1)  # [E, out, rank]
        if param == DOWN:
            for e in range(n):
                out[f"{container}.{e}.down_proj"] = (a_e[e].clone(), b_e[e].clone())
            target_modules.add("down_proj")
            continue
        if b.shape[0] % 2:
            raise PeftTensorError(f"{where}: {module} gate_up has {b.shape[0]} rows, not 2*I")
        i = b.shape[0] // 2
        fold = scale_gu / scale
        for e in range(n):
            be = b_e[e].float() * fold if fold != 1.0 else b_e[e]
            be = be.to(b.dtype)
            if rank == 2 * r:
                off = torch.cat([be[:i, r:].reshape(-1), be[i:, :r].reshape(-1)])
                if bool(off.ne(0).any()):
                    raise PeftTensorError(
                        f"{where}: {module} lora_B of expert {e} is not block-diagonal; a rank "
                        f"{rank} gate_up adapter cannot be written as gate and up at rank {r}"
                    )
                gate = (a_e[e, :r].clone(), be[:i, :r].clone())
                up = (a_e[e, r:].clone(), be[i:, r:].clone())
            elif rank == r:
                gate = (a_e[e].clone(), be[:i].clone())
                up = (a_e[e].clone(), be[i:].clone())
            else:
                raise PeftTensorError(
                    f"{where}: {module} gate_up rank {rank} is neither r={r} nor 2r"
                )
            out[f"{container}.{e}.gate_proj"] = gate
            out[f"{container}.{e}.up_proj"] = up
        target_modules.update(("gate_proj", "up_proj"))
    cfg = {k: v for k, v in config.items() if k not in ("target_parameters",)}
    cfg["target_modules"] = sorted(target_modules)
    cfg["rank_pattern"] = {}
    cfg["alpha_pattern"] = {}
    return cfg, out
