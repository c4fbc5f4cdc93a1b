"""The decoder's own MLA path (issue 36): ``DecoderModel`` of a GLM-4.7-Flash-layout config.

``gpu_mla.py`` stacks the MLA and DeepSeek-MoE modules by hand (written before the decoder
built them); this script measures what the trainer and local-engine run: ``build_model`` of
a ``glm4_moe_lite`` ``ModelConfig`` of the same shapes (``gpu_mla.SIZES``: ``--size 1b`` is
GLM-4.7-Flash's attention shape at hidden 2048, 16 heads, 8 layers, 16 routed experts top 4
in 2 groups, a shared expert; ~1.0B parameters), through its public forwards:

* ``train_forward`` (no grad) and ``train_forward_backward``: ``forward_logprobs`` over
  ``--segments`` packed segments of ``--length`` tokens;
* ``decode``: ``new_kv_cache`` (the MLA cache: compressed latent + rope key), ``--rows`` rows
  prefilled with ``--prompt`` tokens through ``extend``, then ``--steps`` batched one-token
  ``decode_step`` calls (strict: expanded latents, bit-identical to training; fast: absorbed);
* ``parity``: ``posttrain.models.parity``'s packed vs chunked-prefill + decode logprobs.

Strict and fast are timed interleaved, ``--reps`` times (medians; a warm-up round first).
Run from the repo root (prints one JSON object):

    python packages/models/benchmarks/gpu_mla_decoder.py --size 1b --dtype bfloat16
    # check on CPU:  uv run python packages/models/benchmarks/gpu_mla_decoder.py --device cpu --size tiny
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from gpu_mla import arguments, run_cases, timed

from posttrain.models import DecoderModel, ModelConfig, Numerics, RopeScaling, build_model
from posttrain.models.parity import decoded_logprobs, packed_logprobs


def config_of(size: dict[str, Any], dtype: str) -> ModelConfig:
    """A ``glm4_moe_lite`` config of ``size`` (one dense layer first, then the MoE layers)."""
    cap = size["capacity"]
    return ModelConfig(
        family="glm4_moe_lite",
        qk_norm=False,
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["dense_inter"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        head_dim=size["rope"],
        q_lora_rank=size["q_lora"],
        kv_lora_rank=size["kv_lora"],
        qk_nope_head_dim=size["nope"],
        qk_rope_head_dim=size["rope"],
        v_head_dim=size["v"],
        moe_intermediate_size=size["moe_inter"],
        num_experts=size["experts"],
        num_experts_per_tok=size["topk"],
        n_group=size["groups"],
        topk_group=size["topk_groups"],
        n_shared_experts=1,
        router_score_function="sigmoid",
        routed_scaling_factor=1.8,
        mlp_only_layers=(0,),
        rope_theta=1e6,
        rope_scaling=RopeScaling(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=cap // 4,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=cap,
        initializer_range=0.02,
        torch_dtype=dtype,
    )


def decode_rate(model: DecoderModel, args: argparse.Namespace) -> float:
    dev = model.embedding.device
    cache = model.new_kv_cache(args.rows)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.rows)
    ]
    rows = list(range(args.rows))
    steps = model.extend(cache, rows, prompts)
    nxt = [int(s.logits[-1].argmax()) for s in steps]

    def run() -> None:
        tok = nxt
        for _ in range(args.steps):
            tok = model.decode_step(cache, rows, tok).logits.argmax(-1).tolist()

    return args.rows * args.steps / timed(dev, run)


def parity(model: DecoderModel) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    cap, vocab = model.config.capacity, model.config.vocab_size
    segments = [
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (min(37, cap), min(20, cap))
    ]
    out: dict[str, Any] = {}
    for numerics in (Numerics.STRICT, Numerics.FAST):
        model.numerics = numerics
        train = packed_logprobs(model, segments)
        served = decoded_logprobs(model, segments, [8, 8], chunked_prefill=True)
        out[numerics.value] = {
            "bit_identical": bool(torch.equal(train, served)),
            "max_abs_diff": float((train - served).abs().max()),
        }
    return out


def main() -> None:
    args, device, size = arguments(__doc__)
    model = build_model(config_of(size, args.dtype), seed=0, device=device)
    tokens = args.segments * args.length
    ids = torch.randint(0, size["vocab"], (tokens,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    lengths = [args.length] * args.segments

    def with_numerics(numerics: Numerics, fn: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            model.numerics = numerics
            return fn()

        return run

    def forward() -> float:
        with torch.no_grad():
            return tokens / timed(device, lambda: model.forward_logprobs(ids, lengths))

    def forward_backward() -> float:
        model.zero_grad(set_to_none=True)
        return tokens / timed(device, lambda: model.forward_logprobs(ids, lengths).sum().backward())

    cases: dict[str, Callable[[], float]] = {
        "train_forward": forward,
        "decode": lambda: decode_rate(model, args),
    }
    if not args.no_backward:
        cases["train_forward_backward"] = forward_backward
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "size": args.size,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "train_tokens": tokens,
        "decode": {"rows": args.rows, "prompt": args.prompt, "steps": args.steps},
        "parity": parity(model),
        "results": {},
    }
    run_cases(
        {c: {n.value: with_numerics(n, fn) for n in (Numerics.STRICT, Numerics.FAST)}
         for c, fn in cases.items()},
        args.reps,
        device,
        report,
    )  # fmt: skip


if __name__ == "__main__":
    main()
