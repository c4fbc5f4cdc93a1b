"""MLA (``_mla``): transformers' ``DeepseekV3Attention`` / ``Glm4MoeLiteAttention`` on the same
weights, strict train == strict decode bit for bit, absorbed decode within tolerance.

Stated tolerance: 1e-5 absolute on outputs of O(1) (fp32 weights and activations), strict and
fast. Observed on these shapes: up to 1.3e-6.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from transformers import DeepseekV3Config, Glm4MoeLiteConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
    Glm4MoeLiteAttention,
    Glm4MoeLiteRotaryEmbedding,
)

from posttrain.models import (
    CacheError,
    FastOps,
    MissingTensorError,
    ModelConfigError,
    ModelInputError,
    PackedLayout,
    StrictOps,
    TensorSpecMismatchError,
    UnknownTensorError,
)
from posttrain.models._mla import MlaAttention, deinterleave
from posttrain.models._mla_cache import MlaCache
from posttrain.models._mla_config import MlaRope, MlaSpec

TOLERANCE = 1e-5
CAPACITY = 32
SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "max_position_embeddings": CAPACITY,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32,
    "beta_slow": 1,
}
# (config class, fields): q_lora_rank set and None; v_head_dim below, above and equal to
# qk_head_dim (12); default rope, DeepSeek-V3's yarn (mscale == mscale_all_dim: the whole
# correction in the softmax scale) and a yarn whose cos/sin factor is not 1; rope interleaved
# (both classes' default) and not.
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "deepseek-q-lora": (DeepseekV3Config, {"q_lora_rank": 12, "v_head_dim": 6}),
    "deepseek-q-proj-yarn": (
        DeepseekV3Config,
        {
            "q_lora_rank": None,
            "v_head_dim": 16,
            "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        },
    ),
    "deepseek-yarn-attention-factor": (
        DeepseekV3Config,
        {
            "q_lora_rank": 12,
            "v_head_dim": 6,
            "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
        },
    ),
    "deepseek-not-interleaved": (
        DeepseekV3Config,
        {"q_lora_rank": 12, "v_head_dim": 6, "rope_interleave": False},
    ),
    "glm4-moe-lite": (
        Glm4MoeLiteConfig,
        {"q_lora_rank": 12, "v_head_dim": 12, "num_hidden_layers": 2},
    ),
}


def hf_config(name: str) -> DeepseekV3Config | Glm4MoeLiteConfig:
    cls, fields = CASES[name]
    cfg = cls(**SHAPE, **fields)
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' attention module (random weights, norms near 1) and its rotary module."""
    cfg = hf_config(name)
    if isinstance(cfg, Glm4MoeLiteConfig):
        attn: torch.nn.Module = Glm4MoeLiteAttention(cfg, 0)
        rotary: torch.nn.Module = Glm4MoeLiteRotaryEmbedding(cfg)
    else:
        attn, rotary = DeepseekV3Attention(cfg, 0), DeepseekV3RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in attn.named_parameters():
            draw = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * draw if "layernorm" in pname else 0.2 * draw)
    return attn.eval(), rotary


def ours(name: str, seed: int = 0) -> MlaAttention:
    attn, _ = hf_attention(name, seed)
    module = MlaAttention(MlaSpec.from_hf_dict(hf_config(name).to_dict()))
    module.load_hf_state_dict(attn.state_dict())
    return module


def hf_segment(attn: torch.nn.Module, rotary: torch.nn.Module, x: Tensor) -> Tensor:
    """transformers' output for one sequence ``x[n, H]`` (positions 0..n-1, causal mask)."""
    n = x.shape[0]
    cos, sin = rotary(x[None], torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out: Tensor = attn(x[None], (cos, sin), mask)[0][0]
    return out


def packed(lengths: Sequence[int]) -> PackedLayout:
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    pos = torch.arange(int(sum(lengths))) - starts[seg]
    return PackedLayout(seg, pos, len(lengths), CAPACITY)


def train(module: MlaAttention, ops: type[FastOps], x: Tensor, lengths: Sequence[int]) -> Tensor:
    layout = packed(lengths)
    cos, sin = module.spec.rope_tables(CAPACITY)
    return module.forward_packed(ops, x, layout, cos=cos[layout.pos], sin=sin[layout.pos])


def decode(
    module: MlaAttention,
    ops: type[FastOps],
    seqs: Sequence[Tensor],
    chunks: Sequence[int],
    *,
    absorbed: bool | None = None,
) -> list[Tensor]:
    """Feed sequence ``j`` into cache row ``len(seqs) - 1 - j`` (rows out of order), all rows
    in each call: ``chunks[0]`` tokens of every row first (a prefill), then ``chunks[i]``
    tokens per call; returns each sequence's outputs in order."""
    cache = MlaCache(module.spec, 1, len(seqs) + 1, CAPACITY)
    cos_t, sin_t = module.spec.rope_tables(CAPACITY)
    done = [0] * len(seqs)
    outs: list[list[Tensor]] = [[] for _ in seqs]
    step = 0
    while any(d < s.shape[0] for d, s in zip(done, seqs, strict=True)):
        size = chunks[min(step, len(chunks) - 1)]
        live = [j for j, s in enumerate(seqs) if done[j] < s.shape[0]]
        parts = [seqs[j][done[j] : done[j] + size] for j in live]
        rows = [len(seqs) - 1 - j for j in live]
        buf_row, pos = cache.placement(rows, [p.shape[0] for p in parts])
        with torch.no_grad():
            y = module.forward_cached(
                ops,
                torch.cat(parts),
                cache,
                0,
                rows=buf_row,
                pos=pos,
                cos=cos_t[pos],
                sin=sin_t[pos],
                absorbed=absorbed,
            )
        cache.advance(rows, [p.shape[0] for p in parts])
        for j, piece in zip(live, torch.split(y, [p.shape[0] for p in parts]), strict=True):
            outs[j].append(piece)
            done[j] += piece.shape[0]
        step += 1
    return [torch.cat(o) for o in outs]


# ---------------------------------------------------------------------- transformers parity


@pytest.mark.parametrize("numerics", [FastOps, StrictOps], ids=["fast", "strict"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_forward_matches_transformers_per_segment(
    name: str, numerics: type[FastOps]
) -> None:
    attn, rotary = hf_attention(name)
    module = ours(name)
    lengths = [5, 1, 11, 3]
    x = torch.randn(sum(lengths), SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = train(module, numerics, x, lengths)
    for seg_x, seg_out in zip(x.split(lengths), out.split(lengths), strict=True):
        ref = hf_segment(attn, rotary, seg_x)
        assert float((seg_out - ref).abs().max()) < TOLERANCE, name


@pytest.mark.parametrize("name", ["deepseek-q-lora", "glm4-moe-lite"])
def test_gradients_match_transformers(name: str) -> None:
    attn, rotary = hf_attention(name)
    x = torch.randn(9, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(2))
    hf_x = x.clone().requires_grad_(True)
    n = x.shape[0]
    cos, sin = rotary(hf_x[None], torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    attn(hf_x[None], (cos, sin), mask)[0].square().sum().backward()
    hf_grads = {k: v.grad for k, v in attn.named_parameters()}
    for numerics in (FastOps, StrictOps):
        module = ours(name)
        our_x = x.clone().requires_grad_(True)
        train(module, numerics, our_x, [n]).square().sum().backward()
        assert our_x.grad is not None
        assert hf_x.grad is not None
        assert float((our_x.grad - hf_x.grad).abs().max()) < 1e-4
        for key in module.hf_state_dict():
            got = dict(module.named_parameters())[key.removesuffix(".weight")].grad
            assert got is not None
            assert float((got - hf_grads[key]).abs().max()) < 1e-4, key


def test_deinterleave_is_transformers_interleaved_rope() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    from posttrain.models._ops import apply_rope

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 3, 5, 8, generator=gen), torch.randn(1, 1, 5, 8, generator=gen)
    cos, sin = MlaRope(rope_theta=100.0).tables(8, 5)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q, k, cos[None], sin[None])
    ours_q = apply_rope(deinterleave(q[0].transpose(0, 1)), cos, sin).transpose(0, 1)
    ours_k = apply_rope(deinterleave(k[0].transpose(0, 1)), cos, sin).transpose(0, 1)
    assert torch.equal(ours_q, hf_q[0])
    assert torch.equal(ours_k, hf_k[0])


# ---------------------------------------------------------------------- train == decode


def _stack_outputs(
    layers: Sequence[MlaAttention], ops: type[FastOps], x: Tensor, run: Any
) -> Tensor:
    """Two residual MLA layers: ``h = x + attn0(x); out = h + attn1(h)``, each via ``run``."""
    h = x + run(layers[0], 0, x)
    return h + run(layers[1], 1, h)


def test_strict_train_equals_strict_decode_bit_for_bit_over_layers_rows_and_chunks() -> None:
    layers = [ours("deepseek-q-lora", 0), ours("deepseek-q-lora", 5)]
    spec = layers[0].spec
    cos_t, sin_t = spec.rope_tables(CAPACITY)
    gen = torch.Generator().manual_seed(4)
    lengths = [7, 13, 2, 20]
    x = torch.randn(sum(lengths), spec.hidden_size, generator=gen)
    layout = packed(lengths)
    cos, sin = cos_t[layout.pos], sin_t[layout.pos]
    with torch.no_grad():
        want = _stack_outputs(
            layers,
            StrictOps,
            x,
            lambda m, i, h: m.forward_packed(StrictOps, h, layout, cos=cos, sin=sin, layer=i),
        ).split(lengths)
    for chunks in ([1], [5, 1], [3, 2, 1, 4], [20]):
        cache = MlaCache(spec, 2, len(lengths), CAPACITY)
        seqs = x.split(lengths)
        done = [0] * len(lengths)
        got: list[list[Tensor]] = [[] for _ in lengths]
        for call in range(40):
            size = chunks[min(call, len(chunks) - 1)]
            live = [j for j in range(len(lengths)) if done[j] < lengths[j]]
            if not live:
                break
            parts = [seqs[j][done[j] : done[j] + size] for j in live]
            sizes = [p.shape[0] for p in parts]
            rows, pos = cache.placement(live, sizes)
            place = {"rows": rows, "pos": pos, "cos": cos_t[pos], "sin": sin_t[pos]}
            with torch.no_grad():
                y = _stack_outputs(
                    layers,
                    StrictOps,
                    torch.cat(parts),
                    lambda m, i, h, c=cache, p=place: m.forward_cached(StrictOps, h, c, i, **p),
                )
            cache.advance(live, sizes)
            for j, piece in zip(live, y.split(sizes), strict=True):
                got[j].append(piece)
                done[j] += piece.shape[0]
        for j, w in enumerate(want):
            assert torch.equal(torch.cat(got[j]), w), (chunks, j)


@pytest.mark.parametrize("name", ["deepseek-q-proj-yarn", "glm4-moe-lite"])
def test_absorbed_decode_is_close_to_training_but_not_bitwise_in_strict(name: str) -> None:
    module = ours(name)
    lengths = [9, 4, 15]
    x = torch.randn(sum(lengths), SHAPE["hidden_size"], generator=torch.Generator().manual_seed(6))
    seqs = list(x.split(lengths))
    with torch.no_grad():
        fast_train = train(module, FastOps, x, lengths).split(lengths)
        strict_train = train(module, StrictOps, x, lengths).split(lengths)
    fast = decode(module, FastOps, seqs, [3, 1])  # absorbed: the fast default
    strict_absorbed = decode(module, StrictOps, seqs, [3, 1], absorbed=True)
    strict_expanded = decode(module, StrictOps, seqs, [3, 1])  # the strict default
    fast_expanded = decode(module, FastOps, seqs, [3, 1], absorbed=False)
    for j in range(len(lengths)):
        assert float((fast[j] - fast_train[j]).abs().max()) < TOLERANCE
        assert float((fast_expanded[j] - fast_train[j]).abs().max()) < TOLERANCE
        assert float((strict_absorbed[j] - strict_train[j]).abs().max()) < TOLERANCE
        assert torch.equal(strict_expanded[j], strict_train[j])
    # Absorption reorders the reductions: its bits differ from training's (why strict
    # decode expands the latents instead; see _mla's docstring).
    assert not all(torch.equal(a, b) for a, b in zip(strict_absorbed, strict_train, strict=True))


def test_bf16_parameters_keep_strict_train_equal_to_decode() -> None:
    attn, _ = hf_attention("deepseek-q-proj-yarn")
    module = MlaAttention(MlaSpec.from_hf_dict(hf_config("deepseek-q-proj-yarn").to_dict()),
                          dtype=torch.bfloat16)  # fmt: skip
    module.load_hf_state_dict({k: v.bfloat16() for k, v in attn.state_dict().items()})
    lengths = [6, 10]
    x = torch.randn(sum(lengths), SHAPE["hidden_size"], generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = train(module, StrictOps, x, lengths).split(lengths)
    got = decode(module, StrictOps, list(x.split(lengths)), [4, 1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert want[0].dtype == torch.float32  # fp32 activations whatever the parameter dtype


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_strict_rows_do_not_depend_on_packing(
    lengths: list[int], seed: int, data: st.DataObject
) -> None:
    module = ours("glm4-moe-lite")
    x = torch.randn(
        sum(lengths), SHAPE["hidden_size"], generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        together = train(module, StrictOps, x, lengths).split(lengths)
        order = data.draw(st.permutations(range(len(lengths))))
        seqs = x.split(lengths)
        shuffled = train(
            module, StrictOps, torch.cat([seqs[j] for j in order]), [lengths[j] for j in order]
        )
        for j, piece in zip(order, shuffled.split([lengths[j] for j in order]), strict=True):
            assert torch.equal(piece, together[j])
        j = data.draw(st.integers(0, len(lengths) - 1))
        assert torch.equal(train(module, StrictOps, seqs[j], [lengths[j]]), together[j])


# ---------------------------------------------------------------------- config and errors


def test_spec_reads_transformers_configs() -> None:
    glm = MlaSpec.from_hf_dict(hf_config("glm4-moe-lite").to_dict())
    assert glm.latent_norm_eps == 1e-6  # not rms_norm_eps (1e-5): transformers' latent norms
    assert hf_config("glm4-moe-lite").rms_norm_eps == 1e-5
    yarn = MlaSpec.from_hf_dict(hf_config("deepseek-yarn-attention-factor").to_dict())
    attn, rotary = hf_attention("deepseek-yarn-attention-factor")
    assert yarn.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert yarn.rope.cos_sin_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert yarn.rope.cos_sin_factor != 1.0
    assert torch.allclose(yarn.rope.inv_freq(4).float(), rotary.inv_freq, rtol=1e-6)
    legacy = {
        **SHAPE,
        "q_lora_rank": None,
        "v_head_dim": 6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", **{k: v for k, v in YARN.items() if k != "rope_type"}},
    }
    v5 = {**legacy, "rope_parameters": YARN}
    del v5["rope_scaling"]
    assert MlaSpec.from_hf_dict(legacy) == MlaSpec.from_hf_dict(v5)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "llama3"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ],
)
def test_spec_refuses_by_name(change: dict[str, Any], needle: str) -> None:
    hf = {**SHAPE, "q_lora_rank": 12, "v_head_dim": 6, **change}
    with pytest.raises(ModelConfigError, match=needle):
        MlaSpec.from_hf_dict(hf)


def test_weight_loading_refuses_unknown_missing_and_mismatched_tensors() -> None:
    attn, _ = hf_attention("deepseek-q-lora")
    module = MlaAttention(MlaSpec.from_hf_dict(hf_config("deepseek-q-lora").to_dict()))
    state = attn.state_dict()
    with pytest.raises(UnknownTensorError, match=r"q_proj\.weight"):
        module.load_hf_state_dict({**state, "q_proj.weight": torch.zeros(1)})
    with pytest.raises(MissingTensorError, match=r"kv_b_proj\.weight"):
        module.load_hf_state_dict({k: v for k, v in state.items() if k != "kv_b_proj.weight"})
    with pytest.raises(TensorSpecMismatchError, match=r"o_proj\.weight"):
        module.load_hf_state_dict({**state, "o_proj.weight": state["o_proj.weight"].bfloat16()})
    assert not module.kv_b_proj.abs().sum()  # nothing was copied by a refused load
    module.load_hf_state_dict(state)
    assert all(torch.equal(module.hf_state_dict()[k], v) for k, v in state.items())


def test_cache_rows_capacity_and_reset() -> None:
    spec = MlaSpec.from_hf_dict(hf_config("deepseek-q-lora").to_dict())
    cache = MlaCache(spec, 2, 3, 8)
    assert cache.latent(1).shape == (3, 8, 16)
    assert cache.rope_key(1).shape == (3, 8, 4)
    rows, pos = cache.placement([2, 0], [3, 1])
    assert rows.tolist() == [2, 2, 2, 0]
    assert pos.tolist() == [0, 1, 2, 0]
    cache.advance([2, 0], [3, 1])
    assert cache.placement([2], [5])[1].tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(CacheError, match="exceed capacity 8"):
        cache.placement([2], [6])
    with pytest.raises(CacheError, match="distinct"):
        cache.placement([1, 1], [1, 1])
    with pytest.raises(CacheError, match="out of range"):
        cache.placement([3], [1])
    cache.kv[0][2].fill_(1.0)
    cache.reset(2)
    assert cache.lengths == [1, 0, 0]
    assert not cache.kv[0][2].any()
    module = ours("deepseek-q-lora")
    with pytest.raises(ModelInputError, match="3 tokens, 2 rows"):
        module.forward_cached(
            StrictOps,
            torch.zeros(3, 32),
            cache,
            0,
            rows=torch.zeros(2, dtype=torch.long),
            pos=torch.zeros(2, dtype=torch.long),
            cos=torch.zeros(3, 4),
            sin=torch.zeros(3, 4),
        )
    with pytest.raises(CacheError, match=r"positions must lie in \[0, 8\)"):
        module.forward_cached(
            StrictOps,
            torch.zeros(1, 32),
            cache,
            0,
            rows=torch.zeros(1, dtype=torch.long),
            pos=torch.full((1,), 8),
            cos=torch.zeros(1, 4),
            sin=torch.zeros(1, 4),
        )
