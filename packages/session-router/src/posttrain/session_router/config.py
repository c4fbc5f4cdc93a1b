"""Typed configuration of the session server.

Whether a rollout generates with the trained adapter is ``posttrain.formats.serves_lora`` of
``SessionRouterConfig.lora``: the same predicate the trainer's generate path asks, and the chat
path and the raw ``/generate`` proxy both write the LoRA fields with
``posttrain.formats.apply_lora_fields``, so no two paths can disagree (an earlier system gated
them differently and silently generated LoRA trajectories with base weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from posttrain.formats import LoraServing
from posttrain.interface import ConfigError, is_weight_version

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# One turn's upstream call (one generation, never streamed). Sized for RL rollout turns of a few
# thousand tokens on a loaded GPU engine (~30 tokens/s per sequence: ~3,600 tokens in 120 s); a
# frozen engine then fails the turn with 504 in two minutes instead of holding it. Longer
# generations (long reasoning traces) need a larger value: --upstream-timeout-s.
DEFAULT_UPSTREAM_TIMEOUT_S = 120.0
# About 40 MB of cached ids (a tuple element and its int object are ~36 bytes) plus the texts.
DEFAULT_ENCODE_CACHE_TOKENS = 1 << 20
# How stored and requested messages are compared when finding the common history (tito.py).
MATCHER_NAMES = ("strict", "loose_tool_call", "role_content_only")


def is_positive_seconds(value: object) -> bool:
    """Whether ``value`` is a finite number of seconds > 0 (a bool is not a number here)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclass(kw_only=True, slots=True)
class SessionRouterConfig:
    """What a session server needs to know; validated on construction.

    ``upstream_timeout_s`` bounds one upstream call (a turn's generation); a turn that gets no
    reply in time fails with 504 and is not recorded. It may be ``math.inf`` only when passed
    explicitly.
    ``max_trim_tokens`` bounds how many trailing tokens of a turn the next turn may replace
    (a stop token the chat template renders differently). ``lora_weight_version`` is the
    version of the adapter the engines loaded at startup; a session created with its own
    ``weight_version`` (the trainer's latest push) uses that instead.
    ``parallel_sampling``: a ``POST /rollouts`` group goes upstream as one ``/generate`` with
    ``sampling_params.n`` (see ``app.rollouts``). Only for engines that draw sample ``j`` with
    ``sampling_seed + j`` (posttrain's local engine): SGLang gives all n samples the request's
    one ``sampling_seed``, so with deterministic inference its n samples would be equal.
    """

    upstream_url: str
    tokenizer: str
    lora_adapter: str | None = None
    lora_train_only: bool = False
    lora_weight_version: int | None = None
    api_key: str | None = None
    session_ttl_s: float = 3600.0
    upstream_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int = 1024
    max_trim_tokens: int = 1
    max_rollback_checkpoints: int = 1
    matcher: str = "strict"
    # Token ids the exact-text tokenization cache may hold (0 turns it off); see template.py.
    encode_cache_tokens: int = DEFAULT_ENCODE_CACHE_TOKENS
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    parallel_sampling: bool = False

    def __post_init__(self) -> None:
        if not self.upstream_url.startswith(("http://", "https://")):
            raise ConfigError(f"upstream_url must be an http(s) URL, got {self.upstream_url!r}")
        self.upstream_url = self.upstream_url.rstrip("/")
        for name in ("session_ttl_s", "upstream_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or math.isnan(value):
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"max_body_bytes must be > 0, got {self.max_body_bytes}")
        if self.encode_cache_tokens < 0:
            raise ConfigError(f"encode_cache_tokens must be >= 0, got {self.encode_cache_tokens}")
        if self.max_trim_tokens < 0:
            raise ConfigError(f"max_trim_tokens must be >= 0, got {self.max_trim_tokens}")
        if self.max_rollback_checkpoints < 0:
            raise ConfigError(
                f"max_rollback_checkpoints must be >= 0, got {self.max_rollback_checkpoints}"
            )
        if self.lora_adapter is not None and (not self.lora_adapter or "," in self.lora_adapter):
            # One constant adapter name; per-slot multi-LoRA is not supported with sessions.
            raise ConfigError(
                f"lora_adapter must be one non-empty adapter name, got {self.lora_adapter!r}"
            )
        version = self.lora_weight_version
        if version is not None and not is_weight_version(version):
            raise ConfigError(f"lora_weight_version must be an int >= 0, got {version!r}")
        if not isinstance(self.parallel_sampling, bool):
            raise ConfigError(f"parallel_sampling must be a bool, got {self.parallel_sampling!r}")
        if self.matcher not in MATCHER_NAMES:
            raise ConfigError(f"matcher must be one of {MATCHER_NAMES}, got {self.matcher!r}")

    @property
    def lora(self) -> LoraServing:
        """Which adapter rollouts use (``posttrain.formats.serves_lora`` of it)."""
        return LoraServing(adapter_name=self.lora_adapter, train_only=self.lora_train_only)
