"""LoRA adapters by name: PEFT directories, tensors sent in a request, and the registry.

An adapter maps a linear layer's PEFT module name (``model.layers.0.self_attn.q_proj``,
as ``posttrain.models`` lists in ``lora_targets``) to ``A [r, in]`` and ``B [out, r]``
and one scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA). The delta itself is
applied inside ``posttrain.models``' forward (``y = W x + s * B (A x)``, the op order of
``lora-core``, through the same invariant kernels), so the engine's logprobs with an
adapter equal the trainer's bit for bit; this module only validates and names adapters.

PEFT layout read: ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``target_modules``, ``lora_dropout``, ``use_rslora``) and ``adapter_model.safetensors``
with keys ``base_model.model.<module>.lora_{A,B}.weight`` (``.default.`` tolerated).
Departure from PEFT: a non-zero ``lora_dropout`` is accepted (inactive at inference), but
``bias`` other than ``"none"``, DoRA and fan_in_fan_out are refused.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from posttrain.formats import DTYPES
from posttrain.local_engine._errors import AdapterError, UnknownAdapterError
from posttrain.local_engine._update import TensorSpec
from posttrain.models import LoraAdapter as ModelLora

__all__ = [
    "LoraAdapter",
    "LoraRegistry",
    "adapter_from_tensors",
    "expected_lora_tensors",
    "load_peft_adapter",
]

_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraAdapter:
    """A loaded adapter: the model-level adapter plus where it came from."""

    name: str
    r: int
    alpha: float
    target_modules: tuple[str, ...]
    model_adapter: ModelLora
    source: str
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.model_adapter.scaling


def _config_values(name: str, config: Mapping[str, Any]) -> tuple[int, float, bool, Any]:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias {config.get('bias')!r} unsupported (need none)")
    if config.get("use_dora") or config.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name!r}: DoRA and fan_in_fan_out adapters are unsupported")
    try:
        r = int(config["r"])
        alpha = float(config.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: config needs integer r and lora_alpha ({e})") from e
    if r <= 0:
        raise AdapterError(f"adapter {name!r}: r must be positive, got {r}")
    return r, alpha, bool(config.get("use_rslora", False)), config.get("target_modules")


Targets = Mapping[str, tuple[int, int]]
"""PEFT module name -> ``(in_features, out_features)`` (``posttrain.models.lora_targets``)."""


def _targets(target_modules: Any, targets: Targets) -> list[str]:
    if target_modules in ("all-linear", "all", ["all"], ["all-linear"]):
        return sorted(m for m in targets if not m.endswith(("lm_head", ".mlp.gate")))
    if isinstance(target_modules, str):
        return sorted(m for m in targets if m.rsplit(".", 1)[-1] == target_modules)
    if isinstance(target_modules, list | tuple):
        wanted = {str(t) for t in target_modules}
        return sorted(m for m in targets if m.rsplit(".", 1)[-1] in wanted or m in wanted)
    raise AdapterError(f"target_modules {target_modules!r} must be a list, a name or all-linear")


def expected_lora_tensors(
    name: str,
    config: Mapping[str, Any],
    targets: Targets,
    dtype: torch.dtype = torch.float32,
) -> dict[str, TensorSpec]:
    """PEFT tensor names and shapes an adapter with ``config`` must have on this model.

    The dtype is what the caller declares (adapters may be sent as bf16 or fp32).
    """
    r, _, _, wanted = _config_values(name, config)
    modules = _targets(wanted, targets)
    if not modules:
        raise AdapterError(f"adapter {name!r}: target_modules {wanted!r} match no linear layer")
    out: dict[str, TensorSpec] = {}
    for m in modules:
        n_in, n_out = targets[m]
        out[f"{_PREFIX}{m}.lora_A.weight"] = TensorSpec(dtype, (r, n_in))
        out[f"{_PREFIX}{m}.lora_B.weight"] = TensorSpec(dtype, (n_out, r))
    return out


def adapter_from_tensors(
    name: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    targets: Targets,
    *,
    source: str = "tensors",
) -> LoraAdapter:
    """Build an adapter from PEFT-named tensors, checking every name and shape.

    Accepts keys with or without PEFT's ``.default`` segment. Raises AdapterError
    naming the first unknown, missing or mis-shaped tensor; an empty adapter raises too.
    """
    r, alpha, rslora, wanted = _config_values(name, config)
    if not tensors:
        raise AdapterError(f"adapter {name!r}: no tensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        k = key.replace(".default.", ".")
        if not k.startswith(_PREFIX) or not k.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a PEFT lora_A/lora_B key")
        module, ab = k[len(_PREFIX) : -len(".weight")].rsplit(".", 1)
        if module not in targets:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} targets unknown module {module!r}"
            )
        if t.dtype not in DTYPES.values() or not t.is_floating_point():
            raise AdapterError(f"adapter {name!r}: tensor {key!r} has non-float dtype {t.dtype}")
        pairs.setdefault(module, {})[ab] = t.detach().clone()
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, halves in sorted(pairs.items()):
        if set(halves) != {"lora_A", "lora_B"}:
            lone = next(iter(halves))
            raise AdapterError(f"adapter {name!r}: module {module!r} has {lone} without its pair")
        a, b = halves["lora_A"], halves["lora_B"]
        n_in, n_out = targets[module]
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise AdapterError(
                f"adapter {name!r}: module {module!r} has A {list(a.shape)}, B {list(b.shape)}; "
                f"expected A [{r}, {n_in}], B [{n_out}, {r}]"
            )
        weights[module] = (a, b)
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    tm = wanted if isinstance(wanted, list | tuple) else [str(wanted)]
    return LoraAdapter(
        name=name,
        r=r,
        alpha=alpha,
        target_modules=tuple(str(x) for x in tm),
        model_adapter=ModelLora(weights=weights, scaling=scaling, name=name),
        source=source,
        config=dict(config),
    )


def load_peft_adapter(name: str, path: str | Path, targets: Targets) -> LoraAdapter:
    """Load a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    d = Path(path)
    cfg_file, weights_file = d / "adapter_config.json", d / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"adapter {name!r}: {f} does not exist")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"adapter {name!r}: {cfg_file} is not JSON ({e})") from e
    tensors = load_file(str(weights_file))
    return adapter_from_tensors(name, config, tensors, targets, source=str(d))


class LoraRegistry:
    """Adapters by name, at most ``max_loras`` at once; swaps are atomic per name."""

    def __init__(self, *, max_loras: int) -> None:
        self.max_loras = max_loras
        self._adapters: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()

    def put(self, adapter: LoraAdapter) -> None:
        """Register or replace an adapter (replacing does not count against the limit)."""
        with self._lock:
            if adapter.name not in self._adapters and len(self._adapters) >= self.max_loras:
                raise AdapterError(
                    f"adapter {adapter.name!r}: {len(self._adapters)} adapters loaded, the limit "
                    f"(--max-loaded-loras) is {self.max_loras}"
                )
            self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise UnknownAdapterError(f"lora_name {name!r} is not loaded")

    def get(self, name: str) -> LoraAdapter:
        with self._lock:
            try:
                return self._adapters[name]
            except KeyError:
                loaded = sorted(self._adapters)
                raise UnknownAdapterError(
                    f"lora_path {name!r} is not a loaded adapter (loaded: {loaded})"
                ) from None

    def names(self) -> dict[str, str]:
        """Name -> source (path or ``tensors``), as SGLang's ``loaded_adapters``."""
        with self._lock:
            return {n: a.source for n, a in sorted(self._adapters.items())}
