"""Strict parity: packed training forward == KV-cache decode, bit for bit; and its negative controls."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from posttrain.models import (
    DecoderModel,
    LoraAdapter,
    ModelConfig,
    ModelInputError,
    Numerics,
    StrictOps,
    TensorSpecMismatchError,
    build_model,
    decoded_logprobs,
    packed_logprobs,
)


@contextmanager
def threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


C = 32  # KV capacity of the test models (max_position_embeddings)
VARIANTS = {
    "tiny": ModelConfig.tiny(max_position_embeddings=C),
    "bf16-params-tied": ModelConfig.tiny(
        torch_dtype="bfloat16", tie_word_embeddings=True, max_position_embeddings=C
    ),
    "sparse-step-2-unnormed-k3": ModelConfig.tiny(
        decoder_sparse_step=2,
        mlp_only_layers=(),
        norm_topk_prob=False,
        num_hidden_layers=3,
        num_experts_per_tok=3,
        max_position_embeddings=C,
    ),
    "wide-gqa-1": ModelConfig.tiny(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=C,
    ),
}


def random_batch(
    cfg: ModelConfig, seed: int, n: int, max_len: int
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(2, max_len) for _ in range(n)]
    segments = [[rng.randrange(cfg.vocab_size) for _ in range(m)] for m in lens]
    return segments, [rng.randint(1, m - 1) for m in lens]


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_strict_train_forward_equals_kv_decode(name: str, seed: int) -> None:
    cfg = VARIANTS[name]
    model = build_model(cfg, seed)
    segments, prompts = random_batch(cfg, seed + 10, 4, C)
    with threads(2 if seed == 0 else 1):  # the two sides run with different thread counts
        train = packed_logprobs(model, segments)
    with threads(1):
        roll = decoded_logprobs(model, segments, prompts, chunked_prefill=seed == 1)
    assert (train != 0).sum() == sum(len(s) - 1 for s in segments)
    assert torch.equal(train, roll)


def test_strict_logprobs_do_not_depend_on_packing_or_padding() -> None:
    cfg = VARIANTS["tiny"]
    model = build_model(cfg, 3)
    segments, _ = random_batch(cfg, 3, 4, C)
    packed = packed_logprobs(model, segments)
    alone = torch.cat([packed_logprobs(model, [s]) for s in segments])
    padded = packed_logprobs(model, [*segments, [cfg.pad_token_id or 0] * 17])
    reordered = packed_logprobs(model, segments[::-1])
    assert torch.equal(packed, alone)
    assert torch.equal(packed, padded[: packed.shape[0]])
    lens = [len(s) for s in segments]
    back = torch.cat(list(reversed(torch.split(reordered, lens[::-1]))))
    assert torch.equal(packed, back)


@pytest.mark.parametrize("numerics", [Numerics.STRICT, Numerics.FAST])
def test_forward_logits_of_rows_are_the_full_logits_rows(numerics: Numerics) -> None:
    """``forward_logits(..., rows=)`` (the LM head on those rows only) gives the rows of the
    full logits: bit for bit in strict numerics, to fp32 rounding in fast; differentiable."""
    cfg = VARIANTS["tiny"]
    model = build_model(cfg, 5)
    model.numerics = numerics
    segments, _ = random_batch(cfg, 5, 4, C)
    ids = torch.tensor([t for s in segments for t in s])
    lengths = [len(s) for s in segments]
    rows = torch.tensor([0, 3, 3, ids.shape[0] - 1, 7])
    full = model.forward_logits(ids, lengths)
    picked = model.forward_logits(ids, lengths, rows=rows)
    assert picked.shape == (rows.shape[0], cfg.vocab_size)
    if numerics is Numerics.STRICT:
        assert torch.equal(picked, full[rows])
    else:
        torch.testing.assert_close(picked, full[rows], rtol=1e-5, atol=1e-6)
    picked.sum().backward()
    assert model.sites["lm_head"].weight.grad is not None


def sample_rollouts(
    engine: DecoderModel, prompts: list[list[int]], new_tokens: int, seed: int
) -> list[list[int]]:
    """Sample continuations from the engine (temperature 1) with a KV cache."""
    gen = torch.Generator().manual_seed(seed)
    cache = engine.new_kv_cache(len(prompts))
    dists = [engine.prefill(cache, j, p).logprobs[-1] for j, p in enumerate(prompts)]
    out = [list(p) for p in prompts]
    for _ in range(new_tokens):
        toks = [int(torch.multinomial(d.exp(), 1, generator=gen)) for d in dists]
        for j, t in enumerate(toks):
            out[j].append(t)
        step = engine.decode_step(cache, list(range(len(prompts))), toks)
        dists = list(step.logprobs)
    return out


def test_parity_holds_over_optimizer_steps_and_weight_sync() -> None:
    cfg = VARIANTS["tiny"]
    trainer = build_model(cfg, 5)
    engine = build_model(cfg, 99)  # different weights until the first sync
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    rng = random.Random(5)
    for round_ in range(3):
        engine.load_hf_state_dict(trainer.hf_state_dict())  # the weight sync
        prompts = [
            [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(2, 6))] for _ in range(3)
        ]
        with threads(1):
            samples = sample_rollouts(engine, prompts, 6, seed=round_)
            roll = decoded_logprobs(engine, samples, [len(p) for p in prompts])
        with threads(1):
            ids = torch.tensor([t for s in samples for t in s])
            lp = trainer.forward_logprobs(ids, [len(s) for s in samples])
        assert torch.equal(lp.detach(), roll), f"round {round_}"
        opt.zero_grad()
        (-lp.sum()).backward()
        opt.step()
    changed = sum(
        not torch.equal(a, b)
        for a, b in zip(
            trainer.hf_state_dict().values(), engine.hf_state_dict().values(), strict=True
        )
    )
    assert changed > 0  # the last step really moved the weights


def test_lora_adapters_keep_parity_per_row() -> None:
    cfg = VARIANTS["tiny"]
    model = build_model(cfg, 7)
    gen = torch.Generator().manual_seed(7)
    targets = model.lora_targets()
    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.experts.2.down_proj",
        "model.layers.2.mlp.gate",
        "lm_head",
    ]

    def adapter(scale: float, tag: str) -> LoraAdapter:
        weights = {}
        for n in names:
            d_in, d_out = targets[n]
            a = torch.randn(4, d_in, generator=gen) * 0.3
            b = torch.randn(d_out, 4, generator=gen) * 0.3
            weights[n] = (a, b)
        return LoraAdapter(weights=weights, scaling=scale, name=tag)

    a1, a2 = adapter(2.0, "a1"), adapter(0.5, "a2")
    segments, prompts = random_batch(cfg, 7, 4, 20)
    per_segment = [a1, None, a2, a1]
    train = packed_logprobs(model, segments, lora=per_segment)
    roll = decoded_logprobs(model, segments, prompts, lora=per_segment)
    assert torch.equal(train, roll)
    base = packed_logprobs(model, segments)
    lens = [len(s) for s in segments]
    moved = [
        not torch.equal(x, y) for x, y in zip(train.split(lens), base.split(lens), strict=True)
    ]
    assert moved == [True, False, True, True]


# --------------------------------------------------------------------------- negative controls


def _mismatches(a: Tensor, b: Tensor) -> int:
    return int((a != b).sum())


@pytest.fixture(scope="module")
def control_setup() -> tuple[DecoderModel, list[list[int]], list[int], Tensor]:
    # top-3 routing: with two slots a + b == b + a, so only k >= 3 can expose combine order
    cfg = VARIANTS["tiny"].replace(num_experts_per_tok=3)
    model = build_model(cfg, 11)
    segments, prompts = random_batch(cfg, 11, 5, C)
    train = packed_logprobs(model, segments)
    assert torch.equal(train, decoded_logprobs(model, segments, prompts))
    return model, segments, prompts, train


def test_control_plain_f_linear_breaks_parity(
    control_setup: tuple[DecoderModel, list[list[int]], list[int], Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, segments, prompts, train = control_setup
    monkeypatch.setattr(StrictOps, "linear", staticmethod(lambda x, w: F.linear(x, w.float())))
    roll = decoded_logprobs(model, segments, prompts)
    assert _mismatches(train, roll) > 0
    assert float((train - roll).abs().max()) < 1e-4  # a small, silent drift: only bits catch it


def test_control_fp32_param_sent_as_bf16_is_refused_or_breaks_parity(
    control_setup: tuple[DecoderModel, list[list[int]], list[int], Tensor],
) -> None:
    model, segments, prompts, train = control_setup
    engine = build_model(model.config, 0)
    hf = model.hf_state_dict()
    name = "model.layers.1.mlp.gate.weight"
    sent = dict(hf)
    sent[name] = hf[name].to(torch.bfloat16)
    with pytest.raises(TensorSpecMismatchError, match=r"mlp\.gate\.weight.*bfloat16"):
        engine.load_hf_state_dict(sent)
    sent[name] = sent[name].float()  # a sender that casts back silently
    engine.load_hf_state_dict(sent)
    roll = decoded_logprobs(engine, segments, prompts)
    assert _mismatches(train, roll) > 0


def test_control_changed_expert_combine_order_breaks_parity(
    control_setup: tuple[DecoderModel, list[list[int]], list[int], Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, segments, prompts, train = control_setup

    original = StrictOps.moe_combine
    monkeypatch.setattr(
        StrictOps,
        "moe_combine",
        staticmethod(lambda w, y: original(w.flip(1), y.flip(1))),
    )
    roll = decoded_logprobs(model, segments, prompts)
    assert _mismatches(train, roll) > 0


def test_control_gate_up_swap_in_sync_breaks_parity(
    control_setup: tuple[DecoderModel, list[list[int]], list[int], Tensor],
) -> None:
    model, segments, prompts, train = control_setup
    sent = model.hf_state_dict()
    gate, up = (
        "model.layers.2.mlp.experts.1.gate_proj.weight",
        "model.layers.2.mlp.experts.1.up_proj.weight",
    )
    sent[gate], sent[up] = sent[up], sent[gate]  # a converter that mixes up the fused halves
    engine = build_model(model.config, 0)
    engine.load_hf_state_dict(sent)
    assert _mismatches(train, decoded_logprobs(engine, segments, prompts)) > 0


def test_fast_mode_is_close_but_makes_no_bitwise_promise() -> None:
    cfg = VARIANTS["tiny"]
    strict = build_model(cfg, 13)
    fast = build_model(cfg, 13, numerics=Numerics.FAST)
    segments, prompts = random_batch(cfg, 13, 3, 20)
    a = packed_logprobs(strict, segments)
    b = packed_logprobs(fast, segments)
    c = decoded_logprobs(fast, segments, prompts)
    assert float((a - b).abs().max()) < 2e-5
    assert float((b - c).abs().max()) < 2e-5


def test_mixed_prefill_and_decode_in_one_extend_call() -> None:
    """Continuous batching: one call prefills a row while others decode; bits do not move."""
    cfg = VARIANTS["tiny"]
    model = build_model(cfg, 17)
    alone = model.new_kv_cache(3)
    mixed = model.new_kv_cache(3)
    first = [model.prefill(alone, r, [5 + r, 6, 7]) for r in range(2)]
    model.extend(mixed, [0, 1], [[5, 6, 7], [6, 6, 7]])
    ref = [model.extend(alone, [r], [toks])[0] for r, toks in enumerate([[9], [10, 11]])]
    ref.append(model.prefill(alone, 2, [1, 2, 3, 4]))
    got = model.extend(mixed, [2, 0, 1], [[1, 2, 3, 4], [9], [10, 11]])
    assert torch.equal(got[0].logprobs, ref[2].logprobs)
    assert torch.equal(got[1].logprobs, ref[0].logprobs)
    assert torch.equal(got[2].logprobs, ref[1].logprobs)
    assert first[0].logprobs.shape == (3, cfg.vocab_size)


SMALL = ModelConfig.tiny(num_hidden_layers=2, max_position_embeddings=16, vocab_size=64)


@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.integers(2, 16), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_parity_over_random_lengths_and_prompts(
    lens: list[int], seed: int, data: st.DataObject
) -> None:
    model = build_model(SMALL, seed)
    gen = torch.Generator().manual_seed(seed)
    segments = [torch.randint(0, SMALL.vocab_size, (n,), generator=gen).tolist() for n in lens]
    prompts = [data.draw(st.integers(1, n - 1)) for n in lens]
    chunked = data.draw(st.booleans())
    assert torch.equal(
        packed_logprobs(model, segments),
        decoded_logprobs(model, segments, prompts, chunked_prefill=chunked),
    )


def test_decoded_logprobs_refuses_a_prompt_outside_its_segment() -> None:
    model = build_model(VARIANTS["tiny"], 0)
    with pytest.raises(ModelInputError, match=r"prompt_lens\[1\]=6 must be in \[1, 5\]"):
        decoded_logprobs(model, [[1, 2, 3], [4, 5, 6, 7, 8]], [1, 6])
