"""The engine core: generation tasks, logprob layouts, weights, adapters and versions.

Everything here is synchronous and runs on the scheduler's single worker thread
(generation, weight commits) or under the update lock (bucket staging), so the
model's weights never change in the middle of a request. The HTTP layer turns
JSON into ``GenTask`` and ``GenResult`` back into SGLang's ``meta_info``.

Logprob layout (SGLang's): input lists cover absolute positions
``logprob_start_len .. P-1``; the entry for position ``i`` is
``log p(x_i | x_<i)`` from the full-vocabulary log-softmax, and null at ``i = 0``
(nothing predicts the first token). Output lists have one entry per generated
token. Per-position id scoring (``token_ids_logprob_positions``) returns, at
input position ``i``, the logprobs of the ids listed for ``i`` (null for an
empty list), which equals the flat form restricted to those ids.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.formats import NVFP4FormatError, dequantize_nvfp4_state_dict, tensors_sha256
from posttrain.interface import (
    IncompleteUpdateError,
    WireFormatError,
)
from posttrain.local_engine._errors import UnavailableError, UpdateSessionError
from posttrain.local_engine._lora import (
    LoraAdapter,
    LoraRegistry,
    adapter_from_tensors,
)
from posttrain.local_engine._sampling import SamplingConfig, pick_tokens, top_logprobs
from posttrain.local_engine._update import StagedUpdate, TensorSpec, check_version_increases
from posttrain.models import DecoderModel, KVCache, MediaBatch, tower_parameter_names
from posttrain.models import LoraAdapter as ModelLora

__all__ = ["Engine", "GenResult", "GenTask"]


@dataclass(slots=True, kw_only=True)
class GenTask:
    """One prompt to complete (or score), validated."""

    input_ids: list[int]
    """The prompt, media sentinels already expanded into their placeholder runs."""
    max_new_tokens: int
    sampling: SamplingConfig
    seed: int
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    token_ids_logprob_positions: list[list[int]] | None = None
    lora_name: str | None = None
    rid: str = ""
    media: MediaBatch | None = None
    """Placeholder runs of ``input_ids`` and their decoded items (``expand_media_tokens``)."""


@dataclass(slots=True, kw_only=True)
class GenResult:
    """A finished task: ids, finish reason and the logprob lists (None when not asked)."""

    rid: str
    output_ids: list[int]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: int | None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    output_token_logprobs: list[tuple[float, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    trim_chars: int = 0
    latency_s: float = 0.0


def _ids_logprobs(row: torch.Tensor, ids: Sequence[int]) -> list[tuple[float, int]]:
    return [(float(row[i].item()), int(i)) for i in ids]


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""Tags of ``release/resume_memory_occupation`` (SGLang's names; None = all). ``cuda_graph``
is accepted for SGLang clients and frees nothing here (no CUDA graphs on CPU); ``kv_cache``
drops the KV cache kept between batches (the next batch allocates it again), and while it is
released nothing generates, as in SGLang."""


@dataclass(slots=True)
class _WeightState:
    version: int | None = None
    unavailable: str | None = None
    history: list[str] = field(default_factory=list)
    released: set[str] = field(default_factory=set)
    """Memory tags released and not yet resumed."""
    stale: set[str] = field(default_factory=set)
    """Base tensors (HF names) whose values were dropped by a release and not sent since."""


def shared_prefill_owners(tasks: Sequence[GenTask]) -> list[int]:
    """For each task, the index of the first task with the same prompt and adapter (itself if
    none before it); a task with media never shares (its placeholders carry decoded items)."""
    first: dict[tuple[tuple[int, ...], str | None], int] = {}
    owners = []
    for j, t in enumerate(tasks):
        owners.append(
            j if t.media is not None else first.setdefault((tuple(t.input_ids), t.lora_name), j)
        )
    return owners


@dataclass(slots=True, kw_only=True)
class _Live:
    """A task in the running batch: its result so far, sampler and next-token logprobs."""

    handle: object
    task: GenTask
    res: GenResult
    gen: torch.Generator
    stops: set[int]
    limit: int
    lora: ModelLora | None
    started: float
    next_lp: torch.Tensor | None = None
    prompt_lp: torch.Tensor | None = None


def _pick(lives: Sequence[_Live]) -> list[int]:
    """The next token of each of ``lives``, chosen together (``pick_tokens``: each from its own
    seeded generator, the token ``pick_token`` would choose for it alone)."""
    rows = []
    for lv in lives:
        assert lv.next_lp is not None
        rows.append(lv.next_lp)
    return pick_tokens(rows, [lv.task.sampling for lv in lives], [lv.gen for lv in lives])


class Engine:
    """One served model: generation, versioned weights and named adapters."""

    def __init__(
        self,
        model: DecoderModel,
        *,
        eos_token_ids: Sequence[int] = (),
        decode_text: Callable[[Sequence[int]], str] | None = None,
        max_loras: int = 8,
    ) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_context = model.config.capacity
        self.eos_token_ids = tuple(eos_token_ids)
        self.lora_targets = model.lora_targets()
        self._specs = {
            k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in model.hf_state_dict().items()
        }
        self._update_specs = self._specs  # an NVFP4 checkpoint's engine: take_nvfp4_updates
        self.decode_text = decode_text
        self.adapters = LoraRegistry(max_loras=max_loras)
        self._w = _WeightState()
        self._update_lock = threading.Lock()
        self.abort_running = threading.Event()
        self.generated_tokens = 0
        self.forward_passes = 0
        """Model calls of generation (each a batched prefill and/or decode step)."""
        self._cache: KVCache | None = None
        self._dirty_rows: set[int] = set()

    # ---- state -------------------------------------------------------------------------

    @property
    def weight_version(self) -> int | None:
        """The installed version (an int, as everywhere in posttrain); None until the first
        versioned update (SGLang reports ``"default"`` there)."""
        return self._w.version

    @property
    def unavailable_reason(self) -> str | None:
        return self._w.unavailable

    def unserviceable(self) -> str | None:
        """Why the engine cannot generate now (memory released, tensors stale since a resume,
        a failed update), or None when it can: the one rule ``check_available`` and
        ``/server_info``'s ``weights_serviceable`` read."""
        if self._w.released:
            return (
                f"memory released ({sorted(self._w.released)}): call "
                "/resume_memory_occupation, then push the weights again"
            )
        if self._w.stale:
            stale = sorted(self._w.stale)
            return (
                f"weights were released and resumed: {len(stale)} tensor(s) have not been "
                f"re-sent since, e.g. {stale[:3]}; push them (a full update) before generating"
            )
        if self._w.unavailable is not None:
            return (
                f"weights are not serviceable until a full update succeeds: {self._w.unavailable}"
            )
        return None

    def check_available(self) -> None:
        why = self.unserviceable()
        if why is not None:
            raise UnavailableError(why)

    # ---- memory occupation (SGLang's release/resume_memory_occupation) ------------------

    def release_memory(self, tags: Sequence[str] | None) -> list[str]:
        """Drop what ``tags`` name (None = all); worker thread, between batches.

        ``weights``: every base parameter's storage is freed for real (each becomes an
        empty tensor of its dtype; the shapes are kept in ``param_specs``), and the staging
        pool of weight updates too. LoRA adapters stay. Returns the tags now released.
        """
        wanted = self._memory_tags(tags)
        if "kv_cache" in wanted:
            self._cache = None
        if "weights" in wanted and "weights" not in self._w.released:
            with self._update_lock:
                for param in self.model.parameters():
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._w.released |= set(wanted)
        self._w.history.append(f"released {sorted(wanted)}")
        return sorted(self._w.released)

    def resume_memory(self, tags: Sequence[str] | None) -> list[str]:
        """Re-allocate what ``tags`` name (None = all released); worker thread.

        Resumed weights are zero-filled and **not valid**: every base tensor is marked stale
        and generation answers 503 until updates (``/update_weights_from_distributed`` or from disk)
        have sent each of them again, towers included. Returns the tags still released.
        """
        wanted = set(self._memory_tags(tags)) if tags is not None else set(self._w.released)
        if "weights" in wanted and "weights" in self._w.released:
            specs = self._param_shapes()
            for name, param in self.model.named_parameters():
                param.data = torch.zeros(specs[name], dtype=param.dtype, device=param.device)
            self._w.stale = set(self._specs)
        self._w.released -= wanted
        self._w.history.append(f"resumed {sorted(wanted)}")
        return sorted(self._w.released)

    @property
    def released_tags(self) -> list[str]:
        """Memory tags released and not yet resumed."""
        return sorted(self._w.released)

    @property
    def stale_tensors(self) -> list[str]:
        """Base tensors not re-sent since the weights were resumed."""
        return sorted(self._w.stale)

    def _memory_tags(self, tags: Sequence[str] | None) -> list[str]:
        if tags is None:
            return ["kv_cache", "weights"]
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise WireFormatError(
                f"tags: {bad} are not memory tags; use {list(MEMORY_TAGS)}", field="tags"
            )
        return sorted(set(tags))

    def _param_shapes(self) -> dict[str, tuple[int, ...]]:
        from posttrain.models import weight_groups

        return {g.name: g.shape for g in weight_groups(self.model.config)}

    def param_specs(self) -> dict[str, TensorSpec]:
        """HF name -> dtype and shape of every base tensor the model holds."""
        return dict(self._specs)

    def digests(self) -> tuple[str, str | None]:
        """``(weights_sha256, tower_sha256)`` from one conversion to HF names: a digest of
        every base tensor (to compare engines and transports) and of the media towers' tensors
        (``tower_parameter_names``; None without towers), which the trainer computes the same
        way with ``tensors_sha256`` over those names."""
        self._check_resident()
        hf = self.model.hf_state_dict()
        names = tower_parameter_names(self.model)
        towers = tensors_sha256({n: hf[n] for n in names}) if names else None
        return tensors_sha256(hf), towers

    def _check_resident(self) -> None:
        if "weights" in self._w.released:
            raise UnavailableError("weights are released: /resume_memory_occupation first")

    # ---- generation ----------------------------------------------------------------------

    def validate(self, task: GenTask, field_prefix: str) -> None:
        """Reject a task the model cannot run, naming the field (400)."""
        v, ctx = self.vocab_size, self.max_context
        p = len(task.input_ids)
        if p == 0:
            raise WireFormatError(f"{field_prefix}input_ids: empty prompt", field="input_ids")
        bad = next((t for t in task.input_ids if not 0 <= t < v), None)
        if bad is not None:
            raise WireFormatError(
                f"{field_prefix}input_ids: token id {bad} outside the vocabulary [0, {v})",
                field="input_ids",
            )
        if p > ctx or (task.max_new_tokens > 0 and p >= ctx):
            raise WireFormatError(
                f"{field_prefix}input_ids: {p} tokens leave no room in the context of {ctx}",
                field="input_ids",
            )
        for name, ids in (
            ("token_ids_logprob", task.token_ids_logprob or []),
            ("stop_token_ids", sorted(task.stop_token_ids)),
            *(
                (f"token_ids_logprob_positions[{i}]", row)
                for i, row in enumerate(task.token_ids_logprob_positions or [])
            ),
        ):
            bad = next((t for t in ids if not 0 <= t < v), None)
            if bad is not None:
                raise WireFormatError(
                    f"{field_prefix}{name}: token id {bad} outside the vocabulary [0, {v})",
                    field=name,
                )
        rows = task.token_ids_logprob_positions
        if rows is not None and len(rows) != p:
            raise WireFormatError(
                f"{field_prefix}token_ids_logprob_positions: {len(rows)} rows for {p} input "
                "positions",
                field="token_ids_logprob_positions",
            )
        if task.top_logprobs_num > v:
            raise WireFormatError(
                f"{field_prefix}top_logprobs_num: {task.top_logprobs_num} > vocabulary size {v}",
                field="top_logprobs_num",
            )
        if task.logprob_start_len >= p:
            raise WireFormatError(
                f"{field_prefix}logprob_start_len: {task.logprob_start_len} >= prompt length {p}",
                field="logprob_start_len",
            )
        if task.lora_name is not None:
            self.adapters.get(task.lora_name)

    def abort_result(self, task: GenTask) -> GenResult:
        return GenResult(
            rid=task.rid,
            output_ids=[],
            finish_reason={"type": "abort", "message": "generation paused with mode=abort"},
            prompt_tokens=len(task.input_ids),
            weight_version=self.weight_version,
        )

    def run_batch(self, tasks: list[GenTask]) -> list[GenResult]:
        """Generate for all tasks together (``run_stream`` without later admissions)."""
        out: dict[int, GenResult] = {}

        def finish(handle: object, res: GenResult | Exception) -> None:
            assert isinstance(handle, int)
            if isinstance(res, Exception):
                raise res
            out[handle] = res

        self.run_stream(list(enumerate(tasks)), lambda free: [], finish, rows=len(tasks))
        return [out[i] for i in range(len(tasks))]

    def run_stream(
        self,
        first: Sequence[tuple[object, GenTask]],
        admit: Callable[[int], Sequence[tuple[object, GenTask]]],
        finish: Callable[[object, GenResult | Exception], None],
        *,
        rows: int,
    ) -> None:
        """Continuous batching: decode ``first`` and every task ``admit(free_rows)`` hands in
        at a step boundary, in one batch of at most ``rows`` KV rows; ``finish(handle,
        result)`` as each task ends; a task that cannot start (its adapter was unloaded while
        it waited) is finished with the exception, alone. Returns when nothing runs and
        nothing is admitted.

        Each step is one ``extend`` call: the running rows' last tokens and the admitted
        prompts together. Admitted tasks with the same prompt and adapter (no media) share one
        prefill (the ``n`` samples of a prompt): the row is copied to the siblings, which
        equals prefilling each (a row's values do not depend on its batch mates). The strict
        kernels are batch-invariant, so a task's tokens and logprobs do not depend on when it
        joined or on whom it ran with; each task samples from its own seeded generator.
        """
        self.check_available()
        cache = self._kv_cache(rows)
        free = list(range(rows - 1, -1, -1))  # pop() takes the lowest row
        live: dict[int, _Live] = {}
        tokens: dict[int, int] = {}  # running row -> the token its next step appends
        incoming = list(first)
        while live or incoming:
            new_rows = []
            for handle, task in incoming:
                try:
                    started = self._start(handle, task)
                except Exception as exc:  # this task's error, not its batch mates'
                    finish(handle, exc)
                    continue
                row = free.pop()
                live[row] = started
                new_rows.append(row)
            dirty = [r for r in new_rows if r in self._dirty_rows]
            cache.reset_rows(dirty)  # one fill per buffer for every reused row
            self._dirty_rows.difference_update(dirty)
            owner = dict(zip(new_rows, shared_prefill_owners([live[r].task for r in new_rows]),
                             strict=True))  # fmt: skip
            firsts = [r for i, r in enumerate(new_rows) if owner[r] == i]
            call = sorted(tokens) + firsts
            if call:
                media = [None if r in tokens else live[r].task.media for r in call]
                lora = [live[r].lora for r in call]
                self.forward_passes += 1
                steps = self.model.extend(
                    cache,
                    call,
                    [[tokens[r]] if r in tokens else live[r].task.input_ids for r in call],
                    lora=lora if any(x is not None for x in lora) else None,
                    media=media if any(m is not None for m in media) else None,
                )
                for r, step in zip(call, steps, strict=True):
                    live[r].next_lp = step.logprobs[-1]
                    if r not in tokens:
                        self._prefilled(live[r], step.logprobs)
                copies = []  # (source, target): the siblings of a shared prefill
                for r in new_rows:
                    src = new_rows[owner[r]]
                    prompt_lp = live[src].prompt_lp
                    if src != r and prompt_lp is not None:
                        copies.append((src, r))
                        live[r].next_lp = live[src].next_lp
                        self._prefilled(live[r], prompt_lp)
                cache.copy_rows([s for s, _ in copies], [d for _, d in copies])
            tokens = {}
            aborting = self.abort_running.is_set()
            sampling = [] if aborting else [r for r in sorted(live) if live[r].limit > 0]
            picked = dict(zip(sampling, _pick([live[r] for r in sampling]), strict=True))
            for row in sorted(live):
                lv = live[row]
                tok = None
                if lv.limit > 0 and aborting:
                    lv.res.finish_reason = {
                        "type": "abort",
                        "message": "generation paused with mode=abort",
                    }
                elif lv.limit > 0:
                    assert lv.next_lp is not None
                    tok = self._emit(lv.task, lv.res, lv.next_lp, picked[row], lv.stops)
                if tok is not None and len(lv.res.output_ids) < lv.limit:
                    tokens[row] = tok
                    continue
                del live[row]
                free.append(row)
                self._dirty_rows.add(row)
                lv.res.latency_s = time.perf_counter() - lv.started
                self.generated_tokens += len(lv.res.output_ids)
                finish(lv.handle, lv.res)
            incoming = list(admit(len(free))) if free and not self.abort_running.is_set() else []

    def _kv_cache(self, rows: int) -> KVCache:
        """The engine's KV cache, kept between batches (``release_memory('kv_cache')`` drops
        it); reallocated when a batch needs more rows. A row is zeroed before it is reused."""
        if self._cache is None or self._cache.num_rows < rows:
            self._cache = self.model.new_kv_cache(rows)
            self._dirty_rows = set()
        return self._cache

    def _start(self, handle: object, task: GenTask) -> _Live:
        res = GenResult(
            rid=task.rid,
            output_ids=[],
            finish_reason={},
            prompt_tokens=len(task.input_ids),
            weight_version=self.weight_version,
        )
        limit = min(task.max_new_tokens, self.max_context - len(task.input_ids))
        res.finish_reason = {"type": "length", "length": limit}
        stops = set(task.stop_token_ids)
        if not task.ignore_eos:
            stops.update(self.eos_token_ids)
        lora = None if task.lora_name is None else self.adapters.get(task.lora_name).model_adapter
        return _Live(
            handle=handle,
            task=task,
            res=res,
            gen=torch.Generator().manual_seed(task.seed),
            stops=stops,
            limit=limit,
            lora=lora,
            started=time.perf_counter(),
        )

    def _prefilled(self, lv: _Live, prompt_lp: torch.Tensor) -> None:
        lv.prompt_lp = prompt_lp
        task, res = lv.task, lv.res
        if task.return_logprob:
            self._fill_input_logprobs(task, prompt_lp, res)
            res.output_token_logprobs = []
            if task.top_logprobs_num:
                res.output_top_logprobs = []
            if task.token_ids_logprob is not None:
                res.output_token_ids_logprobs = []

    def _emit(
        self,
        task: GenTask,
        res: GenResult,
        row: torch.Tensor,
        tok: int,
        stops: set[int],
    ) -> int | None:
        """Record the sampled token; None when the task has finished with it."""
        res.output_ids.append(tok)
        if task.return_logprob:
            assert res.output_token_logprobs is not None
            res.output_token_logprobs.append((float(row[tok].item()), tok))
            if res.output_top_logprobs is not None:
                res.output_top_logprobs.append(top_logprobs(row, task.top_logprobs_num))
            if res.output_token_ids_logprobs is not None:
                res.output_token_ids_logprobs.append(
                    _ids_logprobs(row, task.token_ids_logprob or [])
                )
        if tok in stops:
            res.finish_reason = {"type": "stop", "matched": tok}
            return None
        if task.stop and self.decode_text is not None:
            text = self.decode_text(res.output_ids)
            hit = next((s for s in task.stop if s in text), None)
            if hit is not None:
                res.finish_reason = {"type": "stop", "matched": hit}
                if not task.no_stop_trim:
                    res.trim_chars = len(text) - text.index(hit)
                return None
        return tok

    def _fill_input_logprobs(self, task: GenTask, prompt_lp: torch.Tensor, res: GenResult) -> None:
        ids = task.input_ids
        p = len(ids)
        start = p - 1 if task.logprob_start_len < 0 else task.logprob_start_len
        positions = range(start, p)
        res.input_token_logprobs = [
            (None if i == 0 else float(prompt_lp[i - 1, ids[i]].item()), ids[i]) for i in positions
        ]
        if task.top_logprobs_num:
            res.input_top_logprobs = [
                None if i == 0 else top_logprobs(prompt_lp[i - 1], task.top_logprobs_num)
                for i in positions
            ]
        if task.token_ids_logprob is not None:
            flat = task.token_ids_logprob
            res.input_token_ids_logprobs = [
                None if i == 0 else _ids_logprobs(prompt_lp[i - 1], flat) for i in positions
            ]
        elif task.token_ids_logprob_positions is not None:
            rows = task.token_ids_logprob_positions
            res.input_token_ids_logprobs = [
                None if i == 0 or not rows[i] else _ids_logprobs(prompt_lp[i - 1], rows[i])
                for i in positions
            ]

    # ---- adapters ------------------------------------------------------------------------

    def put_adapter(self, adapter: LoraAdapter) -> None:
        """Install (or replace) an adapter, already checked: every ``LoraAdapter`` is built by
        ``posttrain.formats``' PEFT checks (names, shapes, finite ``lora_alpha``, no NaN/Inf
        factor), so nothing is scanned again here, where generation may be paused."""
        self.adapters.put(adapter)

    def load_adapter_tensors(
        self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
    ) -> None:
        self.put_adapter(adapter_from_tensors(name, config, tensors, self.lora_targets))

    # ---- weight updates ------------------------------------------------------------------

    def take_nvfp4_updates(self, wire: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        """Served from an NVFP4 checkpoint: updates carry its NVFP4 tensors (packed codes,
        ``weight_scale``, ``weight_scale_2``, ``input_scale``) for the weights it dequantized,
        as an SGLang ``modelopt_fp4`` engine takes them; they are dequantized at commit."""
        modules = {n.rsplit(".", 1)[0] for n in wire}
        specs = {n: s for n, s in self._specs.items() if n.removesuffix(".weight") not in modules}
        specs.update({n: TensorSpec(d, shape) for n, (d, shape) in wire.items()})
        self._update_specs = specs

    def new_update(self) -> StagedUpdate:
        """An empty staging area for a distributed update, against the specs updates carry."""
        if "weights" in self._w.released:
            raise UpdateSessionError(
                "weights are released: /resume_memory_occupation before updating them"
            )
        return StagedUpdate(specs=self._update_specs)

    def served_tensors(self, update: StagedUpdate) -> dict[str, torch.Tensor]:
        """A completed update's tensors as the model holds them: NVFP4 groups dequantized to
        the served dtype (a group missing a part is refused, naming it). Off the worker."""
        if self._update_specs is self._specs:
            return dict(update.staged)
        dtypes = {n: s.dtype for n, s in self._specs.items()}
        try:
            tensors, _ = dequantize_nvfp4_state_dict(update.staged, dtypes=dtypes)
        except NVFP4FormatError as exc:
            raise IncompleteUpdateError(f"NVFP4 update: {exc}") from exc
        return tensors

    def commit_staged(
        self, update: StagedUpdate, version: int | None, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Install a completed update's ``tensors`` (``served_tensors``; worker thread, between
        batches); the version is checked first, so a stale one changes nothing."""
        with self._update_lock:
            if version is not None:
                check_version_increases(self._w.version, version)
            if "weights" in self._w.released:
                raise UpdateSessionError(
                    "the weights were released before the update was installed; "
                    "/resume_memory_occupation, then send it again"
                )
            self.model.load_hf_state_dict(dict(tensors), partial=True)
            self._w.stale -= set(tensors)
            if version is not None:
                self._w.version = version
            self._w.unavailable = None

    def mark_failed(self, why: str) -> None:
        """Refuse to generate (503) until a full update succeeds."""
        self._w.unavailable = why
        self._w.history.append(why)

    def set_weight_version(self, version: int) -> None:
        """``/update_weight_version``: relabel the served weights (the version must increase)."""
        with self._update_lock:
            check_version_increases(self._w.version, version)
            self._w.version = version

    def check_full_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse a full state that is not exactly the served model's (names, dtypes, shapes).

        NaN/Inf is the reader's refusal (``_loader.read_checkpoint`` scans each tensor once).
        Changes nothing; safe to run off the worker thread (``/update_weights_from_disk``
        runs it in a thread so generation continues while a checkpoint is checked).
        """
        specs = self._specs
        missing = sorted(set(specs) - set(tensors))
        unexpected = sorted(set(tensors) - set(specs))
        wrong = sorted(
            n
            for n in set(specs) & set(tensors)
            if tensors[n].dtype != specs[n].dtype or tuple(tensors[n].shape) != specs[n].shape
        )
        if missing or unexpected or wrong:
            raise IncompleteUpdateError(
                f"checkpoint does not match the served model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong dtype/shape {wrong[:5]}"
            )

    def load_full_state(self, tensors: Mapping[str, torch.Tensor], version: int | None) -> None:
        """Replace every base tensor at once (``/update_weights_from_disk``); all or nothing.

        ``tensors`` come from a reader that refused NaN/Inf (``read_checkpoint``) and passed
        ``check_full_state`` (the route runs both in a thread, before it pauses generation).
        A stale version changes nothing and the engine keeps serving. Only a failure while
        the tensors are being copied in, after every check passed, leaves the weights mixed;
        the engine is then marked unavailable (503) until a full update succeeds.
        """
        if version is not None:
            check_version_increases(self._w.version, version)
        if "weights" in self._w.released:
            raise UpdateSessionError(
                "weights are released: /resume_memory_occupation before loading weights"
            )
        try:
            self.model.load_hf_state_dict(dict(tensors))
        except Exception as e:
            self.mark_failed(f"full state load failed midway, weights are mixed: {e}")
            raise
        if version is not None:
            self._w.version = version
        self._w.unavailable = None
        self._w.stale.clear()
