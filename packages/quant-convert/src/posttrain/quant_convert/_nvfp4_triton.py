# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# ruff: noqa: N803, N806  (Triton spells compile-time constants in capitals)
"""Fused Triton NVFP4 kernels: the CUDA path of :mod:`posttrain.quant_convert.nvfp4`.

Imported only when a CUDA tensor is quantized (or by the interpreter test), so a CPU-only
install never needs Triton. Two passes over the input:

* ``_amax_kernel`` reduces max|x| of every matrix into an fp32 slot, as ``int32`` bit patterns
  with ``atomic_max`` (non-negative floats order like their bits; a NaN's bits exceed +inf's,
  so a NaN anywhere leaves a NaN amax). Matrices that share a slot (a gate/up pair) share A.
* ``_quant_kernel`` reads the input once (any of fp16/bf16/fp32) and writes the packed E2M1
  codes (one int64 per 16-element block: byte j = code[2j] | code[2j+1] << 4, little endian),
  the E4M3 scale bytes, and ``weight_scale_2`` per matrix; a non-finite block sets a flag.
  ``_quant_4over6_kernel`` does the same for 4-over-6 with one thread per 16-element block
  (its two 8-element halves are two 16-byte loads into that thread), so per-block work runs
  once per block and the error sums need no data exchange between threads.

The grouped (live) path, one bucket of weights at a time (``_grouped``), addresses its
matrices through an int64 table (input offset in 16-element blocks from one tensor of the
launch, output block, amax slot, flag slot, ``weight_scale_2`` index), so no input is copied:

* ``_prepass_kernel``: max|x| into the amax slot and a non-finite flag into the weight's own
  flag slot, one read;
* ``_pipelined_kernel``: either quantize kernel's work (block tiles, or 4-over-6 one thread
  per block) over table rows (no flag: the pre-pass has it); in the pipelined order one
  launch quantizes a stage of rows (pre-passed by the launch before) while pre-passing the
  next stage, a tile of each per program: the quantize kernel is bound by integer arithmetic
  (0.87x of copy bandwidth alone on an H100, one thread per block), the pre-pass by memory,
  so running them side by side hides most of the pre-pass;
* ``_speculative_kernel`` and ``_redo_kernel`` (a bucket quantized before): one read that
  quantizes under the amax each slot held at the last run while folding the true amax and
  the flag into ``bits``, then a second quantize of only the matrices whose amax moved (the
  others' programs return at once), so the bytes are the two-pass bytes either way.

Bit parity with the CPU reference (pure torch, IEEE fp32, round-to-nearest-even) is by
construction and tested bit for bit (the interpreter on CPU, the device in the benchmark):

* every division is ``div_rn`` (Triton's ``/`` is approximate on fp32), in the reference's
  order: ``S_enc = 6*Emax / A``, ``scale_2 = 1 / S_enc``, ``e = 1 / (s * scale_2)``,
  ``v / 6`` (te-divide and 4-over-6), and 4-over-6's ``((q * s) * A) / (6 * Emax)``;
* that last one is formed per block, not per element: ``|q|`` is ``m * 2**j`` with m in
  {1, 1.5} and j in -1..2, ``q * s`` is exact, and multiplying by 2**j commutes with each
  rounding while every operand and result is a normal float, so the value of code q is
  ``+-2**j * ((m*s*A) / (6*Emax))`` from two divisions per block and candidate. The global
  amax in [2**-100, 2**115] keeps every value normal for all E4M3 scales (2**-9 .. 448); a
  matrix outside that range takes a per-element ``div_rn`` branch (the identity is tested on
  CPU over every E4M3 scale and sampled amaxes up to both bounds, the kernel on both sides);
* kernels are compiled with ``enable_fp_fusion=False``, so no mul+add becomes an FMA (the
  MSE error sum ``acc + d*d`` would otherwise round once instead of twice);
* the E4M3 cast is integer arithmetic on the fp32 bits (round-to-nearest-even on the mantissa
  for normals, ``rne(d * 2**9)`` through the 2**23 magic add for subnormals), so neither the
  hardware's nor the interpreter's float8 conversion is trusted;
* E2M1 rounding is integer arithmetic too (the mantissa rounded to one bit, ties even), the
  same codes as the reference's ``round(2a) / 2+round(a) / 4+round(a/2)`` form;
* the 4-over-6 errors of a block are summed one element after another (0..15), as TE and the
  reference do, by splitting the block's columns apart (register moves when one thread holds
  the block) rather than with ``tl.sum``, whose order is the compiler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

__all__ = [
    "DEFAULT_TUNING",
    "KernelTuning",
    "amax_into",
    "prepass_rows",
    "quantize_matrices",
    "quantize_rows",
    "speculate_rows",
]

_AMAX_TILE = 4096
_AMAX_TILES_PER_PROGRAM = 4
_MODES = {
    ("off", "te-multiplier"): 0,
    ("off", "te-divide"): 1,
    ("mae", "te-multiplier"): 2,
    ("mae", "te-divide"): 2,  # 4-over-6 always forms (v / 6) * S_enc, as TE
    ("mse", "te-multiplier"): 3,
    ("mse", "te-divide"): 3,
}


@triton.jit
def _amax_bits(x_ptr, first, per_matrix, TILE: tl.constexpr, TILES: tl.constexpr):
    """max of |x|'s fp32 bit patterns over elements ``[first, first + TILE*TILES)`` of one
    matrix (``per_matrix`` long): exact, +0.0 for zeros, NaN above +inf."""
    acc = tl.zeros([TILE], dtype=tl.int32)
    for t in tl.static_range(TILES):
        offs = first + t * TILE + tl.arange(0, TILE)
        x = tl.load(x_ptr + offs, mask=offs < per_matrix, other=0.0)
        bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        acc = tl.maximum(acc, bits)
    return tl.max(acc, axis=0)


@triton.jit
def _amax_kernel(x_ptr, bits_ptr, slot_ptr, per_matrix, TILE: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.program_id(1)
    x_ptr += m.to(tl.int64) * per_matrix
    slot = tl.load(slot_ptr + m)
    tl.atomic_max(bits_ptr + slot, _amax_bits(x_ptr, pid * TILES * TILE, per_matrix, TILE, TILES))


# the grouped (live) path: one row of int64 per matrix, describing where it lives
META = 5  # columns of a matrix's row in the table
IN_AT, OUT_AT, AMAX_AT, FLAG_AT, SCALE2_AT = range(META)


@triton.jit
def _prepass_tile(x_ptr, meta_ptr, bits_ptr, row, tile, per_matrix, TILE: tl.constexpr,
                  TILES: tl.constexpr):  # fmt: skip
    """Tile ``tile`` of table row ``row``: its max|x| folded into the matrix's amax slot and,
    when that is NaN or Inf, 1 into its tensor's flag slot."""
    at = row.to(tl.int64) * 5
    x_ptr += tl.load(meta_ptr + at) * 16
    a = _amax_bits(x_ptr, tile * TILES * TILE, per_matrix, TILE, TILES)
    tl.atomic_max(bits_ptr + tl.load(meta_ptr + at + 2), a)
    tl.atomic_max(bits_ptr + tl.load(meta_ptr + at + 3), 1, mask=a >= 0x7F800000)


@triton.jit
def _prepass_kernel(
    x_ptr, meta_ptr, bits_ptr, first_row, per_matrix, TILE: tl.constexpr, TILES: tl.constexpr
):
    """One read of each matrix: amax and non-finite flag (``_prepass_tile``). Matrix ``j`` of
    this launch is row ``first_row + j`` of the table; its input starts ``meta[IN_AT] * 16``
    elements after ``x_ptr`` (any tensor of the bucket's dtype, so no copy gathers them)."""
    row = first_row + tl.program_id(1)
    _prepass_tile(x_ptr, meta_ptr, bits_ptr, row, tl.program_id(0), per_matrix, TILE, TILES)


@triton.jit
def _e4m3_rne(d):
    """Scale byte and its fp32 value for ``0 <= d <= 448`` (round to nearest, ties even)."""
    bits = d.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20  # exponent and 3 mantissa bits, rounded
    normal_byte = r - (120 << 3)  # rebias 127 -> 7
    normal_val = (r << 20).to(tl.float32, bitcast=True)
    k = ((d * 512.0) + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # rne(d * 2**9)
    sub = d < 0.015625  # 2**-6, the least normal E4M3
    byte = tl.where(sub, k, normal_byte)
    val = tl.where(sub, k.to(tl.float32) * 0.001953125, normal_val)
    return byte, val


@triton.jit
def _e2m1_index(a):
    """E2M1 magnitude index 0..7 of ``0 <= a <= 6``, ties to the even code: for a >= 1 the
    fp32 mantissa rounded to one bit (nearest, ties even) with the exponent rebiased; below
    1, ``rne(2a)``: adding 2**22 (whose ulp is 0.5) rounds ``a`` once to a multiple of 0.5,
    ties to the even multiple. Same codes as comparing against the midpoints .25 .75 1.25
    1.75 2.5 3.5 5 (ties to the even code). The rebias (- 252 << 22) rides in the rounding
    add (bits >= 1.0's, so nothing borrows): three integer ops for the normal path, two for
    the small one (the quantize kernel is bound by integer arithmetic)."""
    bits = a.to(tl.int32, bitcast=True)
    normal = (bits + (0x1FFFFF - (252 << 22)) + ((bits >> 22) & 1)) >> 22  # 1.0 -> 2, 6 -> 7
    small = (a + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
    return tl.where(a < 1.0, small, normal)


@triton.jit
def _e2m1_codes(x, sf, ws2):
    """E2M1 codes (int32, sign << 3 | idx) of fp32 blocks ``x [B, 16]`` under scales ``sf [B]``."""
    e = tl.minimum(
        tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * ws2), 3.4028234663852886e38
    )
    y = x * e[:, None]
    idx = _e2m1_index(tl.minimum(tl.abs(y), 6.0))  # = |clamp(y, -6, 6)|
    return idx | tl.where(y < 0.0, 8, 0)


@triton.jit
def _block_error(x, codes, sf, amax, DENOM: tl.constexpr, MSE: tl.constexpr):
    """Sum over a block's 16 elements, in order, of |q*s*A/denom - x| (or its square)."""
    idx = (codes & 7).to(tl.float32)
    mag = tl.where(idx < 4.0, idx * 0.5, tl.where(idx < 6.0, idx - 2.0, (idx - 4.0) * 2.0))
    q = tl.where((codes & 8) != 0, -mag, mag)
    val = tl.math.div_rn((q * sf[:, None]) * amax, tl.full(q.shape, DENOM, tl.float32))
    diff = val - x
    err = diff * diff if MSE else tl.abs(diff)
    # columns in order: [B,16] -> halves by the lowest index bit, four times
    B: tl.constexpr = err.shape[0]
    c_even, c_odd = tl.split(tl.reshape(err, [B, 8, 2]))  # cols 2i | 2i+1
    c0, c2 = tl.split(tl.reshape(c_even, [B, 4, 2]))  # cols 4i | 4i+2
    c1, c3 = tl.split(tl.reshape(c_odd, [B, 4, 2]))  # cols 4i+1 | 4i+3
    c00, c04 = tl.split(tl.reshape(c0, [B, 2, 2]))  # 8i | 8i+4
    c02, c06 = tl.split(tl.reshape(c2, [B, 2, 2]))
    c01, c05 = tl.split(tl.reshape(c1, [B, 2, 2]))
    c03, c07 = tl.split(tl.reshape(c3, [B, 2, 2]))
    e0, e8 = tl.split(c00)
    e4, e12 = tl.split(c04)
    e2, e10 = tl.split(c02)
    e6, e14 = tl.split(c06)
    e1, e9 = tl.split(c01)
    e5, e13 = tl.split(c05)
    e3, e11 = tl.split(c03)
    e7, e15 = tl.split(c07)
    acc = e0 + e1
    acc = acc + e2
    acc = acc + e3
    acc = acc + e4
    acc = acc + e5
    acc = acc + e6
    acc = acc + e7
    acc = acc + e8
    acc = acc + e9
    acc = acc + e10
    acc = acc + e11
    acc = acc + e12
    acc = acc + e13
    acc = acc + e14
    return acc + e15


@triton.jit
def _global_scales(amax, SIX_EMAX: tl.constexpr):
    """The matrix's encode scale ``6 * EMAX / amax`` (capped at fp32 max; 1 for an all-zero
    matrix) and its decode scale ``1 / s_enc``, both correctly rounded as on the CPU."""
    s_enc = tl.minimum(
        tl.math.div_rn(tl.full([], SIX_EMAX, tl.float32), amax), 3.4028234663852886e38
    )
    s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)
    return s_enc, tl.math.div_rn(tl.full([], 1.0, tl.float32), s_enc)


@triton.jit
def _quant_kernel(
    x_ptr,
    amax_ptr,
    slot_ptr,
    packed_ptr,
    scale_ptr,
    ws2_ptr,
    flag_ptr,
    blocks_per_matrix,
    EMAX: tl.constexpr,
    MODE: tl.constexpr,
    BLOCKS: tl.constexpr,
    PACK_WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.program_id(1)
    slot = tl.load(slot_ptr + m)
    amax = tl.load(amax_ptr + slot)
    SIX_EMAX: tl.constexpr = 6.0 * EMAX  # exact: 2688 or 1536
    s_enc, ws2 = _global_scales(amax, SIX_EMAX)
    if pid == 0:
        tl.store(ws2_ptr + m, ws2)

    # 64-bit only in the per-matrix base; offsets within a matrix are int32 (< 2**31 elements)
    first = m.to(tl.int64) * blocks_per_matrix
    x_ptr += first * 16
    scale_ptr += first
    packed_ptr += first * (1 if PACK_WORDS else 8)
    offs = pid * BLOCKS + tl.arange(0, BLOCKS)
    ok = offs < blocks_per_matrix
    cols = tl.arange(0, 16)
    x = tl.load(x_ptr + offs[:, None] * 16 + cols[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    # block amax as the integer max of |x|'s bits: exact, +0.0 for zeros, and a NaN's bits
    # exceed +inf's, so the NaN/Inf check is one compare per block (a float max may drop NaN)
    v_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    bad = tl.max((v_bits >= 0x7F800000).to(tl.int32), axis=0)
    tl.atomic_max(flag_ptr, bad, mask=bad > 0)
    v = v_bits.to(tl.float32, bitcast=True)

    codes, byte = _scales_and_codes(x, v, amax, s_enc, ws2, MODE, SIX_EMAX)
    _store_blocks(packed_ptr, scale_ptr, offs, ok, codes, byte, BLOCKS, PACK_WORDS)


@triton.jit
def _scales_and_codes(x, v, amax, s_enc, ws2, MODE: tl.constexpr, SIX_EMAX: tl.constexpr):
    """E4M3 scale bytes ``[B]`` and E2M1 codes ``[B, 16]`` of fp32 blocks ``x`` with block
    amaxes ``v``, in one of the block-tile modes (0: te-multiplier, 1: te-divide, 2/3:
    4-over-6 MAE/MSE with one division per element)."""
    if MODE == 0:
        d = v * (s_enc * 0.16666666666666666)
        byte, sf = _e4m3_rne(tl.minimum(d, 448.0))
        codes = _e2m1_codes(x, sf, ws2)
    elif MODE == 1:
        d = tl.math.div_rn(v, tl.full(v.shape, 6.0, tl.float32)) * s_enc
        byte, sf = _e4m3_rne(tl.minimum(d, 448.0))
        codes = _e2m1_codes(x, sf, ws2)
    else:
        base = tl.math.div_rn(v, tl.full(v.shape, 6.0, tl.float32)) * s_enc
        b6, sf6 = _e4m3_rne(tl.minimum(base, 448.0))
        b4, sf4 = _e4m3_rne(tl.minimum(base * 1.5, 448.0))
        c6 = _e2m1_codes(x, sf6, ws2)
        c4 = _e2m1_codes(x, sf4, ws2)
        err6 = _block_error(x, c6, sf6, amax, SIX_EMAX, MODE == 3)
        err4 = _block_error(x, c4, sf4, amax, SIX_EMAX, MODE == 3)
        use4 = err4 < err6
        codes = tl.where(use4[:, None], c4, c6)
        byte = tl.where(use4, b4, b6)
    return codes, byte


@triton.jit
def _store_blocks(
    packed_ptr, scale_ptr, offs, ok, codes, byte, BLOCKS: tl.constexpr, PACK_WORDS: tl.constexpr
):
    """Write blocks ``offs`` (where ``ok``): packed codes, then scale bytes."""
    cols = tl.arange(0, 16)
    if PACK_WORDS:  # one int64 per block (little endian: byte j = code 2j | code 2j+1 << 4)
        shifts = (cols * 4).to(tl.int64)
        word = tl.sum(codes.to(tl.int64) << shifts[None, :], axis=1)  # disjoint: sum == or
        tl.store(packed_ptr + offs, word, mask=ok)
    else:  # eight bytes per block
        lo, hi = tl.split(tl.reshape(codes, [BLOCKS, 8, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        bytes_at = offs[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(packed_ptr + bytes_at, packed, mask=ok[:, None])
    tl.store(scale_ptr + offs, byte.to(tl.uint8), mask=ok)


@triton.jit
def _row_scales(meta_ptr, bits_ptr, ws2_ptr, at, tile, SIX_EMAX: tl.constexpr):
    """The global amax of the table row at ``at`` (from its slot) and its two global scales;
    tile 0 of the row stores its ``weight_scale_2``."""
    amax = tl.load(bits_ptr + tl.load(meta_ptr + at + 2)).to(tl.float32, bitcast=True)
    s_enc, ws2 = _global_scales(amax, SIX_EMAX)
    if tile == 0:
        tl.store(ws2_ptr + tl.load(meta_ptr + at + 4), ws2)
    return amax, s_enc, ws2


@triton.jit
def _quant_tile(x_ptr, meta_ptr, bits_ptr, packed_ptr, scale_ptr, ws2_ptr, row, tile,
                blocks_per_matrix, EMAX: tl.constexpr, MODE: tl.constexpr, BLOCKS: tl.constexpr,
                PACK_WORDS: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Blocks of tile ``tile`` of table row ``row`` (see ``_pipelined_kernel``); ``ROWS``: one
    thread per block (``_4over6_blocks``, or ``_plain_blocks`` for modes 0 and 1; codes as
    one int64 per block)."""
    at = row.to(tl.int64) * 5
    SIX_EMAX: tl.constexpr = 6.0 * EMAX
    amax, s_enc, ws2 = _row_scales(meta_ptr, bits_ptr, ws2_ptr, at, tile, SIX_EMAX)
    x_ptr += tl.load(meta_ptr + at) * 16
    out = tl.load(meta_ptr + at + 1)
    scale_ptr += out
    offs = tile * BLOCKS + tl.arange(0, BLOCKS)
    ok = offs < blocks_per_matrix
    if ROWS:
        packed_ptr += out
        halves = x_ptr + offs[:, None] * 16 + tl.arange(0, 8)[None, :]
        x_lo = tl.load(halves, mask=ok[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(halves + 8, mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.maximum(tl.max(tl.abs(x_lo), axis=1), tl.max(tl.abs(x_hi), axis=1))
        if MODE >= 2:
            word, byte = _4over6_blocks(x_lo, x_hi, v, amax, s_enc, ws2, MODE == 3, SIX_EMAX)
        else:
            word, byte = _plain_blocks(x_lo, x_hi, v, s_enc, ws2, MODE)
        tl.store(packed_ptr + offs, word, mask=ok)
        tl.store(scale_ptr + offs, byte.to(tl.uint8), mask=ok)
    else:
        packed_ptr += out * (1 if PACK_WORDS else 8)
        cols = tl.arange(0, 16)
        x = tl.load(x_ptr + offs[:, None] * 16 + cols[None, :], mask=ok[:, None], other=0.0)
        x = x.to(tl.float32)
        v = tl.max(tl.abs(x), axis=1)  # finite here: equals the integer max of the bits
        codes, byte = _scales_and_codes(x, v, amax, s_enc, ws2, MODE, SIX_EMAX)
        _store_blocks(packed_ptr, scale_ptr, offs, ok, codes, byte, BLOCKS, PACK_WORDS)


@triton.jit
def _pipelined_kernel(
    x_ptr,
    meta_ptr,
    bits_ptr,
    packed_ptr,
    scale_ptr,
    ws2_ptr,
    q_first,
    q_rows,
    p_first,
    p_rows,
    blocks_per_matrix,
    tiles,  # programs per matrix: cdiv(blocks_per_matrix, BLOCKS), at least 1
    EMAX: tl.constexpr,
    MODE: tl.constexpr,
    BLOCKS: tl.constexpr,
    PACK_WORDS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The grouped path's quantize kernel: rows ``q_first..+q_rows`` of the table (their
    pre-pass ran in an earlier launch) as ``_quant_kernel`` (or, ``ROWS``,
    ``_quant_4over6_kernel``) would, each matrix's global amax from its slot, its output at
    block ``meta[OUT_AT]`` of the bucket's flat buffers, its ``weight_scale_2`` at
    ``meta[SCALE2_AT]``; NaN/Inf were flagged by the pre-pass (the bucket is then refused), so
    the block amax is a float max and no flag is kept. With ``p_rows`` it is one pipeline
    step: it pre-passes rows ``p_first..+p_rows`` too, a tile of each per program, so the
    memory-bound pre-pass and the arithmetic-bound quantize share every SM."""
    pid = tl.program_id(0)
    if pid < p_rows * tiles:
        _prepass_tile(x_ptr, meta_ptr, bits_ptr, p_first + pid // tiles, pid % tiles,
                      blocks_per_matrix * 16, BLOCKS * 16, 1)  # fmt: skip
    if pid < q_rows * tiles:
        _quant_tile(
            x_ptr, meta_ptr, bits_ptr, packed_ptr, scale_ptr, ws2_ptr, q_first + pid // tiles,
            pid % tiles, blocks_per_matrix, EMAX, MODE, BLOCKS, PACK_WORDS, ROWS,
        )  # fmt: skip


@triton.jit
def _block_halves(x_ptr, offs, ok):
    """Blocks ``offs`` (where ``ok``; zeros elsewhere) as two fp32 halves ``[B, 8]`` (one
    16-byte load each for BF16) and each block's max|x| as the integer max of the bits: exact,
    +0.0 for zeros, and NaN/Inf sort above every finite value, so one compare flags them."""
    halves = x_ptr + offs[:, None] * 16 + tl.arange(0, 8)[None, :]
    x_lo = tl.load(halves, mask=ok[:, None], other=0.0).to(tl.float32)
    x_hi = tl.load(halves + 8, mask=ok[:, None], other=0.0).to(tl.float32)
    v_bits = tl.maximum(
        tl.max(x_lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1),
        tl.max(x_hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1),
    )
    return x_lo, x_hi, v_bits


@triton.jit
def _outputs_at(addr_ptr, code_at, scale_at):
    """The output pointers of a bucket whose buffer's address is read from device memory
    (``addr_ptr``: one int64), so a recorded launch (a CUDA graph) writes each replay into
    the buffer allocated for it: ``weight_scale_2`` at the start (fp32), the codes at byte
    ``code_at`` (one int64 per block), the scale bytes at ``scale_at``."""
    base = tl.load(addr_ptr)
    packed_ptr = (base + code_at).to(tl.pointer_type(tl.int64))
    scale_ptr = (base + scale_at).to(tl.pointer_type(tl.uint8))
    ws2_ptr = base.to(tl.pointer_type(tl.float32))
    return packed_ptr, scale_ptr, ws2_ptr


@triton.jit
def _speculative_kernel(
    x_ptr,
    meta_ptr,
    bits_ptr,
    guess_ptr,
    packed_ptr,
    scale_ptr,
    ws2_ptr,
    addr_ptr,
    code_at,
    scale_at,
    first_row,
    blocks_per_matrix,
    tiles,  # programs per matrix: cdiv(blocks_per_matrix, BLOCKS), at least 1
    EMAX: tl.constexpr,
    MODE: tl.constexpr,
    BLOCKS: tl.constexpr,
    INDIRECT: tl.constexpr,
):
    """One read for both passes, betting on the global amax: tile ``pid % tiles`` of table row
    ``first_row + pid // tiles`` is quantized (one thread per block, as ``_quant_tile`` with
    ``ROWS``) under the amax its slot held at the last sync (``guess_ptr``), while the true
    max|x| and the non-finite flag go to ``bits`` as the pre-pass puts them. Where the bet and
    the truth differ in a single bit, ``_redo_kernel`` quantizes that matrix again; where they
    agree, these are the bytes the two-pass order writes (the same arithmetic on the same
    amax). ``INDIRECT``: the outputs' addresses come from ``_outputs_at`` (a recorded replay)."""
    if INDIRECT:
        packed_ptr, scale_ptr, ws2_ptr = _outputs_at(addr_ptr, code_at, scale_at)
    pid = tl.program_id(0)
    row = first_row + pid // tiles
    tile = pid % tiles
    at = row.to(tl.int64) * 5
    SIX_EMAX: tl.constexpr = 6.0 * EMAX
    slot = tl.load(meta_ptr + at + 2)
    s_enc, ws2 = _global_scales(tl.load(guess_ptr + slot).to(tl.float32, bitcast=True), SIX_EMAX)
    if tile == 0:
        tl.store(ws2_ptr + tl.load(meta_ptr + at + 4), ws2)
    x_ptr += tl.load(meta_ptr + at) * 16
    out = tl.load(meta_ptr + at + 1)
    offs = tile * BLOCKS + tl.arange(0, BLOCKS)
    ok = offs < blocks_per_matrix
    x_lo, x_hi, v_bits = _block_halves(x_ptr, offs, ok)
    a = tl.max(v_bits, axis=0)  # the tile's max|x| (bits): the slot's and the flag's input
    tl.atomic_max(bits_ptr + slot, a)
    tl.atomic_max(bits_ptr + tl.load(meta_ptr + at + 3), 1, mask=a >= 0x7F800000)
    word, byte = _plain_blocks(x_lo, x_hi, v_bits.to(tl.float32, bitcast=True), s_enc, ws2, MODE)
    tl.store(packed_ptr + out + offs, word, mask=ok)
    tl.store(scale_ptr + out + offs, byte.to(tl.uint8), mask=ok)


@triton.jit
def _redo_kernel(
    x_ptr,
    meta_ptr,
    bits_ptr,
    guess_ptr,
    packed_ptr,
    scale_ptr,
    ws2_ptr,
    addr_ptr,
    code_at,
    scale_at,
    first_row,
    blocks_per_matrix,
    tiles,
    programs,  # programs per matrix; program r takes tiles r, r + programs, ...
    EMAX: tl.constexpr,
    MODE: tl.constexpr,
    BLOCKS: tl.constexpr,
    INDIRECT: tl.constexpr,
):
    """After ``_speculative_kernel``: a matrix whose true amax (``bits``) differs from the
    bet (``guess_ptr``) is quantized again under the true one (``_quant_tile``, all of it, its
    ``weight_scale_2`` too); the others' programs return at once."""
    if INDIRECT:
        packed_ptr, scale_ptr, ws2_ptr = _outputs_at(addr_ptr, code_at, scale_at)
    pid = tl.program_id(0)
    row = first_row + pid // programs
    at = row.to(tl.int64) * 5
    slot = tl.load(meta_ptr + at + 2)
    if tl.load(bits_ptr + slot) != tl.load(guess_ptr + slot):
        for tile in range(pid % programs, tiles, programs):
            _quant_tile(
                x_ptr, meta_ptr, bits_ptr, packed_ptr, scale_ptr, ws2_ptr, row, tile,
                blocks_per_matrix, EMAX, MODE, BLOCKS, True, True,
            )  # fmt: skip


@triton.jit
def _e2m1_code_1d(x, e):
    """E2M1 codes (int32) of fp32 values ``x`` under per-block encode scales ``e``."""
    y = x * e
    idx = _e2m1_index(tl.minimum(tl.abs(y), 6.0))
    return idx | tl.where(y < 0.0, 8, 0)


@triton.jit
def _columns8(t):
    """The 8 columns of ``t [B, 8]`` in order; each thread holds whole rows, so no data moves."""
    B: tl.constexpr = t.shape[0]
    even, odd = tl.split(tl.reshape(t, [B, 4, 2]))  # cols 2i | 2i+1
    c04, c26 = tl.split(tl.reshape(even, [B, 2, 2]))  # cols 0 4 | 2 6
    c15, c37 = tl.split(tl.reshape(odd, [B, 2, 2]))  # cols 1 5 | 3 7
    c0, c4 = tl.split(c04)
    c2, c6 = tl.split(c26)
    c1, c5 = tl.split(c15)
    c3, c7 = tl.split(c37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _add_in_order(acc, t):
    """``acc + t[:, 0] + ... + t[:, 7]``, one addition after another."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _columns8(t)
    acc = acc + c0
    acc = acc + c1
    acc = acc + c2
    acc = acc + c3
    acc = acc + c4
    acc = acc + c5
    acc = acc + c6
    return acc + c7


@triton.jit
def _sum16_in_order(lo, hi):
    """Per row, the 16 values ``lo [B, 8]`` then ``hi [B, 8]`` summed one after another from
    the first (TE's and the reference's order)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _columns8(lo)
    acc = c0 + c1
    acc = acc + c2
    acc = acc + c3
    acc = acc + c4
    acc = acc + c5
    acc = acc + c6
    acc = acc + c7
    return _add_in_order(acc, hi)


@triton.jit
def _dequant_scaled(code, unit, unit15):
    """The reference's ``((q * s) * A) / (6*Emax)`` of E2M1 codes, from the block's two
    correctly rounded values ``unit = (s*A)/(6*Emax)`` and ``unit15 = ((1.5*s)*A)/(6*Emax)``:
    |q| is 2**j or 1.5 * 2**j (j in -1..2), ``q*s`` is exact, and scaling by 2**j commutes
    with each rounding while every value stays a normal float (the caller's amax range)."""
    idx = code & 7
    odd = ((idx & 1) != 0) & (idx > 1)  # 1.5, 3, 6
    # +-2**((idx >> 1) - 1): 0.5 1 1 2 2 4 4 for idx 1..7, the sign from code bit 3
    factor = ((((idx >> 1) + 126) << 23) | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    val = tl.where(odd, unit15, unit) * factor
    return tl.where(idx == 0, 0.0, val)


@triton.jit
def _dequant_divided(code, sf, amax, DENOM: tl.constexpr):
    """``((q * s) * A) / (6*Emax)`` of E2M1 codes, one correctly rounded division each."""
    idx = (code & 7).to(tl.float32)
    mag = tl.where(idx < 4.0, idx * 0.5, tl.where(idx < 6.0, idx - 2.0, (idx - 4.0) * 2.0))
    q = tl.where((code & 8) != 0, -mag, mag)
    return tl.math.div_rn((q * sf) * amax, tl.full(q.shape, DENOM, tl.float32))


@triton.jit
def _error(val, x, MSE: tl.constexpr):
    diff = val - x
    return diff * diff if MSE else tl.abs(diff)


@triton.jit
def _plain_blocks(x_lo, x_hi, v, s_enc, ws2, MODE: tl.constexpr):
    """Modes 0 and 1 (4-over-6 off) with one thread per block, as ``_scales_and_codes`` and
    ``_store_blocks`` compute them: packed codes (one int64 per block) and scale bytes."""
    if MODE == 0:
        d = v * (s_enc * 0.16666666666666666)
    else:
        d = tl.math.div_rn(v, tl.full(v.shape, 6.0, tl.float32)) * s_enc
    byte, sf = _e4m3_rne(tl.minimum(d, 448.0))
    one = tl.full(v.shape, 1.0, tl.float32)
    e = tl.minimum(tl.math.div_rn(one, sf * ws2), 3.4028234663852886e38)[:, None]
    # each half's eight 4-bit codes into one 32-bit word (disjoint bits: the sum is their or,
    # carries never happen), widened once per block: 64-bit shifts and adds per element cost
    # twice the integer issue slots of 32-bit ones, and this kernel is bound by them
    shifts = (tl.arange(0, 8) * 4)[None, :]
    lo = tl.sum(_e2m1_code_1d(x_lo, e) << shifts, axis=1)
    hi = tl.sum(_e2m1_code_1d(x_hi, e) << shifts, axis=1)
    return (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32), byte


@triton.jit
def _quant_4over6_kernel(
    x_ptr,
    amax_ptr,
    slot_ptr,
    packed_ptr,
    scale_ptr,
    ws2_ptr,
    flag_ptr,
    blocks_per_matrix,
    EMAX: tl.constexpr,
    MSE: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """4-over-6 with one thread per block: its two 8-element halves arrive as two vector
    loads into the same thread, so per-block work (scales, reciprocals) runs once per block
    and the errors sum in element order in registers. The dequantized values come from two
    divisions per block and candidate (``_dequant_scaled``) when the global amax lies in
    [2**-100, 2**115]; outside it (every value tiny or huge) one division per element."""
    pid = tl.program_id(0)
    m = tl.program_id(1)
    slot = tl.load(slot_ptr + m)
    amax = tl.load(amax_ptr + slot)
    SIX_EMAX: tl.constexpr = 6.0 * EMAX  # exact: 2688 or 1536
    s_enc, ws2 = _global_scales(amax, SIX_EMAX)
    if pid == 0:
        tl.store(ws2_ptr + m, ws2)
    first = m.to(tl.int64) * blocks_per_matrix
    x_ptr += first * 16
    scale_ptr += first
    packed_ptr += first
    offs = pid * BLOCKS + tl.arange(0, BLOCKS)
    ok = offs < blocks_per_matrix
    x_lo, x_hi, v_bits = _block_halves(x_ptr, offs, ok)
    bad = tl.max((v_bits >= 0x7F800000).to(tl.int32), axis=0)
    tl.atomic_max(flag_ptr, bad, mask=bad > 0)
    v = v_bits.to(tl.float32, bitcast=True)

    word, byte = _4over6_blocks(x_lo, x_hi, v, amax, s_enc, ws2, MSE, SIX_EMAX)
    tl.store(packed_ptr + offs, word, mask=ok)
    tl.store(scale_ptr + offs, byte.to(tl.uint8), mask=ok)


@triton.jit
def _4over6_blocks(x_lo, x_hi, v, amax, s_enc, ws2, MSE: tl.constexpr, SIX_EMAX: tl.constexpr):
    """Packed codes (one int64 per block) and scale bytes of 4-over-6 blocks held one per
    thread as two 8-element halves, with block amaxes ``v``."""
    base = tl.math.div_rn(v, tl.full(v.shape, 6.0, tl.float32)) * s_enc
    b6, sf6 = _e4m3_rne(tl.minimum(base, 448.0))
    b4, sf4 = _e4m3_rne(tl.minimum(base * 1.5, 448.0))
    one = tl.full(v.shape, 1.0, tl.float32)
    e6 = tl.minimum(tl.math.div_rn(one, sf6 * ws2), 3.4028234663852886e38)[:, None]
    e4 = tl.minimum(tl.math.div_rn(one, sf4 * ws2), 3.4028234663852886e38)[:, None]
    c6_lo = _e2m1_code_1d(x_lo, e6)
    c6_hi = _e2m1_code_1d(x_hi, e6)
    c4_lo = _e2m1_code_1d(x_lo, e4)
    c4_hi = _e2m1_code_1d(x_hi, e4)
    if (amax >= 7.888609052210118e-31) & (amax <= 4.153837486827862e34):  # 2**-100, 2**115
        denom = tl.full(v.shape, SIX_EMAX, tl.float32)
        u6 = tl.math.div_rn(sf6 * amax, denom)[:, None]
        w6 = tl.math.div_rn((sf6 * 1.5) * amax, denom)[:, None]
        u4 = tl.math.div_rn(sf4 * amax, denom)[:, None]
        w4 = tl.math.div_rn((sf4 * 1.5) * amax, denom)[:, None]
        err6 = _sum16_in_order(
            _error(_dequant_scaled(c6_lo, u6, w6), x_lo, MSE),
            _error(_dequant_scaled(c6_hi, u6, w6), x_hi, MSE),
        )
        err4 = _sum16_in_order(
            _error(_dequant_scaled(c4_lo, u4, w4), x_lo, MSE),
            _error(_dequant_scaled(c4_hi, u4, w4), x_hi, MSE),
        )
    else:
        s6 = sf6[:, None]
        s4 = sf4[:, None]
        err6 = _sum16_in_order(
            _error(_dequant_divided(c6_lo, s6, amax, SIX_EMAX), x_lo, MSE),
            _error(_dequant_divided(c6_hi, s6, amax, SIX_EMAX), x_hi, MSE),
        )
        err4 = _sum16_in_order(
            _error(_dequant_divided(c4_lo, s4, amax, SIX_EMAX), x_lo, MSE),
            _error(_dequant_divided(c4_hi, s4, amax, SIX_EMAX), x_hi, MSE),
        )
    use4 = (err4 < err6)[:, None]
    shifts = (tl.arange(0, 8) * 4).to(tl.int64)[None, :]
    lo = tl.sum(tl.where(use4, c4_lo, c6_lo).to(tl.int64) << shifts, axis=1)  # disjoint bits
    hi = tl.sum(tl.where(use4, c4_hi, c6_hi).to(tl.int64) << shifts, axis=1)
    return lo | (hi << 32), tl.where(err4 < err6, b4, b6)


def amax_into(x: torch.Tensor, bits: torch.Tensor, slots: torch.Tensor) -> None:
    """Fold max|x[m]| into ``bits[slots[m]]`` (int32 views of fp32) for ``x`` of shape [M, L]."""
    m, per = x.shape
    if per == 0 or m == 0:
        return
    grid = (triton.cdiv(per, _AMAX_TILE * _AMAX_TILES_PER_PROGRAM), m)
    _amax_kernel[grid](
        x, bits, slots, per, TILE=_AMAX_TILE, TILES=_AMAX_TILES_PER_PROGRAM,
        enable_fp_fusion=False,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class KernelTuning:
    """Launch shape of the quantize kernels; none of it changes the bytes written. Defaults are
    the fastest of ``benchmarks/gpu_nvfp4_throughput.py --sweep`` on an H200: 256 blocks x 2
    warps with byte packing (2026-12-01), and for 4-over-6 the one-thread-per-block kernel at
    128 blocks x 4 warps (2026-12-02; ``four_over_six_rows=False``: the block-tile kernel,
    one division per element, 32 blocks x 2 warps was its best). The grouped path's pre-pass
    shape is the old amax kernel's; ``pipeline`` and its stage size were set on 2026-12-06
    before any GPU run (``benchmarks/bench_live_quantize.py`` reports both orders). On an H100
    (2026-12-06, third lease) the grouped quantize ran fastest one thread per block, 256 blocks
    x 4 warps, pipelined: 0.766 ms against 0.852 ms for 256 block tiles x 2 warps on 8 x
    [8192, 7168] BF16; the per-tensor kernel is the same at 2 or 4 warps (0.531 / 0.534 ms)."""

    blocks_per_program: int = 256
    num_warps: int = 4
    pack_words: bool = False
    four_over_six_rows: bool = True  # 4-over-6 in the one-thread-per-block kernel
    blocks_per_program_4over6: int = 128
    num_warps_4over6: int = 4
    max_registers_4over6: int | None = None  # Triton's maxnreg for the 4-over-6 kernels
    prepass_tile: int = _AMAX_TILE  # elements per step of the grouped path's pre-pass
    prepass_tiles: int = _AMAX_TILES_PER_PROGRAM  # steps per program
    prepass_warps: int = 4
    block_per_thread: bool = True  # grouped path, 4-over-6 off: one thread per block
    pipeline: bool = True  # grouped path (4-over-6 off): a stage's pre-pass beside the
    # previous stage's quantize, in one launch
    pipeline_stage_bytes: int = 64 << 20  # least input per pipeline stage
    speculate: bool = True  # grouped path, a bucket seen before (4-over-6 off, one thread per
    # block): one read, betting on the last run's amaxes; a lost bet re-quantizes that matrix
    replay: bool = True  # a betting bucket's launches recorded once (a CUDA graph on CUDA)
    # and replayed, the outputs' address read on the device: one host call per sync


DEFAULT_TUNING = KernelTuning()


def quantize_matrices(
    x: torch.Tensor,
    amax: torch.Tensor,
    slots: torch.Tensor,
    *,
    four_over_six: str,
    scale_rounding: str,
    emax: float,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize contiguous ``x [M, N, K]``; matrix m uses global amax ``amax[slots[m]]``.

    Returns packed ``[M, N, K/2]`` uint8, scales ``[M, N, K/16]`` float8_e4m3fn, ``scale_2``
    ``[M]`` fp32, and an int32 flag (nonzero when some block held NaN or Inf) left on the
    device, so a caller can check many results with one synchronisation.
    """
    mats, n, k = x.shape
    dev = x.device
    if n * k >= 2**31:
        raise ValueError(f"one matrix of {n}x{k} elements exceeds the kernel's int32 offsets")
    packed = torch.empty((mats, n, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((mats, n, k // 16), dtype=torch.float8_e4m3fn, device=dev)
    ws2 = torch.empty((mats,), dtype=torch.float32, device=dev)
    flag = torch.zeros((1,), dtype=torch.int32, device=dev)
    blocks = n * k // 16
    if mats == 0 or blocks == 0:
        return packed, scale, ws2, flag
    if four_over_six != "off" and tuning.four_over_six_rows:
        grid = (triton.cdiv(blocks, tuning.blocks_per_program_4over6), mats)
        _quant_4over6_kernel[grid](
            x, amax, slots, packed.view(torch.int64), scale.view(torch.uint8), ws2, flag,
            blocks, EMAX=float(emax), MSE=four_over_six == "mse",
            BLOCKS=tuning.blocks_per_program_4over6, num_warps=tuning.num_warps_4over6,
            enable_fp_fusion=False, **_max_registers(tuning),
        )  # fmt: skip
        return packed, scale, ws2, flag
    tile, warps = tuning.blocks_per_program, tuning.num_warps
    if four_over_six != "off":
        tile, warps = tuning.blocks_per_program_4over6, tuning.num_warps_4over6
    grid = (triton.cdiv(blocks, tile), mats)
    _quant_kernel[grid](
        x, amax, slots, packed.view(torch.int64) if tuning.pack_words else packed,
        scale.view(torch.uint8), ws2, flag, blocks,
        EMAX=float(emax), MODE=_MODES[(four_over_six, scale_rounding)],
        BLOCKS=tile, PACK_WORDS=tuning.pack_words, num_warps=warps, enable_fp_fusion=False,
        **(_max_registers(tuning) if four_over_six != "off" else {}),
    )  # fmt: skip
    return packed, scale, ws2, flag


def _max_registers(tuning: KernelTuning) -> dict[str, int]:
    n = tuning.max_registers_4over6
    return {} if n is None else {"maxnreg": n}


@dataclass(frozen=True, slots=True)
class OutputsAt:
    """Where a bucket's outputs go when the address is read on the device: ``addr`` holds
    one int64, the buffer's address (``weight_scale_2`` there, fp32), the codes start
    ``code_at`` bytes in and the scale bytes ``scale_at`` bytes in."""

    addr: torch.Tensor
    code_at: int
    scale_at: int


REDO_PROGRAMS = 256  # programs per matrix of the redo launch (one wave when none redoes)


def speculate_rows(
    x: torch.Tensor,
    meta: torch.Tensor,
    bits: torch.Tensor,
    guess: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | OutputsAt,
    rows: range,
    blocks_per_matrix: int,
    *,
    redo: bool,
    scale_rounding: str,
    emax: float,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> None:
    """Launch the one-read quantize of table rows ``rows`` under the amaxes in ``guess`` (int32
    bits per slot) or, ``redo``, the second quantize of every matrix whose true amax differs
    (4-over-6 off). Every speculative launch of a bucket must come before its first redo (a
    pair's halves of two sizes share a slot across launches). ``out``: the bucket's flat
    codes, scales and ``weight_scale_2``, or an :class:`OutputsAt` (the kernels read the
    buffer's address from the device: a launch recorded once writes where each replay says)."""
    if not rows:
        return
    if blocks_per_matrix * 16 >= 2**31:
        raise ValueError(
            f"one matrix of {blocks_per_matrix * 16} elements exceeds the kernel's int32 offsets"
        )
    tile, warps = tuning.blocks_per_program, tuning.num_warps
    tiles = max(1, triton.cdiv(blocks_per_matrix, tile))
    mode = _MODES[("off", scale_rounding)]
    if isinstance(out, OutputsAt):
        addr = out.addr
        outputs = (x, meta, bits, guess, addr, addr, addr, addr, out.code_at, out.scale_at)
    else:
        packed, scale, ws2 = out
        outputs = (x, meta, bits, guess, packed.view(torch.int64), scale, ws2, bits, 0, 0)
    indirect = isinstance(out, OutputsAt)
    if not redo:
        _speculative_kernel[(tiles * len(rows),)](
            *outputs, rows.start, blocks_per_matrix, tiles, EMAX=float(emax), MODE=mode,
            BLOCKS=tile, INDIRECT=indirect, num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
        return
    programs = min(tiles, REDO_PROGRAMS)
    _redo_kernel[(programs * len(rows),)](
        *outputs, rows.start, blocks_per_matrix, tiles, programs, EMAX=float(emax), MODE=mode,
        BLOCKS=tile, INDIRECT=indirect, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip


def prepass_rows(
    x: torch.Tensor,
    meta: torch.Tensor,
    bits: torch.Tensor,
    rows: range,
    per_matrix: int,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> None:
    """Launch the pre-pass over table rows ``rows`` (matrices of ``per_matrix`` elements each,
    addressed from ``x``'s data pointer): amax bits and non-finite flags into ``bits``."""
    if per_matrix == 0 or not rows:
        return
    grid = (triton.cdiv(per_matrix, tuning.prepass_tile * tuning.prepass_tiles), len(rows))
    _prepass_kernel[grid](
        x, meta, bits, rows.start, per_matrix, TILE=tuning.prepass_tile,
        TILES=tuning.prepass_tiles, num_warps=tuning.prepass_warps, enable_fp_fusion=False,
    )  # fmt: skip


def quantize_rows(
    x: torch.Tensor,
    meta: torch.Tensor,
    bits: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    quantize: range,
    prepass: range,
    blocks_per_matrix: int,
    *,
    four_over_six: str,
    scale_rounding: str,
    emax: float,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> None:
    """Launch the grouped quantize kernel over table rows ``quantize`` (already pre-passed;
    ``out``: the bucket's flat packed-code bytes, scale bytes and fp32 ``weight_scale_2``),
    pre-passing rows ``prepass`` in the same launch (a pipeline step: 4-over-6 off only)."""
    if not quantize and not prepass:
        return
    if prepass and four_over_six != "off":
        raise ValueError("a pipelined pre-pass runs beside the block-tile kernel only")
    if blocks_per_matrix * 16 >= 2**31:
        raise ValueError(
            f"one matrix of {blocks_per_matrix * 16} elements exceeds the kernel's int32 offsets"
        )
    packed, scale, ws2 = out
    one_per_thread = (
        tuning.four_over_six_rows if four_over_six != "off" else tuning.block_per_thread
    )
    tile, warps = tuning.blocks_per_program, tuning.num_warps
    if four_over_six != "off":
        tile, warps = tuning.blocks_per_program_4over6, tuning.num_warps_4over6
    words = one_per_thread or tuning.pack_words
    # at least one program per matrix: it writes weight_scale_2 even for an empty matrix
    tiles = max(1, triton.cdiv(blocks_per_matrix, tile))
    grid = (tiles * max(len(quantize), len(prepass)),)
    _pipelined_kernel[grid](
        x, meta, bits, packed.view(torch.int64) if words else packed, scale, ws2,
        quantize.start, len(quantize), prepass.start, len(prepass), blocks_per_matrix, tiles,
        EMAX=float(emax), MODE=_MODES[(four_over_six, scale_rounding)], BLOCKS=tile,
        PACK_WORDS=words, ROWS=one_per_thread, num_warps=warps, enable_fp_fusion=False,
        **(_max_registers(tuning) if four_over_six != "off" else {}),
    )  # fmt: skip
