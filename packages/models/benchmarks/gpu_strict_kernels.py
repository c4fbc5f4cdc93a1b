"""Strict (Triton, batch-invariant) vs fast numerics on a GPU: parity and speed, one run.

* Parity on the device: packed training forward == prefill + batched KV-cache decode, bit for
  bit, for tiny dense / MoE / MoE + LoRA / sliding-window / Inkling (relative bias: those
  layers take ``StrictOps.attention``) configs and for the ~1B config; negative controls that
  must break the bits: decode with another attention ``block_n``, decode with a TF32 linear,
  fast-numerics decode. CPU strict vs CUDA strict is reported (different kernels: close,
  not equal).
* The linear kernel against cuBLAS fp32 (TF32 off, torch's default) at training and decode
  row counts, for a few tilings (``--tilings``), and whether the tilings give the same bits.
* Model throughput, strict vs fast side by side (alternating reps, median): training forward
  (no grad), forward + backward, and decode tokens/s, at the tiny config and at ~1B: hidden
  2048, 16 layers, 16 heads / 8 KV heads of dim 128, SwiGLU 6144, vocab 32000, untied, ~0.94B
  parameters.

Needs torch (+CUDA) and Triton. From the repo root:

    PYTHONPATH=packages/interface/src:packages/formats/src:packages/models/src \
        python packages/models/benchmarks/gpu_strict_kernels.py --out report.json

Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from triton.testing import do_bench  # type: ignore[import-untyped]

from posttrain.models import (
    DecoderModel,
    LoraAdapter,
    ModelConfig,
    Numerics,
    build_model,
    decoded_logprobs,
    packed_logprobs,
)
from posttrain.models import _triton_kernels as kernels
from posttrain.models._strict_cuda import CudaStrictOps

BIG = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mlp_only_layers": tuple(range(16)),
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
}
SMALL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "max_position_embeddings": 256,
}


DEV = "cuda"
START = time.perf_counter()
PROMPT = 128


def progress(stage: str) -> None:
    """One line per stage on stderr (with the time since start), so a cut-off run shows where."""
    print(f"[{time.perf_counter() - START:7.1f}s] {stage}", file=sys.stderr, flush=True)


def init_on_device(cfg: ModelConfig, seed: int) -> DecoderModel:
    """``build_model`` on the device (drawn there: a ~1B model in a second), Triton kernels."""
    return build_model(cfg, seed, strict_kernels="triton", device=DEV)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def segments_for(vocab: int, seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    return {
        "bit_identical": bool(torch.equal(a, b)),
        "mismatched_tokens": int((a != b).sum()),
        "tokens": int(a.numel()),
        "max_abs_diff": float((a - b).abs().max()),
    }


def adapter_for(model: DecoderModel, seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (d_in, d_out) in model.lora_targets().items():
        if name.endswith(("q_proj", "down_proj", "lm_head", "gate")):
            a = torch.randn(8, d_in, generator=gen) * 0.3
            b = torch.randn(d_out, 8, generator=gen) * 0.3
            weights[name] = (a.to(DEV), b.to(DEV))
    return LoraAdapter(weights=weights, scaling=2.0, name=f"a{seed}")


def with_tiling(fn: Callable[[], torch.Tensor], **changes: Any) -> torch.Tensor:
    """Run ``fn`` with the attention/linear tilings changed (a negative control)."""
    old_a, old_l = CudaStrictOps.attention_tiling, kernels.LINEAR_TILING
    attn = {k: v for k, v in changes.items() if k in ("block_n", "block_m")}
    lin = {k[4:]: v for k, v in changes.items() if k.startswith("lin_")}
    CudaStrictOps.attention_tiling = dataclasses.replace(old_a, **attn)
    kernels.LINEAR_TILING = dataclasses.replace(old_l, **lin)
    try:
        return fn()
    finally:
        CudaStrictOps.attention_tiling, kernels.LINEAR_TILING = old_a, old_l


def parity() -> dict[str, Any]:
    tiny = {"max_position_embeddings": 96}
    configs = {
        "tiny_dense_fp32": ModelConfig.tiny(**tiny, mlp_only_layers=(0, 1, 2, 3)),
        "tiny_moe_bf16": ModelConfig.tiny(**tiny, torch_dtype="bfloat16"),
        "tiny_moe_lora": ModelConfig.tiny(**tiny),
        "tiny_moe_window": ModelConfig.tiny(
            **tiny, sliding_window_layers=(1, 3), sliding_window_size=9
        ),
        "inkling_tiny": ModelConfig.inkling_tiny(**tiny),
    }
    out: dict[str, Any] = {}
    lens, prompts = [37, 90, 5, 64, 71, 12], [5, 20, 2, 64, 1, 11]
    if DEV == "cpu":
        lens, prompts = [7, 12, 5, 6, 3, 4], [2, 5, 2, 6, 1, 1]
    for name, cfg in configs.items():
        progress(f"parity {name}")
        model = build_model(cfg, 0, strict_kernels="triton").to(DEV)
        segs = segments_for(cfg.vocab_size, 1, lens)
        lora = None
        if name.endswith("lora"):
            lora = [adapter_for(model, 1), None, adapter_for(model, 2), None, None, None]
        train = packed_logprobs(model, segs, lora=lora)
        entry = {
            "kernel_set": model.ops.__name__,
            "train_vs_decode": compare(train, decoded_logprobs(model, segs, prompts, lora=lora)),
        }
        if name == "tiny_moe_lora":

            def decode(
                model: DecoderModel = model, segs: list[list[int]] = segs, lora: Any = lora
            ) -> torch.Tensor:
                return decoded_logprobs(model, segs, prompts, lora=lora)

            entry["negative_attention_block_n_32"] = compare(train, with_tiling(decode, block_n=32))
            entry["negative_linear_tf32"] = compare(
                train,
                with_tiling(decode, lin_precision="tf32"),
            )
            model.numerics = Numerics.FAST
            entry["negative_fast_decode"] = compare(
                train, decoded_logprobs(model, segs, prompts, lora=lora)
            )
            model.numerics = Numerics.STRICT
        if lora is None:
            cpu = build_model(cfg, 0)
            entry["cpu_strict_vs_cuda_strict"] = compare(packed_logprobs(cpu, segs), train)
        out[name] = entry
    return out


def linear_bench(tilings: list[kernels.LinearTiling]) -> dict[str, Any]:
    shapes = [(4096, 2048), (12288, 2048), (2048, 6144), (32000, 2048)]
    out: dict[str, Any] = {"tilings": [dataclasses.asdict(t) for t in tilings], "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for m in (8192, 32):
            for n, k in shapes:
                x = torch.randn(m, k, device="cuda", generator=gen)
                w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
                flops = 2 * m * n * k
                row: dict[str, Any] = {"m": m, "n": n, "k": k, "w_dtype": str(dtype)[6:]}
                t_fast = do_bench(lambda x=x, w=w: torch.nn.functional.linear(x, w.float()))
                row["torch_fp32_ms"] = round(t_fast, 4)
                outs = []
                for i, t in enumerate(tilings):
                    ms = do_bench(lambda x=x, w=w, t=t: kernels.linear(x, w, t))
                    row[f"tiling{i}_ms"] = round(ms, 4)
                    row[f"tiling{i}_tflops"] = round(flops / ms / 1e9, 1)
                    outs.append(kernels.linear(x, w, t))
                for precision in {t.precision for t in tilings}:
                    same = [
                        o for o, t in zip(outs, tilings, strict=True) if t.precision == precision
                    ]
                    row[f"{precision}_tilings_same_bits"] = all(
                        torch.equal(same[0], o) for o in same
                    )
                ref = x.double() @ w.double().T
                row["rel_err_tilings_then_torch"] = [
                    f"{float((o.double() - ref).norm() / ref.norm()):.2e}"
                    for o in [*outs, torch.nn.functional.linear(x, w.float())]
                ]
                row["speed_vs_torch"] = round(t_fast / row["tiling0_ms"], 3)
                out["rows"].append(row)
    return out


def timed(fn: Callable[[], Any]) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def model_speed(cfg: ModelConfig, tokens: int, seg_len: int, rows: int, steps: int,
                reps: int, backward: bool) -> dict[str, Any]:  # fmt: skip
    progress(f"model_speed: building hidden {cfg.hidden_size}, {cfg.dtype}")
    model = init_on_device(cfg, 0)
    ids = torch.randint(0, cfg.vocab_size, (tokens,))
    lens = [seg_len] * (tokens // seg_len)

    def fwd() -> None:
        with torch.no_grad():
            model.forward_logprobs(ids, lens)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        model.forward_logprobs(ids, lens).sum().backward()

    def decode() -> None:
        cache = model.new_kv_cache(rows)
        for r in range(rows):
            model.prefill(cache, r, [1 + r % 7] * PROMPT)
        toks = [2] * rows
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            toks = model.decode_step(cache, list(range(rows)), toks).logprobs.argmax(-1).tolist()
        sync()
        samples["decode_tok_s"].append(rows * steps / (time.perf_counter() - t))

    results: dict[str, Any] = {}
    for numerics in Numerics:  # warm-up (Triton compiles, cuBLAS handles)
        model.numerics = numerics
        progress(f"warm-up {numerics.value}: forward")
        fwd()
        if backward:
            progress(f"warm-up {numerics.value}: forward + backward")
            fwd_bwd()
    progress("timed reps")
    all_samples: dict[str, dict[str, list[float]]] = {n.value: {} for n in Numerics}
    for _ in range(reps):
        for numerics in Numerics:
            model.numerics = numerics
            samples: dict[str, list[float]] = all_samples[numerics.value]
            samples.setdefault("decode_tok_s", [])
            samples.setdefault("train_forward_tok_s", []).append(tokens / timed(fwd))
            if backward:
                samples.setdefault("forward_backward_tok_s", []).append(tokens / timed(fwd_bwd))
            decode()
    model.zero_grad(set_to_none=True)
    for numerics, samples in all_samples.items():
        results[numerics] = {k: round(statistics.median(v), 1) for k, v in samples.items()}
    results["strict_over_fast"] = {
        k: round(results["strict"][k] / results["fast"][k], 3) for k in results["strict"]
    }
    results["setup"] = {"tokens": tokens, "segment_len": seg_len, "decode_rows": rows,
                        "decode_steps": steps, "prompt": PROMPT, "reps": reps,
                        "params": sum(p.numel() for p in model.parameters()),
                        "param_dtype": str(cfg.dtype)[6:]}  # fmt: skip
    progress("train vs decode")
    model.numerics = Numerics.STRICT
    segs = segments_for(cfg.vocab_size, 3, [70, 45])
    results["train_vs_decode"] = compare(
        packed_logprobs(model, segs), decoded_logprobs(model, segs, [6, 1])
    )
    return results


def parse_tiling(text: str) -> kernels.LinearTiling:
    bm, bn, bk, gm, warps, stages, precision = text.split(",")
    return kernels.LinearTiling(int(bm), int(bn), int(bk), int(gm), int(warps), int(stages),
                                precision)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--sections", default="parity,linear,tiny,big")
    parser.add_argument("--big-dtypes", default="bfloat16,float32")
    parser.add_argument("--big-tokens", type=int, default=8192)
    parser.add_argument("--decode-rows", type=int, default=32)
    parser.add_argument(
        "--tilings",
        default="64,64,32,8,4,3,tf32x3;128,128,32,8,8,3,tf32x3;128,64,32,8,4,3,tf32x3;"
        "64,32,32,8,4,3,tf32x3;128,128,32,8,8,3,ieee",
        help="BM,BN,BK,GROUP_M,warps,stages,precision;... (the first is the one the model uses)",
    )
    parser.add_argument("--model-tiling", default="", help="override LINEAR_TILING (same format)")
    parser.add_argument("--attention-precision", default="", help="override: ieee or tf32x3")
    parser.add_argument(
        "--device",
        default="cuda",
        help="cpu: a dry run of the code paths, with TRITON_INTERPRET=1 set in the "
        "environment (the interpreter's numpy dot is not sequential over k, so "
        "train vs decode bits differ there)",
    )
    args = parser.parse_args()
    global DEV, PROMPT
    DEV = args.device
    if DEV == "cpu":
        PROMPT = 4
    sections = args.sections.split(",")
    if args.model_tiling:
        kernels.LINEAR_TILING = parse_tiling(args.model_tiling)
    if args.attention_precision:
        CudaStrictOps.attention_tiling = dataclasses.replace(
            CudaStrictOps.attention_tiling, precision=args.attention_precision
        )
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "linear_tiling": dataclasses.asdict(kernels.LINEAR_TILING),
        "attention_tiling": dataclasses.asdict(CudaStrictOps.attention_tiling),
    }

    def emit() -> None:
        text = json.dumps(report, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)

    if "parity" in sections:
        report["parity"] = parity()
        emit()
    if "linear" in sections:
        progress("linear")
        report["linear"] = linear_bench([parse_tiling(t) for t in args.tilings.split(";")])
        emit()
    if "tiny" in sections:
        size = (2048, 256, 8, 16) if DEV == "cuda" else (32, 16, 2, 2)
        report["speed_small"] = model_speed(ModelConfig.tiny(**SMALL), *size, args.reps, True)
        emit()
    if "big" in sections:
        for dtype in args.big_dtypes.split(","):
            cfg = ModelConfig.tiny(**BIG, torch_dtype=dtype)
            report[f"speed_1b_{dtype}"] = model_speed(
                cfg, args.big_tokens, 1024, args.decode_rows, 32, args.reps, True
            )
            torch.cuda.empty_cache()
            emit()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
