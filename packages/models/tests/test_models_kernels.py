"""Strict kernels: accuracy of exp/log, the tree order, and row/batch/thread invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.models import StrictOps
from posttrain.models._ops import exp_strict, log_strict, tree_sum


def reference_tree(values: np.ndarray) -> np.float32:
    """The documented order, in numpy float32: pad to 2**k, add element i to i + half."""
    v = list(values.astype(np.float32))
    width = 1 << max(len(v) - 1, 0).bit_length()
    v += [np.float32(0)] * (width - len(v))
    while len(v) > 1:
        half = len(v) // 2
        v = [np.float32(v[i] + v[i + half]) for i in range(half)]
    return v[0]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), seed=st.integers(0, 1000))
def test_tree_sum_follows_the_documented_order(n: int, seed: int) -> None:
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(seed)) * 10
    got = tree_sum(x)
    for row in range(3):
        assert got[row].item() == float(reference_tree(x[row].numpy()))
    assert torch.equal(tree_sum(x.t().contiguous(), dim=0), got)


def test_exp_and_log_are_accurate() -> None:
    x = torch.linspace(-87.0, 88.0, 200_001)
    ref = torch.exp(x.double())
    rel = ((exp_strict(x).double() - ref) / ref).abs().max().item()
    assert rel < 4e-7  # a few ulp
    y = torch.logspace(-30, 30, 100_001).float()
    err = (log_strict(y).double() - torch.log(y.double())).abs().max().item()
    assert err < 1e-5  # |log y| <= 70: a few ulp of the result
    assert log_strict(torch.tensor([1.0])).item() == 0.0


def test_exp_does_not_depend_on_where_an_element_sits() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 5
    full = exp_strict(x)
    for offset in (1, 3, 7, 13):  # shifts each element between SIMD body and scalar tail
        assert torch.equal(exp_strict(x[offset:]), full[offset:])


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 40),
    n=st.integers(1, 48),
    k=st.integers(1, 80),
    seed=st.integers(0, 1000),
    threads=st.sampled_from([1, 2]),
)
def test_linear_rows_are_invariant(t: int, n: int, k: int, seed: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(t, k, generator=gen), torch.randn(n, k, generator=gen)
    full = StrictOps.linear(x, w)
    torch.set_num_threads(threads)
    rows = [StrictOps.linear(x[i : i + 1], w)[0] for i in range(t)]
    torch.set_num_threads(1)
    assert torch.equal(torch.stack(rows), full)
    perm = torch.randperm(t, generator=gen)
    assert torch.equal(StrictOps.linear(x[perm], w), full[perm])
    # fused vs split weights: each output column is its own reduction
    cut = n // 2
    split = torch.cat([StrictOps.linear(x, w[:cut]), StrictOps.linear(x, w[cut:])], dim=1)
    assert torch.equal(split, full)
    assert torch.allclose(full, x @ w.t(), atol=1e-4, rtol=1e-4)


def test_large_linear_is_thread_count_invariant() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=gen), torch.randn(200, 96, generator=gen)
    one = StrictOps.linear(x, w)
    torch.set_num_threads(2)
    two = StrictOps.linear(x, w)
    assert torch.equal(one, two)


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 12), cap=st.sampled_from([4, 16, 24]), seed=st.integers(0, 1000))
def test_attention_rows_are_invariant(t: int, cap: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    nkv, g, hd = 2, 2, 4
    q = torch.randn(t, nkv, g, hd, generator=gen)
    keys = torch.randn(t, cap, nkv, hd, generator=gen)
    values = torch.randn(t, cap, nkv, hd, generator=gen)
    pos = torch.randint(0, cap, (t,), generator=gen)
    valid = torch.arange(cap)[None, :] <= pos[:, None]
    full = StrictOps.attention(q, keys, values, valid, 0.5)
    for i in range(t):
        one = StrictOps.attention(
            q[i : i + 1], keys[i : i + 1], values[i : i + 1], valid[i : i + 1], 0.5
        )
        assert torch.equal(one[0], full[i])
        width = 1 << int(pos[i]).bit_length()  # trailing masked slots are exact zeros
        short = StrictOps.attention(
            q[i : i + 1],
            keys[i : i + 1, :width],
            values[i : i + 1, :width],
            valid[i : i + 1, :width],
            0.5,
        )
        assert torch.equal(short[0], full[i])
    # masked slots do not matter, whatever they hold
    noise = torch.where(valid[:, :, None, None], keys, torch.randn_like(keys) * 100)
    assert torch.equal(StrictOps.attention(q, noise, values, valid, 0.5), full)
    ref = torch.softmax(
        torch.einsum("tkgd,tckd->tkgc", q, keys).masked_fill(~valid[:, None, None], float("-inf"))
        * 0.5,
        dim=-1,
    )
    assert torch.allclose(full, torch.einsum("tkgc,tckd->tkgd", ref, values), atol=1e-5)


def test_log_softmax_and_rms_norm_rows_are_invariant() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 101, generator=gen) * 4
    full = StrictOps.log_softmax(x)
    assert torch.equal(torch.cat([StrictOps.log_softmax(x[i : i + 1]) for i in range(9)]), full)
    assert torch.allclose(full, torch.log_softmax(x, -1), atol=2e-6)
    w = torch.rand(101, generator=gen)
    norm = StrictOps.rms_norm(x, w, 1e-6)
    assert torch.equal(
        torch.cat([StrictOps.rms_norm(x[i : i + 1], w, 1e-6) for i in range(9)]), norm
    )


@pytest.mark.parametrize("k", [3, 4])
def test_moe_combine_is_sequential_in_slot_order(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    w, y = torch.rand(50, k, generator=gen), torch.randn(50, k, 8, generator=gen)
    acc = w[:, 0, None] * y[:, 0]
    for j in range(1, k):
        acc = acc + w[:, j, None] * y[:, j]
    assert torch.equal(StrictOps.moe_combine(w, y), acc)


def _run(fn, *inputs: torch.Tensor, reference: bool) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """The output of ``fn(*inputs)`` and its inputs' gradients against a fixed upstream
    gradient, with the strict kernels' own backwards or autograd's of their forward ops."""
    from posttrain.models import _ops

    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    _ops._CUSTOM_BACKWARD = not reference
    try:
        out = fn(*leaves)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        out.backward(upstream * 1e-3)  # exp's scale up to 2**127 times it stays finite
    finally:
        _ops._CUSTOM_BACKWARD = True
    return [out.detach(), *(x.grad for x in leaves if x.grad is not None)]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / den if den else float(a.double().norm())


def _same_forward_close_gradients(fn, *inputs: torch.Tensor, exact_zeros: bool = True) -> None:  # type: ignore[no-untyped-def]
    """The strict kernels' backwards against autograd's graph of the same forward: the output
    bit for bit, every gradient to fp32 rounding (relative L2 and elementwise), exact zeros
    where autograd's are (clamped exp; ``exact_zeros``), and the same bits when run again
    (run-to-run determinism at a fixed thread count)."""
    ours = _run(fn, *inputs, reference=False)
    ref = _run(fn, *inputs, reference=True)
    assert len(ours) == len(ref) > 1
    assert torch.equal(ours[0], ref[0])  # the forward did not change a bit
    for got, want in zip(ours[1:], ref[1:], strict=True):
        assert got.shape == want.shape
        assert _rel_l2(got, want) <= 1e-6
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        if exact_zeros:
            assert bool((got[want == 0] == 0).all())  # clamped, masked: exactly 0
    again = _run(fn, *inputs, reference=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, again, strict=True))


@pytest.mark.parametrize(("rows", "k", "n"), [(700, 32, 101), (5, 12, 3), (300, 8, 64)])
def test_strict_backwards_are_autograds_gradients_to_fp32_rounding(
    rows: int, k: int, n: int
) -> None:
    """The strict linear's BLAS backward, the product trees' (attention's scores and
    ``probs @ V``), ``tree_sum``'s and ``exp_strict``'s (softmax, SiLU) against autograd's
    gradient of the strict forward ops; the forward bits unchanged."""
    from posttrain.models._ops import product_tree_sum

    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    x[::7] = 0.0  # zero rows
    for fn, inputs in (
        (StrictOps.linear, (x, w)),
        (lambda a: tree_sum(a, dim=0), (x,)),
        (lambda a: tree_sum(a), (x,)),
        (product_tree_sum, (x.t()[:, :, None], w.t()[:, None, :])),
        (exp_strict, (x * 40.0,)),  # past the clamp at both ends too: gradient exactly 0
        (StrictOps.softmax, (x,)),
        (lambda a: StrictOps.silu_mul(a, a * 0.5), (x,)),
    ):
        _same_forward_close_gradients(fn, *inputs)
    q, keys = torch.randn(9, 2, 2, 8, generator=gen), torch.randn(9, 16, 2, 8, generator=gen)
    values = torch.randn(9, 16, 2, 8, generator=gen)
    valid = torch.arange(16)[None, :] <= torch.arange(9)[:, None]

    def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return StrictOps.attention(q, keys, values, valid, 0.35)

    _same_forward_close_gradients(attention, q, keys, values)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_merged_attention_chunks_keep_the_forward_bits(
    seed: int, rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attend_buffers`` runs runs of query chunks of one width as one ``ops.attention`` call
    (the torch path, ``rows=False``) or the key buffers as key rows of ``attend_rows`` (the
    fused C kernel; the per-run torch backward): the output equals autograd's own
    chunk-by-chunk graph bit for bit, and the gradients of queries, keys and values (through
    the key/value buffers, ``_GatherRows``) agree to fp32 rounding and are the same bits run to
    run (on the test's own thread count)."""
    if not rows:
        monkeypatch.setattr(StrictOps, "uses_row_attention", classmethod(lambda cls, q: False))
    import random

    from posttrain.models._blocks import attend

    rnd = random.Random(seed)
    lengths = [rnd.randint(1, 40) for _ in range(24)]
    gen = torch.Generator().manual_seed(seed)
    t, nh, nkv, hd = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(t, n, hd, generator=gen) for n in (nh, nkv, nkv))
    v[::7] = 0.0
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    pos = torch.arange(t) - starts[seg]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(
            StrictOps, q, k, v, q_pos=pos, q_seg=seg, k_pos=pos, k_seg=seg,
            num_segments=len(lengths), capacity=64, scale=0.35,
        )  # fmt: skip

    _same_forward_close_gradients(run, q, k, v, exact_zeros=not rows)  # see the test below


@pytest.mark.parametrize("seed", [0, 1])
def test_row_attention_keeps_the_forward_bits_with_a_torch_gradient(seed: int) -> None:
    """In-order packed segments (the training forward): ``PackedLayout.attend`` runs
    ``StrictOps.attend_rows`` (the fused C kernel, no graph) under ``RowAttention``'s torch
    backward. The output equals autograd's graph of the strict ops over gathered key buffers bit
    for bit, the gradients of queries, keys and values agree with it to fp32 rounding, and are
    the same bits run to run; segments of one token and very unequal lengths included. A query
    with one key has a gradient of exactly 0 in autograd's graph and of fp32 rounding noise in
    the torch backward (``P * (dP - rowsum(dO * O))``, two sums of one product in two orders):
    close, not zero."""
    import random

    from posttrain.models._blocks import PackedLayout

    rnd = random.Random(seed)
    lengths = [1, *(rnd.randint(1, 40) for _ in range(14))] if seed == 0 else [60, 2, 3]
    gen = torch.Generator().manual_seed(seed)
    t, nh, nkv, hd = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(t, n, hd, generator=gen) for n in (nh, nkv, nkv))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    pos = torch.arange(t) - starts[seg]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = PackedLayout(seg, pos, len(lengths), 64)
        return layout.attend(StrictOps, 0, q, k, v, scale=0.35, window=None, rel_logits=None)

    _same_forward_close_gradients(run, q, k, v, exact_zeros=False)


def test_fused_rms_norm_keeps_the_bits_and_its_backward_is_autograds_to_fp32_rounding() -> None:
    """``StrictOps.rms_norm`` through the fused C kernel (mean of squares, torch's sqrt, the
    scaling) equals the torch ops bit for bit, for a plain and a per-head weight, zero rows and
    non-contiguous input included; ``_RmsNorm``'s backward gives autograd's gradients of the
    torch ops to fp32 rounding."""
    from posttrain.models import _ckernel
    from posttrain.models._ops import _rms_norm_torch

    if not _ckernel.available():
        pytest.skip("the fused strict C kernel is not built here")
    gen = torch.Generator().manual_seed(3)
    for shape, w_shape in (((37, 32), (32,)), ((9, 4, 8), (4, 8)), ((3, 5, 33), (33,))):
        x, w = torch.randn(shape, generator=gen) * 3, torch.randn(w_shape, generator=gen)
        x[0] = 0.0
        assert torch.equal(StrictOps.rms_norm(x, w, 1e-6), _rms_norm_torch(x, w, 1e-6))
        _same_forward_close_gradients(lambda a, b: StrictOps.rms_norm(a, b, 1e-6), x[1:], w)
    wide = torch.randn(16, 64, generator=gen)[:, :40]
    w = torch.randn(40, generator=gen)
    assert torch.equal(StrictOps.rms_norm(wide, w, 1e-5), _rms_norm_torch(wide, w, 1e-5))


def test_fused_silu_mul_keeps_the_bits_and_its_backward_is_autograds_to_fp32_rounding() -> None:
    """``StrictOps.silu_mul`` through the fused C kernel equals the torch ops bit for bit on
    column slices of one projection (as the MLPs call it), large and tiny gates included;
    ``_SiluMul``'s backward gives autograd's gradients of the torch ops to fp32 rounding."""
    from posttrain.models import _ckernel
    from posttrain.models._ops import _silu_mul_torch

    if not _ckernel.available():
        pytest.skip("the fused strict C kernel is not built here")
    gen = torch.Generator().manual_seed(4)
    fused = torch.randn(41, 48, generator=gen) * 6
    fused[0, :3] = torch.tensor([100.0, -100.0, 0.0])
    gate, up = fused[:, :24], fused[:, 24:]
    assert torch.equal(StrictOps.silu_mul(gate, up), _silu_mul_torch(gate, up))
    _same_forward_close_gradients(StrictOps.silu_mul, gate[1:].contiguous(), up[1:].contiguous())


def _expert_loop(
    m: torch.Tensor, ids: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor
) -> torch.Tensor:
    """Routed experts expert by expert with the strict ops (the model's loop without LoRA)."""
    k, inter = ids.shape[1], fc2.shape[2]
    out = m.new_zeros(m.shape[0], k, fc2.shape[1])
    for e in range(fc1.shape[0]):
        pairs = (ids.reshape(-1) == e).nonzero().flatten()
        tok, slot = pairs // k, pairs % k
        gu = StrictOps.linear(m[tok], fc1[e])
        y = StrictOps.linear(StrictOps.silu_mul(gu[:, :inter], gu[:, inter:]), fc2[e])
        out = out.index_put((tok, slot), y)
    return out


@pytest.mark.parametrize(("t", "h", "inter", "e", "k"), [(1, 32, 32, 4, 2), (37, 32, 16, 4, 2),
                                                         (60, 20, 12, 8, 3), (5, 7, 3, 3, 1)])  # fmt: skip
def test_fused_routed_experts_keep_the_loops_bits_and_its_gradients(
    t: int, h: int, inter: int, e: int, k: int
) -> None:
    """``StrictOps.routed_experts`` (one C call for a MoE layer's experts) equals the expert loop
    of strict linears and SiLU bit for bit, idle experts and one-token batches included; its
    backward gives autograd's gradients of the loop's torch ops to fp32 rounding, the same bits
    run to run."""
    from posttrain.models import _ckernel

    if not _ckernel.available():
        pytest.skip("the fused strict C kernel is not built here")
    gen = torch.Generator().manual_seed(t * 31 + e)
    m = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[ids == e - 1] = 0  # expert e - 1 gets no token (a token may then pick one expert twice)
    fc1 = torch.randn(e, 2 * inter, h, generator=gen) * 0.3
    fc2 = torch.randn(e, h, inter, generator=gen) * 0.3
    with torch.no_grad():
        fused = StrictOps.routed_experts(m, ids, fc1, fc2)
        assert fused is not None
        assert torch.equal(
            fused.view(torch.int32), _expert_loop(m, ids, fc1, fc2).view(torch.int32)
        )

    def experts(m: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
        out = StrictOps.routed_experts(m, ids, fc1, fc2)  # None for the reference graph
        return _expert_loop(m, ids, fc1, fc2) if out is None else out

    _same_forward_close_gradients(experts, m, fc1, fc2, exact_zeros=False)


def test_fused_routed_experts_refuse_an_expert_id_out_of_range() -> None:
    from posttrain.models import _ckernel

    if not _ckernel.available():
        pytest.skip("the fused strict C kernel is not built here")
    m, fc1, fc2 = torch.randn(3, 8), torch.randn(4, 8, 8), torch.randn(4, 8, 4)
    with pytest.raises(ValueError, match="expert id 4 outside"):
        StrictOps.routed_experts(m, torch.tensor([[0, 1], [2, 4], [1, 3]]), fc1, fc2)


def test_a_moe_model_gives_the_same_bits_with_and_without_the_fused_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A strict MoE decoder's logits and gradients are the same with the fused routed experts
    as with its expert loop; an adapter on the routed experts keeps the loop (the fused op takes
    no expert LoRA) and gives the loop's bits too."""
    from posttrain.models import LoraAdapter, ModelConfig, _ckernel, build_model

    if not _ckernel.available():
        pytest.skip("the fused strict C kernel is not built here")
    cfg = ModelConfig.tiny()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (23,), generator=gen)
    name = "model.layers.2.mlp.experts.1.up_proj"
    a = torch.randn(2, cfg.hidden_size, generator=gen)
    b = torch.randn(cfg.moe_intermediate_size, 2, generator=gen)
    adapter = LoraAdapter(weights={name: (a, b)}, scaling=0.5)
    calls: list[int] = []
    real = _ckernel.routed_experts

    def counted(*args: torch.Tensor) -> _ckernel.RoutedExperts | None:
        calls.append(1)
        return real(*args)

    def run(fused: bool, lora: LoraAdapter | None) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            patch.setattr(_ckernel, "routed_experts", counted if fused else lambda *a: None)
            model = build_model(cfg, 0)
            logits = model.forward_logits(ids, [10, 13], lora=lora)
            logits.square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return [logits.detach(), *grads]

    with_fused, without = run(True, None), run(False, None)
    assert len(calls) == 3  # the tiny config's three MoE layers
    assert torch.equal(with_fused[0], without[0])
    for got, want in zip(with_fused[1:], without[1:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    calls.clear()
    with_lora, loop_lora = run(True, adapter), run(False, adapter)
    assert len(calls) == 2  # layer 2's experts carry the adapter: the loop runs there
    assert torch.equal(with_lora[0], loop_lora[0])
    assert not torch.equal(with_lora[0], with_fused[0])
