"""``LoraConfig``: the adapter hyper-parameters and the layout-invariant initialisation.

Departures from the obvious:

* Init is drawn for the *full* factor from a generator seeded by (config seed, site name), then
  sliced to the local shard. Fans come from the full dims. So TP=1 and TP=2 give bitwise equal
  adapters, and a replicated factor is equal on every rank of its group without a broadcast.
  (Calling ``xavier_uniform_`` on each local shard, as some systems do, makes the bound depend on
  the TP degree.)
* Dropout defaults to 0 and needs ``allow_dropout=True``: a dropout mask makes the trainer's
  logprobs differ from the rollout engine's, which RL importance ratios cannot tell from drift.
* ``b_init="normal"`` exists for tests (a zero B hides every bug in the B path); training uses
  the default ``"zero"`` so the adapter starts as an exact no-op.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from posttrain.formats import peft_config_from_spec
from posttrain.interface import LoraSpec
from posttrain.lora._errors import LoraConfigError

AInit = Literal["xavier", "kaiming", "normal", "zero"]
BInit = Literal["zero", "normal"]


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraConfig:
    """LoRA hyper-parameters; ``scaling`` is ``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``)."""

    r: int
    alpha: float
    dropout: float = 0.0
    allow_dropout: bool = False
    use_rslora: bool = False
    a_init: AInit = "xavier"
    b_init: BInit = "zero"
    seed: int = 0
    param_dtype: torch.dtype = torch.float32
    export_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise LoraConfigError(f"LoraConfig.r must be a positive int, got {self.r!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise LoraConfigError(
                f"LoraConfig.alpha must be positive and finite, got {self.alpha!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise LoraConfigError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.dropout > 0.0 and not self.allow_dropout:
            raise LoraConfigError(
                f"LoraConfig.dropout={self.dropout} breaks train/rollout logprob parity; "
                "pass allow_dropout=True to accept that"
            )
        if self.a_init not in ("xavier", "kaiming", "normal", "zero"):
            raise LoraConfigError(f"LoraConfig.a_init: unknown init {self.a_init!r}")
        if self.b_init not in ("zero", "normal"):
            raise LoraConfigError(f"LoraConfig.b_init: unknown init {self.b_init!r}")
        for field in ("param_dtype", "export_dtype"):
            value = getattr(self, field)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise LoraConfigError(
                    f"LoraConfig.{field} must be a floating torch.dtype, got {value!r}"
                )

    @property
    def scaling(self) -> float:
        """The factor ``s`` in ``y = W x + s * B (A x)``."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_spec(cls, spec: LoraSpec, **overrides: Any) -> LoraConfig:
        """Build from the interface's ``LoraSpec`` (r, alpha, dropout, use_rslora); its
        ``target_modules`` go to ``attach_lora``. A non-zero dropout still needs
        ``allow_dropout=True`` in ``overrides``."""
        kwargs: dict[str, Any] = {
            "r": spec.r,
            "alpha": float(spec.alpha),
            "dropout": float(spec.dropout),
            "use_rslora": bool(spec.use_rslora),
        }
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_spec(self, target_modules: Sequence[str] | str) -> LoraSpec:
        """The interface's ``LoraSpec`` of this config for ``target_modules`` (one name, a list
        of names, or ``"all-linear"``)."""
        targets = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
        return LoraSpec(
            r=self.r,
            alpha=self.alpha,
            target_modules=targets,
            dropout=self.dropout,
            use_rslora=self.use_rslora,
        )

    def peft_config(
        self, target_modules: Sequence[str] | str, base_model_name_or_path: str = ""
    ) -> dict[str, Any]:
        """The ``adapter_config.json`` dict PEFT and SGLang read for this config (written by
        ``posttrain.formats.peft_config_from_spec``)."""
        return peft_config_from_spec(
            self.to_spec(target_modules), base_model_name_or_path=base_model_name_or_path
        )


def _site_generator(seed: int, site: str, factor: str) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(f"{site}/{factor}".encode())) % (2**63 - 1))
    return gen


def init_full_factor(
    config: LoraConfig, site: str, factor: Literal["A", "B"], shape: tuple[int, ...]
) -> torch.Tensor:
    """The full (unsharded) initial value of one factor, in fp32 on CPU, independent of layout.

    ``shape`` is ``(r, in)`` for A and ``(out, r)`` for B (a leading expert dim is allowed).
    """
    kind = config.a_init if factor == "A" else config.b_init
    if kind == "zero":
        return torch.zeros(shape, dtype=torch.float32)
    gen = _site_generator(config.seed, site, factor)
    fan_out, fan_in = shape[-2], shape[-1]
    if kind == "xavier":
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
    if kind == "kaiming":
        # kaiming_uniform_(a=sqrt(5)) as nn.Linear and PEFT use: bound = 1 / sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
    std = 1.0 / config.r if factor == "A" else 0.02
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std
