"""Pure-torch NVFP4 quantizer (CPU and CUDA), bit-exact to TE's 1-D reference.

The output is the ModelOpt layout SGLang's ``modelopt_fp4`` loader reads; the layout itself
(names, dtypes, E2M1 code packing, dequantization) is ``posttrain.formats``' NVFP4 format,
which this module uses rather than restates: ``packed`` holds ``pack_e2m1_codes`` bytes,
``scale`` the float8_e4m3fn block scales, ``scale_2`` the global decode scale.

The arithmetic follows TransformerEngine's ``NVFP4QuantizerRef`` 1-D path (RHT, 2-D and
stochastic rounding off), all in fp32 with round-to-nearest-even. Where it departs from the
obvious (and from ModelOpt/torchao):

* the global encode scale is ``min(6*Emax/A, FLT_MAX)`` and ``weight_scale_2 = 1/S_enc``;
  computing ``A/2688`` directly differs by one ulp for about a quarter of amaxes;
* block scales are ``v * fp32(S_enc * fp32(1/6))`` (``te-multiplier``); older TE computed
  ``(v/6) * S_enc`` (``te-divide``), which rounds differently on ~1.7e-5 of blocks;
* a block whose scale rounds to zero encodes with ``e = FLT_MAX``: its nonzero values get code
  +-7 but still decode to 0 (kept for bit parity with TE);
* NaN/Inf raise (TE would saturate Inf silently); rows are never padded.

On CUDA tensors the fused Triton kernels of ``_nvfp4_triton`` run instead (one amax pass,
one quantize pass; Triton is imported only then), bit-identical to this code on the CPU;
``backend="torch"`` forces the pure-torch path anywhere (CUDA torch divides by a Python
scalar through its reciprocal, so the 4-over-6 and te-divide paths here divide by a tensor).

Rounding to E2M1 uses the branch-free form ``round(2a)`` (a<2), ``2+round(a)`` (a<4),
``4+round(a/2)`` (else) with half-even ``torch.round``: the same codes as a table of
midpoints with ties to the even code, about twice as fast on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from posttrain.formats import GROUP_SIZE, e2m1_code_values, nvfp4_layout, pack_e2m1_codes
from posttrain.interface import NVFP4Precision
from posttrain.quant_convert import _grouped
from posttrain.quant_convert._errors import QuantInputError

__all__ = [
    "NVFP4Config",
    "NVFP4Tensor",
    "global_amax",
    "quantize_nvfp4",
    "quantize_nvfp4_many",
    "quantize_nvfp4_pair",
    "start_nvfp4_many",
]

ScaleRounding = Literal["te-multiplier", "te-divide"]
FourOverSixMode = Literal["off", "mae", "mse"]
Backend = Literal["auto", "torch", "triton"]

FLT_MAX = float(torch.finfo(torch.float32).max)
E4M3_MAX = 448.0
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CHUNK_ELEMENTS = 1 << 20  # rows per step on CPU: ~10 fp32 temporaries of 4 MiB each


@dataclass(kw_only=True, slots=True, frozen=True)
class NVFP4Config:
    """How weights are quantized (the knobs TE exposes for its 1-D NVFP4 weight path).

    ``four_over_six`` picks, per block, between the usual scale (map-6) and one 1.5x larger
    (map-4) by MAE or MSE, as TE's ``NVTE_NVFP4_4OVER6``; ``e4m3_max`` is the Emax of the
    global scale (None: 448, or 256 when 4-over-6 is on, as TE's default).
    """

    scale_rounding: ScaleRounding = "te-multiplier"
    four_over_six: FourOverSixMode = "off"
    e4m3_max: float | None = None

    @property
    def emax(self) -> float:
        if self.e4m3_max is not None:
            return float(self.e4m3_max)
        return 256.0 if self.four_over_six != "off" else E4M3_MAX

    @classmethod
    def from_precision(
        cls, precision: NVFP4Precision, *, e4m3_max: float | None = None
    ) -> NVFP4Config:
        """The quantizer knobs of an interface ``NVFP4Precision`` (plus TE's Emax switch)."""
        return cls(
            scale_rounding=precision.scale_rounding.value,
            four_over_six=precision.four_over_six.value,
            e4m3_max=e4m3_max,
        )

    def validate(self) -> None:
        from posttrain.interface import ConfigError

        if self.scale_rounding not in ("te-multiplier", "te-divide"):
            raise ConfigError(
                f"scale_rounding={self.scale_rounding!r}: use te-multiplier or te-divide"
            )
        if self.four_over_six not in ("off", "mae", "mse"):
            raise ConfigError(f"four_over_six={self.four_over_six!r}: use off, mae or mse")
        if self.e4m3_max is not None and self.e4m3_max not in (448, 256):
            raise ConfigError(f"e4m3_max={self.e4m3_max!r}: use 448 or 256")


@dataclass(slots=True, frozen=True)
class NVFP4Tensor:
    """One quantized weight: packed codes, block scales and the global decode scale."""

    packed: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor

    def named(
        self, weight_name: str, *, input_scale: float | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors that replace the source weight ``weight_name``, in the order
        and under the names of ``posttrain.formats.nvfp4_layout`` (``input_scale``: emit one)."""
        parts = {"weight": self.packed, "weight_scale": self.scale, "weight_scale_2": self.scale_2}
        if input_scale is not None:
            parts["input_scale"] = torch.full_like(self.scale_2, input_scale)
        shape = (*self.packed.shape[:-1], self.packed.shape[-1] * 2)
        return [
            (name, parts[part])
            for name, part in _layout(weight_name, shape, input_scale is not None)
        ]


@functools.lru_cache(maxsize=1 << 16)
def _layout(
    weight_name: str, shape: tuple[int, ...], input_scale: bool
) -> tuple[tuple[str, str], ...]:
    """(name, part) of ``nvfp4_layout``, memoised: live sync names the same weights each step."""
    return tuple(
        (t.name, t.part) for t in nvfp4_layout(weight_name, shape, input_scale=input_scale)
    )


def _check(w: torch.Tensor, name: str, allow_3d: bool) -> None:
    if w.dtype not in _SUPPORTED_DTYPES:
        raise QuantInputError(f"{name}: dtype {w.dtype} is not fp16/bf16/fp32")
    ranks = (2, 3) if allow_3d else (2,)
    if w.dim() not in ranks:
        raise QuantInputError(f"{name}: rank {w.dim()} (shape {tuple(w.shape)}); expected {ranks}")
    if w.shape[-1] % GROUP_SIZE != 0:
        raise QuantInputError(f"{name}: last dim K={w.shape[-1]} is not a multiple of {GROUP_SIZE}")


def _absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    # two reductions instead of materialising |x|; NaN propagates through both. The abs turns
    # the -0.0 of a block of (negative) zeros into +0.0, as TE's amax(|x|) gives: its scale
    # byte is then 0x00, not 0x80, and an all-(-0.0) tensor keeps a positive S_enc
    return torch.maximum(x.amax(dim=dim), -x.amin(dim=dim)).abs()


def _check_finite(amax: torch.Tensor, name: str, w: torch.Tensor) -> None:
    if not bool(torch.isfinite(amax).all()):
        bad = "NaN" if bool(torch.isnan(w).any()) else "Inf"
        raise QuantInputError(f"{name}: contains {bad}; NVFP4 needs finite weights")


def global_amax(w: torch.Tensor, *, per_expert: bool = False) -> torch.Tensor:
    """max|w| in fp32 (exact): 0-d, or ``[E]`` over all but the first dim when ``per_expert``."""
    if w.numel() == 0:
        return torch.zeros(w.shape[0] if per_expert else (), dtype=torch.float32, device=w.device)
    flat = w.reshape(w.shape[0], -1) if per_expert else w.reshape(1, -1)
    a = _absmax(flat, dim=1).to(torch.float32)
    return a if per_expert else a[0]


def _encode_scale(amax: torch.Tensor, emax: float) -> torch.Tensor:
    s_enc = torch.tensor(6.0 * emax, dtype=torch.float32, device=amax.device) / amax
    s_enc = torch.clamp(s_enc, max=FLT_MAX)
    return torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)


def _encode(x: torch.Tensor, s_f32: torch.Tensor, ws2: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 blocks ``x [..., nb, 16]`` under block scales ``s_f32 [..., nb]``."""
    e = torch.clamp(1.0 / (s_f32 * ws2), max=FLT_MAX)
    y = torch.clamp(x * e.unsqueeze(-1), -6.0, 6.0)
    a = y.abs()
    idx = torch.where(
        a < 2.0,
        torch.round(a * 2.0),
        torch.where(a < 4.0, torch.round(a) + 2.0, torch.round(a * 0.5) + 4.0),
    )
    return idx.to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)


def _e4m3(d: torch.Tensor) -> torch.Tensor:
    d = torch.clamp(torch.clamp(d, max=FLT_MAX), -E4M3_MAX, E4M3_MAX)
    return d.to(torch.float8_e4m3fn)


def _sequential_sum(t: torch.Tensor) -> torch.Tensor:
    # TE sums the 16 block errors one after another; torch.sum's order would change ties.
    acc = t[..., 0]
    for i in range(1, t.shape[-1]):
        acc = acc + t[..., i]
    return acc


def _quantize_rows(
    x: torch.Tensor,
    s_enc: torch.Tensor,
    ws2: torch.Tensor,
    amax: torch.Tensor,
    cfg: NVFP4Config,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[R, K]`` and e4m3 scales ``[R, K/16]`` of rows ``x`` (fp32)."""
    blocks = x.reshape(x.shape[0], -1, GROUP_SIZE)
    v = _absmax(blocks, dim=-1)
    _check_finite(v, name, x)
    # a tensor divisor: CUDA torch turns "/ 6.0" into a multiply by fp32(1/6), not a division
    six = torch.tensor(6.0, dtype=torch.float32, device=x.device)
    if cfg.four_over_six == "off":
        if cfg.scale_rounding == "te-multiplier":
            mult = s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=x.device)
            s = _e4m3(v * mult)
        else:
            s = _e4m3((v / six) * s_enc)
        codes = _encode(blocks, s.to(torch.float32), ws2)
        return codes.reshape(x.shape), s
    base = (v / six) * s_enc
    s6 = _e4m3(base)
    s4 = _e4m3(base * 1.5)
    denom = torch.tensor(6.0 * cfg.emax, dtype=torch.float32, device=x.device)
    errs = []
    cands = []
    for s in (s4, s6):
        sf = s.to(torch.float32)
        c = _encode(blocks, sf, ws2)
        val = ((e2m1_code_values(c) * sf.unsqueeze(-1)) * amax) / denom
        diff = val - blocks
        errs.append(_sequential_sum(diff.abs() if cfg.four_over_six == "mae" else diff * diff))
        cands.append(c)
    use4 = errs[0] < errs[1]
    codes = torch.where(use4.unsqueeze(-1), cands[0], cands[1])
    s = torch.where(use4, s4.to(torch.float32), s6.to(torch.float32)).to(torch.float8_e4m3fn)
    return codes.reshape(x.shape), s


def _quantize_2d(
    w: torch.Tensor, amax: torch.Tensor, cfg: NVFP4Config, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    s_enc = _encode_scale(amax, cfg.emax)
    ws2 = 1.0 / s_enc
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((n, k // GROUP_SIZE), dtype=torch.float8_e4m3fn, device=w.device)
    # row chunks bound the fp32 temporaries; a GPU wants fewer, larger launches
    chunk = _CHUNK_ELEMENTS if w.device.type == "cpu" else _CHUNK_ELEMENTS * 16
    rows = max(1, chunk // max(k, 1))
    for r0 in range(0, n, rows):
        x = w[r0 : r0 + rows].to(torch.float32)
        codes, s = _quantize_rows(x, s_enc, ws2, amax, cfg, name)
        packed[r0 : r0 + rows] = pack_e2m1_codes(codes)
        scale[r0 : r0 + rows] = s
    return packed, scale, ws2


def _use_triton(device: torch.device, backend: Backend) -> bool:
    if backend not in ("auto", "torch", "triton"):
        from posttrain.interface import ConfigError

        raise ConfigError(f"backend={backend!r}: use auto, torch or triton")
    if backend == "triton":
        return True
    return backend == "auto" and device.type == "cuda" and _triton_installed()


def _triton_installed() -> bool:
    global _TRITON
    if _TRITON is None:
        import importlib.util

        _TRITON = importlib.util.find_spec("triton") is not None
    return _TRITON


_TRITON: bool | None = None


def _resolve_cfg(cfg: NVFP4Config | NVFP4Precision | None) -> NVFP4Config:
    if isinstance(cfg, NVFP4Precision):
        cfg = NVFP4Config.from_precision(cfg)
    return cfg or NVFP4Config()


def _raise_non_finite(name: str, w: torch.Tensor) -> None:
    bad = "NaN" if bool(torch.isnan(w).any()) else "Inf"
    raise QuantInputError(f"{name}: contains {bad}; NVFP4 needs finite weights")


def _triton_amax(tensors: list[torch.Tensor], matrices: int) -> torch.Tensor:
    """max|t| per matrix (``[matrices]`` fp32), folded over ``tensors`` (all ``[matrices, ...]``
    or 2-D with ``matrices == 1``): one read of each, no sync."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    dev = tensors[0].device
    bits = torch.zeros(matrices, dtype=torch.int32, device=dev)
    slots = _slots(dev, matrices)
    for t in tensors:
        kernels.amax_into(t.contiguous().reshape(matrices, -1), bits, slots)
    return bits.view(torch.float32)


_SLOTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _slots(device: torch.device, n: int) -> torch.Tensor:
    """``arange(n)`` as int32 on ``device``, kept (each call's launches need one)."""
    key = (device, n)
    if key not in _SLOTS:
        _SLOTS[key] = torch.arange(n, dtype=torch.int32, device=device)
    return _SLOTS[key]


def _quantize_triton(
    weight: torch.Tensor, amax: torch.Tensor, cfg: NVFP4Config, name: str
) -> NVFP4Tensor:
    """The fused-kernel path; ``amax`` is 0-d (2-D weight) or ``[E]`` (3-D), on the device."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    is_3d = weight.dim() == 3
    x = weight.contiguous()
    x3 = x if is_3d else x.unsqueeze(0)
    mats = x3.shape[0]
    amax = amax.reshape(-1)
    if amax.numel() != mats or amax.device != x.device or amax.dtype != torch.float32:
        amax = amax.to(device=x.device, dtype=torch.float32).reshape(-1).expand(mats)
    slots = _slots(x.device, mats)
    packed, scale, ws2, flag = kernels.quantize_matrices(
        x3, amax.contiguous(), slots, four_over_six=cfg.four_over_six,
        scale_rounding=cfg.scale_rounding, emax=cfg.emax,
    )  # fmt: skip
    if int(flag.item()):
        _raise_non_finite(name, weight)
    if is_3d:
        return NVFP4Tensor(packed, scale, ws2)
    return NVFP4Tensor(packed[0], scale[0], ws2[0])


def quantize_nvfp4(
    weight: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    cfg: NVFP4Config | NVFP4Precision | None = None,
    name: str = "weight",
    allow_3d: bool = False,
    backend: Backend = "auto",
) -> NVFP4Tensor:
    """Quantize a ``[N, K]`` (or, with ``allow_3d``, ``[E, N, K]``) weight to NVFP4.

    ``global_amax`` overrides max|weight| (a gate/up pair passes the max over both; 3-D takes
    one per expert, shape ``[E]``). Raises :class:`QuantInputError` naming ``name`` for NaN,
    Inf, K not a multiple of 16, an unsupported dtype or rank. ``backend``: ``auto`` runs the
    fused Triton kernel on CUDA tensors and pure torch elsewhere (the same bytes either way).
    """
    cfg = _resolve_cfg(cfg)
    _check(weight, name, allow_3d)
    is_3d = weight.dim() == 3
    if _use_triton(weight.device, backend):
        if global_amax is None:
            mats = weight.shape[0] if is_3d else 1
            amax = _triton_amax([weight], mats)
        else:
            amax = torch.as_tensor(global_amax, dtype=torch.float32, device=weight.device)
        return _quantize_triton(weight, amax, cfg, name)
    if global_amax is None:
        amax = _amax_of(weight, is_3d)
    else:
        amax = torch.as_tensor(global_amax, dtype=torch.float32, device=weight.device)
        if is_3d and amax.dim() == 0:
            amax = amax.expand(weight.shape[0]).clone()
    if not is_3d:
        p, s, ws2 = _quantize_2d(weight, amax, cfg, name)
        return NVFP4Tensor(p, s, ws2)
    parts = [_quantize_2d(weight[e], amax[e], cfg, name) for e in range(weight.shape[0])]
    return NVFP4Tensor(
        torch.stack([p[0] for p in parts]),
        torch.stack([p[1] for p in parts]),
        torch.stack([p[2] for p in parts]),
    )


def _amax_of(w: torch.Tensor, is_3d: bool) -> torch.Tensor:
    return global_amax(w, per_expert=is_3d)


def quantize_nvfp4_pair(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    cfg: NVFP4Config | NVFP4Precision | None = None,
    names: tuple[str, str] = ("gate_proj.weight", "up_proj.weight"),
    allow_3d: bool = False,
    backend: Backend = "auto",
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Quantize a gate/up pair with one shared global amax.

    Bitwise equal to quantizing ``cat([gate, up])`` and splitting the rows, without the concat
    (the pair's ``weight_scale_2`` values are equal, as SGLang's fused w13 requires).
    """
    _check(gate, names[0], allow_3d)
    _check(up, names[1], allow_3d)
    if gate.dim() != up.dim() or gate.shape[-1] != up.shape[-1]:
        raise QuantInputError(
            f"{names[0]} {tuple(gate.shape)} and {names[1]} {tuple(up.shape)} do not pair"
        )
    is_3d = gate.dim() == 3
    if _use_triton(gate.device, backend):
        if is_3d and gate.shape[0] != up.shape[0]:
            raise QuantInputError(
                f"{names[0]} {tuple(gate.shape)} and {names[1]} {tuple(up.shape)} do not pair"
            )
        amax = _triton_amax([gate, up], gate.shape[0] if is_3d else 1)  # one shared slot each
        if not is_3d:
            amax = amax[0]
    else:
        amax = torch.maximum(_amax_of(gate, is_3d), _amax_of(up, is_3d))
    return (
        quantize_nvfp4(gate, global_amax=amax, cfg=cfg, name=names[0], allow_3d=allow_3d,
                       backend=backend),
        quantize_nvfp4(up, global_amax=amax, cfg=cfg, name=names[1], allow_3d=allow_3d,
                       backend=backend),
    )  # fmt: skip


def quantize_nvfp4_many(
    weights: Sequence[tuple[str, torch.Tensor]],
    *,
    partners: Mapping[str, str] | None = None,
    cfg: NVFP4Config | NVFP4Precision | None = None,
    allow_3d: bool = True,
    backend: Backend = "auto",
) -> dict[str, NVFP4Tensor]:
    """Quantize many named weights; ``partners`` maps each gate/up member to the other, and a
    pair shares one global amax (per expert for 3-D), exactly as :func:`quantize_nvfp4_pair`.

    On CUDA (the live weight-sync path) the weights of each device go through the grouped
    kernels as one bucket (``_grouped``): a pre-pass (every amax and a non-finite flag per
    weight, one read), then the quantize kernel, one launch each per group of same-size
    matrices, the outputs views of one buffer, and one synchronisation for the whole call
    (NaN/Inf raise :class:`QuantInputError` naming the weight). Elsewhere weights are
    quantized one by one. The bytes are those of :func:`quantize_nvfp4` either way.
    """
    out, check = start_nvfp4_many(
        weights, partners=partners, cfg=cfg, allow_3d=allow_3d, backend=backend
    )
    check()
    return out


def start_nvfp4_many(
    weights: Sequence[tuple[str, torch.Tensor]],
    *,
    partners: Mapping[str, str] | None = None,
    cfg: NVFP4Config | NVFP4Precision | None = None,
    allow_3d: bool = True,
    backend: Backend = "auto",
) -> tuple[dict[str, NVFP4Tensor], Callable[[], None]]:
    """:func:`quantize_nvfp4_many` in two halves: the outputs (on CUDA, launched but not yet
    checked: read them only after the check) and the check, the call's one synchronisation,
    which raises :class:`QuantInputError` for NaN/Inf. A caller arranges the outputs while the
    kernels run, then calls the check."""
    cfg = _resolve_cfg(cfg)
    partners = dict(partners or {})
    if weights and allow_3d and _use_triton(weights[0][1].device, backend):
        layout = _grouped.lookup(weights, partners)
        if layout is not None:  # the very bucket (names, pointers, dtypes, shapes, device,
            # pairs) went through the kernels before, so it passed the checks below
            return _grouped.start_layout(weights, layout, cfg)
    by_name = dict(weights)
    for n, t in weights:
        _check(t, n, allow_3d)
        p = partners.get(n)
        if p is not None and (p not in by_name or partners.get(p) != n):
            raise QuantInputError(f"{n}: its partner {p!r} is not among the weights (or unpaired)")
        if p is not None and by_name[p].device != t.device:
            raise QuantInputError(f"{n} and {p}: a pair must sit on one device")
    out: dict[str, NVFP4Tensor] = {}
    grouped: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    done: set[str] = set()
    for n, t in weights:
        if _use_triton(t.device, backend):
            grouped.setdefault(t.device, []).append((n, t))
            continue
        if n in done:
            continue
        p = partners.get(n)
        names = [n] if p is None else [n, p]
        done.update(names)
        is_3d = t.dim() == 3
        amax = global_amax(t, per_expert=is_3d)
        if p is not None:
            amax = torch.maximum(amax, global_amax(by_name[p], per_expert=is_3d))
        for m in names:
            out[m] = quantize_nvfp4(by_name[m], global_amax=amax, cfg=cfg, name=m,
                                    allow_3d=allow_3d, backend=backend)  # fmt: skip
    checks: list[Callable[[], None]] = []
    if grouped:
        for bucket in grouped.values():
            got, check = _grouped.start_grouped(bucket, partners, cfg)
            out.update(got)
            checks.append(check)

    def check_all() -> None:
        for check in checks:
            check()

    return {n: out[n] for n, _ in weights}, check_all
