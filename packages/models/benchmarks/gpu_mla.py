"""MLA + DeepSeek-style MoE: strict/fast training forward and decode tokens/s, and strict parity.

Written before the decoder built MLA layers (``gpu_mla_decoder.py`` measures the decoder's
own path now), this script stacks the modules itself: embedding, then per layer ``x + MLA(rms(x))`` and ``x + MLP(rms(x))`` (the
first layer a dense SwiGLU, the rest ``DeepseekMoe``), a final norm and an untied head, with
the kernels of ``posttrain.models`` (strict: ``strict_ops_for(device)``, i.e. Triton
``CudaStrictOps`` on CUDA; fast: plain torch). ``--size 1b`` is GLM-4.7-Flash's attention
shape (MLA, ``q_lora_rank`` 768, ``kv_lora_rank`` 512, rope 64) at hidden 2048, 16 heads,
8 layers, 16 routed experts (top 4, 2 groups of 8, top 1 group) and a shared expert: 1.01B
parameters.

Measured, interleaved, ``--reps`` times each (medians; the first round is a warm-up):

* ``train_forward`` (no grad) and ``train_forward_backward`` over ``--segments`` packed
  segments of ``--length`` tokens;
* ``decode``: ``--rows`` rows prefilled with ``--prompt`` tokens, then ``--steps`` batched
  one-token steps, for strict (expanded latents: bit-identical to training), fast (absorbed),
  and the two other forms for reference (fast expanded, strict absorbed).
* ``parity``: strict training logprobs == strict prefill + decode logprobs, bit for bit
  (and fast's max difference), on two sequences.

Run from the repo root (prints one JSON object):

    python packages/models/benchmarks/gpu_mla.py --size 1b --dtype bfloat16
    # check on CPU:  uv run python packages/models/benchmarks/gpu_mla.py --device cpu --size tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.models import FastOps, PackedLayout, RopeScaling, strict_ops_for
from posttrain.models._ds_moe import DeepseekMoe, DeepseekMoeSpec, swiglu_mlp
from posttrain.models._mla import MlaAttention
from posttrain.models._mla_cache import MlaCache
from posttrain.models._mla_config import MlaRope, MlaSpec

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab": 96, "hidden": 32, "heads": 4, "q_lora": 12, "kv_lora": 16, "nope": 8,
        "rope": 4, "v": 8, "layers": 2, "dense_inter": 64, "experts": 8, "topk": 2,
        "groups": 2, "topk_groups": 1, "moe_inter": 16, "capacity": 64,
    },
    "1b": {
        "vocab": 32000, "hidden": 2048, "heads": 16, "q_lora": 768, "kv_lora": 512,
        "nope": 128, "rope": 64, "v": 128, "layers": 8, "dense_inter": 5632, "experts": 16,
        "topk": 4, "groups": 2, "topk_groups": 1, "moe_inter": 1024, "capacity": 2048,
    },
}  # fmt: skip

AttendFn = Callable[[int, MlaAttention, Tensor], Tensor]


class MlaStack(nn.Module):
    """The benchmark's model: embedding, MLA + (dense | DeepSeek MoE) layers, norm, head."""

    def __init__(self, size: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        h = size["hidden"]
        yarn = RopeScaling(rope_type="yarn", factor=4.0,
                           original_max_position_embeddings=size["capacity"] // 4,
                           mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
        rope = MlaRope(rope_theta=1e6, scaling=yarn)
        self.spec = MlaSpec(hidden_size=h, num_heads=size["heads"], q_lora_rank=size["q_lora"],
                            kv_lora_rank=size["kv_lora"], qk_nope_head_dim=size["nope"],
                            qk_rope_head_dim=size["rope"], v_head_dim=size["v"], rope=rope)  # fmt: skip
        moe = DeepseekMoeSpec(hidden_size=h, moe_intermediate_size=size["moe_inter"],
                              n_routed_experts=size["experts"], num_experts_per_tok=size["topk"],
                              n_group=size["groups"], topk_group=size["topk_groups"],
                              routed_scaling_factor=1.8)  # fmt: skip
        self.capacity = size["capacity"]
        self.embedding = nn.Parameter(torch.zeros(size["vocab"], h, dtype=dtype))
        self.attn = nn.ModuleList(
            MlaAttention(self.spec, dtype=dtype) for _ in range(size["layers"])
        )
        self.norms = nn.Parameter(torch.ones(size["layers"], 2, h, dtype=dtype))
        self.dense = nn.ParameterList(
            [torch.zeros(2 * size["dense_inter"], h, dtype=dtype), torch.zeros(h, size["dense_inter"], dtype=dtype)]
        )  # fmt: skip
        self.moe = nn.ModuleList(DeepseekMoe(moe, dtype=dtype) for _ in range(size["layers"] - 1))
        self.final_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.head = nn.Parameter(torch.zeros(size["vocab"], h, dtype=dtype))
        cos, sin = self.spec.rope_tables(self.capacity)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def logprobs(self, ops: type[FastOps], ids: Tensor, attend: AttendFn) -> Tensor:
        eps = 1e-6
        x = self.embedding[ids].float()
        for i, attn in enumerate(self.attn):
            x = x + attend(i, attn, ops.rms_norm(x, self.norms[i, 0], eps))
            m = ops.rms_norm(x, self.norms[i, 1], eps)
            if i == 0:
                x = x + swiglu_mlp(ops, self.dense[0], self.dense[1], m)
            else:
                moe = self.moe[i - 1]
                assert isinstance(moe, DeepseekMoe)
                x = x + moe(ops, m)
        return ops.log_softmax(ops.linear(ops.rms_norm(x, self.final_norm, eps), self.head))

    def packed(self, ops: type[FastOps], ids: Tensor, lengths: list[int]) -> Tensor:
        dev = ids.device
        seg = torch.repeat_interleave(torch.arange(len(lengths), device=dev),
                                      torch.tensor(lengths, device=dev))  # fmt: skip
        starts = torch.tensor([0, *lengths], device=dev).cumsum(0)[:-1]
        pos = torch.arange(ids.shape[0], device=dev) - starts[seg]
        layout = PackedLayout(seg, pos, len(lengths), self.capacity)
        cos, sin = self.cos[pos], self.sin[pos]
        return self.logprobs(
            ops, ids, lambda i, a, x: a.forward_packed(ops, x, layout, cos=cos, sin=sin, layer=i)
        )

    @torch.no_grad()
    def extend(
        self,
        ops: type[FastOps],
        cache: MlaCache,
        rows: list[int],
        tokens: list[Tensor],
        absorbed: bool | None,
    ) -> Tensor:
        sizes = [t.shape[0] for t in tokens]
        buf_row, pos = cache.placement(rows, sizes)
        cos, sin = self.cos[pos], self.sin[pos]

        def attend(i: int, a: MlaAttention, x: Tensor) -> Tensor:
            return a.forward_cached(ops, x, cache, i, rows=buf_row, pos=pos, cos=cos, sin=sin,
                                    absorbed=absorbed)  # fmt: skip

        out = self.logprobs(ops, torch.cat(tokens), attend)
        cache.advance(rows, sizes)
        return out


def init_weights(model: MlaStack, device: torch.device, seed: int) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name or name == "final_norm":
                p.fill_(1.0)
            elif "expert_bias" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=gen, device=device))
            else:
                p.copy_((0.02 * torch.randn(p.shape, generator=gen, device=device)).to(p.dtype))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def decode_rate(
    model: MlaStack, ops: type[FastOps], args: argparse.Namespace, absorbed: bool | None
) -> float:
    dev = model.embedding.device
    cache = MlaCache(model.spec, len(model.attn), args.rows, model.capacity, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    vocab = model.embedding.shape[0]
    prompts = [
        torch.randint(0, vocab, (args.prompt,), generator=gen, device=dev) for _ in range(args.rows)
    ]
    rows = list(range(args.rows))
    last = model.extend(ops, cache, rows, prompts, absorbed)
    nxt = last.reshape(args.rows, args.prompt, -1)[:, -1].argmax(-1)

    def steps() -> None:
        tok = nxt
        for _ in range(args.steps):
            tok = model.extend(ops, cache, rows, list(tok[:, None]), absorbed).argmax(-1)

    return args.rows * args.steps / timed(dev, steps)


def parity(model: MlaStack, strict: type[FastOps]) -> dict[str, Any]:
    """Strict training logprobs vs strict prefill + one-token decode, on two sequences."""
    dev = model.embedding.device
    gen = torch.Generator(device=dev).manual_seed(2)
    lengths = [min(37, model.capacity), min(20, model.capacity)]
    ids = torch.randint(0, model.embedding.shape[0], (sum(lengths),), generator=gen, device=dev)
    out: dict[str, Any] = {}
    for name, ops in (("strict", strict), ("fast", FastOps)):
        with torch.no_grad():
            train = model.packed(ops, ids, lengths)
        cache = MlaCache(model.spec, len(model.attn), 2, model.capacity, device=dev)
        seqs = list(ids.split(lengths))
        got: list[list[Tensor]] = [[], []]
        done = [0, 0]
        while live := [j for j in (0, 1) if done[j] < lengths[j]]:
            n = 8 if done == [0, 0] else 1  # an 8-token prefill, then one token per step
            parts = [seqs[j][done[j] : done[j] + n] for j in live]
            step = model.extend(ops, cache, live, parts, None)
            for j, piece in zip(live, step.split([p.shape[0] for p in parts]), strict=True):
                got[j].append(piece)
                done[j] += piece.shape[0]
        decoded = torch.cat([torch.cat(g) for g in got])
        out[name] = {
            "bit_identical": bool(torch.equal(train, decoded)),
            "max_abs_diff": float((train - decoded).abs().max()),
            "tokens": int(decoded.shape[0]),
        }
    return out


def arguments(doc: str | None) -> tuple[argparse.Namespace, torch.device, dict[str, Any]]:
    """The command line both MLA benchmarks take: ``(args, device, size)``, lengths clamped to
    the size's capacity."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-backward", action="store_true", help="skip forward + backward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size = SIZES[args.size]
    args.length = min(args.length, size["capacity"])
    args.prompt = min(args.prompt, size["capacity"] - args.steps - 1)
    return args, device, size


def run_cases(
    cases: dict[str, dict[str, Callable[[], float]]],
    reps: int,
    device: torch.device,
    report: dict[str, Any],
) -> None:
    """Each case's forms (``strict``, ``fast``, ...) warmed up, then timed interleaved ``reps``
    times; medians and ``strict_over_fast`` into ``report["results"]``; the report printed."""
    for case, fns in cases.items():
        row: dict[str, float | str] = {}
        for k, fn in list(fns.items()):
            try:
                fn()  # warm-up (Triton compiles here)
            except Exception as exc:  # a reference form that does not run here is reported
                row[f"{k}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                del fns[k]
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():  # interleaved
                samples[k].append(fn())
        med = {k: statistics.median(v) for k, v in samples.items()}
        row.update({f"{k}_tokens_per_s": round(v, 1) for k, v in med.items()})
        if "strict" in med and "fast" in med:
            row["strict_over_fast"] = round(med["strict"] / med["fast"], 4)
        report["results"][case] = row
        print(json.dumps({case: row}), file=sys.stderr, flush=True)  # progress
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    print(json.dumps(report, indent=1))


def main() -> None:
    args, device, size = arguments(__doc__)
    model = MlaStack(size, getattr(torch, args.dtype)).to(device)
    init_weights(model, device, 0)
    strict = strict_ops_for(device)
    tokens = args.segments * args.length
    vocab = size["vocab"]
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    lengths = [args.length] * args.segments

    def forward(ops: type[FastOps]) -> float:
        with torch.no_grad():
            return tokens / timed(device, lambda: model.packed(ops, ids, lengths))

    def forward_backward(ops: type[FastOps]) -> float:
        model.zero_grad(set_to_none=True)
        return tokens / timed(device, lambda: model.packed(ops, ids, lengths).sum().backward())

    cases: dict[str, dict[str, Callable[[], float]]] = {
        "train_forward": {"strict": lambda: forward(strict), "fast": lambda: forward(FastOps)},
        "decode": {
            "strict": lambda: decode_rate(model, strict, args, None),
            "fast": lambda: decode_rate(model, FastOps, args, None),
            "fast_expanded": lambda: decode_rate(model, FastOps, args, False),
            "strict_absorbed": lambda: decode_rate(model, strict, args, True),
        },
    }
    if not args.no_backward:
        cases["train_forward_backward"] = {
            "strict": lambda: forward_backward(strict),
            "fast": lambda: forward_backward(FastOps),
        }
    spec = model.spec
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "strict_kernels": strict.__name__,
        "size": args.size,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "train_tokens": tokens,
        "decode": {"rows": args.rows, "prompt": args.prompt, "steps": args.steps},
        "cache_floats_per_token_layer": {
            "mla": spec.cache_width,
            "expanded_kv": spec.num_heads * (spec.qk_head_dim + spec.v_head_dim),
        },
        "parity": parity(model, strict),
        "results": {},
    }
    run_cases(cases, args.reps, device, report)


if __name__ == "__main__":
    main()
