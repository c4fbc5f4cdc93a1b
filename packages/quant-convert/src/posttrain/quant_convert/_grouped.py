"""The grouped live path: a whole bucket of weights through the Triton kernels at once.

Per bucket, whatever the number of weights (``quantize_nvfp4_many`` on CUDA tensors, hence
``quantize_named_params``):

1. host: one table row (int64) per matrix (a 2-D weight is one matrix, a 3-D one ``E``)
   saying where its input lives (relative to one tensor of its launch group, so nothing is
   gathered or copied), its amax slot (a gate/up pair shares one per expert), its tensor's
   non-finite flag slot, where its output goes; one host-to-device copy of the table;
2. one ``torch.zeros`` for the amax bits and flags, one ``torch.empty`` for every output
   byte of the bucket (codes, scales and ``weight_scale_2``, handed out as views);
3. the pre-pass kernel (amax and non-finite flag, one read of the input), one launch per
   group of same-size matrices of one dtype;
4. the quantize kernel, the same launches, reading each global amax from device memory and
   computing the global scales there (no ``.item()``). By default (4-over-6 off) steps 3 and
   4 are pipelined (``run_pipelined``): each group is cut at pair boundaries into stages of
   ``KernelTuning.pipeline_stage_bytes``, and one launch quantizes stage k while it
   pre-passes stage k + 1;
5. one synchronisation: the flags come back; a flagged tensor raises
   :class:`QuantInputError` naming it (only then does anything else look at the input).

The host half of step 1 (table, slots, launch groups) depends only on the bucket's names,
shapes, dtypes, data pointers and pairs: a weight sync sends the same buckets every step, so
it is kept (``_PLANS``, least recently used, keyed on exactly those) and a repeated bucket
costs a dictionary lookup, two allocations and the launches. Inputs that needed a copy
(non-contiguous or misaligned views) are planned afresh each time. ``start_grouped`` returns
the outputs before the synchronisation, so a caller can arrange them while the kernels run.

A kept bucket's next run reads each input once (``run_speculative``): it bets that every
amax equals the last run's (kept on the device), quantizes under the bet while the true
amaxes and flags accumulate, and re-quantizes the matrices whose amax moved. The amaxes come
back with the flags at the one sync; when more than ``SPECULATE_BELOW`` of the bytes moved,
the next run takes steps 3 and 4 instead (a lost bet costs a second quantize).

That betting run is recorded once per kept bucket (``_Replay``; on CUDA a CUDA graph, whose
kernels read the output buffer's address from the device, so each replay writes a buffer of
its own) and replayed: a sync then costs the host one ``torch.empty``, a store to pinned
memory, one graph launch and one event wait for the flags, which the graph lands in pinned
memory itself.

The bytes are those of :func:`posttrain.quant_convert.nvfp4.quantize_nvfp4` on the CPU.
Triton is imported only when a bucket runs (``_nvfp4_triton``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from posttrain.formats import GROUP_SIZE
from posttrain.quant_convert._errors import QuantInputError

if TYPE_CHECKING:
    from posttrain.quant_convert._nvfp4_triton import KernelTuning, OutputsAt
    from posttrain.quant_convert.nvfp4 import NVFP4Config, NVFP4Tensor

__all__ = [
    "GroupedBucket",
    "lookup",
    "plan_bucket",
    "quantize_grouped",
    "results",
    "run_pipelined",
    "run_prepass",
    "run_quantize",
    "run_speculative",
    "start_grouped",
    "start_layout",
]

_ALIGN = 16  # bytes: where each region of the flat output buffer starts


@dataclass(slots=True, frozen=True)
class _Launch:
    base: int  # the input whose data pointer the table's input offsets count from
    rows: range  # table rows of this launch (same dtype, same elements per matrix)
    per_matrix: int  # elements per matrix
    element_size: int  # bytes per input element
    unit_ends: tuple[int, ...]  # rows where a unit (a weight or a pair, every matrix) ends
    straddling: int  # first row of the units whose other half sits in another launch group


@dataclass(slots=True, eq=False)
class _Layout:
    """The reusable half of a plan: what depends only on names, shapes, dtypes, pointers;
    once kept, also the amaxes its last run found (int32 bits per slot, on the device)."""

    meta: torch.Tensor  # [matrices, META] int64 on the device
    slots: int
    matrices: int
    blocks: int
    first_matrix: tuple[int, ...]  # per tensor: its first matrix (output and scale_2 order)
    first_block: tuple[int, ...]  # per tensor: its first 16-element block in the outputs
    launches: tuple[_Launch, ...]
    slot_bytes: tuple[int, ...]  # per amax slot: the input bytes that slot's matrices hold
    last_amax: torch.Tensor | None = None  # the bet of the next run (``run_speculative``)
    last_amax_host: list[int] | None = None  # the same, read back at the last run's sync
    speculate: bool = True  # bet next run: the last run's amaxes moved for few enough bytes
    replay: _Replay | None = None  # the betting run, recorded (``_record``)


@dataclass(slots=True, eq=False)
class _Replay:
    """A betting bucket's whole run, recorded once (``_record``): zero the slots and flags, the
    one-read quantize and the redo under the last amaxes, keep the new amaxes. On CUDA it is a
    CUDA graph (one host call per sync, instead of a Triton launch per kernel); its kernels read
    the outputs' address from ``at.addr``, so each replay writes the buffer allocated for it.
    It holds no input tensor: the graph reads the addresses its layout is kept under."""

    key: Hashable  # the config and tuning it was recorded under
    bits: torch.Tensor  # int32 amax slots and flags: this replay's (static) copy
    at: OutputsAt
    run: Callable[[GroupedBucket], None]
    address: Callable[[int], None]  # where the next run writes (before ``run``)
    read_bits: Callable[[], list[int]]  # after ``run``: the slots and flags (the one sync)
    busy: bool = False  # replayed and not yet checked: a second start takes the eager path


@dataclass(slots=True)
class GroupedBucket:
    """A planned bucket: its inputs, table, buffers and launches (see the module docstring).

    The output buffer is allocated on first use (``packed``, ``scale``, ``scale_2``), after
    the first pre-pass launch: the GPU starts reading while the host allocates."""

    names: list[str]
    inputs: list[torch.Tensor]  # contiguous, aligned (kept alive until the kernels ran)
    layout: _Layout
    bits: torch.Tensor  # int32: amax slots, then one non-finite flag per tensor
    kept: bool = False  # the layout is in ``_PLANS`` (so it may carry amaxes to the next run)
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def meta(self) -> torch.Tensor:  # [matrices, META] int64 on the device
        return self.layout.meta

    @property
    def slots(self) -> int:
        return self.layout.slots

    @property
    def first_matrix(self) -> tuple[int, ...]:
        return self.layout.first_matrix

    @property
    def first_block(self) -> tuple[int, ...]:
        return self.layout.first_block

    @property
    def launches(self) -> tuple[_Launch, ...]:
        return self.layout.launches

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat packed-code bytes, scale bytes and fp32 ``weight_scale_2`` (one per matrix):
        regions of one fresh buffer, allocated on the first call."""
        if self.buffers is None:
            self.buffers = _carve(self.layout, _new_buffer(self.layout, self.bits.device))
        return self.buffers

    @property
    def packed(self) -> torch.Tensor:
        return self.outputs()[0]

    @property
    def scale(self) -> torch.Tensor:
        return self.outputs()[1]

    @property
    def scale_2(self) -> torch.Tensor:
        return self.outputs()[2]


def _regions(layout: _Layout) -> tuple[int, int, int]:
    """Where the codes and the scale bytes start in a bucket's output buffer (``weight_scale_2``
    first, fp32, one per matrix), and the buffer's size, in bytes."""
    code_at = -(-4 * layout.matrices // _ALIGN) * _ALIGN
    scale_at = code_at + -(-8 * layout.blocks // _ALIGN) * _ALIGN
    return code_at, scale_at, scale_at + layout.blocks


def _new_buffer(layout: _Layout, device: torch.device) -> torch.Tensor:
    return torch.empty(_regions(layout)[2], dtype=torch.uint8, device=device)


def _carve(layout: _Layout, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bucket's output buffer as its codes, scale bytes and ``weight_scale_2``."""
    code_at, scale_at, _ = _regions(layout)
    return (
        buf[code_at : code_at + 8 * layout.blocks],
        buf[scale_at:],
        buf[: 4 * layout.matrices].view(torch.float32),
    )


_PLANS: OrderedDict[Hashable, _Layout] = OrderedDict()
PLAN_CACHE_SIZE = 64  # buckets kept (a model's sync sends a few dozen)


def _matrices(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() == 3 else 1


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with its data at a multiple of 16 elements' bytes (a fresh copy when a
    view starts elsewhere), so every table offset is a whole number of 16-element blocks."""
    t = t.contiguous()
    if t.data_ptr() % (GROUP_SIZE * t.element_size()):
        t = t.clone()
    return t


def plan_bucket(
    weights: Sequence[tuple[str, torch.Tensor]], partners: Mapping[str, str]
) -> GroupedBucket:
    """The host half of a bucket: checks pairs, assigns slots, builds the table and buffers.

    ``weights`` are already checked (dtype, rank, K) and on one device; ``partners`` maps each
    gate/up member to the other (both present). A pair shares one amax slot per matrix. The
    layout of a bucket seen before (same names, shapes, dtypes, pointers, pairs) is reused."""
    names = [n for n, _ in weights]
    inputs = [_aligned(t) for _, t in weights]
    copied = any(a is not t for a, (_, t) in zip(inputs, weights, strict=True))
    key = _plan_key(weights, partners)
    layout = None if copied else _PLANS.get(key)
    if layout is None:
        layout = _plan_layout(names, inputs, partners)
        if not copied:
            _PLANS[key] = layout
            if len(_PLANS) > PLAN_CACHE_SIZE:
                _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    bits = torch.zeros(layout.slots + len(inputs), dtype=torch.int32, device=inputs[0].device)
    return GroupedBucket(names, inputs, layout, bits, kept=not copied)


def _plan_key(weights: Sequence[tuple[str, torch.Tensor]], partners: Mapping[str, str]) -> Hashable:
    """What a bucket's layout depends on: names, pointers, dtypes, shapes, device, pairs."""
    return (
        tuple((n, t.data_ptr(), t.dtype, t.shape, t.device) for n, t in weights),
        tuple(partners.get(n) for n, _ in weights),
    )


def lookup(
    weights: Sequence[tuple[str, torch.Tensor]], partners: Mapping[str, str]
) -> _Layout | None:
    """The kept layout of this very bucket (``_plan_key``; every input contiguous, as it was
    when kept), or None. A bucket found here was planned, hence checked, before: the caller
    may skip its per-weight checks (dtype, rank, K, pairs) and launch it (``start_layout``)."""
    if not all(t.is_contiguous() for _, t in weights):
        return None
    key = _plan_key(weights, partners)
    layout = _PLANS.get(key)
    if layout is not None:
        _PLANS.move_to_end(key)
    return layout


def _amax_slots(
    names: list[str], inputs: list[torch.Tensor], partners: Mapping[str, str]
) -> tuple[dict[int, int], int]:
    """Each tensor's first amax slot (a pair's halves share theirs) and the slot count."""
    index = {n: i for i, n in enumerate(names)}
    slot_of: dict[int, int] = {}
    slots = 0
    for i, (n, t) in enumerate(zip(names, inputs, strict=True)):
        if i in slot_of:
            continue
        slot_of[i] = slots
        p = partners.get(n)
        if p is not None:
            j = index[p]
            other = inputs[j]
            if t.dim() != other.dim() or _matrices(t) != _matrices(other):
                raise QuantInputError(
                    f"{n} {tuple(t.shape)} and {p} {tuple(other.shape)} do not pair"
                )
            slot_of[j] = slots
        slots += _matrices(t)
    return slot_of, slots


def _plan_layout(
    names: list[str], inputs: list[torch.Tensor], partners: Mapping[str, str]
) -> _Layout:
    """Slots, table and launch groups of a bucket (``plan_bucket``)."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    index = {n: i for i, n in enumerate(names)}
    slot_of, slots = _amax_slots(names, inputs, partners)
    first_matrix, first_block = [], []
    matrices = blocks = 0
    for t in inputs:
        first_matrix.append(matrices)
        first_block.append(blocks)
        matrices += _matrices(t)
        blocks += t.numel() // GROUP_SIZE
    # rows grouped by (dtype, elements per matrix): one launch per group, no copies; a pair's
    # halves in one group are adjacent, so the group splits into units at known rows
    groups: dict[tuple[torch.dtype, int], list[list[int]]] = {}
    seen: set[int] = set()
    for i in range(len(inputs)):
        if i in seen:
            continue
        p = partners.get(names[i])
        unit = [i] if p is None else [i, index[p]]
        seen.update(unit)
        by_group: dict[tuple[torch.dtype, int], list[int]] = {}
        for j in unit:
            per = inputs[j].numel() // max(_matrices(inputs[j]), 1)
            by_group.setdefault((inputs[j].dtype, per), []).append(j)
        for key, members in by_group.items():
            groups.setdefault(key, []).append(members)
    rows: list[int] = []
    launches: list[_Launch] = []
    pair = {index[n] for n in partners if n in index}
    for (_, per), units in groups.items():
        # whole units first; a pair whose halves differ in size comes last (no pipelining)
        units.sort(key=lambda u: len(u) == 1 and u[0] in pair)
        members = [i for u in units for i in u]
        base = min(members, key=lambda i: inputs[i].data_ptr())
        base_ptr = inputs[base].data_ptr()
        step = GROUP_SIZE * inputs[base].element_size()  # bytes per 16 elements
        start = len(rows) // kernels.META
        ends: list[int] = []
        for u in units:
            for i in u:
                t = inputs[i]
                for e in range(_matrices(t)):
                    rows += [
                        (t.data_ptr() - base_ptr) // step + e * (per // GROUP_SIZE),
                        first_block[i] + e * (per // GROUP_SIZE),
                        slot_of[i] + e,
                        slots + i,  # the tensor's flag, after every amax slot
                        first_matrix[i] + e,
                    ]
            ends.append(len(rows) // kernels.META)
        whole = [e for e, u in zip(ends, units, strict=True) if len(u) == 2 or u[0] not in pair]
        straddling = whole[-1] if whole else start
        launches.append(
            _Launch(base, range(start, ends[-1]), per, inputs[base].element_size(), tuple(ends),
                    straddling)
        )  # fmt: skip
    meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, kernels.META)
    slot_bytes = [0] * slots
    for i, t in enumerate(inputs):
        per = t.numel() // max(_matrices(t), 1) * t.element_size()
        for e in range(_matrices(t)):
            slot_bytes[slot_of[i] + e] += per
    return _Layout(
        slot_bytes=tuple(slot_bytes),
        meta=meta.to(inputs[0].device, non_blocking=True),
        slots=slots,
        matrices=matrices,
        blocks=blocks,
        first_matrix=tuple(first_matrix),
        first_block=tuple(first_block),
        launches=tuple(launches),
    )


def run_prepass(bucket: GroupedBucket, tuning: KernelTuning | None = None) -> None:
    """Launch the pre-pass kernels of a bucket (amaxes and flags; no sync)."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    for launch in bucket.launches:
        kernels.prepass_rows(
            bucket.inputs[launch.base], bucket.meta, bucket.bits, launch.rows, launch.per_matrix,
            tuning or kernels.DEFAULT_TUNING,
        )  # fmt: skip


def run_quantize(
    bucket: GroupedBucket, cfg: NVFP4Config, tuning: KernelTuning | None = None
) -> None:
    """Launch the quantize kernels of a bucket after its pre-pass (no sync)."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    out = bucket.outputs()
    for launch in bucket.launches:
        kernels.quantize_rows(
            bucket.inputs[launch.base], bucket.meta, bucket.bits, out, launch.rows,
            range(launch.rows.start, launch.rows.start), launch.per_matrix // GROUP_SIZE,
            four_over_six=cfg.four_over_six,
            scale_rounding=cfg.scale_rounding, emax=cfg.emax,
            tuning=tuning or kernels.DEFAULT_TUNING,
        )  # fmt: skip


def _stages(launch: _Launch, rows: range, stage_bytes: int) -> list[range]:
    """``rows`` (whole units of ``launch``) cut at unit ends into stages of at least
    ``stage_bytes`` of input each (the last may be smaller)."""
    out: list[range] = []
    start = rows.start
    per_row = launch.per_matrix * launch.element_size
    for end in launch.unit_ends:
        if end <= start or end > rows.stop:
            continue
        if (end - start) * per_row >= stage_bytes or end == rows.stop:
            out.append(range(start, end))
            start = end
    return out


def run_pipelined(
    bucket: GroupedBucket, cfg: NVFP4Config, tuning: KernelTuning | None = None
) -> None:
    """Pre-pass and quantize a bucket (4-over-6 off) as a pipeline: in each launch group, the
    quantize of stage k runs in the same launch as the pre-pass of stage k + 1. Pairs whose
    halves differ in size (two launch groups) and empty matrices take the two-pass order."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    tuning = tuning or kernels.DEFAULT_TUNING
    plain, staged = [], []
    for la in bucket.launches:
        cut = la.rows.start if la.per_matrix == 0 else la.straddling
        plain.append(range(cut, la.rows.stop))
        staged.append(_stages(la, range(la.rows.start, cut), tuning.pipeline_stage_bytes))
    # every pre-pass that has nothing to run beside it goes first, with the pre-pass kernel
    # (the outputs are not needed yet: the host allocates them while the GPU reads)
    for la, rows in zip(bucket.launches, plain, strict=True):
        kernels.prepass_rows(
            bucket.inputs[la.base], bucket.meta, bucket.bits, rows, la.per_matrix, tuning
        )
    for la, stages in zip(bucket.launches, staged, strict=True):
        if stages:
            kernels.prepass_rows(
                bucket.inputs[la.base], bucket.meta, bucket.bits, stages[0], la.per_matrix, tuning
            )
    out = bucket.outputs()
    for la, rows in zip(bucket.launches, plain, strict=True):
        kernels.quantize_rows(
            bucket.inputs[la.base], bucket.meta, bucket.bits, out, rows, range(rows.start, rows.start),
            la.per_matrix // GROUP_SIZE, four_over_six="off", scale_rounding=cfg.scale_rounding,
            emax=cfg.emax, tuning=tuning,
        )  # fmt: skip
    for la, stages in zip(bucket.launches, staged, strict=True):
        if not stages:
            continue
        previous = stages[0]
        for stage in [*stages[1:], range(stages[-1].stop, stages[-1].stop)]:
            kernels.quantize_rows(
                bucket.inputs[la.base], bucket.meta, bucket.bits, out, previous, stage,
                la.per_matrix // GROUP_SIZE, four_over_six="off",
                scale_rounding=cfg.scale_rounding, emax=cfg.emax, tuning=tuning,
            )  # fmt: skip
            previous = stage


def _views(bucket: GroupedBucket) -> dict[str, NVFP4Tensor]:
    """Each weight's outputs as views of the bucket's buffer (no synchronisation)."""
    from posttrain.quant_convert.nvfp4 import NVFP4Tensor

    out: dict[str, NVFP4Tensor] = {}
    scale = bucket.scale.view(torch.float8_e4m3fn)
    for i, (n, t) in enumerate(zip(bucket.names, bucket.inputs, strict=True)):
        *lead, rows, k = t.shape
        b0, b1 = bucket.first_block[i], bucket.first_block[i] + t.numel() // GROUP_SIZE
        m0 = bucket.first_matrix[i]
        out[n] = NVFP4Tensor(
            bucket.packed[8 * b0 : 8 * b1].view(*lead, rows, k // 2),
            scale[b0:b1].view(*lead, rows, k // GROUP_SIZE),
            bucket.scale_2[m0 : m0 + lead[0]] if lead else bucket.scale_2[m0],
        )
    return out


# A lost bet costs its matrices a second quantize: on an H100 (8 x [8192, 7168] BF16) the
# one-read pass took 0.537 ms, redoing every matrix 0.483 ms more, the two-pass pipeline
# 0.753 ms. Betting pays while the bytes whose amax moved stay under 0.216 / 0.483 = 45%.
SPECULATE_BELOW = 0.45


def _check_flags(bucket: GroupedBucket, bits: list[int] | None = None) -> None:
    """The bucket's one synchronisation: raises :class:`QuantInputError` naming the first
    weight that holds NaN or Inf. The amaxes come back with the flags; for a kept layout they
    decide whether its next run bets (``SPECULATE_BELOW`` of its bytes moved, or less).
    ``bits``: the bucket's bits already read back (a replay lands them on the host itself)."""
    from posttrain.quant_convert.nvfp4 import _raise_non_finite

    if bits is None:
        bits = bucket.bits.tolist()  # plain ints: no torch op after the sync
    layout = bucket.layout
    if bucket.kept:
        amax = bits[: layout.slots]
        last = layout.last_amax_host
        if last is not None:
            sizes = layout.slot_bytes
            moved = sum(n for a, b, n in zip(amax, last, sizes, strict=True) if a != b)
            layout.speculate = moved < SPECULATE_BELOW * max(sum(sizes), 1)
        layout.last_amax_host = amax
    for i, flag in enumerate(bits[layout.slots :]):
        if flag:
            _raise_non_finite(bucket.names[i], bucket.inputs[i])


def results(bucket: GroupedBucket) -> dict[str, NVFP4Tensor]:
    """Each weight's outputs as views of the bucket's buffer, after its single sync: raises
    :class:`QuantInputError` naming the first weight that holds NaN or Inf."""
    out = _views(bucket)
    _check_flags(bucket)
    return out


def start_grouped(
    weights: Sequence[tuple[str, torch.Tensor]],
    partners: Mapping[str, str],
    cfg: NVFP4Config,
    tuning: KernelTuning | None = None,
) -> tuple[dict[str, NVFP4Tensor], Callable[[], None]]:
    """A bucket of checked weights on one device, launched: its outputs (not to be read before
    the check ran) and the check, the bucket's one synchronisation (raises on NaN/Inf)."""
    if not weights:
        return {}, lambda: None
    return _launch(plan_bucket(weights, partners), cfg, tuning)


def start_layout(
    weights: Sequence[tuple[str, torch.Tensor]],
    layout: _Layout,
    cfg: NVFP4Config,
    tuning: KernelTuning | None = None,
) -> tuple[dict[str, NVFP4Tensor], Callable[[], None]]:
    """``start_grouped`` for a bucket whose layout ``lookup`` found: no planning at all (and,
    once its betting run is recorded, one replay: ``_Replay``)."""
    inputs = [t for _, t in weights]
    names = [n for n, _ in weights]
    rep = _free_replay(layout, cfg, tuning)
    if rep is not None:
        return _replayed(GroupedBucket(names, inputs, layout, rep.bits, kept=True), rep)
    bits = torch.zeros(layout.slots + len(inputs), dtype=torch.int32, device=inputs[0].device)
    return _launch(GroupedBucket(names, inputs, layout, bits, kept=True), cfg, tuning)


def _replay_key(cfg: NVFP4Config, tuning: KernelTuning | None) -> Hashable:
    """What a recorded run depends on besides its layout: the kernels' config and shape."""
    return (cfg, tuning)


def _free_replay(layout: _Layout, cfg: NVFP4Config, tuning: KernelTuning | None) -> _Replay | None:
    """The layout's recorded run if this call may replay it: it bets this time, the run was
    recorded under this config and tuning, and no replay of it is still unchecked."""
    rep = layout.replay
    if rep is None or rep.busy or not layout.speculate or rep.key != _replay_key(cfg, tuning):
        return None
    return rep


def _replayed(
    bucket: GroupedBucket, rep: _Replay
) -> tuple[dict[str, NVFP4Tensor], Callable[[], None]]:
    """One replay of a recorded run into a fresh output buffer; the check (the one sync) frees
    the replay's ``bits`` for the next."""
    rep.busy = True
    bucket.bits = rep.bits
    buf = _new_buffer(bucket.layout, rep.bits.device)
    rep.address(buf.data_ptr())
    rep.run(bucket)
    read = rep.read_bits  # this run's (``_record`` swaps them after its first, eager run)
    bucket.buffers = _carve(bucket.layout, buf)  # while the kernels run

    def check() -> None:
        try:
            _check_flags(bucket, read())
        finally:
            rep.busy = False

    return _views(bucket), check


def _one_read(bucket: GroupedBucket, rep: _Replay, cfg: NVFP4Config, tuning: KernelTuning) -> None:
    """What a recorded run does (``_Replay``): ``run_speculative`` into ``rep``'s bits and the
    address in ``rep.at``, betting on the layout's last amaxes, then keeping the new ones."""

    last = bucket.layout.last_amax
    assert last is not None  # recorded only for a layout that bets
    assert bucket.bits is rep.bits  # set by ``_replayed``
    rep.bits.zero_()
    run_speculative(bucket, last, cfg, tuning, out=rep.at)
    last.copy_(rep.bits[: bucket.layout.slots])


def _record(
    bucket: GroupedBucket, cfg: NVFP4Config, tuning: KernelTuning | None
) -> tuple[dict[str, NVFP4Tensor], Callable[[], None]]:
    """The first betting run of a kept layout: runs it eagerly through the indirect kernels
    (compiling them), then, on CUDA, records the same launches as a CUDA graph for every later
    run (``_Replay``). Elsewhere (the Triton interpreter) a replay runs the launches again."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    tune = tuning or kernels.DEFAULT_TUNING
    layout = bucket.layout
    device = bucket.bits.device
    code_at, scale_at, _ = _regions(layout)
    at = kernels.OutputsAt(torch.zeros(1, dtype=torch.int64, device=device), code_at, scale_at)

    def eager(b: GroupedBucket) -> None:
        _one_read(b, rep, cfg, tune)

    def address(ptr: int) -> None:
        at.addr.fill_(ptr)  # stream-ordered before the run's first kernel

    bits = torch.zeros_like(bucket.bits)
    rep = _Replay(_replay_key(cfg, tuning), bits, at, eager, address, bits.tolist)
    out = _replayed(bucket, rep)  # this run: eager, and the kernels are compiled after it
    if device.type == "cuda":
        _capture(bucket, rep, cfg, tune)
    layout.replay = rep
    return out


def _capture(bucket: GroupedBucket, rep: _Replay, cfg: NVFP4Config, tuning: KernelTuning) -> None:
    """``rep`` as a CUDA graph: the output address comes in from pinned host memory and the
    slots and flags go out to it inside the graph, so a replay costs the host one store, one
    graph launch and, at the check, one event wait. Recorded on a side stream (as capture
    needs) without ``torch.cuda.graph``'s synchronize, gc and cache flush: capture runs
    nothing, and the eager run before it stays queued."""
    device = rep.bits.device
    staged = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    landed = torch.zeros(rep.bits.shape, dtype=rep.bits.dtype, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            rep.at.addr.copy_(staged, non_blocking=True)
            _one_read(bucket, rep, cfg, tuning)
            landed.copy_(rep.bits, non_blocking=True)
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    staged_view = staged.numpy()  # the pinned bytes themselves: a store, no torch op
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def address(ptr: int) -> None:
        staged_view[0] = ptr

    def run(_bucket: GroupedBucket) -> None:
        graph.replay()
        done.record()

    def read_bits() -> list[int]:
        done.synchronize()
        return landed.tolist()

    rep.address, rep.run, rep.read_bits = address, run, read_bits


def _launch(
    bucket: GroupedBucket, cfg: NVFP4Config, tuning: KernelTuning | None
) -> tuple[dict[str, NVFP4Tensor], Callable[[], None]]:
    from posttrain.quant_convert import _nvfp4_triton as kernels

    tune = tuning or kernels.DEFAULT_TUNING
    plain = cfg.four_over_six == "off"
    layout = bucket.layout
    last = layout.last_amax if layout.speculate else None
    if plain and tune.speculate and tune.block_per_thread and last is not None:
        rep = _free_replay(layout, cfg, tuning)
        if rep is not None:
            return _replayed(bucket, rep)
        if tune.replay and bucket.kept and (layout.replay is None or not layout.replay.busy):
            return _record(bucket, cfg, tuning)  # recorded now; replayed from the next run
        run_speculative(bucket, last.clone(), cfg, tune)
    elif tune.pipeline and plain:
        run_pipelined(bucket, cfg, tuning)
    else:
        run_prepass(bucket, tuning)
        run_quantize(bucket, cfg, tuning)
    if bucket.kept:  # the next run of this bucket may bet on these amaxes (stream-ordered)
        if layout.last_amax is None:
            layout.last_amax = bucket.bits[: layout.slots].clone()
        else:
            layout.last_amax.copy_(bucket.bits[: layout.slots])
    return _views(bucket), lambda: _check_flags(bucket)


def run_speculative(
    bucket: GroupedBucket,
    bet: torch.Tensor,
    cfg: NVFP4Config,
    tuning: KernelTuning,
    *,
    out: OutputsAt | None = None,
) -> None:
    """Quantize a bucket in one read, betting each slot's amax is ``bet``'s (the last run's:
    a weight's max|x| seldom moves between syncs), then quantize again every matrix whose
    true amax differs. The bytes are the two-pass order's either way; a lost bet costs that
    matrix a second read and write. ``out``: outputs whose address the kernels read on the
    device (a recorded run), instead of the bucket's own buffer."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    where = bucket.outputs() if out is None else out
    for redo in (False, True):  # every bet placed before the first redo reads a slot
        for la in bucket.launches:
            kernels.speculate_rows(
                bucket.inputs[la.base], bucket.meta, bucket.bits, bet, where, la.rows,
                la.per_matrix // GROUP_SIZE, redo=redo, scale_rounding=cfg.scale_rounding,
                emax=cfg.emax, tuning=tuning,
            )  # fmt: skip


def quantize_grouped(
    weights: Sequence[tuple[str, torch.Tensor]],
    partners: Mapping[str, str],
    cfg: NVFP4Config,
    tuning: KernelTuning | None = None,
) -> dict[str, NVFP4Tensor]:
    """A bucket of checked weights on one device through the kernels (module docstring)."""
    out, check = start_grouped(weights, partners, cfg, tuning)
    check()
    return out
