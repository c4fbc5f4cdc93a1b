"""The engines of a run, on the controller side: ``EngineFleet``.

One ``EngineFleet`` holds every engine of a run (by URL, with one ``EngineClient`` each: the
weight routes, the adapter pushes through lora-core's ``AdapterClient`` borrowing that client's
connection, the ``/health`` probes and ``/model_info`` all go through it), the weight version
each engine took, the weight-update group, which engines are lost, and their sgl-router
registration. The loop hands it the policy and a version; it does the rest. Its collective
methods (``first_version``, ``sync``, ``set_memory``) run on every trainer rank:
rank 0 talks to the engines and every rank learns the outcome.

What a sync sends:

* Adapter training: ``export_adapter`` assembles the full PEFT adapter on every rank (fp32,
  the trainer's own bytes), and rank 0 pushes it to each engine (``lora_sync=tensors``: SGLang's
  ``/load_lora_adapter_from_tensors``, upsert where the engine has it, sha256 checksums checked
  where it verifies them; ``lora_sync=disk``: a PEFT directory in ``sync_dir`` and
  ``/load_lora_adapter``). The base is never re-sent.
* Full training: ``iter_full_state_dict`` gathers every parameter (collective), ``models``'
  converter renames them to the HF layout (the megatron backend: ``hf_state_dict`` gathers the
  tensor-parallel shards straight to HF names), and rank 0 sends them with SGLang's own
  distributed update (``weight_sync=distributed``) at a weight version that increases on every
  engine, or as a checkpoint in ``sync_dir`` read with ``/update_weights_from_disk``
  (``weight_sync=disk``). The update group (``posttrain.formats.WeightUpdateGroup``: gloo on
  CPU, nccl on GPU) is formed once, at the first sync, with the engines that answer, kept for
  every later sync, and destroyed at ``close`` (the end of the run). Engines colocated on the
  trainer's GPUs take ``weight_sync=tensor``: each bucket flattened into one GPU tensor
  (SGLang's ``flattened_bucket``) and handed over as a CUDA IPC handle in SGLang's
  ``/update_weights_from_tensor`` body (``posttrain.formats.tensor_update_requests``); the
  CPU engine refuses that route by name. It is formed again only
  when its members change: an engine is lost (the group leaves it out), a lost engine is
  re-admitted (the group takes it in), or an update failed (a broadcast may have stopped
  midway). A failed update is ended on every engine it began on (the group is destroyed there,
  which drops what was staged), so they keep serving their old weights; the error names the
  engine, the route and the engine's message.
* ``rollout_quant=nvfp4``: the HF tensors go through ``quant_convert.quantize_named_params``
  (routed experts to NVFP4, the same selection as the converted checkpoint the engines
  started from) and travel packed, under the converted checkpoint's names, dtypes and shapes
  (uint8 codes, fp8 ``weight_scale``, fp32 ``weight_scale_2`` and ``input_scale``): what
  SGLang's ``modelopt_fp4`` loader takes. The CPU engine dequantizes them at commit
  (``E2M1 * scale * scale_2``, rounded once): the values an NVFP4 engine computes with. The
  trainer's own weights stay full precision, which is the point: the train/rollout mismatch
  is real and TIS corrects it.

Frozen media towers and engine offload (issue 25): the towers never change during training, so
a full sync sends them only when the engine's copy may be missing: on the first sync of a run
and after an offload/onload cycle (``engines_resumed``: the engines released their memory
with SGLang's ``/release_memory_occupation`` and got it back, zero-filled, with
``/resume_memory_occupation``; ``set_memory``). Whether the policy has towers at all is read
from the model's structure (``posttrain.models.has_towers``; their names from
``tower_parameter_names``), never from a separate flag, so the condition cannot go dead in a
refactor. Adapter training never changes the base: after an offload cycle each engine reloads
it, towers included, from the checkpoint (``/update_weights_from_disk`` with
``SyncTarget.base_model_path``), then takes the adapter as usual (adapters survive an offload).

Lost engines: one that cannot be reached (its connection refused or reset, or no reply within
the target's timeout: an engine that died or froze) is *lost*, not fatal, as long as another
engine took the weights. The fleet logs a warning naming it, counts it in
``sync_engines_lost``, stops pushing to it and deregisters it from sgl-router (when the run
knows the router, ``router_url``: ``DELETE /workers/{id}`` through session-router's
``RouterHandle``), so no rollout turn reaches it even when sgl-router's own health checks find
it healthy again. At every later sync it asks each lost engine for ``/health`` with a short,
bounded timeout (``answering``, all at once); one that answers gets the current weights the way
an engine after an offload cycle gets them (full weights with the frozen towers, in a group
formed anew with it; or a base reload from the checkpoint and then the adapter), and only once
that push succeeded is it registered with the router again and counted back
(``sync_engines_readmitted``). A re-admission push that fails leaves the engine lost (a warning;
tried again at the next sync), never fails the step. Without a router URL the fleet still
re-syncs an engine that answers again; in full-weight training ``screen`` leaves out of a step
every sample any turn of which an engine produced at another weight version than the trainer's
(``is_stale``; ``stale_samples``). An adapter push does not change an engine's weight version,
so in LoRA training the router is what keeps a stale engine out. Every other failure (a refused
adapter, a checksum mismatch, a stale version) still fails the step, and so does losing every
engine.

A step's samples (``screen``, rank 0, before the rewards): an engine that froze leaves a turn
with no reply within ``turn_timeout_s``, which comes back as an ``aborted`` sample, and that
sample is *left out of the step*: no reward, no advantage, no loss tokens, and its group is
normalized over the samples that completed. (Not a zero advantage: an aborted sample has no
tokens to carry one, and counting it in the group would shift the others' baseline with a reward
nobody earned.) An engine that died mid-rollout costs nothing here: sgl-router retries its
requests on another engine, and the session router commits each turn once, so no sample counts
twice. In full-weight training a sample any turn of which an engine produced at another weight
version than the trainer's is left out as well (``is_stale``). A warning names each sample left
out (the loop counts them in ``aborted_samples`` and ``stale_samples``); a step where every
sample is left out fails with a named error.

Besides engine URLs, a ``SyncTarget`` may hold in-process ``WeightSink``s (the interface
Protocol: a user's own engine): each gets the same tensors through ``update_weights``, the
adapter with its name and PEFT config, full weights as they are; one that raises fails the step
with an error naming it.

Departure from a colocated GPU sync: no pause/flush here, because the loop never syncs while a
rollout is in flight (a step's rollouts finish before training starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
import torch.distributed as dist

from posttrain.formats import (
    DEFAULT_GROUP_NAME,
    EngineClient,
    UpdateWeightFromDiskReq,
    WeightUpdateGroup,
    atomic_directory,
    tensor_update_requests,
    write_safetensors,
)
from posttrain.grpo._controller import run_on_rank0
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.backend import Policy, SyncOccasion
from posttrain.interface import (
    ABORT_REASON_KEY,
    SESSION_ID_KEY,
    WEIGHT_VERSIONS_KEY,
    Sample,
    SampleStatus,
    TransportError,
    WeightSink,
    WeightSyncError,
    parse_weight_version,
)
from posttrain.lora import AdapterClient
from posttrain.models import has_towers, tower_parameter_names
from posttrain.quant_convert import (
    QuantConvertError,
    QuantPolicy,
    quantize_named_params,
    read_input_scales,
)
from posttrain.session_router import RouterHandle

__all__ = [
    "EngineFleet",
    "Screened",
    "SyncResult",
    "SyncTarget",
    "is_stale",
    "push_each",
    "towers_due",
    "turn_versions",
    "unreachable",
]

_log = logging.getLogger("posttrain.grpo")
T = TypeVar("T")
PROBE_TIMEOUT_S = 2.0  # the most one lost engine's /health may take, per sync
HEALTH_TIMEOUT_S = 10.0  # the most a live engine's /health may take before a group forms
ROUTER_TIMEOUT_S = 30.0  # one sgl-router worker registration or removal, at most


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


def turn_versions(sample: Sample) -> list[int | None]:
    """The engine weight version of each turn of ``sample`` (the session router's
    ``WEIGHT_VERSIONS_KEY``), or the sample's own when it has no per-turn list."""
    per_turn = sample.metadata.get(WEIGHT_VERSIONS_KEY)
    if isinstance(per_turn, list) and per_turn:
        return [v if isinstance(v, int) else None for v in per_turn]
    return [sample.weight_version]


def is_stale(sample: Sample, version: int) -> bool:
    """Whether an engine at another weight version than ``version`` produced a turn of
    ``sample`` (sampled from weights the trainer no longer holds); a turn with no reported
    version counts as current."""
    return any(v is not None and v != version for v in turn_versions(sample))


@dataclass(frozen=True, kw_only=True, slots=True)
class Screened:
    """A step's samples after the engines' faults (``EngineFleet.screen``): those to train on,
    the aborted ones, and those an engine produced at another weight version (``None``: not
    checked, as in adapter training)."""

    kept: list[Sample]
    aborted: tuple[Sample, ...] = ()
    stale: tuple[Sample, ...] | None = None


def _leave_out(
    samples: list[Sample],
    step: int,
    is_out: Callable[[Sample], bool],
    *,
    what: str,
    every: str,
    describe: Callable[[Sample], str],
) -> tuple[list[Sample], list[Sample]]:
    """(the samples to keep, those ``is_out``); a warning names each one left out, and a step
    where every sample is left out is a ``GrpoRunError``."""
    kept = [s for s in samples if not is_out(s)]
    out = [s for s in samples if is_out(s)]
    if not out:
        return kept, out
    named = "; ".join(
        f"prompt {s.metadata.get('prompt_index')} sample {s.index} {describe(s)}" for s in out
    )
    if not kept:
        raise GrpoRunError(f"every one of the {len(out)} samples {every}: {named}")
    _log.warning(
        "step %d: %d of %d samples %s, left out of the step: %s",
        step, len(out), len(samples), what, named,
    )  # fmt: skip
    return kept, out


def _lead() -> bool:
    """Whether this process talks to the engines: rank 0 (or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _decided_on_lead(compute: Callable[[], T], *, when: str | None = None) -> T:
    """``compute()`` on rank 0, its result on every rank (``run_on_rank0``); a
    ``GrpoRunError`` there is raised on every rank prefixed with ``when``."""

    def decide() -> T:
        try:
            return compute()
        except GrpoRunError as exc:
            if when is None:
                raise
            raise GrpoRunError(f"{when}: {exc}") from exc

    return run_on_rank0(decide, group=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Reached:
    """What rank 0's push reached, for every rank: the bytes it sent, the live engines it could
    not reach (``(url, why)``), the lost ones it re-admitted and those it could not."""

    sent_bytes: float = 0.0
    lost: tuple[tuple[str, str], ...] = ()
    readmitted: tuple[str, ...] = ()
    readmit_failed: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class _Outgoing:
    """One sync's tensors on rank 0: for the live engines, and for the re-admitted ones (the
    towers included where the model has them)."""

    version: int
    tensors: dict[str, torch.Tensor]
    readmit_tensors: dict[str, torch.Tensor]
    readmit: tuple[str, ...]
    reload_base: bool


class EngineFleet:
    """The engines of a run (see the module docstring); create it on every trainer rank with
    the same arguments, and ``close`` it at the end of the run (rank 0 destroys the update
    group and closes its clients)."""

    def __init__(
        self,
        target: SyncTarget,
        *,
        router_url: str | None = None,
        readmit_lost: bool = True,
    ) -> None:
        self.target = target
        self.router_url = router_url
        self.readmit_lost = readmit_lost
        self.engine_urls: tuple[str, ...] = tuple(target.engine_urls)  # the live engines
        self.lost: tuple[str, ...] = ()  # out of syncs and the router until re-admitted
        self.versions: dict[str, int] = {}  # the weight version each engine last took
        self._clients: dict[str, EngineClient] = {}
        self._adapters: dict[str, AdapterClient] = {}
        self._group: WeightUpdateGroup | None = None
        self._scales: dict[str, torch.Tensor] | None = None  # NVFP4: the served input_scales

    def __enter__(self) -> EngineFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Destroy the update group on its engines (those still live) and close every client."""
        group = self._group
        self._drop_group(
            leave_out=[u for u in group.urls if u not in self.engine_urls] if group else ()
        )
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._adapters.clear()

    # --- one client per engine ------------------------------------------------------------

    def client(self, url: str) -> EngineClient:
        """The engine's one client (made on first use)."""
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = EngineClient(
                url,
                api_key=self.target.api_key,
                timeout_s=self.target.timeout_s,
                transport=self.target.transport,
            )
        return client

    def adapter_client(self, url: str) -> AdapterClient:
        """lora-core's adapter client for the engine, on the engine's one connection."""
        adapters = self._adapters.get(url)
        if adapters is None:
            client = self.client(url)
            adapters = self._adapters[url] = AdapterClient(client.base_url, http=client.http)
        return adapters

    def weight_version(self, url: str) -> int:
        """An engine's current weight version (0 before any versioned update); an engine that
        cannot answer, or reports something that is not a weight version, is a
        ``GrpoRunError`` naming it."""
        try:
            reply = self.client(url).get("/model_info")
            version = parse_weight_version(reply.get("weight_version"))
        except (TransportError, WeightSyncError, ValueError) as exc:  # EngineError, wire errors
            raise GrpoRunError(f"weight sync: {url}/model_info: {exc}") from exc
        return version or 0

    def answers(self, url: str, *, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        """Whether the engine answers ``/health`` within ``timeout_s`` (capped at the
        target's timeout)."""
        try:
            self.client(url).get("/health", timeout_s=min(timeout_s, self.target.timeout_s))
        except (TransportError, WeightSyncError):  # EngineError: refused or unreachable
            return False
        return True

    def answering(self, urls: Sequence[str]) -> list[str]:
        """The engines of ``urls`` whose ``/health`` answers within ``PROBE_TIMEOUT_S``, in the
        order given; all at once (frozen engines cost that timeout once per sync, not once
        each)."""
        if not urls:
            return []
        with ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
            ok = list(pool.map(lambda url: self.answers(url, timeout_s=PROBE_TIMEOUT_S), urls))
        return [url for url, up in zip(urls, ok, strict=True) if up]

    # --- a step's samples (rank 0) --------------------------------------------------------

    def screen(
        self, samples: list[Sample], *, step: int, version: int, check_versions: bool
    ) -> Screened:
        """The samples of step ``step`` the trainer (at weight ``version``) can train on: an
        aborted one (a turn with no reply within ``turn_timeout_s``) is left out, and, with
        ``check_versions`` (full-weight training: an adapter push leaves an engine's version as
        it was), so is one any turn of which an engine produced at another weight version (a
        lost engine that came back before it was re-synced). A warning names each sample left
        out; a step that would keep none is a ``GrpoRunError``."""
        kept, aborted = _leave_out(
            samples, step, lambda s: s.status is SampleStatus.ABORTED,
            what="aborted", every="was aborted",
            describe=lambda s: f"(session {s.metadata.get(SESSION_ID_KEY)}): "
            f"{s.metadata.get(ABORT_REASON_KEY)}",
        )  # fmt: skip
        if not check_versions:
            return Screened(kept=kept, aborted=tuple(aborted))
        kept, stale = _leave_out(
            kept, step, lambda s: is_stale(s, version),
            what=f"came from an engine not at weight version {version}",
            every=f"came from weights other than version {version}",
            describe=lambda s: f"(engine weight versions {turn_versions(s)})",
        )  # fmt: skip
        return Screened(kept=kept, aborted=tuple(aborted), stale=tuple(stale))

    # --- collective operations ------------------------------------------------------------

    def first_version(self) -> int:
        """One past the highest weight version any engine reports (versions must increase);
        collective: rank 0 asks, every rank gets it (or raises the same error)."""
        highest = _decided_on_lead(
            lambda: max((self.weight_version(u) for u in self.engine_urls), default=0)
        )
        return int(highest) + 1

    def set_memory(self, *, resident: bool, when: str) -> None:
        """Release (``resident=False``) or resume every live engine's memory, SGLang's
        ``/release_memory_occupation`` / ``/resume_memory_occupation`` (all tags); collective.
        An unreachable engine is set aside as a lost one."""
        route = "/resume_memory_occupation" if resident else "/release_memory_occupation"

        def call(url: str) -> None:
            self.client(url).post(route, {"tags": None})

        gone = _decided_on_lead(lambda: push_each(self.engine_urls, call), when=when)
        self._set_aside(tuple((str(u), str(w)) for u, w in gone), when)

    def sync(
        self,
        policy: Policy,
        version: int,
        *,
        first: bool = False,
        engines_resumed: bool = False,
        readmit: Sequence[str] | None = None,
        when: str = "sync",
    ) -> SyncResult:
        """Push the current weights to every live engine at ``version`` (collective; rank 0
        sends), then set aside the engines it could not reach (router deregistration, a warning
        each) and take back the re-admitted ones (router registration).

        ``first``: the run's first sync (the engines may hold other weights than the trainer's);
        ``engines_resumed``: the engines went through an offload/onload cycle since the last
        sync. Either way the frozen towers go too. ``readmit``: the lost engines to re-admit
        (default: those that answer ``/health`` now, when ``readmit_lost``); each gets what a
        resumed engine gets (full weights with the towers, or a base reload and the adapter),
        and a failure there only leaves it lost. ``when`` names the step in warnings and
        errors. Returns, on every rank, ``{"sync_bytes": ..., "sync_towers": 0|1,
        "sync_engines_lost": ..., "sync_engines_readmitted": ...}``, the engines that could not
        be reached and the re-admitted ones.
        """
        if readmit is None:
            # ``lost`` is the same on every rank (each takes it from the sync's result): with
            # none lost there is nothing to probe, and no rank needs rank 0's word on it
            readmit = (
                _decided_on_lead(lambda: self.answering(self.lost))
                if self.readmit_lost and self.lost
                else []
            )
        synced = self._push(
            policy, version, first=first, engines_resumed=engines_resumed, readmit=readmit
        )
        self._set_aside(synced.lost, when)
        self._take_back(synced, when)
        return synced

    def _push(
        self,
        policy: Policy,
        version: int,
        *,
        first: bool,
        engines_resumed: bool,
        readmit: Sequence[str],
    ) -> SyncResult:
        """``sync``'s push; the fleet's membership is left as it is."""
        target = self.target
        readmit = tuple(url for url in readmit if url not in self.engine_urls)
        plan = policy.mode.engine_sync(
            SyncOccasion(
                towers=has_towers(policy.model), first=first, engines_resumed=engines_resumed,
                readmit=bool(readmit), disk=target.weight_sync == "disk",
                live_engines=bool(self.engine_urls),
            )
        )  # fmt: skip
        reload_base, with_towers, gather_towers = (
            plan.reload_base,
            plan.with_towers,
            plan.gather_towers,
        )
        if plan.needs_base and target.base_model_path is None:
            raise GrpoRunError(
                "weight sync: the engines were resumed after an offload (or a lost engine is "
                "re-admitted), but SyncTarget.base_model_path is unset, so their base weights "
                "(and towers) cannot be reloaded"
            )
        tensors = policy.backend.export_weights(policy)  # collective
        if plan.peft_config is None and dist.get_rank() == 0:
            # Only rank 0 sends, so only rank 0 converts (and, for NVFP4 rollouts, quantizes).
            tensors = _engine_tensors(
                tensors, policy, target, with_towers=gather_towers, scales=self._input_scales()
            )
        readmit_tensors = tensors  # with the towers where the model has them (full training)
        if gather_towers and not with_towers:
            tensors = _without_towers(tensors, policy)

        def push() -> _Reached:  # rank 0; every rank gets what it reached, or its error
            update = _Outgoing(
                version=version, tensors=tensors, readmit_tensors=readmit_tensors,
                readmit=tuple(readmit), reload_base=reload_base,
            )  # fmt: skip
            try:
                if plan.peft_config is not None:
                    reached = self._push_adapters(plan.peft_config, update)
                else:
                    reached = self._push_full(update)
                for sink in target.sinks:
                    _push_to_sink(sink, plan.peft_config, target, tensors, version)
            except GrpoRunError:
                raise
            except Exception as exc:
                where = [*self.engine_urls, *(type(s).__name__ for s in target.sinks)]
                raise GrpoRunError(f"weight sync to {where}: {type(exc).__name__}: {exc}") from exc
            sent = float(sum(t.numel() * t.element_size() for t in tensors.values()))
            return dataclasses.replace(reached, sent_bytes=sent)

        reached = run_on_rank0(push, group=None)
        return SyncResult(
            metrics={
                "sync_bytes": reached.sent_bytes,
                "sync_towers": float(with_towers),
                "sync_engines_lost": float(len(reached.lost)),
                "sync_engines_readmitted": float(len(reached.readmitted)),
            },
            lost=reached.lost,
            readmitted=reached.readmitted,
            readmit_failed=reached.readmit_failed,
        )

    # --- rank 0: the pushes ---------------------------------------------------------------

    def _push_adapters(self, config: dict[str, Any], update: _Outgoing) -> _Reached:
        """The adapter (PEFT ``config``) to every live engine, then to each re-admitted one
        (after a base reload)."""
        target, version = self.target, update.version

        def push(url: str, tensors: dict[str, torch.Tensor], *, reload: bool) -> None:
            if reload:
                self._reload_base(url)
            adapters = self.adapter_client(url)
            if target.lora_sync == "disk":
                path = _write_sync_adapter(target, tensors, config, version)
                adapters.unload(target.lora_name)
                adapters.load_from_path(target.lora_name, path)
            else:
                adapters.push(target.lora_name, tensors, config)
            self.versions[url] = version

        lost = push_each(
            self.engine_urls, lambda url: push(url, update.tensors, reload=update.reload_base)
        )
        readmitted: list[str] = []
        failed: list[tuple[str, str]] = []
        for url in update.readmit:  # after the live engines: a slow one never delays them
            try:
                push(url, update.readmit_tensors, reload=True)
            except Exception as exc:  # it stays lost; the next sync tries again
                failed.append((url, f"{type(exc).__name__}: {exc}"))
            else:
                readmitted.append(url)
        return _Reached(
            lost=tuple(lost), readmitted=tuple(readmitted), readmit_failed=tuple(failed)
        )

    def _push_full(self, update: _Outgoing) -> _Reached:
        """Full weights to the live engines that answer ``/health``, and to the re-admitted
        ones (in one group formed anew with them, the towers going to every engine)."""
        urls = self.engine_urls
        live = [url for url in urls if self.answers(url)]
        lost = [(url, "no answer to /health") for url in urls if url not in live]
        if urls and not live:
            raise GrpoRunError(f"weight sync: no engine could be reached ({list(urls)})")
        if update.reload_base:
            for url in live:
                self._reload_base(url)
        if not update.readmit:
            self._send(live, update.tensors, update.version)
            return _Reached(lost=tuple(lost))
        try:  # in a group formed anew: a re-admitted engine never reuses one from before
            self._send(
                [*live, *update.readmit], update.readmit_tensors, update.version, reform=True
            )
        except Exception as exc:  # without them, then: a re-admission never fails the step
            why = f"{type(exc).__name__}: {exc}"
            self._send(live, update.tensors, update.version)
            return _Reached(
                lost=tuple(lost), readmit_failed=tuple((u, why) for u in update.readmit)
            )
        return _Reached(lost=tuple(lost), readmitted=update.readmit)

    def _send(
        self,
        urls: Sequence[str],
        tensors: dict[str, torch.Tensor],
        version: int,
        *,
        reform: bool = False,
    ) -> None:
        """One full update to ``urls``: a checkpoint read from disk, or through the update
        group (formed anew when its members are not ``urls``, or after a failed update; the
        old one destroyed on those of its engines that stay, as one that left may be frozen
        and would only cost a timeout)."""
        target = self.target
        if target.weight_sync == "disk":
            path = _write_sync_checkpoint(target, tensors, version)
            body = UpdateWeightFromDiskReq(model_path=path, weight_version=str(version))
            for url in urls:
                self.client(url).post("/update_weights_from_disk", body)
                self.versions[url] = version
            return
        if not urls:
            return
        if target.weight_sync == "tensor":
            self._send_handles(urls, tensors, version)
            return
        group = self._group
        if reform or group is None or not group.usable or group.urls != tuple(urls):
            self._drop_group(leave_out=[u for u in group.urls if u not in urls] if group else ())
            for url in urls:
                if group is None or url not in group.urls:  # it may hold one from before
                    self._leave_stale_group(url)
            group = self._group = WeightUpdateGroup.form(
                [self.client(url) for url in urls],
                backend=target.weight_sync_backend,
                master_address=target.weight_sync_address,
                timeout_s=target.timeout_s,
            )
        try:
            group.push(
                list(tensors.items()), weight_version=version, bucket_bytes=target.bucket_bytes
            )
        except BaseException:
            self._drop_group()  # ends the update on every engine it began on
            raise
        for url in urls:
            self.versions[url] = version

    def _send_handles(
        self, urls: Sequence[str], tensors: dict[str, torch.Tensor], version: int
    ) -> None:
        """Colocated engines (``weight_sync=tensor``): each bucket flattened into one tensor on
        the trainer's GPU and handed over as a CUDA IPC handle in SGLang's
        ``/update_weights_from_tensor`` body; the engine maps the trainer's memory, so the
        buckets stay alive here until every engine answered."""
        device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        if device is None:
            raise GrpoRunError(
                "weight sync: --weight-sync tensor hands colocated engines CUDA IPC handles to "
                "the trainer's GPU memory, and this trainer has no GPU; use --weight-sync "
                "distributed (or disk)"
            )
        on_gpu = [(n, t.detach().to(device)) for n, t in tensors.items()]
        requests, held = tensor_update_requests(
            on_gpu, weight_version=version, bucket_bytes=self.target.bucket_bytes
        )
        torch.cuda.synchronize(device)  # the copies are done before an engine maps them
        for url in urls:
            for request in requests:
                self.client(url).post("/update_weights_from_tensor", request)
            self.versions[url] = version
        del held

    def _drop_group(self, *, leave_out: Sequence[str] = ()) -> None:
        """Destroy the update group (on its engines but ``leave_out``), if one is formed."""
        group, self._group = self._group, None
        if group is not None:
            group.close(leave_out=leave_out)

    def _leave_stale_group(self, url: str) -> None:
        """Best effort: an engine joining a group may still hold one of an earlier formation
        (it was lost while in it); have it leave that one first."""
        if not self.versions.get(url):  # it never took an update here: it holds none of ours
            return
        with contextlib.suppress(TransportError, WeightSyncError):  # EngineError: it held none
            self.client(url).post(
                "/destroy_weights_update_group",
                {"group_name": DEFAULT_GROUP_NAME},
                timeout_s=min(HEALTH_TIMEOUT_S, self.target.timeout_s),
            )

    def _input_scales(self) -> dict[str, torch.Tensor]:
        """NVFP4 rollouts: the served checkpoint's ``input_scale`` tensors (read once), which
        every update carries again; none otherwise."""
        if self.target.rollout_quant != "nvfp4":
            return {}
        if self._scales is None:
            if self.target.base_model_path is None:
                raise GrpoRunError(
                    "weight sync: --rollout-quant nvfp4 needs the served checkpoint "
                    "(SyncTarget.base_model_path) to read its input_scale tensors"
                )
            try:
                self._scales = read_input_scales(self.target.base_model_path)
            except QuantConvertError as exc:
                raise GrpoRunError(f"weight sync: the served NVFP4 checkpoint: {exc}") from exc
        return self._scales

    def _reload_base(self, url: str) -> None:
        """Have the engine reload its base weights (towers included) from the checkpoint, as
        after an offload it holds none (``/update_weights_from_disk``)."""
        body = UpdateWeightFromDiskReq(model_path=str(self.target.base_model_path))
        self.client(url).post("/update_weights_from_disk", body)

    # --- membership -----------------------------------------------------------------------

    def _set_aside(self, gone: Sequence[tuple[str, str]], when: str) -> None:
        """Drop the engines a sync could not reach (every rank got the same list): rank 0 logs
        a warning naming each and, with ``router_url``, deregisters the newly lost ones."""
        if not gone:
            return
        lost = {url for url, _ in gone}
        left = tuple(url for url in self.engine_urls if url not in lost)
        if _lead():
            for url, why in gone:
                _log.warning(
                    "weight sync (%s): engine %s is unreachable (%s); it is left out of later "
                    "syncs, %d of %d engines remain", when, url, why, len(left),
                    len(self.engine_urls),
                )  # fmt: skip
        self.engine_urls = left
        new = tuple(url for url, _ in gone if url not in self.lost)
        if new:
            self._on_router("deregister", new, when)
            self.lost = (*self.lost, *new)

    def _take_back(self, synced: SyncResult, when: str) -> None:
        """Bring back the engines the sync re-admitted (they hold its weights): rank 0
        registers each with sgl-router again (``router_url``), then every rank counts them
        live. Those whose re-admission push failed stay lost (a warning names them)."""
        lead = _lead()
        if lead:
            for url, why in synced.readmit_failed:
                _log.warning("weight sync (%s): lost engine %s answers again but did not take "
                             "the current weights (%s); it stays out", when, url, why)  # fmt: skip
        if not synced.readmitted:
            return
        self._on_router("register", synced.readmitted, when)
        back = tuple(url for url in synced.readmitted if url not in self.engine_urls)
        if lead:
            for url in back:
                _log.warning("weight sync (%s): lost engine %s answers again and took the "
                             "current weights; it is re-admitted", when, url)  # fmt: skip
        self.engine_urls = (*self.engine_urls, *back)
        self.lost = tuple(url for url in self.lost if url not in synced.readmitted)

    def _on_router(self, action: str, urls: Sequence[str], when: str) -> None:
        """Rank 0 registers or deregisters each engine with the run's sgl-router (when it
        knows one); a router that fails fails the step on every rank."""
        router_url = self.router_url
        if router_url is None:  # every rank knows: nothing to do, nothing to broadcast
            return

        def apply() -> None:
            for url in urls:
                (register if action == "register" else deregister)(
                    router_url, url, timeout_s=ROUTER_TIMEOUT_S
                )

        _decided_on_lead(apply, when=when)


def deregister(router_url: str, url: str, *, timeout_s: float) -> None:
    """Remove engine ``url`` from the sgl-router at ``router_url`` (nothing to do when it is
    not registered); a router that fails is a ``GrpoRunError`` naming both."""
    _router_membership(router_url, url, member=False, timeout_s=timeout_s)


def register(router_url: str, url: str, *, timeout_s: float) -> None:
    """Register engine ``url`` with the sgl-router at ``router_url`` again and wait until the
    router lists it healthy; a router that fails is a ``GrpoRunError`` naming both."""
    _router_membership(router_url, url, member=True, timeout_s=timeout_s)


def _router_membership(router_url: str, url: str, *, member: bool, timeout_s: float) -> None:
    with RouterHandle(router_url, timeout_s=timeout_s) as router:
        try:
            listed = url.rstrip("/") in router.workers()
            if member and not listed:
                router.add_worker(url, timeout_s=timeout_s)
            elif listed and not member:
                router.remove_worker(url, timeout_s=timeout_s)
        except Exception as exc:  # RouterStartError, httpx errors: the router failed
            what = (
                f"registering re-admitted engine {url} with"
                if member
                else f"deregistering lost engine {url} from"
            )
            raise GrpoRunError(f"{what} router {router_url}: {type(exc).__name__}: {exc}") from exc


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


def _push_to_sink(
    sink: WeightSink,
    lora_config: dict[str, Any] | None,
    target: SyncTarget,
    tensors: dict[str, torch.Tensor],
    version: int,
) -> None:
    """``tensors`` to ``sink``: an adapter with its PEFT ``lora_config``, or full weights."""
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
    tensors: dict[str, torch.Tensor],
    policy: Policy,
    target: SyncTarget,
    *,
    with_towers: bool,
    scales: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The HF-named tensors an engine loads (the frozen towers only ``with_towers``); for
    NVFP4 rollouts, each NVFP4-selected weight is replaced by its packed NVFP4 tensors (uint8
    codes, fp8 ``weight_scale``, ``weight_scale_2``, and the served checkpoint's ``input_scale``
    from ``scales``) under the converted checkpoint's names and shapes, what an SGLang
    ``modelopt_fp4`` engine loads (the local engine dequantizes them)."""
    if not with_towers:
        tensors = _without_towers(tensors, policy)
    if target.rollout_quant != "nvfp4":
        return tensors
    return dict(
        quantize_named_params(
            tensors.items(),
            num_layers=policy.model.config.num_hidden_layers,
            policy=QuantPolicy(num_layers_at_end_in_bf16=0),
            input_scales=scales,
        )
    )


def _without_towers(tensors: dict[str, torch.Tensor], policy: Policy) -> dict[str, torch.Tensor]:
    """``tensors`` less the frozen towers' (by ``tower_parameter_names``)."""
    towers = set(tower_parameter_names(policy.model))
    return {name: t for name, t in tensors.items() if name not in towers}
