"""Weight sync: put the trainer's weights on every engine, exactly as the trainer holds them.

* Adapter training: ``export_adapter`` assembles the full PEFT adapter on every rank (fp32,
  the trainer's own bytes), and rank 0 pushes it to each engine with ``lora-core``'s
  ``AdapterClient`` (upsert where the engine has it; the engine verifies sha256 checksums).
  The base is never re-sent.
* Full training: ``iter_full_state_dict`` gathers every parameter (collective), ``models``'
  converter renames them to the HF layout (the megatron backend: ``hf_state_dict`` gathers the
  tensor-parallel shards straight to HF names), and rank 0 sends them with SGLang's own
  distributed update (``posttrain.formats.push_distributed``: ``/init_weights_update_group``,
  per bucket ``/update_weights_from_distributed`` while rank 0 broadcasts, then
  ``/destroy_weights_update_group``; gloo on CPU, nccl on GPU), at a weight version that
  increases on every engine. The group is formed per sync with the engines that answer, so a
  lost or re-admitted engine needs nothing more. A failed update is ended on every engine it
  began on (the group is destroyed there, which drops what was staged), so they keep serving
  their old weights; the error names the engine, the route and the engine's message.
* ``rollout_quant=nvfp4``: the HF tensors go through ``quant_convert.quantize_named_params``
  (routed experts to NVFP4, the same selection as the converted checkpoint the engines
  started from) and travel packed, under the converted checkpoint's names, dtypes and shapes
  (uint8 codes, fp8 ``weight_scale``, fp32 ``weight_scale_2``): what SGLang's
  ``modelopt_fp4`` loader takes. The CPU engine dequantizes them at commit
  (``E2M1 * scale * scale_2``, rounded once): the values an NVFP4 engine computes with. The trainer's own weights stay full precision, which is the point: the
  train/rollout mismatch is real and TIS corrects it.

Frozen media towers and engine offload (issue 25): the towers never change during training, so
a full sync sends them only when the engine's copy may be missing: on the first sync of a run
and after an offload/onload cycle (``engines_resumed``: the engines released their memory
with SGLang's ``/release_memory_occupation`` and got it back, zero-filled, with
``/resume_memory_occupation``). Whether the policy has towers at all is read from the model's
structure (``posttrain.models.has_towers``; their names from ``tower_parameter_names``), never
from a separate flag, so the condition cannot go dead in a refactor. Adapter training never
changes the base: after an offload cycle each engine reloads it, towers included, from the
checkpoint (``/update_weights_from_disk`` with ``SyncTarget.base_model_path``), then takes the
adapter as usual (adapters survive an offload).

An engine that cannot be reached (its connection refused or reset, or no reply within the
target's timeout: an engine that died or froze) is *lost*, not fatal, as long as another engine
took the weights: ``sync_weights`` names it in ``SyncResult.lost`` (the loop logs a warning and
the step's ``sync_engines_lost`` metric, and stops pushing to it). The loop then keeps it from
serving the weights it last took (``readmit.py``): it deregisters it from sgl-router (when the
run knows the router, ``router_url``), probes it at every later sync (``/health``, a short
timeout), and one that answers again is *re-admitted*: ``sync_weights(..., readmit=[url])``
gives it the current weights the way an engine after an offload cycle gets them (full weights
with the frozen towers, or a base reload from the checkpoint and then the adapter), and only an
engine that took them all is named in ``SyncResult.readmitted`` (``sync_engines_readmitted``),
registered with the router again and pushed to at later syncs. A re-admission push that fails
leaves the engine lost (``SyncResult.readmit_failed``, tried again at the next sync), never
fails the step. In full-weight training the loop also leaves out of a step every sample an
engine produced at another weight version than the trainer's (``stale_samples``). Every other
failure (a refused adapter, a checksum mismatch, a stale version) still fails the step, and so
does losing every engine.

Besides engine URLs, a ``SyncTarget`` may hold in-process ``WeightSink``s (the interface
Protocol: a user's own engine): each gets the same tensors through ``update_weights``, the
adapter with its name and PEFT config, full weights as they are; one that raises fails the step
with an error naming it.

Departure from a colocated GPU sync: no CUDA IPC and no pause/flush here, because the loop
never syncs while a rollout is in flight (a step's rollouts finish before training starts).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from posttrain.formats import (
    EngineClient,
    UpdateWeightFromDiskReq,
    atomic_directory,
    push_distributed,
    write_safetensors,
)
from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.trainer import Policy
from posttrain.interface import WeightSink, parse_weight_version
from posttrain.lora import AdapterClient, export_adapter
from posttrain.models import has_towers, to_hf_state_dict, tower_parameter_names
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
    base_model_path: str | None = None  # the checkpoint an engine reloads its base from
    weight_sync: str = "distributed"  # full weights: distributed (update group) or disk
    lora_sync: str = "tensors"  # the adapter: tensors (in the request) or disk (a PEFT dir)
    sync_dir: str | None = None  # where disk syncs write (a directory the engines read)
    weight_sync_backend: str = "gloo"  # the update group's backend: gloo (CPU) or nccl (GPU)
    weight_sync_address: str = "127.0.0.1"  # where the trainer's rank 0 hosts the group
    bucket_bytes: int = 256 * 1024 * 1024

    def client(self, url: str) -> EngineClient:
        """A client for the engine at ``url``."""
        return EngineClient(
            url, api_key=self.api_key, timeout_s=self.timeout_s, transport=self.transport
        )


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


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncResult:
    """What a sync did: its metrics, the engines it could not reach (``(url, why)``), and which
    lost engines it re-admitted (or tried to)."""

    metrics: dict[str, float]
    lost: tuple[tuple[str, str], ...] = field(default=())
    readmitted: tuple[str, ...] = field(default=())  # lost engines that took every weight
    readmit_failed: tuple[tuple[str, str], ...] = field(default=())  # still lost: (url, why)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the engine could not be reached (an httpx transport error or
    timeout in its ``raise ... from`` chain), as opposed to an engine that answered and refused."""
    seen: BaseException | None = exc
    for _ in range(16):  # a bounded walk down __cause__
        if seen is None:
            return False
        if isinstance(seen, httpx.TransportError | TimeoutError):
            return True
        seen = seen.__cause__
    return False


def push_each(urls: Sequence[str], push: Callable[[str], None]) -> list[tuple[str, str]]:
    """``push(url)`` for every engine; returns the unreachable ones as ``(url, reason)``.

    Raises ``GrpoRunError`` on the first other failure, or when no engine took the push.
    """
    lost: list[tuple[str, str]] = []
    for url in urls:
        try:
            push(url)
        except Exception as exc:
            if not unreachable(exc):
                raise GrpoRunError(f"weight sync to {url}: {type(exc).__name__}: {exc}") from exc
            lost.append((url, f"{type(exc).__name__}: {exc}"))
    if urls and len(lost) == len(urls):
        reasons = "; ".join(f"{url}: {why}" for url, why in lost)
        raise GrpoRunError(f"weight sync: no engine could be reached ({reasons})")
    return lost


def towers_due(policy: Policy, *, first: bool, engines_resumed: bool) -> bool:
    """Whether this sync must (re)send the frozen tower weights: the model has towers (its
    structure says so) and the engines may lack them (the run's first sync, or their memory
    went through an offload/onload cycle since the last one)."""
    return has_towers(policy.model) and (first or engines_resumed)


def sync_weights(
    policy: Policy,
    target: SyncTarget,
    version: int,
    *,
    first: bool = True,
    engines_resumed: bool = False,
    readmit: Sequence[str] = (),
) -> SyncResult:
    """Push the current weights to every engine at ``version`` (collective; rank 0 sends).

    ``first``: the run's first sync (the engines may hold other weights than the trainer's);
    ``engines_resumed``: the engines went through an offload/onload cycle since the last sync.
    Either way the frozen towers go too (see the module docstring). ``readmit``: lost engines
    that answer again (not in ``target.engine_urls``); each gets what a resumed engine gets
    (full weights with the towers, or a base reload and the adapter), and a failure there only
    leaves it lost. Returns, on every rank, ``{"sync_bytes": ..., "sync_towers": 0|1,
    "sync_engines_lost": ..., "sync_engines_readmitted": ...}``, the engines that could not be
    reached (the caller drops them from later syncs) and the re-admitted ones.
    """
    readmit = tuple(url for url in readmit if url not in target.engine_urls)
    reload_base = policy.lora is not None and engines_resumed
    if policy.lora is None:
        with_towers = towers_due(policy, first=first, engines_resumed=engines_resumed)
        # a re-admitted engine is treated as a resumed one: the towers go to it too
        gather_towers = with_towers or (bool(readmit) and has_towers(policy.model))
        if target.weight_sync == "disk":  # a disk update is a whole checkpoint, towers too
            with_towers = gather_towers = has_towers(policy.model)
    else:  # the adapter never touches the towers: they come back only with a base reload
        with_towers = reload_base and has_towers(policy.model)
        gather_towers = with_towers
    needs_base = (reload_base and bool(target.engine_urls)) or (
        policy.lora is not None and bool(readmit)
    )
    if needs_base and target.base_model_path is None:
        raise GrpoRunError(
            "weight sync: the engines were resumed after an offload (or a lost engine is "
            "re-admitted), but SyncTarget.base_model_path is unset, so their base weights (and "
            "towers) cannot be reloaded"
        )
    if policy.lora is not None:
        tensors = export_adapter(policy.lora)  # collective over the LoRA groups
    elif policy.backend == "megatron":
        hf = policy.model.hf_state_dict()  # collective over TP: shards gathered to HF names
        tensors = (
            _engine_tensors(hf, policy, target, with_towers=gather_towers)
            if dist.get_rank() == 0
            else {}
        )
    else:
        full = dict(iter_full_state_dict(policy.model))  # collective over the FSDP mesh
        # Only rank 0 sends, so only rank 0 converts (and, for NVFP4 rollouts, quantizes).
        tensors = (
            _engine_tensors(
                to_hf_state_dict(full, policy.model.config), policy, target,
                with_towers=gather_towers,
            )
            if dist.get_rank() == 0
            else {}
        )  # fmt: skip
    readmit_tensors = tensors  # with the towers where the model has them (full training)
    if gather_towers and not with_towers:
        tensors = _without_towers(tensors, policy)
    # (error, bytes sent, lost, re-admitted, re-admission failures), decided on rank 0
    outcome: list[Any] = [None, 0.0, [], [], []]

    def push_full(urls: Sequence[str], tensors: dict[str, torch.Tensor]) -> None:
        if target.weight_sync == "disk":
            path = _write_sync_checkpoint(target, tensors, version)
            body = UpdateWeightFromDiskReq(model_path=path, weight_version=str(version))
            for url in urls:
                with target.client(url) as client:
                    client.post("/update_weights_from_disk", body)
            return
        clients = [target.client(url) for url in urls]
        try:
            push_distributed(
                clients,
                list(tensors.items()),
                weight_version=version,
                backend=target.weight_sync_backend,
                master_address=target.weight_sync_address,
                bucket_bytes=target.bucket_bytes,
                timeout_s=target.timeout_s,
            )
        finally:
            for c in clients:
                c.close()

    def push_adapter(url: str, tensors: dict[str, torch.Tensor], *, reload: bool) -> None:
        if reload:
            _reload_base(url, target)
        assert policy.lora_config is not None
        config = policy.lora_config.peft_config(policy.target_modules)
        with AdapterClient(
            url, transport=target.transport, timeout=target.timeout_s, api_key=target.api_key
        ) as client:
            if target.lora_sync == "disk":
                path = _write_sync_adapter(target, tensors, config, version)
                client.unload(target.lora_name)
                client.load_from_path(target.lora_name, path)
            else:
                client.push(target.lora_name, tensors, config)

    def send_all(urls: Sequence[str]) -> list[tuple[str, str]]:
        """Push to ``urls``; returns the unreachable ones (left out of the push)."""
        if policy.lora is not None:
            return push_each(urls, lambda url: push_adapter(url, tensors, reload=reload_base))
        live = [url for url in urls if _answers(url, target)]
        lost = [(url, "no answer to /health") for url in urls if url not in live]
        if urls and not live:
            raise GrpoRunError(f"weight sync: no engine could be reached ({list(urls)})")
        if reload_base:
            for url in live:
                _reload_base(url, target)
        push_full(live, tensors)
        return lost

    def send_readmit(url: str) -> None:
        if policy.lora is not None:
            push_adapter(url, readmit_tensors, reload=True)
        else:
            push_full([url], readmit_tensors)

    if dist.get_rank() == 0:
        outcome[1] = float(sum(t.numel() * t.element_size() for t in tensors.values()))
        try:
            outcome[2] = send_all(target.engine_urls)
            for sink in target.sinks:
                _push_to_sink(sink, policy, target, tensors, version)
            for url in readmit:  # after the live engines: a slow one never delays them
                try:
                    send_readmit(url)
                except Exception as exc:  # it stays lost; the next sync tries again
                    outcome[4].append((url, f"{type(exc).__name__}: {exc}"))
                else:
                    outcome[3].append(url)
        except Exception as exc:  # reported to every rank below, so none waits forever
            where = [*target.engine_urls, *(type(s).__name__ for s in target.sinks)]
            outcome[0] = str(exc) if isinstance(exc, GrpoRunError) else (
                f"weight sync to {where}: {type(exc).__name__}: {exc}"
            )  # fmt: skip
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise GrpoRunError(outcome[0])
    lost = tuple((str(url), str(why)) for url, why in outcome[2])
    readmitted = tuple(str(url) for url in outcome[3])
    return SyncResult(
        metrics={
            "sync_bytes": float(outcome[1]),
            "sync_towers": float(with_towers),
            "sync_engines_lost": float(len(lost)),
            "sync_engines_readmitted": float(len(readmitted)),
        },
        lost=lost,
        readmitted=readmitted,
        readmit_failed=tuple((str(url), str(why)) for url, why in outcome[4]),
    )


def _sync_path(target: SyncTarget, kind: str, version: int) -> Path:
    if target.sync_dir is None:
        raise GrpoRunError(f"weight sync: {kind} over disk needs sync_dir (--sync-dir)")
    root = Path(target.sync_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(f"{kind}-v*"):  # earlier versions: the engines took them already
        shutil.rmtree(old, ignore_errors=True)
    return root / f"{kind}-v{version}"


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        write_safetensors(f, {k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def _write_sync_checkpoint(
    target: SyncTarget, tensors: dict[str, torch.Tensor], version: int
) -> str:
    """The update as a checkpoint directory the engines read (``config.json`` of the served
    checkpoint, the tensors in ``model.safetensors``), written atomically."""
    if target.base_model_path is None:
        raise GrpoRunError("weight sync over disk: base_model_path (the served checkpoint) unset")
    path = _sync_path(target, "weights", version)
    with atomic_directory(path) as staging:
        shutil.copy(Path(target.base_model_path) / "config.json", staging / "config.json")
        _save(tensors, staging / "model.safetensors")
    return str(path)


def _write_sync_adapter(
    target: SyncTarget, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int
) -> str:
    """The adapter as a PEFT directory the engines read, written atomically."""
    path = _sync_path(target, "adapter", version)
    with atomic_directory(path) as staging:
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
        _save(tensors, staging / "adapter_model.safetensors")
    return str(path)


def _answers(url: str, target: SyncTarget) -> bool:
    """Whether the engine at ``url`` answers ``/health`` (a short probe before a group forms)."""
    try:
        with httpx.Client(timeout=min(10.0, target.timeout_s), transport=target.transport) as c:
            return c.get(f"{url.rstrip('/')}/health").status_code == 200
    except httpx.HTTPError:
        return False


def _reload_base(url: str, target: SyncTarget) -> None:
    """Have the engine at ``url`` reload its base weights (towers included) from the
    checkpoint, as after an offload it holds none (``/update_weights_from_disk``)."""
    body = UpdateWeightFromDiskReq(model_path=str(target.base_model_path))
    with target.client(url) as client:
        client.post("/update_weights_from_disk", body)


def set_engine_memory(target: SyncTarget, *, resident: bool) -> list[tuple[str, str]]:
    """Release (``resident=False``) or resume every engine's memory, SGLang's
    ``/release_memory_occupation`` / ``/resume_memory_occupation`` (all tags); rank 0 only.
    Returns the engines that could not be reached (as ``push_each``)."""
    route = "/resume_memory_occupation" if resident else "/release_memory_occupation"

    def call(url: str) -> None:
        with target.client(url) as client:
            client.post(route, {"tags": None})

    return push_each(target.engine_urls, call)


def _push_to_sink(
    sink: WeightSink,
    policy: Policy,
    target: SyncTarget,
    tensors: dict[str, torch.Tensor],
    version: int,
) -> None:
    lora_config = None
    if policy.lora is not None:
        assert policy.lora_config is not None
        lora_config = policy.lora_config.peft_config(policy.target_modules)
    try:
        sink.update_weights(
            tensors,
            weight_version=version,
            lora_name=None if lora_config is None else target.lora_name,
            lora_config=lora_config,
        )
    except Exception as exc:
        raise GrpoRunError(
            f"{type(sink).__name__} refused version {version}: {type(exc).__name__}: {exc}"
        ) from exc


def _engine_tensors(
    tensors: dict[str, torch.Tensor], policy: Policy, target: SyncTarget, *, with_towers: bool
) -> dict[str, torch.Tensor]:
    """The HF-named tensors an engine loads (the frozen towers only ``with_towers``); for
    NVFP4 rollouts, each NVFP4-selected weight is replaced by its packed NVFP4 tensors (uint8
    codes, fp8 ``weight_scale``, ``weight_scale_2``) under the converted checkpoint's names and
    shapes, what an SGLang ``modelopt_fp4`` engine loads (the local engine dequantizes them)."""
    if not with_towers:
        tensors = _without_towers(tensors, policy)
    if target.rollout_quant != "nvfp4":
        return tensors
    return dict(
        quantize_named_params(
            tensors.items(),
            num_layers=policy.model.config.num_hidden_layers,
            policy=QuantPolicy(num_layers_at_end_in_bf16=0),
        )
    )


def _without_towers(tensors: dict[str, torch.Tensor], policy: Policy) -> dict[str, torch.Tensor]:
    """``tensors`` less the frozen towers' (by ``tower_parameter_names``)."""
    towers = set(tower_parameter_names(policy.model))
    return {name: t for name, t in tensors.items() if name not in towers}
