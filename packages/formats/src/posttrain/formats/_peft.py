"""PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``, both directions.

Layout of an adapter directory (what HF PEFT saves and loads, and SGLang serves):

* ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
  ``.lora_B.weight`` ``[out, r]`` for every adapted module. PEFT's in-memory form puts the
  adapter name before ``.weight`` (``lora_A.default.weight``); the reader accepts it and
  normalises to the saved form. Stacked MoE factors (SGLang's shared-outer experts) are 3-D:
  ``[E or 1, r, in]`` and ``[E or 1, out, r]``.
* ``adapter_config.json``: ``peft_type "LORA"``, ``r``, ``lora_alpha``, ``target_modules``
  (a list of names, or ``"all-linear"``), ``lora_dropout``, ``use_rslora``, ``bias "none"``,
  ``task_type``, ``fan_in_fan_out false``, ``inference_mode``, ``base_model_name_or_path``.
  It maps to and from ``posttrain.interface.LoraSpec``.

Departures from PEFT, which only warns or silently ignores: the reader refuses, with a
:class:`PeftConfigError` or :class:`PeftTensorError` naming the file and key or field, a config
that is not a JSON object or lacks ``peft_type``/``r``/``lora_alpha``/``target_modules``;
``r <= 0``; bias, DoRA, fan_in_fan_out, ``rank_pattern``/``alpha_pattern`` or
``modules_to_save`` (we cannot apply them); ``target_modules`` as a regex string (we match by
name); a tensor of a module that ``target_modules`` does not select (PEFT would drop it);
a corrupt safetensors file; integer or bool dtypes; NaN or Inf; a factor whose shape
disagrees with ``r``; ``lora_A`` without ``lora_B``. A target that selects no tensor is
allowed: PEFT writes such targets when a name matched nothing in the base model.
The writer applies the same checks before it writes, so it never writes what the reader refuses.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch

from posttrain.formats._atomic import atomic_directory
from posttrain.formats._errors import PeftConfigError, PeftNonFiniteError, PeftTensorError
from posttrain.formats._finite import count_non_finite
from posttrain.formats._peft_moe import (
    MOE_CONVENTIONS,
    MoeConvention,
    is_target_parameters_config,
    stack_expert_adapter,
    unstack_expert_adapter,
)
from posttrain.formats._safetensors import write_safetensors
from posttrain.interface import ConfigError, LoraSpec

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ALL_LINEAR",
    "PEFT_KEY_PREFIX",
    "PEFT_TENSOR_DTYPES",
    "PeftAdapter",
    "build_peft_adapter",
    "module_is_targeted",
    "parse_peft_config",
    "parse_peft_key",
    "peft_config_from_spec",
    "peft_key",
    "peft_modules",
    "read_peft_adapter",
    "write_peft_adapter",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_KEY_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"
PEFT_TENSOR_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
"""The dtypes an adapter factor may have (on disk, on the wire, as an export dtype)."""

MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.default)?\.weight$"
)
_REQUIRED = ("peft_type", "r", "lora_alpha", "target_modules")
_UNSUPPORTED_EMPTY = ("rank_pattern", "alpha_pattern", "modules_to_save")

Factor = Literal["A", "B"]


def peft_key(module: str, factor: str) -> str:
    """``base_model.model.<module>.lora_A.weight`` (factor ``"A"``) or ``...lora_B.weight``."""
    if factor not in ("A", "B"):
        raise PeftTensorError(f"{module}: LoRA factor {factor!r} is neither 'A' nor 'B'")
    return f"{PEFT_KEY_PREFIX}{module}.lora_{factor}.weight"


def parse_peft_key(key: str, *, where: str = "adapter") -> tuple[str, Factor]:
    """``(module, "A" | "B")`` of a PEFT LoRA key (``.default`` allowed); else PeftTensorError."""
    m = _KEY.match(key)
    if m is None or not all(m["module"].split(".")):
        raise PeftTensorError(
            f"{where}: {key!r} is not a PEFT LoRA key "
            "(base_model.model.<module>.lora_A|lora_B[.default].weight)"
        )
    return m["module"], "A" if m["factor"] == "A" else "B"


def module_is_targeted(target_modules: tuple[str, ...], module: str) -> bool:
    """Whether PEFT's ``target_modules`` (as a ``LoraSpec`` holds them) select ``module``.

    A name selects a module it equals or ends (``q_proj`` selects ``model.layers.0.q_proj``);
    ``("all-linear",)`` selects every module (which ones are linear the caller knows).
    """
    if target_modules == (ALL_LINEAR,):
        return True
    return any(module == t or module.endswith("." + t) for t in target_modules)


# ---- config <-> LoraSpec -----------------------------------------------------------------


def peft_config_from_spec(spec: LoraSpec, *, base_model_name_or_path: str = "") -> dict[str, Any]:
    """The ``adapter_config.json`` object for ``spec`` (PEFT and SGLang read it)."""
    targets: list[str] | str = list(spec.target_modules)
    if ALL_LINEAR in spec.target_modules:
        if spec.target_modules != (ALL_LINEAR,):
            raise PeftConfigError(
                f"target_modules {list(spec.target_modules)}: {ALL_LINEAR!r} must stand alone"
            )
        targets = ALL_LINEAR
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.use_rslora,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }


def _number(where: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PeftConfigError(f"{where}: {field} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise PeftConfigError(f"{where}: {field} must be finite, got {value!r}")
    return float(value)


def _targets(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        if value.lower() == ALL_LINEAR:
            return (ALL_LINEAR,)
        raise PeftConfigError(
            f"{where}: target_modules {value!r} is a regex string; give a list of module names "
            f"or {ALL_LINEAR!r}"
        )
    if not isinstance(value, list) or not value:
        raise PeftConfigError(f"{where}: target_modules must be a non-empty list of names")
    if not all(isinstance(t, str) and t for t in value):
        raise PeftConfigError(f"{where}: target_modules {value!r} holds a non-name")
    if any(t.lower() == ALL_LINEAR for t in value):
        if len(value) > 1:
            raise PeftConfigError(f"{where}: target_modules: {ALL_LINEAR!r} must stand alone")
        return (ALL_LINEAR,)
    return tuple(value)


def parse_peft_config(config: object, *, where: str = ADAPTER_CONFIG_FILE) -> LoraSpec:
    """The ``LoraSpec`` of a decoded ``adapter_config.json`` object; PeftConfigError if invalid.

    ``where`` (a file name, or ``adapter 'x': config_dict``) starts every message.
    """
    if not isinstance(config, Mapping):
        raise PeftConfigError(f"{where}: a JSON {type(config).__name__}, not an object")
    missing = [f for f in _REQUIRED if f not in config]
    if missing:
        raise PeftConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    if not isinstance(config["peft_type"], str) or config["peft_type"].upper() != "LORA":
        raise PeftConfigError(f"{where}: peft_type {config['peft_type']!r} is not LORA")
    r = config["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise PeftConfigError(f"{where}: r must be a positive integer, got {r!r}")
    alpha = _number(where, "lora_alpha", config["lora_alpha"])
    if alpha <= 0:
        raise PeftConfigError(f"{where}: lora_alpha must be > 0, got {alpha!r}")
    raw_dropout = config.get("lora_dropout")
    dropout = 0.0 if raw_dropout is None else _number(where, "lora_dropout", raw_dropout)
    if not 0.0 <= dropout < 1.0:
        raise PeftConfigError(f"{where}: lora_dropout must be in [0, 1), got {dropout!r}")
    rslora = config.get("use_rslora", False)
    if rslora is None:
        rslora = False
    if not isinstance(rslora, bool):
        raise PeftConfigError(f"{where}: use_rslora must be true or false, got {rslora!r}")
    if config.get("bias") not in (None, "none"):
        raise PeftConfigError(f"{where}: bias {config.get('bias')!r} is unsupported (need none)")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag) not in (None, False):
            raise PeftConfigError(f"{where}: {flag}={config.get(flag)!r} is unsupported")
    for field in _UNSUPPORTED_EMPTY:
        if config.get(field) not in (None, {}, []):
            raise PeftConfigError(f"{where}: {field} is unsupported (must be empty)")
    try:
        return LoraSpec(
            r=r,
            alpha=alpha,
            target_modules=_targets(where, config["target_modules"]),
            dropout=dropout,
            use_rslora=rslora,
        )
    except ConfigError as e:  # LoraSpec's own checks, should a field slip past the ones above
        raise PeftConfigError(f"{where}: {e}") from None


# ---- tensors -----------------------------------------------------------------------------


def _check_factor(where: str, key: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise PeftTensorError(f"{where}: {key} is a {type(t).__name__}, not a tensor")
    if t.dtype not in PEFT_TENSOR_DTYPES:
        raise PeftTensorError(
            f"{where}: {key} has dtype {str(t.dtype).removeprefix('torch.')}; adapter factors "
            "are float16, bfloat16, float32 or float64"
        )
    if t.dim() not in (2, 3):
        raise PeftTensorError(f"{where}: {key} has shape {list(t.shape)}; expected 2-D or 3-D")
    if count_non_finite(t):
        bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
        raise PeftNonFiniteError(f"{where}: {key} contains {bad} (non-finite factors are refused)")
    return t


def peft_modules(
    tensors: Mapping[str, torch.Tensor], *, where: str = ADAPTER_WEIGHTS_FILE
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` of PEFT-keyed tensors, sorted by module; PeftTensorError if invalid.

    Checks every key and factor (float dtype, finite, 2-D or 3-D), that each module has both
    factors exactly once, and that A's rank (``shape[-2]``) equals B's (``shape[-1]``).
    """
    if not tensors:
        raise PeftTensorError(f"{where}: no LoRA tensors")
    halves: dict[str, dict[Factor, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        module, factor = parse_peft_key(key, where=where)
        pair = halves.setdefault(module, {})
        if factor in pair:
            raise PeftTensorError(f"{where}: {key} and {pair[factor][0]} are the same factor")
        pair[factor] = (key, _check_factor(where, key, t))
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in sorted(halves):
        pair = halves[module]
        if len(pair) != 2:
            key, lacking = (pair["A"][0], "B") if "A" in pair else (pair["B"][0], "A")
            raise PeftTensorError(f"{where}: {key} without its pair lora_{lacking} ({module})")
        (ka, a), (kb, b) = pair["A"], pair["B"]
        if a.dim() != b.dim() or a.shape[-2] != b.shape[-1]:
            raise PeftTensorError(
                f"{where}: {ka} {list(a.shape)} and {kb} {list(b.shape)} disagree on the rank"
            )
        if a.dim() == 3 and a.shape[0] != b.shape[0] and 1 not in (a.shape[0], b.shape[0]):
            raise PeftTensorError(
                f"{where}: {ka} {list(a.shape)} and {kb} {list(b.shape)} stack "
                "different expert counts"
            )
        out[module] = (a, b)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PeftAdapter:
    """A validated adapter: its spec, ``{module: (A, B)}`` and its config object.

    Always in the per-expert MoE convention (``_peft_moe``): an adapter that came in the
    ``target_parameters`` form is converted, and ``convention`` says which form it came in.
    """

    spec: LoraSpec
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    config: Mapping[str, Any]
    convention: MoeConvention = "per_expert"

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The factors under their saved PEFT keys (``...lora_A.weight``), sorted."""
        out: dict[str, torch.Tensor] = {}
        for module, (a, b) in self.modules.items():
            out[peft_key(module, "A")] = a
            out[peft_key(module, "B")] = b
        return out


def build_peft_adapter(
    config: object,
    tensors: Mapping[str, torch.Tensor],
    *,
    config_where: str = ADAPTER_CONFIG_FILE,
    tensors_where: str = ADAPTER_WEIGHTS_FILE,
) -> PeftAdapter:
    """Check a config object against PEFT-keyed tensors (the reader's checks, for any source).

    Beyond :func:`parse_peft_config` and :func:`peft_modules`: every factor's rank equals
    ``r``, and ``target_modules`` select every module that has tensors. A config with
    ``target_parameters`` (PEFT's stacked-experts form) is converted to the per-expert form first
    (``unstack_expert_adapter``), and the checks run on the result.
    """
    convention: MoeConvention = "per_expert"
    if isinstance(config, Mapping) and is_target_parameters_config(config):
        missing = [f for f in ("r", "lora_alpha") if f not in config]
        if missing:
            raise PeftConfigError(f"{config_where}: missing field(s) {', '.join(missing)}")
        stacked = peft_modules(tensors, where=tensors_where)
        config, unstacked = unstack_expert_adapter(config, stacked, where=config_where)
        tensors = {
            peft_key(m, f): t for m, (a, b) in unstacked.items() for f, t in (("A", a), ("B", b))
        }
        convention = "target_parameters"
    spec = parse_peft_config(config, where=config_where)
    modules = peft_modules(tensors, where=tensors_where)
    for module, (a, _) in modules.items():
        if a.shape[-2] != spec.r:
            raise PeftTensorError(
                f"{tensors_where}: {peft_key(module, 'A')} has rank {a.shape[-2]} "
                f"(shape {list(a.shape)}), but {config_where} says r={spec.r}"
            )
        if not module_is_targeted(spec.target_modules, module):
            raise PeftConfigError(
                f"{config_where}: target_modules {list(spec.target_modules)} do not select "
                f"{module!r}, which {tensors_where} holds"
            )
    return PeftAdapter(
        spec=spec,
        modules=modules,
        config=dict(cast(Mapping[str, Any], config)),
        convention=convention,
    )


# ---- files -------------------------------------------------------------------------------


def _read_config(path: Path) -> object:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise PeftConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:  # a path the OS cannot name (an embedded NUL byte)
        raise PeftConfigError(f"{path!r}: not a usable path ({e})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise PeftConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a PEFT config")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise PeftConfigError(f"{path}: not valid JSON ({e})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise PeftTensorError(f"{path}: no such file")
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, TypeError, OverflowError, RuntimeError) as e:
        raise PeftTensorError(f"{path}: not a readable safetensors file ({e})") from None
    except OSError as e:
        raise PeftTensorError(f"{path}: cannot read ({e.strerror or e})") from None


def read_peft_adapter(directory: str | os.PathLike[str]) -> PeftAdapter:
    """Read and validate the PEFT adapter in ``directory`` (every check in the module doc)."""
    root = Path(directory)
    config_path, weights_path = root / ADAPTER_CONFIG_FILE, root / ADAPTER_WEIGHTS_FILE
    config = _read_config(config_path)
    if not (isinstance(config, Mapping) and is_target_parameters_config(config)):
        parse_peft_config(config, where=str(config_path))  # named before the tensors are read
    return build_peft_adapter(
        config,
        _read_tensors(weights_path),
        config_where=str(config_path),
        tensors_where=str(weights_path),
    )


def write_peft_adapter(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    spec: LoraSpec,
    *,
    base_model_name_or_path: str = "",
    dtype: torch.dtype | None = None,
    moe_convention: MoeConvention = "per_expert",
) -> Path:
    """Write a PEFT adapter directory atomically (replacing any old one); returns its path.

    ``tensors`` are PEFT-keyed (``.default`` allowed; saved without it), in the per-expert
    form; ``dtype`` is the export dtype they are cast to (None keeps theirs).
    ``moe_convention`` (``"per_expert"`` or ``"target_parameters"``, see ``_peft_moe``) says how
    MoE experts (``...experts.<e>.<proj>`` modules) and dense MLP targets are written:
    per-expert is what SGLang and PEFT on transformers 4 read, ``target_parameters`` what PEFT
    on transformers 5 applies in full (experts and dense MLP both). The reader's checks run first, on the tensors and config as
    they will be saved, so a refused adapter leaves ``directory`` untouched.
    """
    if dtype is not None and dtype not in PEFT_TENSOR_DTYPES:
        raise PeftTensorError(f"export dtype {dtype} is not one of {PEFT_TENSOR_DTYPES}")
    if moe_convention not in MOE_CONVENTIONS:
        raise PeftConfigError(
            f"moe_convention {moe_convention!r} is not one of {list(MOE_CONVENTIONS)}"
        )
    target = Path(directory)
    cast = {
        k: v.detach().to(device="cpu", dtype=dtype or v.dtype).contiguous()
        for k, v in tensors.items()
    }
    config = peft_config_from_spec(spec, base_model_name_or_path=base_model_name_or_path)
    adapter = build_peft_adapter(
        config, cast, config_where=f"{target}: config", tensors_where=f"{target}: tensors"
    )
    saved = adapter.tensors
    if moe_convention == "target_parameters":
        config, stacked = stack_expert_adapter(config, adapter.modules, where=str(target))
        saved = {
            peft_key(m, f): t for m, (a, b) in stacked.items() for f, t in (("A", a), ("B", b))
        }
        # the reader must accept what is written
        build_peft_adapter(
            config, saved, config_where=f"{target}: config", tensors_where=f"{target}: tensors"
        )
    text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
    with atomic_directory(target) as staged:
        with open(staged / ADAPTER_WEIGHTS_FILE, "wb") as f:
            write_safetensors(f, saved, {"format": "pt"})
        (staged / ADAPTER_CONFIG_FILE).write_text(text, encoding="utf-8")
    return target
