"""Inkling-style blocks: strict train == KV-cache decode bit for bit with every block on, the
negative controls that show the check bites, the CP seams, config validation and layout."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from posttrain.models import (
    CacheError,
    DecoderModel,
    KVCache,
    ModelConfig,
    ModelConfigError,
    Numerics,
    PackedLayout,
    StrictOps,
    TensorSpecMismatchError,
    attend,
    build_model,
    decoded_logprobs,
    load_pretrained,
    packed_logprobs,
    residual_sconv,
    weight_groups,
)
from posttrain.models._blocks import sconv_windows

C = 32  # KV capacity: longer than the window (8) and the global bias extent (16)
INKLING = ModelConfig.inkling_tiny(max_position_embeddings=C)


def inkling_model(cfg: ModelConfig = INKLING, seed: int = 0, **kw: object) -> DecoderModel:
    """``build_model`` plus random sconv weights and expert biases (init makes sconv the
    identity, which would leave the convolution paths untested)."""
    model = build_model(cfg, seed, **kw)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_conv", "expert_bias")):
                draw = torch.randn(param.shape, generator=gen) * 0.3
                param.copy_(draw.to(param.dtype))
    return model


def batch(seed: int, n: int, lo: int = 2, hi: int = C) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(n)]
    segs = [[rng.randrange(INKLING.vocab_size) for _ in range(m)] for m in lens]
    return segs, [rng.randint(1, m - 1) for m in lens]


def decode_lp(
    model: DecoderModel,
    segments: Sequence[Sequence[int]],
    prompts: Sequence[int],
    *,
    chunked: bool = False,
    poke: tuple[int, str] | None = None,
) -> Tensor:
    """``decoded_logprobs``; ``poke=(layer, site)`` adds 1e-3 to one value of that sconv state
    after the prefills (a negative control)."""

    def disturb(cache: KVCache, rows: list[int]) -> None:
        if poke is not None:
            cache.conv_state(*poke)[rows[0], -1, 0] += 1e-3

    return decoded_logprobs(
        model, segments, prompts, chunked_prefill=chunked, after_prefill=disturb
    )


def test_inkling_tiny_has_every_block() -> None:
    cfg = INKLING
    assert cfg.layer_types == ("dense", "moe", "moe", "moe")
    assert [cfg.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]
    assert cfg.attention_shape(0) != cfg.attention_shape(1)
    assert cfg.rel_extent(0) == 8
    assert cfg.rel_extent(1) == 16
    assert cfg.softmax_scale(0) == 1 / 16
    assert cfg.softmax_scale(1) == 1 / 8
    assert cfg.uses_extensions
    assert not ModelConfig.tiny().uses_extensions


@pytest.mark.parametrize("seed", [0, 1])
def test_strict_train_equals_decode_with_every_block(seed: int) -> None:
    model = inkling_model(seed=seed)
    segments, prompts = batch(seed, 4)
    assert max(len(s) for s in segments) > 16  # past the window and the global extent
    packed = packed_logprobs(model, segments)
    assert (packed != 0).sum() == sum(len(s) - 1 for s in segments)
    assert torch.equal(packed, decode_lp(model, segments, prompts, chunked=seed == 1))
    # without packing: each sequence alone gives the same bits too
    alone = torch.cat([packed_logprobs(model, [s]) for s in segments])
    assert torch.equal(packed, alone)
    assert torch.equal(alone[: len(segments[0])], decode_lp(model, segments[:1], prompts[:1]))


def test_parity_in_bf16_params_and_with_two_threads() -> None:
    cfg = INKLING.replace(torch_dtype="bfloat16", tie_word_embeddings=True)
    model = inkling_model(cfg, 4)
    segments, prompts = batch(4, 3)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        packed = packed_logprobs(model, segments)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(packed, decode_lp(model, segments, prompts))


def test_every_block_changes_the_output() -> None:
    """Each block is live: turning it off (its weights to the no-op) moves the logprobs."""
    model = inkling_model(seed=2)
    segments, _ = batch(2, 2)
    base = packed_logprobs(model, segments)
    for name in ("layers.0.k_conv", "layers.1.mlp_out_conv", "layers.1.rel_proj",
                 "layers.2.rel_proj", "layers.3.expert_bias", "layers.3.shared_fc2"):  # fmt: skip
        param = dict(model.named_parameters())[name]
        saved = param.detach().clone()
        with torch.no_grad():
            param.zero_()
        assert not torch.equal(packed_logprobs(model, segments), base), name
        with torch.no_grad():
            param.copy_(saved)
    assert torch.equal(packed_logprobs(model, segments), base)


# --------------------------------------------------------------------------- negative controls


@pytest.fixture(scope="module")
def control() -> tuple[DecoderModel, list[list[int]], list[int], Tensor]:
    model = inkling_model(seed=7)
    segments, prompts = batch(7, 3, lo=10)
    train = packed_logprobs(model, segments)
    assert torch.equal(train, decode_lp(model, segments, prompts))
    return model, segments, prompts, train


@pytest.mark.parametrize("site", [(0, "k"), (1, "v"), (2, "attn"), (3, "mlp")])
def test_control_perturbed_conv_state_breaks_parity(
    control: tuple[DecoderModel, list[list[int]], list[int], Tensor], site: tuple[int, str]
) -> None:
    model, segments, prompts, train = control
    roll = decode_lp(model, segments, prompts, poke=site)
    n0 = len(segments[0])
    assert not torch.equal(train[:n0], roll[:n0])  # the poked row drifts...
    assert torch.equal(train[n0:], roll[n0:])  # ...and only that row


def test_control_conv_across_the_packing_boundary_breaks_parity(
    control: tuple[DecoderModel, list[list[int]], list[int], Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, segments, _prompts, train = control

    def leaky(
        self: PackedLayout, ops: object, layer: int, site: str, x: Tensor, w: Tensor
    ) -> Tensor:
        return residual_sconv(StrictOps, x, torch.zeros_like(self.seg), w)  # one big segment

    monkeypatch.setattr(PackedLayout, "sconv", leaky)
    leaked = packed_logprobs(model, segments)
    n0 = len(segments[0])
    assert torch.equal(leaked[:n0], train[:n0])  # the first segment has nothing before it
    assert not torch.equal(leaked[n0:], train[n0:])


def test_control_window_and_bias_off_by_one_break_parity(
    control: tuple[DecoderModel, list[list[int]], list[int], Tensor],
) -> None:
    model, segments, prompts, train = control
    for changes in ({"sliding_window_size": 9, "rel_pos_extent": 16},
                    {"rel_pos_extent": 15}):  # fmt: skip
        cfg = model.config.replace(**changes)
        other = DecoderModel(cfg)
        state = {k: v for k, v in model.state_dict().items() if "rel_proj" not in k}
        other.load_state_dict(state, strict=False)
        with torch.no_grad():
            for name, p in other.named_parameters():
                if name.endswith("rel_proj"):
                    src = dict(model.named_parameters())[name]
                    n = min(p.shape[1], src.shape[1])
                    p.zero_()
                    p[:, :n] = src[:, :n]
        assert not torch.equal(decode_lp(other, segments, prompts), train), changes


# --------------------------------------------------------------------------- CP seams


def test_sconv_with_a_halo_equals_the_unsplit_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 6, generator=gen)
    seg = torch.tensor([0] * 5 + [1] * 9 + [2] * 6)
    w = torch.randn(6, 4, generator=gen)
    whole = residual_sconv(StrictOps, x, seg, w)
    for cut in (1, 3, 5, 6, 13, 17):
        halo_x = torch.cat([torch.zeros(3, 6), x[:cut]])[-3:]
        halo_s = torch.cat([torch.full((3,), -1), seg[:cut]])[-3:]
        part = residual_sconv(StrictOps, x[cut:], seg[cut:], w, halo_x, halo_s)
        assert torch.equal(part, whole[cut:]), cut
    # taps never cross a segment: row 5 (segment 1's start) sees only itself
    assert torch.equal(sconv_windows(x, seg, 4)[:3, 5], torch.zeros(3, 6))


def test_attend_split_queries_over_gathered_keys_equals_unsplit() -> None:
    gen = torch.Generator().manual_seed(1)
    lens = [7, 12, 5]
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    q = torch.randn(24, 4, 8, generator=gen)
    k, v = torch.randn(24, 2, 8, generator=gen), torch.randn(24, 2, 8, generator=gen)
    rel = torch.randn(24, 4, 6, generator=gen)
    kw = {"num_segments": 3, "capacity": 16, "scale": 0.125, "window": 5}
    whole = attend(StrictOps, q, k, v, q_pos=pos, q_seg=seg, k_pos=pos, k_seg=seg,
                   rel_logits=rel, **kw)  # type: ignore[arg-type]  # fmt: skip
    # zigzag-like split: rank 0 holds chunks 0 and 3 of 4, keys gathered in any order
    order = torch.randperm(24, generator=gen)
    idx = torch.cat([torch.arange(0, 6), torch.arange(18, 24)])
    part = attend(StrictOps, q[idx], k[order], v[order], q_pos=pos[idx], q_seg=seg[idx],
                  k_pos=pos[order], k_seg=seg[order], rel_logits=rel[idx], **kw)  # type: ignore[arg-type]  # fmt: skip
    assert torch.equal(part, whole[idx])


def test_forward_with_a_packed_layout_is_the_training_forward() -> None:
    model = inkling_model(seed=3)
    segments, _ = batch(3, 3)
    ids = torch.tensor([t for s in segments for t in s])
    lens = [len(s) for s in segments]
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    layout = PackedLayout(seg, pos, 3, C)
    assert torch.equal(model.forward_with_layout(ids, layout), model.forward_logits(ids, lens))


# --------------------------------------------------------------------------- training, files


def test_gradients_reach_conv_weights_and_frozen_tensors_stay_frozen() -> None:
    model = inkling_model(seed=5)
    segments, _ = batch(5, 2)
    ids = torch.tensor([t for s in segments for t in s])
    (-model.forward_logprobs(ids, [len(s) for s in segments]).sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("layers.0.k_conv", "layers.0.v_conv", "layers.2.attn_out_conv",
                 "layers.3.mlp_out_conv", "layers.1.qkv", "layers.3.shared_fc1",
                 "layers.1.router", "embed_norm"):  # fmt: skip
        g = grads[name]
        assert g is not None, name
        assert bool(g.abs().sum() > 0), name
    for name, p in model.named_parameters():
        if name.endswith(("rel_proj", "expert_bias")):
            assert not p.requires_grad, name
            assert grads[name] is None, name


def test_fast_mode_is_close_to_strict() -> None:
    strict = inkling_model(seed=6)
    fast = inkling_model(seed=6, numerics=Numerics.FAST)
    segments, prompts = batch(6, 2)
    a, b = packed_logprobs(strict, segments), packed_logprobs(fast, segments)
    assert float((a - b).abs().max()) < 2e-5
    assert float((b - decode_lp(fast, segments, prompts)).abs().max()) < 2e-5


def test_checkpoint_round_trip_keeps_fp32_bias_and_frozen_tables(tmp_path: object) -> None:
    from pathlib import Path

    cfg = INKLING.replace(torch_dtype="bfloat16")
    model = inkling_model(cfg, 8)
    out = Path(str(tmp_path)) / "ink"
    model.save_pretrained(out)
    again = load_pretrained(out)
    assert again.config == cfg
    hf = model.hf_state_dict()
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert hf["model.layers.1.mlp.gate.weight"].shape == (4 + 2, 32)
    assert "model.layers.0.self_attn.r_proj.weight" in hf
    assert all(torch.equal(hf[k], v) for k, v in again.hf_state_dict().items())
    segments, _ = batch(8, 2)
    assert torch.equal(packed_logprobs(model, segments), packed_logprobs(again, segments))
    sent = dict(hf)
    sent["model.layers.1.mlp.gate.e_score_correction_bias"] = sent[
        "model.layers.1.mlp.gate.e_score_correction_bias"
    ].bfloat16()
    with pytest.raises(TensorSpecMismatchError, match="e_score_correction_bias"):
        again.load_hf_state_dict(sent)
    targets = model.lora_targets()
    assert "model.layers.0.self_attn.r_proj" in targets
    assert "model.layers.1.mlp.shared_experts.1.down_proj" in targets
    assert not any("conv" in n or "rel_proj" in n for n in targets)
    names = {n for g in weight_groups(cfg) for n in g.hf_names}
    assert names == set(hf)


def test_plain_configs_write_the_same_config_json() -> None:
    hf = ModelConfig.tiny().to_hf_dict()  # dense layer 0 + MoE layers: the mellum layout
    assert hf["architectures"] == ["MellumForCausalLM"]
    assert not any(key in hf for key in ("sconv_kernel_size", "rel_pos_dim", "logits_divisor"))
    assert ModelConfig.from_hf_dict(hf) == ModelConfig.tiny()
    ink = INKLING.to_hf_dict()
    assert ink["architectures"] == ["InklingForCausalLM"]
    assert ModelConfig.from_hf_dict(ink) == INKLING


def test_cache_errors_name_the_site() -> None:
    cache = build_model(ModelConfig.tiny(max_position_embeddings=8)).new_kv_cache(1)
    with pytest.raises(CacheError, match="sconv_kernel_size is 0"):
        cache.conv_state(0, "k")
    cache = inkling_model().new_kv_cache(1)
    with pytest.raises(CacheError, match="'q'"):
        cache.conv_state(0, "q")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sconv_kernel_size": -1}, "sconv_kernel_size"),
        ({"sconv_kernel_size": 1}, "sconv_kernel_size"),
        ({"rel_pos_dim": 4, "rel_pos_extent": 0}, "rel_pos_extent"),
        ({"rel_pos_dim": 0, "rel_pos_extent": 5}, "rel_pos_extent"),
        ({"rel_pos_extent": 64}, "rel_pos_extent"),
        ({"sliding_window_layers": (9,)}, "sliding_window_layers"),
        ({"sliding_window_layers": (0, 0)}, "sliding_window_layers"),
        ({"sliding_window_size": 0}, "sliding_window_size"),
        (
            {
                "sliding_window_layers": (),
                "swa_head_dim": None,
                "swa_num_attention_heads": None,
                "swa_num_key_value_heads": None,
            },
            "sliding_window_size",
        ),
        ({"swa_num_attention_heads": 3, "swa_num_key_value_heads": 2}, "swa_num_attention_heads"),
        ({"swa_num_key_value_heads": 0}, "swa_num_key_value_heads"),
        ({"swa_head_dim": 7}, "swa_head_dim"),
        ({"attention_softmax_scale": "sqrt"}, "attention_softmax_scale"),
        ({"qk_norm_per_head": 1}, "qk_norm_per_head"),
        ({"router_score_function": "relu"}, "router_score_function"),
        ({"router_score_function": "softmax"}, "n_shared_experts"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"n_shared_experts": 0}, "shared_expert_intermediate_size"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        ({"embedding_rms_norm": "yes"}, "embedding_rms_norm"),
        ({"logits_divisor": 0.0}, "logits_divisor"),
        ({"logits_divisor": float("inf")}, "logits_divisor"),
    ],
)
def test_every_new_field_is_validated_by_name(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        INKLING.replace(**changes)


def test_swa_fields_without_sliding_layers_are_refused() -> None:
    with pytest.raises(ModelConfigError, match="swa_head_dim"):
        ModelConfig.tiny(swa_head_dim=16)
    with pytest.raises(ModelConfigError, match="sliding_window_layers"):
        ModelConfig.from_hf_dict({**INKLING.to_hf_dict(), "sliding_window_layers": 3})


class ChunkedLayout(PackedLayout):
    """A context-parallel data flow in one process: the packed tokens are cut into chunks (as
    ranks would hold them); each chunk's sconv sees only its own rows plus a k-1 halo taken
    from the previous chunk, and each chunk's queries attend over all keys in a shuffled
    (gathered) order. What a CP layout does with real collectives, minus the collectives."""

    def __init__(
        self, seg: Tensor, pos: Tensor, num_segments: int, cuts: list[int], *, detach: bool = False
    ) -> None:
        super().__init__(seg, pos, num_segments, C)
        self.cuts = cuts
        self.detach = detach  # what a gradient-less exchange (a plain all_gather) would give

    def sconv(self, ops: type[StrictOps], layer: int, site: str, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        keep = w.shape[1] - 1
        outs = []
        for a, b in itertools.pairwise(self.cuts):
            halo = torch.cat([x.new_zeros((keep, x.shape[1])), x[:a]])[-keep:]
            halo_seg = torch.cat([self.seg.new_full((keep,), -1), self.seg[:a]])[-keep:]
            if self.detach:
                halo = halo.detach()
            outs.append(residual_sconv(ops, x[a:b], self.seg[a:b], w, halo, halo_seg))
        return torch.cat(outs)

    def attend(self, ops: type[StrictOps], layer: int, q: Tensor, k: Tensor, v: Tensor, *,  # type: ignore[override]
               scale: float, window: int | None, rel_logits: Tensor | None) -> Tensor:  # fmt: skip
        order = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(layer))
        outs = []
        for a, b in itertools.pairwise(self.cuts):
            outs.append(
                attend(
                    ops,
                    q[a:b],
                    k[order],
                    v[order],
                    q_pos=self.pos[a:b],
                    q_seg=self.seg[a:b],
                    k_pos=self.pos[order],
                    k_seg=self.seg[order],
                    num_segments=self.num_segments,
                    capacity=C,
                    scale=scale,
                    window=window,
                    rel_logits=None if rel_logits is None else rel_logits[a:b],
                )
            )
        return torch.cat(outs)


def split_grads(
    model: DecoderModel, detach: bool
) -> tuple[Tensor, Tensor, list[dict[str, Tensor]]]:
    segments, _ = batch(9, 3)
    ids = torch.tensor([t for s in segments for t in s])
    lens = [len(s) for s in segments]
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    n = ids.shape[0]
    cuts = [0, 1, n // 4, n // 2, n // 2 + 2, n]  # chunks shorter than the k-1 halo included
    want = model.forward_logits(ids, lens)
    got = model.forward_with_layout(ids, ChunkedLayout(seg, pos, 3, cuts, detach=detach))
    grads = []
    for out in (want, got):
        model.zero_grad()
        out.sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    return want, got, grads


def rel_l2(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_a_chunked_layout_gives_the_unsplit_logits_and_gradients() -> None:
    want, got, (ref, split) = split_grads(inkling_model(seed=9), detach=False)
    assert torch.equal(got, want)
    assert ref.keys() == split.keys()
    for name, g in ref.items():
        assert rel_l2(split[name], g) <= 1e-6, name


def test_control_a_halo_without_gradient_loses_conv_gradients() -> None:
    want, got, (ref, split) = split_grads(inkling_model(seed=9), detach=True)
    assert torch.equal(got, want)  # the forward cannot tell...
    bad = sorted(n for n, g in ref.items() if rel_l2(split[n], g) > 1e-6)
    # ...the gradients can: what flows back through a halo to the layers below is lost,
    # K/V projections and convolution weights included
    assert {"layers.0.qkv", "layers.0.k_conv", "layers.2.attn_out_conv"} <= set(bad)
    assert "layers.3.mlp_out_conv" not in bad  # the last site's own weight gradient survives


SMALL_INKLING = ModelConfig.inkling_tiny(
    max_position_embeddings=16, vocab_size=64, sliding_window_size=4, rel_pos_extent=8,
    sconv_kernel_size=3, num_hidden_layers=3, sliding_window_layers=(1,), mlp_only_layers=(0,),
)  # fmt: skip


@settings(max_examples=5, deadline=None)
@given(
    lens=st.lists(st.integers(2, 16), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_inkling_parity_over_random_lengths_and_prompts(
    lens: list[int], seed: int, data: st.DataObject
) -> None:
    model = inkling_model(SMALL_INKLING, seed)
    gen = torch.Generator().manual_seed(seed)
    segments = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lens]
    prompts = [data.draw(st.integers(1, n - 1)) for n in lens]
    chunked = data.draw(st.booleans())
    assert torch.equal(
        packed_logprobs(model, segments), decode_lp(model, segments, prompts, chunked=chunked)
    )
