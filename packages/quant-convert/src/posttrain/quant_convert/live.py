"""The live path: quantize named BF16 parameters during weight sync, as the converter would.

Same math (:func:`quantize_nvfp4` with one amax per gate/up pair; on CUDA, same-shape
weights of a bucket go through the fused kernel in a few stacked launches), same selection
(:func:`select_tensors`) and, when given, the exclusion entries read back from the served
checkpoint, so the first checkpoint and every later update quantize identically. A bucket
must carry both halves of a gate/up pair (raises otherwise). ``input_scale`` (an activation
scale, which a weight update does not change) is emitted beside each quantized weight whose
module has one in ``input_scales``: the served checkpoint's own values
(:func:`read_input_scales`), so an update carries every tensor the checkpoint holds for it,
under the same names and shapes, with the values the engine started from.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from posttrain.formats import SAFETENSORS_DTYPES, nvfp4_layout
from posttrain.interface import NVFP4Precision
from posttrain.quant_convert import _grouped
from posttrain.quant_convert._errors import CheckpointError, QuantInputError
from posttrain.quant_convert.nvfp4 import NVFP4Config, NVFP4Tensor, start_nvfp4_many
from posttrain.quant_convert.safetensors_io import ByteCounter, SafetensorsReader
from posttrain.quant_convert.selection import QuantPolicy, TensorInfo, gate_up_role, select_tensors
from posttrain.quant_convert.sglang_rules import build_modules, is_excluded

__all__ = ["quantize_named_params", "read_input_scales"]

# (selection, partners, indices of the chosen, config, kernels' layout) per call signature
_CALLS: OrderedDict[
    Hashable, tuple[frozenset[str], dict[str, str], tuple[int, ...], NVFP4Config, _grouped._Layout]
] = OrderedDict()


def _excluded(infos: Sequence[TensorInfo], entries: Sequence[str]) -> set[str]:
    """Weights whose module SGLang leaves unquantized under ``entries`` (its own rules, so a
    compact list means here exactly what it means to the engine)."""
    if not entries:
        return set()
    out: set[str] = set()
    for m in build_modules(infos):
        try:
            if is_excluded(m, entries):
                out.update(m.weights)
        except ValueError as exc:
            raise CheckpointError(f"{m.name}: exclusion list splits its shards: {exc}") from exc
    return out


@functools.lru_cache(maxsize=1024)
def _selection(
    tensors: tuple[tuple[str, torch.dtype, torch.Size], ...],
    policy: QuantPolicy,
    num_layers: int,
    exclude: tuple[str, ...],
) -> tuple[frozenset[str], dict[str, str]]:
    """The weights of a bucket to quantize and each pair member's partner, from names, dtypes
    and shapes only: memoised on exactly those, since every weight sync sends the same buckets
    again (a refusal raises and is not kept). Callers must not mutate the returned mapping."""
    infos = [
        TensorInfo(n, SAFETENSORS_DTYPES.get(dtype, str(dtype)), tuple(shape))
        for n, dtype, shape in tensors
    ]
    chosen = set(select_tensors(list(infos), policy, num_layers)) - _excluded(infos, exclude)
    roles: dict[str, dict[str, str]] = {}
    for info in infos:
        r = gate_up_role(info.name)
        if r is not None:
            roles.setdefault(r[0], {})[r[1]] = info.name
    partner: dict[str, str] = {}
    for slot in roles.values():
        q = [m for m in slot.values() if m in chosen]
        if q and (len(slot) != 2 or len(q) != 2):
            raise CheckpointError(
                f"{q[0]}: its gate/up partner is missing from this bucket or excluded; a pair "
                "must be quantized together"
            )
        if q:
            partner[slot["gate"]], partner[slot["up"]] = slot["up"], slot["gate"]
    return frozenset(chosen), partner


def quantize_named_params(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    num_layers: int,
    policy: QuantPolicy | None = None,
    cfg: NVFP4Config | NVFP4Precision | None = None,
    exclude_modules: Sequence[str] = (),
    input_scales: Mapping[str, torch.Tensor] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors in, the tensors an NVFP4 engine loads out (``.weight`` packed,
    ``.weight_scale``, ``.weight_scale_2``, and ``.input_scale`` where ``input_scales`` holds
    one under that name); unselected tensors pass through unchanged."""
    items = list(named)
    policy = policy or QuantPolicy()
    exclude = tuple(exclude_modules)
    # every sync after the first sends the same parameters: the whole call's host work (the
    # selection, the checks, the kernels' table) is kept under what it depends on
    key = (
        tuple((n, t.data_ptr(), t.dtype, t.shape, t.device, t.is_contiguous()) for n, t in items),
        policy, num_layers, cfg, exclude,
    )  # fmt: skip
    seen = _CALLS.get(key)
    if seen is not None:
        chosen, partner, indices, resolved, layout = seen
        _CALLS.move_to_end(key)
        # on CUDA the kernels run while the list below is built; the one sync comes last
        quantized, check = _grouped.start_layout([items[i] for i in indices], layout, resolved)
    else:
        chosen, partner = _selection(
            tuple((n, t.dtype, t.shape) for n, t in items), policy, num_layers, exclude
        )
        indices = tuple(i for i, (n, _) in enumerate(items) if n in chosen)
        picked = [items[i] for i in indices]
        resolved = (
            NVFP4Config.from_precision(cfg) if isinstance(cfg, NVFP4Precision) else cfg
        ) or NVFP4Config()
        quantized, check = start_nvfp4_many(picked, partners=partner, cfg=resolved)
        kept = _grouped.lookup(picked, partner) if picked else None
        if kept is not None:  # the kernels' path (CUDA): keep the call
            _CALLS[key] = (chosen, partner, indices, resolved, kept)
            if len(_CALLS) > _grouped.PLAN_CACHE_SIZE:
                _CALLS.popitem(last=False)
    try:
        out = _with_input_scales(items, chosen, quantized, input_scales or {})
    except BaseException:
        with contextlib.suppress(QuantInputError):
            check()  # waits for the launched kernels (and frees a replay for the next call)
        raise
    check()  # NaN/Inf in any weight: raises naming it (nothing is returned)
    return out


def _with_input_scales(
    items: Sequence[tuple[str, torch.Tensor]],
    chosen: frozenset[str],
    quantized: Mapping[str, NVFP4Tensor],
    scales: Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """The call's output list: each chosen weight as its NVFP4 tensors (and its served
    ``input_scale`` where there is one), every other tensor as it came."""
    out: list[tuple[str, torch.Tensor]] = []
    for n, t in items:
        if n not in chosen:
            out.append((n, t))
            continue
        qt = quantized[n]
        out += qt.named(n)  # weight, weight_scale, weight_scale_2: the layout's names
        # input_scale (the layout's name for it) only where the served checkpoint has one
        if not scales:
            continue
        name = nvfp4_layout(n, t.shape, input_scale=True)[-1].name
        served = scales.get(name)
        if served is None:
            continue
        if tuple(served.shape) != tuple(qt.scale_2.shape):
            raise CheckpointError(
                f"{name}: the served checkpoint's has shape {list(served.shape)}, the "
                f"update's {list(qt.scale_2.shape)}"
            )
        out.append((name, served.to(qt.scale_2.dtype)))
    return out


def read_input_scales(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every ``*.input_scale`` tensor of a checkpoint directory (each a scalar, or one per
    expert: only those bytes are read), by name; none for a checkpoint without them."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no .safetensors files (the served checkpoint)")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with SafetensorsReader(file, ByteCounter()) as reader:
            for name in reader.entries:
                if name.endswith(".input_scale"):
                    out[name] = reader.read_tensor(name).clone()
    return out
