"""The strict kernels' forwards: torch's ops versus the fused C kernel (``_ckernel``).

Both paths compute ``_ops._strict_linear_rows`` (``rows[R, K] @ w``, products then the pairwise
tree over K) with the same bits (checked here on every shape); they run interleaved, ``--reps``
rounds of ``--calls`` calls each, at ``--threads`` torch threads (the C kernel is one thread).
Shapes: the recipe model's linears (``posttrain grpo``'s tiny Dense/MoE: hidden 32, heads
4 x 8, MLP 64, experts 32, vocabulary 101) at decode-batch and packed-training row counts,
plus a larger layer; attention (``StrictOps.attention``: both product trees, ``exp_strict``,
``tree_sum``);
then the recipe's model end to end (packed training forward, with backward, batched decode),
every fused kernel switched off and on. Prints one JSON line per case (median microseconds
per call or tokens/s, and the ratio) and a total over the recipe's linears weighted as one
forward of its layers.

    uv run python packages/models/benchmarks/bench_strict_ckernel.py [--threads 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_strict_vs_fast import decode, train_forward

from posttrain.models import ModelConfig, Numerics, StrictOps, _ckernel, _ops, build_model

# (name, K, N, uses per recipe forward): q, k, v, o; the dense MLP (1 layer); the router and
# two experts' gate/up/down per token (3 MoE layers, top-2); the LM head. Rows per use: the
# batch's rows (experts: about rows * top_k / experts each, counted here as full rows / 2).
RECIPE = [
    ("q", 32, 32, 4),
    ("k/v", 32, 16, 8),
    ("o", 32, 32, 4),
    ("mlp gate/up", 32, 64, 2),
    ("mlp down", 64, 32, 1),
    ("router", 32, 4, 3),
    ("expert gate/up", 32, 32, 12),
    ("expert down", 32, 32, 6),
    ("lm head", 32, 101, 1),
]
LARGE = [("large 1024x1024", 1024, 1024, 1)]
# StrictOps.attention: (queries, kv heads, heads per kv head, key slots, head dim): the recipe's
# packed training chunk (slots: the chunk's power of two) and one decode step of 64 requests.
ATTENTION = [("attention train", 512, 2, 2, 32, 8), ("attention decode", 64, 2, 2, 64, 8)]


@contextlib.contextmanager
def torch_kernels() -> Iterator[None]:
    """The strict kernels on torch's path (the fused kernel declines every call)."""
    linear, tree = _ckernel.strict_linear, _ckernel.product_tree
    _ckernel.strict_linear = lambda rows, w: None  # type: ignore[assignment]
    views, exp, sums = _ckernel.reads_views, _ckernel.exp_strict, _ckernel.tree_sum
    _ckernel.product_tree = lambda a, b: None  # type: ignore[assignment]
    _ckernel.reads_views = lambda *tensors: False  # type: ignore[assignment]
    _ckernel.exp_strict = lambda x, coeffs: None  # type: ignore[assignment]
    _ckernel.tree_sum = lambda x, dim: None  # type: ignore[assignment]
    try:
        yield
    finally:
        _ckernel.strict_linear, _ckernel.product_tree = linear, tree  # type: ignore[assignment]
        _ckernel.reads_views, _ckernel.exp_strict = views, exp  # type: ignore[assignment]
        _ckernel.tree_sum = sums  # type: ignore[assignment]


def model_cases(reps: int) -> None:
    """The recipe's model (tiny Dense/MoE, vocabulary 101) end to end in strict numerics: the
    packed training forward (16 x 32 tokens), with backward, and 64-row batched decode."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig.tiny(vocab_size=101, max_position_embeddings=64), 0, numerics=Numerics.STRICT
    )
    cases: dict[str, Callable[[], float]] = {
        "train forward (16 x 32 tokens)": lambda: train_forward(model, 16, 32, False),
        "train forward + backward": lambda: train_forward(model, 16, 32, True),
        "decode (64 rows, 16 steps)": lambda: decode(model, 64, 16, 16),
    }
    for name, fn in cases.items():
        fused, plain = [], []
        fn()
        for _ in range(reps):
            with torch_kernels():
                plain.append(fn())
            fused.append(fn())
        a, b = statistics.median(plain), statistics.median(fused)
        print(
            json.dumps(
                {"model": name, "torch_tok_s": round(a, 1), "fused_tok_s": round(b, 1),
                 "fused/torch": round(b / a, 2)}
            )
        )  # fmt: skip


def _time(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (C: one)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds per shape")
    parser.add_argument("--calls", type=int, default=50, help="calls per round")
    parser.add_argument("--rows", default="1,64,512", help="row counts (comma-separated)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if _ckernel.library() is None:
        raise SystemExit("the fused kernel did not build (see the warning above)")

    def torch_path(rows: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        with torch_kernels():
            return _ops._strict_linear_rows(rows, w_t)

    gen = torch.Generator().manual_seed(0)
    totals: dict[int, list[float]] = {}
    for r in (int(v) for v in args.rows.split(",")):
        totals[r] = [0.0, 0.0]
        for name, k, n, uses in RECIPE + LARGE:
            rows = r if name != "large 1024x1024" else min(r, 64)
            x = torch.randn(rows, k, generator=gen)
            w_t = torch.randn(n, k, generator=gen).t().contiguous()[:, None, :]
            ref = torch_path(x, w_t)
            got = _ops._strict_linear_rows(x, w_t)
            assert torch.equal(ref.view(torch.int32), got.view(torch.int32)), name
            calls = args.calls if k * n * rows < 1 << 22 else max(2, args.calls // 10)
            t_torch: list[float] = []
            t_fused: list[float] = []
            for _ in range(args.reps):
                t_torch.append(_time(lambda: torch_path(x, w_t), calls))  # noqa: B023
                t_fused.append(_time(lambda: _ops._strict_linear_rows(x, w_t), calls))  # noqa: B023
            a, b = statistics.median(t_torch), statistics.median(t_fused)
            if name in {s[0] for s in RECIPE}:
                totals[r][0] += a * uses
                totals[r][1] += b * uses
            print(
                json.dumps(
                    {"rows": rows, "linear": name, "K": k, "N": n, "torch_us": round(a, 1),
                     "fused_us": round(b, 1), "torch/fused": round(a / b, 2)}
                )
            )  # fmt: skip
    for name, t, nkv, g, c, hd in ATTENTION:
        q = torch.randn(t, nkv, g, hd, generator=gen)
        keys, values = (
            torch.randn(t, c, nkv, hd, generator=gen),
            torch.randn(t, c, nkv, hd, generator=gen),
        )
        valid = torch.ones(t, c, dtype=torch.bool)

        def attend() -> torch.Tensor:
            return StrictOps.attention(q, keys, values, valid, 0.35)  # noqa: B023

        def attend_torch() -> torch.Tensor:
            with torch_kernels():
                return attend()

        assert torch.equal(attend().view(torch.int32), attend_torch().view(torch.int32)), name
        t_torch, t_fused = [], []
        for _ in range(args.reps):
            t_torch.append(_time(attend_torch, args.calls // 5))
            t_fused.append(_time(attend, args.calls // 5))
        a, b = statistics.median(t_torch), statistics.median(t_fused)
        print(
            json.dumps(
                {"attention": name, "T": t, "kv_heads": nkv, "group": g, "slots": c, "head_dim": hd,
                 "torch_us": round(a, 1), "fused_us": round(b, 1), "torch/fused": round(a / b, 2)}
            )
        )  # fmt: skip
    model_cases(args.reps)
    for r, (a, b) in totals.items():
        print(
            json.dumps(
                {"rows": r, "recipe forward linears": "total", "torch_us": round(a, 1),
                 "fused_us": round(b, 1), "torch/fused": round(a / b, 2),
                 "threads": args.threads}
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()
