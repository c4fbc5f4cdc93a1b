"""LoRA adapters by name: PEFT directories, tensors sent in a request, and the registry.

An adapter maps a linear layer's PEFT module name (``model.layers.0.self_attn.q_proj``,
as ``posttrain.models`` lists in ``lora_targets``) to ``A [r, in]`` and ``B [out, r]``
and one scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA). The delta itself is
applied inside ``posttrain.models``' forward (``y = W x + s * B (A x)``, the op order of
``lora-core``, through the same invariant kernels), so the engine's logprobs with an
adapter equal the trainer's bit for bit; this module only validates and names adapters.

The PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_{A,B}.weight``, ``.default`` tolerated) is read and checked
by ``posttrain.formats``: its reader refuses corrupt files, non-float, NaN or Inf factors,
shapes that disagree with ``r``, target_modules that disagree with the tensors, bias, DoRA
and fan_in_fan_out. Its errors reach clients as ``AdapterError`` (400). On top, this module
checks the adapter against the served model: known modules, exact 2-D shapes. A non-zero
``lora_dropout`` is accepted (inactive at inference).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.formats import (
    ALL_LINEAR,
    PeftAdapter,
    PeftFormatError,
    PeftNonFiniteError,
    build_peft_adapter,
    module_is_targeted,
    parse_peft_config,
    peft_key,
    read_peft_adapter,
)
from posttrain.interface import LoraSpec
from posttrain.local_engine._errors import AdapterError, NonFiniteWeightsError, UnknownAdapterError
from posttrain.local_engine._update import TensorSpec
from posttrain.models import LoraAdapter as ModelLora

__all__ = [
    "LoraAdapter",
    "LoraRegistry",
    "adapter_from_tensors",
    "expected_lora_tensors",
    "load_peft_adapter",
]


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


Targets = Mapping[str, tuple[int, int]]
"""PEFT module name -> ``(in_features, out_features)`` (``posttrain.models.lora_targets``)."""


def _spec(name: str, config: Mapping[str, Any]) -> LoraSpec:
    try:
        return parse_peft_config(config, where=f"adapter {name!r}: config")
    except PeftFormatError as e:
        raise AdapterError(str(e)) from e


def _modules(spec: LoraSpec, targets: Targets) -> list[str]:
    if spec.target_modules == (ALL_LINEAR,):  # PEFT's all-linear leaves out the head and router
        return sorted(m for m in targets if not m.endswith(("lm_head", ".mlp.gate")))
    return sorted(m for m in targets if module_is_targeted(spec.target_modules, m))


def expected_lora_tensors(
    name: str,
    config: Mapping[str, Any],
    targets: Targets,
    dtype: torch.dtype = torch.float32,
) -> dict[str, TensorSpec]:
    """PEFT tensor names and shapes an adapter with ``config`` must have on this model.

    The dtype is what the caller declares (adapters may be sent as bf16 or fp32).
    """
    spec = _spec(name, config)
    modules = _modules(spec, targets)
    if not modules:
        raise AdapterError(
            f"adapter {name!r}: target_modules {list(spec.target_modules)} match no linear layer"
        )
    out: dict[str, TensorSpec] = {}
    for m in modules:
        n_in, n_out = targets[m]
        out[peft_key(m, "A")] = TensorSpec(dtype, (spec.r, n_in))
        out[peft_key(m, "B")] = TensorSpec(dtype, (n_out, spec.r))
    return out


def _served(name: str, adapter: PeftAdapter, targets: Targets, source: str) -> LoraAdapter:
    r = adapter.spec.r
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in adapter.modules.items():
        if module not in targets:
            raise AdapterError(
                f"adapter {name!r}: tensor {peft_key(module, 'A')!r} targets unknown module "
                f"{module!r}"
            )
        n_in, n_out = targets[module]
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise AdapterError(
                f"adapter {name!r}: module {module!r} has A {list(a.shape)}, B {list(b.shape)}; "
                f"expected A [{r}, {n_in}], B [{n_out}, {r}]"
            )
        weights[module] = (a.detach(), b.detach())  # the reader's own tensors: no copy
    return LoraAdapter(
        name=name,
        r=r,
        alpha=adapter.spec.alpha,
        target_modules=adapter.spec.target_modules,
        model_adapter=ModelLora(weights=weights, scaling=adapter.spec.scaling, name=name),
        source=source,
        config=dict(adapter.config),
    )


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
    naming the first unknown, missing, mis-shaped or non-finite tensor; an empty adapter too.
    """
    try:
        adapter = build_peft_adapter(
            config,
            tensors,
            config_where=f"adapter {name!r}: config",
            tensors_where=f"adapter {name!r}",
        )
    except PeftNonFiniteError as e:
        raise NonFiniteWeightsError(str(e)) from e
    except PeftFormatError as e:
        raise AdapterError(str(e)) from e
    return _served(name, adapter, targets, source)


def load_peft_adapter(name: str, path: str | Path, targets: Targets) -> LoraAdapter:
    """Load a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Every failure is named: the formats reader turns unreadable, corrupt or malformed files
    and unusable paths into its own errors. The one reader of adapter directories for the
    routes and for startup.
    """
    try:
        adapter = read_peft_adapter(path)
    except PeftNonFiniteError as e:
        raise NonFiniteWeightsError(f"adapter {name!r}: {e}") from e
    except PeftFormatError as e:
        raise AdapterError(f"adapter {name!r}: {e}") from e
    return _served(name, adapter, targets, str(Path(path)))


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
