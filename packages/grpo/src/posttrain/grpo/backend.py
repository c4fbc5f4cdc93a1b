"""The trainer-backend seam: what a training backend does, and the policy it does it on.

``TrainerBackend`` is the Protocol the loop, the checkpoints and the weight sync call: build
the policy on this rank, set the rules one step on a rank's samples runs under
(``StepRules``: the step itself is ``posttrain.grpo.step``), export the weights (or the
adapter) for the engines, save and load a checkpoint, and answer the
questions the CLI and the model gate ask. Its implementations are ``fsdp``
(``posttrain.grpo.fsdp_backend``: FSDP2/HSDP, context parallel) and ``megatron``
(``posttrain.grpo.megatron.backend``: tensor / sequence / expert parallel); the loop picks one
by name (``posttrain.grpo.trainer.backend_for``) and never asks which it runs on.

Full versus adapter training is data of the policy, ``Policy.mode``: ``FullTraining`` (every
parameter trains; a frozen copy is the KL reference) or ``AdapterTraining`` (lora-core factors
train; the base with the adapter disabled is the reference). The modes answer what differs:
which parameters train, what the reference model is, what the engines are sent (the PEFT
config; whether the towers go and the base must be reloaded: ``engine_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.fsdp_mesh import CheckpointMeta, FsdpMesh
from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.batch import TrainSample
from posttrain.grpo.config import Backend, GrpoConfig
from posttrain.lora import (
    LoraConfig,
    LoraHandle,
    export_adapter,
    load_peft,
    lora_grad_norm,
    reduce_lora_grads,
    save_peft,
)
from posttrain.models import DecoderModel, ModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncOccasion:
    """What a weight sync knows when it asks the mode what to send.

    ``towers``: the model has frozen media towers; ``first``: the run's first sync;
    ``engines_resumed``: the engines went through an offload/onload cycle since the last sync;
    ``readmit``: lost engines are re-admitted now; ``disk``: the update is a whole checkpoint on
    disk (towers included); ``live_engines``: the fleet has live engines.
    """

    towers: bool
    first: bool
    engines_resumed: bool
    readmit: bool
    disk: bool
    live_engines: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSync:
    """What one weight sync sends, decided by the training mode.

    ``with_towers``: the frozen media towers go to the live engines; ``gather_towers``: they
    are gathered at all (a re-admitted engine gets them even when the live ones do not);
    ``reload_base``: the live engines reload their base weights first; ``needs_base``: some
    engine reloads its base (``SyncTarget.base_model_path`` must be set); ``peft_config``: the
    adapter's PEFT config (None: full weights go).
    """

    with_towers: bool
    gather_towers: bool
    reload_base: bool
    needs_base: bool
    peft_config: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FullTraining:
    """Every (non-frozen) parameter trains; ``ref_model`` is the frozen KL reference (None:
    no KL loss)."""

    ref_model: DecoderModel | None = None

    @property
    def handle(self) -> None:
        """No LoRA handle (``Policy.lora``)."""
        return None

    def trainable(self, model: DecoderModel) -> list[torch.nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self, model: DecoderModel) -> Iterator[DecoderModel]:
        """The KL reference model (the frozen copy)."""
        assert self.ref_model is not None
        yield self.ref_model

    def engine_sync(self, occasion: SyncOccasion) -> EngineSync:
        """The towers go when the engines may lack them (first sync, resumed engines); a
        re-admitted engine is treated as a resumed one; a disk update carries them always."""
        towers = occasion.towers
        with_towers = towers and (occasion.first or occasion.engines_resumed)
        gather_towers = with_towers or (occasion.readmit and towers)
        if occasion.disk:
            with_towers = gather_towers = towers
        return EngineSync(
            with_towers=with_towers, gather_towers=gather_towers,
            reload_base=False, needs_base=False, peft_config=None,
        )  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterTraining:
    """lora-core factors train (``handle``, built with ``config``; ``target_modules``: the PEFT
    names they adapt); the base model with the adapter disabled is the KL reference."""

    handle: LoraHandle
    config: LoraConfig
    target_modules: list[str]

    def trainable(self, model: DecoderModel) -> list[torch.nn.Parameter]:
        return list(self.handle.parameters())

    @contextlib.contextmanager
    def reference(self, model: DecoderModel) -> Iterator[DecoderModel]:
        """The KL reference model: ``model`` with the adapter disabled."""
        self.handle.set_enabled(False)
        try:
            yield model
        finally:
            self.handle.set_enabled(True)

    def peft_config(self) -> dict[str, Any]:
        return self.config.peft_config(self.target_modules)

    def reduce_gradients(self) -> float:
        """Average the factors' gradients over their groups; returns their global norm."""
        reduce_lora_grads(self.handle)
        return lora_grad_norm(self.handle)

    def export(self) -> dict[str, Tensor]:
        """The full adapter in PEFT names (collective over the LoRA groups; every rank)."""
        return export_adapter(self.handle)

    def save(self, directory: Path, adapter: dict[str, Tensor]) -> None:
        """Write ``adapter`` (``export``'s) as a PEFT directory."""
        save_peft(directory, adapter, self.config, target_modules=self.target_modules)

    def load(self, directory: Path) -> None:
        load_peft(self.handle, directory, strict=True)

    def engine_sync(self, occasion: SyncOccasion) -> EngineSync:
        """The adapter never touches the towers: they come back only with a base reload
        (engines resumed after an offload); a re-admitted engine reloads its base too."""
        resumed = occasion.engines_resumed
        with_towers = resumed and occasion.towers
        return EngineSync(
            with_towers=with_towers, gather_towers=with_towers, reload_base=resumed,
            needs_base=(resumed and occasion.live_engines) or occasion.readmit,
            peft_config=self.peft_config(),
        )  # fmt: skip


TrainMode = FullTraining | AdapterTraining


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRules:
    """What a backend decides about a step (``posttrain.grpo.step`` runs it).

    ``accumulation(n)``: the context over ``n`` micro-batches whose value has ``micro_batch()``
    (FSDP's ``accumulate_gradients``, or ``NoAccumulation.over``); ``loss_scale``: each loss is
    scaled by the number of ranks the gradient is averaged over that hold different samples;
    ``reduce_gradients()``: reduce the trainable gradients, return their global norm;
    ``reports_metrics``: this rank's samples count in the metrics (one rank per group that
    shares samples); ``chunked_logprobs``: logprobs and entropies from the hidden states chunk
    by chunk (no [T, vocab] logits).
    """

    accumulation: Callable[[int], contextlib.AbstractContextManager[Any]]
    loss_scale: int
    reduce_gradients: Callable[[], float]
    reports_metrics: bool = True
    chunked_logprobs: bool = False


class NoAccumulation:
    """Gradients simply add up over micro-batches (they are reduced once, after the last)."""

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        yield

    @staticmethod
    def over(num_micro_batches: int) -> contextlib.AbstractContextManager[NoAccumulation]:
        return contextlib.nullcontext(NoAccumulation())


@dataclass(frozen=True, slots=True, kw_only=True)
class DataContextParallel:
    """This rank's place in the data-parallel x context-parallel split of the world."""

    cp_group: dist.ProcessGroup | None
    cp_size: int
    dp_rank: int
    dp_size: int


def data_context_parallel(cp_size: int) -> DataContextParallel:
    """Split the world into ``world / cp_size`` CP groups of consecutive ranks; collective.

    Every rank creates every group (``dist.new_group`` is collective over the world) and keeps
    its own. ``cp_size == 1`` creates none: each rank is its own data-parallel rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise GrpoConfigError(
            f"context_parallel_size must be an int >= 1, got {cp_size!r}",
            field="context_parallel_size",
        )
    if world % cp_size:
        raise GrpoConfigError(
            f"context_parallel_size={cp_size} does not divide the world size {world}",
            field="context_parallel_size",
        )
    if cp_size == 1:
        return DataContextParallel(cp_group=None, cp_size=1, dp_rank=rank, dp_size=world)
    mine: dist.ProcessGroup | None = None
    for start in range(0, world, cp_size):
        group = dist.new_group(list(range(start, start + cp_size)))
        if start <= rank < start + cp_size:
            mine = group
    return DataContextParallel(
        cp_group=mine, cp_size=cp_size, dp_rank=rank // cp_size, dp_size=world // cp_size
    )


@dataclass(kw_only=True, slots=True)
class Policy:
    """The model on this rank, its optimizer, its training mode and the backend that built it."""

    model: DecoderModel
    mesh: FsdpMesh
    optimizer: torch.optim.Optimizer
    backend: TrainerBackend
    mode: TrainMode
    parallel: DataContextParallel | None = None

    @property
    def lora(self) -> LoraHandle | None:
        """The LoRA handle in adapter training, None in full training: for tests and tools
        that inspect the factors; the trainer itself asks ``mode``, never branches on this."""
        return self.mode.handle

    @property
    def cp_size(self) -> int:
        return 1 if self.parallel is None else self.parallel.cp_size

    def data_parallel_share(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """This rank's samples of a step: a strided split over the data-parallel ranks only
        (every rank of one context-parallel group gets the same samples)."""
        if self.parallel is None:
            return list(samples[dist.get_rank() :: dist.get_world_size()])
        return list(samples[self.parallel.dp_rank :: self.parallel.dp_size])

    def trainable(self) -> list[torch.nn.Parameter]:
        return self.mode.trainable(self.model)


class TrainerBackend(Protocol):
    """A training backend: builds the policy and runs everything on it that depends on how the
    model is split over the ranks. Every method but the questions is collective."""

    @property
    def name(self) -> Backend: ...

    def preload(self) -> None:
        """Import what the backend needs once, in the parent, before the ranks are forked."""

    def check_model(self, cfg: GrpoConfig, model: ModelConfig, location: str) -> None:
        """Refuse a ``--model-path`` this backend cannot build (``GrpoConfigError``)."""

    def describe_ranks(self, cfg: GrpoConfig, world: int) -> str:
        """How ``world`` trainer ranks split the model (``--dry-run`` prints it)."""

    def build_policy(self, cfg: GrpoConfig) -> Policy:
        """Load, split and (``cfg.train == "lora"``) adapt the policy on this rank (CPU)."""

    def step_rules(self, policy: Policy) -> StepRules:
        """The rules one step on a rank's samples runs under (``posttrain.grpo.step``:
        ``compute_gradients``, ``train_step``): accumulation, loss scale, reduction."""

    def export_weights(self, policy: Policy) -> dict[str, Tensor]:
        """What the engines load: the adapter (PEFT names, every rank) or the full weights in
        HF names (rank 0; the others get ``{}``)."""

    def save_checkpoint(self, root: Path, step: int, policy: Policy, extra: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` under ``root``; returns its directory."""

    def load_checkpoint(self, path: Path, policy: Policy, meta: CheckpointMeta) -> None:
        """Restore the checkpoint at ``path`` (verified; ``meta``: its ``meta.json``) into the
        live policy: weights, optimizer and the RNG states this backend restores."""
