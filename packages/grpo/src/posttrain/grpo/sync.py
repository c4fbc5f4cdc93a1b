"""Weight sync: put the trainer's weights on every engine, exactly as the trainer holds them.

* Adapter training: ``export_adapter`` assembles the full PEFT adapter on every rank (fp32,
  the trainer's own bytes), and rank 0 pushes it to each engine with ``lora-core``'s
  ``AdapterClient`` (upsert where the engine has it; the engine verifies sha256 checksums).
  The base is never re-sent.
* Full training: ``iter_full_state_dict`` gathers every parameter (collective), ``models``'
  converter renames them to the HF layout, and rank 0 sends them over wsync/1 with a sha256 per
  bucket, at a weight version that increases on every engine.
* ``rollout_quant=nvfp4``: the HF tensors go through ``quant_convert.quantize_named_params``
  (routed experts to NVFP4, the same selection as the converted checkpoint the engines
  started from). The CPU engine takes base updates in its model dtype, so the NVFP4 tensors
  travel dequantized (``E2M1 * scale * scale_2``, rounded once): the values an NVFP4 engine
  computes with. The trainer's own weights stay full precision, which is the point: the
  train/rollout mismatch is real and TIS corrects it.

Besides engine URLs, a ``SyncTarget`` may hold in-process ``WeightSink``s (the interface
Protocol: a user's own engine): each gets the same update through ``push_weights``, the adapter
as a ``kind="lora"`` update named ``lora_name`` with its PEFT config, full weights as ``base``.

Departure from a colocated GPU sync: no CUDA IPC and no pause/flush here, because the loop
never syncs while a rollout is in flight (a step's rollouts finish before training starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
import torch.distributed as dist

from posttrain.formats import WeightPushClient, dequantize_nvfp4_state_dict, push_weights
from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.trainer import Policy
from posttrain.interface import WeightSink, parse_weight_version
from posttrain.lora import AdapterClient, export_adapter
from posttrain.models import to_hf_state_dict
from posttrain.quant_convert import QuantPolicy, quantize_named_params


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncTarget:
    """The engines to update (by URL, or in-process ``sinks``), the adapter name they serve, and
    how to reach them."""

    engine_urls: tuple[str, ...]
    lora_name: str = "policy"
    rollout_quant: str = "none"
    timeout_s: float = 120.0
    transport: httpx.BaseTransport | None = None
    api_key: str | None = None  # the engines' bearer token for their weight routes
    sinks: tuple[WeightSink, ...] = field(default_factory=tuple)


def engine_weight_version(
    url: str, *, timeout_s: float, transport: httpx.BaseTransport | None
) -> int:
    """An engine's current weight version (0 before any versioned update); an engine that
    reports something that is not a weight version is a ``GrpoRunError`` naming it."""
    with httpx.Client(timeout=timeout_s, transport=transport) as client:
        try:
            reply = client.get(f"{url.rstrip('/')}/model_info")
        except httpx.HTTPError as exc:
            raise GrpoRunError(
                f"weight sync: {url}/model_info: {type(exc).__name__}: {exc}"
            ) from exc
    if reply.status_code != 200:
        raise GrpoRunError(f"weight sync: {url}/model_info answered {reply.status_code}")
    try:
        version = parse_weight_version(reply.json().get("weight_version"))
    except (ValueError, AttributeError) as exc:  # WireFormatError, non-JSON, a JSON non-object
        raise GrpoRunError(f"weight sync: {url}/model_info: {exc}") from exc
    return version or 0


def sync_weights(policy: Policy, target: SyncTarget, version: int) -> dict[str, float]:
    """Push the current weights to every engine at ``version`` (collective; rank 0 sends).

    Returns ``{"sync_bytes": ...}`` on every rank.
    """
    if policy.lora is not None:
        tensors = export_adapter(policy.lora)  # collective over the LoRA groups
    else:
        full = dict(iter_full_state_dict(policy.model))  # collective over the FSDP mesh
        # Only rank 0 sends, so only rank 0 converts (and, for NVFP4 rollouts, quantizes).
        tensors = _engine_tensors(full, policy, target) if dist.get_rank() == 0 else {}
    outcome: list[Any] = [None, 0.0]  # (error, bytes sent), decided on rank 0
    if dist.get_rank() == 0:
        outcome[1] = float(sum(t.numel() * t.element_size() for t in tensors.values()))
        try:
            for url in target.engine_urls:
                if policy.lora is not None:
                    assert policy.lora_config is not None
                    config = policy.lora_config.peft_config(policy.target_modules)
                    with AdapterClient(
                        url,
                        transport=target.transport,
                        timeout=target.timeout_s,
                        api_key=target.api_key,
                    ) as client:
                        client.push(target.lora_name, tensors, config)
                else:
                    with WeightPushClient(
                        url,
                        timeout_s=target.timeout_s,
                        transport=target.transport,
                        api_key=target.api_key,
                    ) as client:
                        push_weights(client, tensors, weight_version=version, with_sha256=True)
            for sink in target.sinks:
                _push_to_sink(sink, policy, target, tensors, version)
        except Exception as exc:  # reported to every rank below, so none waits forever
            where = [*target.engine_urls, *(type(s).__name__ for s in target.sinks)]
            outcome[0] = f"weight sync to {where}: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise GrpoRunError(outcome[0])
    return {"sync_bytes": float(outcome[1])}


def _push_to_sink(
    sink: WeightSink,
    policy: Policy,
    target: SyncTarget,
    tensors: dict[str, torch.Tensor],
    version: int,
) -> None:
    if policy.lora is None:
        result = push_weights(sink, tensors, weight_version=version, with_sha256=True)
    else:
        assert policy.lora_config is not None
        config = policy.lora_config.peft_config(policy.target_modules)
        result = push_weights(
            sink, tensors, weight_version=version, kind="lora", lora_name=target.lora_name,
            lora_config=config, with_sha256=True,
        )  # fmt: skip
    if not result.success:
        raise GrpoRunError(f"{type(sink).__name__} refused version {version}: {result.message}")


def _engine_tensors(
    full: dict[str, torch.Tensor], policy: Policy, target: SyncTarget
) -> dict[str, torch.Tensor]:
    """The HF-named tensors an engine loads; for NVFP4 rollouts, each NVFP4-selected weight
    is replaced by its dequantized value (what an NVFP4 engine computes with)."""
    tensors = to_hf_state_dict(full, policy.model.config)
    if target.rollout_quant != "nvfp4":
        return tensors
    quantized = dict(
        quantize_named_params(
            tensors.items(),
            num_layers=policy.model.config.num_hidden_layers,
            policy=QuantPolicy(num_layers_at_end_in_bf16=0),
        )
    )
    values, _ = dequantize_nvfp4_state_dict(
        quantized, dtypes={name: t.dtype for name, t in tensors.items()}
    )
    return values
