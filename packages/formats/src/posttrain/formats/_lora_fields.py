"""The LoRA fields of a rollout request: one predicate, one builder, used by every path.

``serves_lora`` answers "must this rollout generate with the trained adapter?"; when it says
yes, every ``/generate``, prefill-logprob or session request carries ``request_fields(name,
version)``: ``lora_path`` names the adapter (without it the engine silently generates with the
base weights, and the trajectories are off-policy) and ``extra_key`` =
``"<name>:v<version>"`` keeps SGLang's prefix-cache entries from crossing adapter versions
(the adapter is replaced under the same name on every sync).

``apply_lora_fields`` is the only code that writes those two keys into a request body: the
trainer's generate path and the session router's chat and raw-``/generate`` paths all call it,
so they cannot disagree (an earlier system gated the two paths differently and the session path
never sent ``extra_key``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from posttrain.formats._errors import FormatsConfigError
from posttrain.interface import is_weight_version

LORA_REQUEST_KEYS = ("lora_path", "extra_key")


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraServing:
    """Whether rollouts use the trained adapter.

    ``adapter_name`` None: no LoRA. ``train_only``: LoRA trains but the engines serve the base
    (no ``lora_path``, no adapter sync).
    """

    adapter_name: str | None
    train_only: bool = False

    def __post_init__(self) -> None:
        if self.adapter_name is not None and (not self.adapter_name or "," in self.adapter_name):
            raise FormatsConfigError(
                f"LoraServing.adapter_name must be one non-empty adapter name or None, "
                f"got {self.adapter_name!r}"
            )


def serves_lora(serving: LoraServing) -> bool:
    """True when every rollout request must name the adapter (``lora_path``)."""
    return serving.adapter_name is not None and not serving.train_only


def request_fields(name: str, version: int) -> dict[str, str]:
    """The fields every generate / logprob / session request carries when ``serves_lora``.

    ``version`` is the adapter's weight version (an int, as everywhere in posttrain).
    """
    if not name:
        raise FormatsConfigError("request_fields: adapter name must be non-empty")
    if not is_weight_version(version):
        raise FormatsConfigError(
            f"request_fields: version must be a non-negative int, got {version!r}"
        )
    return {"lora_path": name, "extra_key": f"{name}:v{version}"}


def apply_lora_fields(
    body: MutableMapping[str, Any], serving: LoraServing, version: int | None
) -> MutableMapping[str, Any]:
    """Set ``lora_path`` and ``extra_key`` on ``body`` as ``serves_lora`` says, or remove them.

    Whatever the caller put under those keys is replaced: the adapter is the served one, never
    a client's choice. Serving LoRA with ``version`` None is a ``FormatsConfigError`` (the
    cache key would be wrong). Returns ``body``.
    """
    for key in LORA_REQUEST_KEYS:
        body.pop(key, None)
    if serves_lora(serving):
        assert serving.adapter_name is not None
        if version is None:
            raise FormatsConfigError(
                f"adapter {serving.adapter_name!r} is served, so every request carries "
                f"extra_key '{serving.adapter_name}:v<version>': a weight version is required"
            )
        body.update(request_fields(serving.adapter_name, version))
    return body
