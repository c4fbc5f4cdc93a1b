"""The strict kernels' forwards as one fused C kernel (``_strict_kernels.c``), the same bits
as torch's: the linear (``strict_linear``), attention's product trees (``product_tree``,
batched ``strict_matmul``), ``tree_sum``, ``exp_strict``, whole attention over key rows
(``row_attention``), RMSNorm (``rms_norm``), SiLU-and-multiply (``silu_mul``) and a MoE
layer's routed experts (``routed_experts``); and the backwards of attention and RMSNorm (``row_attention_backward``, ``rms_norm_backward``:
sequential fp32 sums, the same bits run to run, no bit contract).

``StrictOps.linear`` computes ``rows[R, K] @ w.T`` as a product tensor ``[K, R, N]`` written
to memory and a pairwise tree of elementwise adds over ``K`` (padded with ``+0.0`` to a power
of two) read back level by level. The C kernel does the same IEEE multiplies and adds on the
same pairs, streaming the products through a small stack of partial sums instead (see the
source's comment), so its result is bit for bit torch's: signed zeros, infinities,
denormals, and a NaN where torch has one (which of two different NaNs wins where they meet is
the CPU's operand order, which torch's own kernels do not fix either). It is compiled with ``-O3 -ffp-contract=off`` (no fused multiply-adds, no fast math)
by the system C compiler at first use into a per-user cache keyed by the source, the flags,
the compiler's version and the CPU's flags, and loaded with ``ctypes`` (no torch headers, so
the compile takes well under a second).

Environment:

* ``POSTTRAIN_STRICT_CKERNEL=0`` keeps the torch kernels (same bits, slower);
* ``CC`` names the compiler (default ``cc``, then ``gcc``, then ``clang``);
* ``POSTTRAIN_KERNEL_CACHE`` names the cache folder (default
  ``$XDG_CACHE_HOME/posttrain/kernels``, else ``~/.cache/posttrain/kernels``).

Where the kernel cannot be built or loaded (no compiler, a failed compile, an unwritable
cache) one warning is logged and every call returns ``None``: the callers keep torch's path,
which gives the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

_log = logging.getLogger("posttrain.models")

_SOURCE = Path(__file__).with_name("_strict_kernels.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
SWITCH_ENV = "POSTTRAIN_STRICT_CKERNEL"
CACHE_ENV = "POSTTRAIN_KERNEL_CACHE"


def cache_dir() -> Path:
    """Where compiled kernels live (see the module docstring)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "posttrain" / "kernels"


def _compiler() -> list[str] | None:
    """The compiler command: ``$CC`` (as given, even if it does not exist) or the first of
    ``cc``, ``gcc``, ``clang`` on ``PATH``."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``), or ``""`` where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return " ".join(sorted(value.split()))
    return ""


def _flag_sets() -> list[list[str]]:
    """The compile flags to try in order: with ``-march=native`` first on x86-64 where the CPU's
    flags (part of the cache key) are known, so a cached library never meets a CPU it was not
    built for; then the portable flags (a compiler that refuses ``-march=native``)."""
    native = platform.machine().lower() in ("x86_64", "amd64") and bool(_cpu_flags())
    return [[*_FLAGS, "-march=native"], list(_FLAGS)] if native else [list(_FLAGS)]


def _compile(cc: list[str], flags: list[str], target: Path) -> None:
    """Compile the source to ``target`` through a temporary file in its folder, renamed into
    place, so processes compiling at once each load a whole library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [*cc, *flags, "-o", tmp, str(_SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(cc)} exited {done.returncode}: {done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> ctypes.CDLL:
    """Load the cached library for this source, compiler and CPU, compiling it if missing."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc/clang)")
    try:
        version = subprocess.run(
            [*cc, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C compiler {shlex.join(cc)!r} cannot run: {exc}") from exc
    failure: RuntimeError | None = None
    for flags in _flag_sets():
        key = hashlib.sha256()
        for part in (_SOURCE.read_bytes(), " ".join(flags).encode(), version.encode()):
            key.update(part)
            key.update(b"\0")
        key.update(_cpu_flags().encode())
        target = cache_dir() / f"strict_linear-{key.hexdigest()[:24]}.so"
        if not target.exists():
            try:
                _compile(cc, flags, target)
            except RuntimeError as exc:
                failure = failure or exc
                continue
        lib = ctypes.CDLL(str(target))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.posttrain_strict_matmul.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        lib.posttrain_strict_matmul.restype = ctypes.c_int
        lib.posttrain_exp_strict.argtypes = [ptr, i64, ptr, ptr]
        lib.posttrain_exp_strict.restype = None
        lib.posttrain_row_attention.argtypes = [
            *(ptr, ptr) * 3,
            ptr,
            ptr,
            ptr,
            *(i64,) * 5,
            ctypes.c_float,
            i64,
            ptr,
        ]
        lib.posttrain_row_attention.restype = ctypes.c_int
        lib.posttrain_row_attention_backward.argtypes = [
            *(ptr, ptr) * 3,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            *(i64,) * 5,
            ctypes.c_float,
            i64,
            ptr,
        ]
        lib.posttrain_row_attention_backward.restype = ctypes.c_int
        lib.posttrain_silu_mul.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr]
        lib.posttrain_silu_mul.restype = None
        lib.posttrain_rms_norm_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
        lib.posttrain_rms_norm_backward.restype = None
        lib.posttrain_rms_norm_ms.argtypes = [ptr, ptr, i64, i64, ctypes.c_float]
        lib.posttrain_rms_norm_ms.restype = ctypes.c_int
        lib.posttrain_rms_norm_scale.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
        lib.posttrain_rms_norm_scale.restype = None
        lib.posttrain_routed_experts.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, i64, i64,
                                                 ptr, ptr, ptr, ptr, ptr]  # fmt: skip
        lib.posttrain_routed_experts.restype = ctypes.c_int
        return lib
    assert failure is not None
    raise failure


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel library, or ``None`` (switched off, or it cannot be built: one
    warning names why)."""
    if os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        return _build()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _log.warning(
            "posttrain.models: the fused strict CPU kernel is unavailable (%s); using the torch "
            "kernels (the same bits, slower). Set %s=0 to skip the compile.",
            exc,
            SWITCH_ENV,
        )
        return None


def available() -> bool:
    """Whether the library is built (compiling it at the first call)."""
    return library() is not None


def _applies(*tensors: Tensor) -> bool:
    """Whether the kernel may run on these operands: CPU fp32, autograd not recording."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if (grad and t.requires_grad) or t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return True


def reads_views(*tensors: Tensor) -> bool:
    """Whether ``product_tree`` will take these operands (CPU fp32, autograd not recording, the
    library built): then it reads strided views in place and the caller need not copy them."""
    return _applies(*tensors) and available()


def strict_linear(rows: Tensor, w_t: Tensor) -> Tensor | None:
    """``rows[R, K] @ w_t[K, 1, N]`` (``w_t`` the weight transposed, as ``_ops`` holds it) as
    products and ``_ops._tree_levels`` over K padded with ``+0.0`` to a power of two, bit for
    bit: ``[R, N]``; ``None`` where the kernel does not apply (not CPU fp32, autograd
    recording, K = 0, or no library): the caller then runs torch's path. Any strides."""
    if rows.dim() != 2 or w_t.dim() != 3 or w_t.shape[1] != 1:
        return None
    (r, k), n = rows.shape, w_t.shape[2]
    if w_t.shape[0] != k or k == 0 or not _applies(rows, w_t):
        return None
    xs, ws = (rows.stride(0), rows.stride(1)), (w_t.stride(0), w_t.stride(2))
    return _matmul(rows, xs, w_t, ws, (), r, k, n)


def tree_sum(x: Tensor, dim: int) -> Tensor | None:
    """``_ops.tree_sum(x, dim)`` (the pairwise tree over ``dim`` padded with ``+0.0``), bit for
    bit: the strict linear of ``x``'s rows against ones (each product ``v * 1.0`` is ``v``
    exactly; a signalling NaN, which no strict op makes, would come out quiet). ``None`` where
    the kernel does not apply."""
    if x.dim() == 0 or x.shape[dim] == 0 or not _applies(x):
        return None
    v = x.movedim(dim, -1)
    k = v.shape[-1]
    out = strict_linear(v.reshape(-1, k), _ONE.expand(k, 1, 1))
    return None if out is None else out.reshape(v.shape[:-1])


_ONE = torch.ones(1, 1, 1)


def strict_matmul(x: Tensor, w: Tensor) -> Tensor | None:
    """``strict_linear`` for each of a batch: ``x[*batch, R, K]``, ``w[*batch, K, N]`` (the same
    batch dims, at most two; any strides) give ``[*batch, R, N]``; ``None`` where the kernel
    does not apply."""
    if x.dim() < 2 or x.dim() != w.dim() or x.shape[:-2] != w.shape[:-2] or x.dim() > 4:
        return None
    (r, k), n = x.shape[-2:], w.shape[-1]
    if w.shape[-2] != k or k == 0 or not _applies(x, w):
        return None
    xs, ws = x.stride(), w.stride()
    return _matmul(x, xs, w, (*ws[:-2], ws[-2], ws[-1]), tuple(x.shape[:-2]), r, k, n)


def product_tree(a: Tensor, b: Tensor) -> Tensor | None:
    """``_ops._tree_sum_owned(a * b)`` for the batched-matmul broadcast ``a[K, *batch, R, 1]``,
    ``b[K, *batch, 1, N]`` (attention's scores and its probabilities times values; at most two
    batch dims; any strides), bit for bit: ``[*batch, R, N]``; ``None`` for any other shape or
    where the kernel does not apply."""
    if (
        a.dim() < 3
        or a.dim() > 5
        or a.dim() != b.dim()
        or a.shape[0] != b.shape[0]
        or a.shape[0] == 0
        or a.shape[-1] != 1
        or b.shape[-2] != 1
        or a.shape[1:-2] != b.shape[1:-2]
        or not _applies(a, b)
    ):
        return None
    sa, sb = a.stride(), b.stride()
    xs = (*sa[1:-2], sa[-2], sa[0])  # x[batch, r, k] = a[k, batch, r, 0]
    ws = (*sb[1:-2], sb[0], sb[-1])  # w[batch, k, n] = b[k, batch, 0, n]
    return _matmul(a, xs, b, ws, tuple(a.shape[1:-2]), a.shape[-2], a.shape[0], b.shape[-1])


def _matmul(
    x: Tensor,
    xs: tuple[int, ...],
    w: Tensor,
    ws: tuple[int, ...],
    batch: tuple[int, ...],
    r: int,
    k: int,
    n: int,
) -> Tensor | None:
    """``out[*batch, R, N]`` from ``x`` and ``w`` read through the element strides ``xs``
    (batch dims, then R, K) and ``ws`` (batch dims, then K, N); at most two batch dims."""
    lib = library()
    if lib is None:
        return None
    out = torch.empty((*batch, r, n), dtype=torch.float32)
    if not out.numel():
        return out
    nb = len(batch)
    b1, b2 = (1, 1) if nb == 0 else (batch[0], 1) if nb == 1 else batch
    pad = (0,) * (2 - nb)
    operands = (x, (*xs[:nb], *pad, *xs[nb:]), w, (*ws[:nb], *pad, *ws[nb:]))
    return _run(lib, operands, out, (b1, b2, r, k, n))


def _run(
    lib: ctypes.CDLL,
    operands: tuple[Tensor, tuple[int, ...], Tensor, tuple[int, ...]],
    out: Tensor,
    dims: tuple[int, int, int, int, int],
) -> Tensor | None:
    """Fill ``out[B1, B2, R, N]`` (``dims``: B1, B2, R, K, N): one call, or above
    ``_PARALLEL_PRODUCTS`` one per torch thread (slices of the outer batch, or of the rows).
    ctypes releases the GIL for the call, so the parts run at once; rows and problems are
    reduced independently, so the split never changes a bit."""
    x, xs, w, ws = operands
    b1, b2, r, k, n = dims
    fn = lib.posttrain_strict_matmul
    i64s = _I64S
    if b1 == 1 and b2 > 1:  # one batch dim: split it as the outer one
        b1, b2, xs, ws = b2, 1, (xs[1], 0, *xs[2:]), (ws[1], 0, *ws[2:])
    threads = torch.get_num_threads()
    if threads == 1 or b1 * b2 * r * k * n < _PARALLEL_PRODUCTS:
        code = fn(x.data_ptr(), i64s(*xs), w.data_ptr(), i64s(*ws), out.data_ptr(), b1, b2, r, k, n)
        return None if code else out
    size = 4  # bytes per fp32
    if b1 > 1:
        cuts = [b1 * i // threads for i in range(threads + 1)]
        # (first problem, problems, first row, rows)
        parts = [(lo, hi - lo, 0, r) for lo, hi in itertools.pairwise(cuts) if hi > lo]
    else:
        cuts = [r * i // threads for i in range(threads + 1)]
        parts = [(0, 1, lo, hi - lo) for lo, hi in itertools.pairwise(cuts) if hi > lo]

    def call(part: tuple[int, int, int, int]) -> int:
        p0, pb, r0, rr = part
        code: int = fn(
            x.data_ptr() + size * (p0 * xs[0] + r0 * xs[2]),
            i64s(*xs),
            w.data_ptr() + size * p0 * ws[0],
            i64s(*ws),
            out.data_ptr() + size * (p0 * b2 * r * n + r0 * n),
            pb,
            b2,
            rr,
            k,
            n,
        )
        return code

    return None if any(_pool(len(parts)).map(call, parts)) else out


_PARALLEL_PRODUCTS = 1 << 20
"""Products at which a call splits its work over torch's thread count (below it one call: a
thread hand-off costs more than the work)."""
_I64S = ctypes.c_int64 * 4
"""The four element strides the C kernel reads per operand."""


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """A thread pool of ``workers`` threads (one per thread count asked for)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="posttrain-strict")


def exp_strict(x: Tensor, coeffs: Tensor) -> Tensor | None:
    """``_ops.exp_strict(x)`` elementwise in one pass, bit for bit (``coeffs``: the Horner
    constants as fp32), contiguous and shaped like ``x``; ``None`` where the kernel does not
    apply."""
    if not _applies(x):
        return None
    lib = library()
    if lib is None:
        return None
    xc = x.contiguous()
    out = torch.empty_like(xc)
    lib.posttrain_exp_strict(xc.data_ptr(), xc.numel(), coeffs.data_ptr(), out.data_ptr())
    return out


def row_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    kstart: Tensor,
    pos: Tensor,
    *,
    scale: float,
    window: int | None,
    coeffs: Tensor,
) -> Tensor | None:
    """``StrictOps.attend_rows`` in one pass, bit for bit the torch path's attention
    (``StrictOps.attention`` over the gathered key rows): ``q[T, heads, hd]`` over the rows
    ``keys[S, kv_heads, hd]``, ``values[S, kv_heads, hd_v]`` from ``kstart[t]``, slots up to
    ``pos[t]`` (and within ``window``); ``[T, heads * hd_v]``. ``coeffs``: ``exp_strict``'s
    Horner constants as fp32. ``None`` where the kernel does not apply (the caller then runs
    torch's path). Any strides; every key row a query can see must exist (not checked here)."""
    if q.dim() != 3 or keys.dim() != 3 or values.dim() != 3 or not _applies(q, keys, values):
        return None
    t, heads, hd = q.shape
    kv_heads, hd_v = keys.shape[1], values.shape[2]
    if keys.shape[2] != hd or values.shape[1] != kv_heads or heads % max(kv_heads, 1):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty((t, heads, hd_v), dtype=torch.float32)
    if not out.numel():
        return out.reshape(t, -1)
    starts = kstart.to(torch.int64).contiguous()
    positions = pos.to(torch.int64).contiguous()
    code = lib.posttrain_row_attention(
        q.data_ptr(), _I3(*q.stride()), keys.data_ptr(), _I3(*keys.stride()),
        values.data_ptr(), _I3(*values.stride()), starts.data_ptr(), positions.data_ptr(),
        out.data_ptr(), t, heads, kv_heads, hd, hd_v, scale, window or 0, coeffs.data_ptr(),
    )  # fmt: skip
    return None if code else out.reshape(t, -1)


def row_attention_backward(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    kstart: Tensor,
    pos: Tensor,
    grad: Tensor,
    *,
    scale: float,
    window: int | None,
    coeffs: Tensor,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The gradients ``(dq, dkeys, dvalues)`` of ``row_attention`` for the output gradient
    ``grad`` (``[T, heads * hd_v]``): the forward's probabilities recomputed with its own ops,
    then sequential fp32 sums in a fixed order (run-to-run deterministic; no bit contract);
    ``None`` where the kernel does not apply."""
    if q.dim() != 3 or keys.dim() != 3 or values.dim() != 3:
        return None
    t, heads, hd = q.shape
    kv_heads, hd_v = keys.shape[1], values.shape[2]
    if heads % max(kv_heads, 1) or grad.numel() != t * heads * hd_v:
        return None
    with torch.no_grad():
        if not _applies(q, keys, values, grad):
            return None
        lib = library()
        if lib is None:
            return None
        g = grad.reshape(t, heads, hd_v).contiguous()
        dq = torch.empty((t, heads, hd), dtype=torch.float32)
        dk = torch.zeros(keys.shape, dtype=torch.float32)
        dv = torch.zeros(values.shape, dtype=torch.float32)
        if not t:
            return dq, dk, dv
        starts = kstart.to(torch.int64).contiguous()
        positions = pos.to(torch.int64).contiguous()
        code = lib.posttrain_row_attention_backward(
            q.data_ptr(), _I3(*q.stride()), keys.data_ptr(), _I3(*keys.stride()),
            values.data_ptr(), _I3(*values.stride()), starts.data_ptr(), positions.data_ptr(),
            g.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), t, heads, kv_heads, hd,
            hd_v, scale, window or 0, coeffs.data_ptr(),
        )  # fmt: skip
    return None if code else (dq, dk, dv)


_I3 = ctypes.c_int64 * 3
"""Three element strides (``row_attention``'s operands)."""


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """``StrictOps.rms_norm(x, weight, eps)``, bit for bit, in three calls: the fused mean of
    squares plus ``eps`` per row, torch's ``1.0 / torch.sqrt`` of it (torch's sqrt is not the
    correctly rounded one on every CPU, so it stays torch's), the fused scaling by it and by
    ``weight`` (``[H]``, or ``[..., H]`` matching ``x``'s trailing dims: a per-head weight).
    ``None`` where the kernel does not apply (the caller then runs torch's path)."""
    if x.dim() == 0 or not _applies(x):
        return None
    h = x.shape[-1]
    w = weight.float()
    if (
        h == 0
        or w.dim() > x.dim()
        or tuple(w.shape) != tuple(x.shape[x.dim() - w.dim() :])
        or not _applies(w)
    ):
        return None
    lib = library()
    if lib is None:
        return None
    xc, wc = x.contiguous(), w.contiguous()
    rows = xc.numel() // h
    ms = torch.empty(xc.shape[:-1], dtype=torch.float32)
    if rows and lib.posttrain_rms_norm_ms(xc.data_ptr(), ms.data_ptr(), rows, h, eps):
        return None
    inv = 1.0 / torch.sqrt(ms)
    out = torch.empty_like(xc)
    if rows:
        lib.posttrain_rms_norm_scale(
            xc.data_ptr(), inv.data_ptr(), wc.data_ptr(), out.data_ptr(), rows, h, wc.numel() // h
        )
    return out


def silu_mul(gate: Tensor, up: Tensor, coeffs: Tensor) -> Tensor | None:
    """``StrictOps.silu_mul(gate, up)`` in one pass, bit for bit, for 2-D ``gate``/``up`` whose
    rows are contiguous (column slices of one projection); ``None`` where the kernel does not
    apply."""
    if (
        gate.dim() != 2
        or up.shape != gate.shape
        or not _applies(gate, up)
        or (gate.shape[1] > 1 and (gate.stride(1) != 1 or up.stride(1) != 1))
    ):
        return None
    lib = library()
    if lib is None:
        return None
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=torch.float32)
    if out.numel():
        lib.posttrain_silu_mul(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows,
            width, coeffs.data_ptr(),
        )  # fmt: skip
    return out


def rms_norm_backward(
    x: Tensor, weight: Tensor, eps: float, grad: Tensor
) -> tuple[Tensor, Tensor] | None:
    """The gradients ``(dx, dweight)`` of ``rms_norm(x, weight, eps)`` for ``grad``, row by row
    in one pass (sequential fp32 sums: run-to-run deterministic, RMSNorm's gradient to fp32
    rounding); ``dweight`` fp32 in ``weight``'s shape. ``None`` where the kernel does not
    apply."""
    with torch.no_grad():
        if x.dim() == 0 or grad.shape != x.shape or not _applies(x, grad):
            return None
        h = x.shape[-1]
        w = weight.float()
        if h == 0 or tuple(w.shape) != tuple(x.shape[x.dim() - w.dim() :]) or w.dim() > x.dim():
            return None
        lib = library()
        if lib is None:
            return None
        xc, wc, gc = x.contiguous(), w.contiguous(), grad.contiguous()
        rows = xc.numel() // h
        ms = torch.empty(xc.shape[:-1], dtype=torch.float32)
        dx = torch.empty_like(xc)
        dw = torch.zeros(wc.shape, dtype=torch.float32)
        if rows:
            if lib.posttrain_rms_norm_ms(xc.data_ptr(), ms.data_ptr(), rows, h, eps):
                return None
            lib.posttrain_rms_norm_backward(
                xc.data_ptr(), wc.data_ptr(), ms.data_ptr(), gc.data_ptr(), dx.data_ptr(),
                dw.data_ptr(), rows, h, wc.numel() // h,
            )  # fmt: skip
    return dx, dw


class RoutedExperts(NamedTuple):
    """``routed_experts``' result: ``out[T, k, H]`` and what a backward reads: the (token,
    slot) pairs' flat indices grouped by expert (``order[P]``, ascending expert, each expert's
    pairs in row-major order), each expert's pair count (``sizes[E]``) and the pairs'
    intermediates in that order (``gate_up[P, 2I]``, ``act[P, I]``)."""

    out: Tensor
    order: Tensor
    sizes: list[int]
    gate_up: Tensor
    act: Tensor


def routed_experts(
    m: Tensor, ids: Tensor, fc1: Tensor, fc2: Tensor, coeffs: Tensor
) -> RoutedExperts | None:
    """A MoE layer's routed experts in one pass, bit for bit the strict expert-by-expert path
    (``strict_linear`` of ``fc1[e]``, ``silu_mul``, ``strict_linear`` of ``fc2[e]`` on each
    (token, slot) pair's row): ``m[T, H]``, ``ids[T, k]`` (int64 expert ids), ``fc1[E, 2I, H]``,
    ``fc2[E, H, I]``. ``None`` where the kernel does not apply (not CPU fp32, autograd
    recording, or more products than one call should take alone:
    ``_PARALLEL_PRODUCTS`` at more than one torch thread, where the per-expert linears split
    over the threads). Raises ``ValueError`` for an expert id outside ``[0, E)``."""
    if m.dim() != 2 or ids.dim() != 2 or fc1.dim() != 3 or fc2.dim() != 3:
        return None
    (t, h), (e, i2) = m.shape, fc1.shape[:2]
    k, inter = ids.shape[1], fc2.shape[2]
    shapes_fit = ids.shape[0] == t and fc1.shape[2] == h and i2 == 2 * inter
    if not shapes_fit or tuple(fc2.shape[:2]) != (e, h) or ids.dtype != torch.int64:
        return None
    if not _applies(m, fc1, fc2) or ids.device.type != "cpu" or min(h, inter, k, e) < 1:
        return None
    if torch.get_num_threads() > 1 and t * k * 3 * inter * h >= _PARALLEL_PRODUCTS:
        return None
    lib = library()
    if lib is None:
        return None
    pairs = t * k
    mc, idc, w1, w2 = m.contiguous(), ids.contiguous(), fc1.contiguous(), fc2.contiguous()
    out = torch.empty((t, k, h), dtype=torch.float32)
    order = torch.empty(pairs, dtype=torch.int64)
    gate_up = torch.empty((pairs, 2 * inter), dtype=torch.float32)
    act = torch.empty((pairs, inter), dtype=torch.float32)
    code = lib.posttrain_routed_experts(
        mc.data_ptr(), idc.data_ptr(), t, k, h, w1.data_ptr(), w2.data_ptr(), e, inter,
        order.data_ptr(), gate_up.data_ptr(), act.data_ptr(), out.data_ptr(), coeffs.data_ptr(),
    )  # fmt: skip
    if code == -1:
        bad = idc[(idc < 0) | (idc >= e)]
        raise ValueError(f"routed experts: expert id {int(bad[0])} outside [0, {e})")
    if code:
        return None
    sizes = torch.bincount(idc.reshape(-1), minlength=e).tolist()
    return RoutedExperts(out, order, sizes, gate_up, act)
