"""PPO clip, KL estimators, entropy, importance weights, mismatch metrics, aggregation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.grpo import GrpoConfigError, GrpoInputError
from posttrain.grpo.losses import (
    aggregate_loss,
    entropy_from_logits,
    importance_weights,
    kl_penalty,
    mismatch_metrics,
    ppo_clip_loss,
)

FAST = settings(max_examples=60, deadline=None)
logprob = st.floats(-8, 0, allow_nan=False, width=32)
adv = st.floats(-5, 5, allow_nan=False, width=32)


@st.composite
def token_batch(draw: st.DrawFn) -> tuple[list[float], list[float], list[float], list[bool]]:
    n = draw(st.integers(1, 16))
    lists = [draw(st.lists(s, min_size=n, max_size=n)) for s in (logprob, logprob, adv)]
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return lists[0], lists[1], lists[2], mask


def ppo_reference(
    new: float, old: float, a: float, lo: float, hi: float, dual: float | None
) -> tuple[float, bool]:
    ratio = math.exp(max(-20.0, min(20.0, new - old)))
    unclipped = -ratio * a
    clipped = -min(max(ratio, 1 - lo), 1 + hi) * a
    loss = max(unclipped, clipped)
    if dual is not None and a < 0:
        loss = min(loss, -dual * a)
    return loss, clipped > unclipped


@FAST
@given(
    token_batch(),
    st.floats(0.0, 0.5),
    st.one_of(st.none(), st.floats(0.0, 0.6)),
    st.one_of(st.none(), st.floats(1.01, 10)),
)
def test_ppo_matches_the_scalar_formula(
    batch: tuple[list[float], list[float], list[float], list[bool]],
    lo: float,
    hi: float | None,
    dual: float | None,
) -> None:
    new, old, a, mask = batch
    out = ppo_clip_loss(
        torch.tensor(new), torch.tensor(old), torch.tensor(a), torch.tensor(mask),
        clip_low=lo, clip_high=hi, dual_clip=dual,
    )  # fmt: skip
    eps_high = lo if hi is None else hi
    for i in range(len(new)):
        if not mask[i]:
            assert float(out.loss[i]) == 0.0
            assert not bool(out.clipped[i])
            continue
        want, clipped = ppo_reference(new[i], old[i], a[i], lo, eps_high, dual)
        assert float(out.loss[i]) == pytest.approx(want, rel=1e-4, abs=1e-5)
        ratio = float(out.ratio[i])
        on_edge = min(abs(ratio - (1 - lo)), abs(ratio - (1 + eps_high))) < 1e-5
        if not on_edge:  # float32 vs float64 may disagree on a ratio at the clip edge
            assert bool(out.clipped[i]) == clipped
        assert float(out.approx_kl[i]) == pytest.approx(old[i] - new[i], abs=1e-5)


def test_clip_high_defaults_to_clip_low() -> None:
    new, old = torch.tensor([-0.1, -3.0, -1.0]), torch.tensor([-1.0, -1.0, -1.0])
    a, m = torch.tensor([1.0, -1.0, 2.0]), torch.ones(3, dtype=torch.bool)
    sym = ppo_clip_loss(new, old, a, m, clip_low=0.2)
    explicit = ppo_clip_loss(new, old, a, m, clip_low=0.2, clip_high=0.2)
    asym = ppo_clip_loss(new, old, a, m, clip_low=0.2, clip_high=0.28)
    assert torch.equal(sym.loss, explicit.loss)
    assert float(asym.loss[0]) == pytest.approx(-1.28)  # ratio e^0.9 clipped at 1 + 0.28
    assert float(sym.loss[0]) == pytest.approx(-1.2)


def test_dual_clip_bounds_negative_advantages() -> None:
    # ratio e^3 ~ 20 with A = -1: plain PPO loss 20, dual clip c = 3 caps it at 3.
    new, old, a = torch.tensor([-1.0, -1.0]), torch.tensor([-4.0, -4.0]), torch.tensor([-1.0, 1.0])
    m = torch.ones(2, dtype=torch.bool)
    plain = ppo_clip_loss(new, old, a, m)
    dual = ppo_clip_loss(new, old, a, m, dual_clip=3.0)
    assert float(plain.loss[0]) == pytest.approx(math.exp(3.0), rel=1e-5)
    assert float(dual.loss[0]) == pytest.approx(3.0)
    assert dual.dual_clipped.tolist() == [True, False]
    assert float(dual.loss[1]) == float(plain.loss[1])  # A > 0 untouched


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": math.inf}, "clip_high"),
    ],
)
def test_bad_clip_settings(kwargs: dict[str, float], match: str) -> None:
    x = torch.zeros(2)
    with pytest.raises(GrpoConfigError, match=match):
        ppo_clip_loss(x, x, x, torch.ones(2, dtype=torch.bool), **kwargs)


def test_masked_nan_and_inf_never_leak() -> None:
    new = torch.tensor([-1.0, math.nan, math.inf, -math.inf], requires_grad=True)
    old = torch.tensor([-1.5, math.nan, -1.0, -1.0])
    a = torch.tensor([1.0, math.inf, math.nan, 2.0])
    mask = torch.tensor([1, 0, 0, 0])
    out = ppo_clip_loss(new, old, a, mask)
    assert torch.isfinite(out.loss).all()
    assert out.loss[1:].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(out.ratio).all()
    assert torch.isfinite(out.approx_kl).all()
    out.loss.sum().backward()
    assert new.grad is not None
    assert torch.isfinite(new.grad).all()
    assert new.grad[1:].tolist() == [0.0, 0.0, 0.0]


def test_unmasked_non_finite_log_ratio_is_sanitised() -> None:
    # NaN -> ratio 1; +inf -> e^20; -inf -> e^-20 (then clipped by the PPO window anyway).
    new = torch.tensor([math.nan, math.inf, -math.inf])
    out = ppo_clip_loss(new, torch.zeros(3), torch.ones(3), torch.ones(3, dtype=torch.bool))
    assert out.ratio.tolist() == pytest.approx([1.0, math.exp(20.0), math.exp(-20.0)], rel=1e-5)
    assert torch.isfinite(out.loss).all()


def test_gradient_flows_only_through_the_current_policy() -> None:
    new = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.0, -2.0], requires_grad=True)
    a = torch.tensor([0.5, -2.0], requires_grad=True)
    ref = torch.tensor([-1.2, -1.9], requires_grad=True)
    roll = torch.tensor([-1.1, -2.1], requires_grad=True)
    m = torch.ones(2, dtype=torch.bool)
    out = ppo_clip_loss(new, old, a, m)
    total = out.loss.sum() + kl_penalty(new, ref, "k3").sum()
    w = importance_weights(old, roll, mode="tis")
    assert w.grad_fn is None
    (total + (out.loss * w).sum()).backward()
    assert new.grad is not None
    for t in (old, a, ref, roll):
        assert t.grad is None
    assert out.ratio.grad_fn is None
    assert out.approx_kl.grad_fn is None


@FAST
@given(st.lists(adv, min_size=1, max_size=12))
def test_gradient_of_a_ratio_at_one_is_the_advantage(a: list[float]) -> None:
    # At ratio = 1 nothing is clipped and L = -ratio * A, so d(-sum L)/d logp = A.
    old = torch.linspace(-3.0, -0.5, len(a))
    new = old.clone().requires_grad_(True)
    out = ppo_clip_loss(new, old, torch.tensor(a), torch.ones(len(a), dtype=torch.bool))
    (-out.loss.sum()).backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor(a))


@FAST
@given(token_batch())
def test_clipped_tokens_get_zero_gradient(
    batch: tuple[list[float], list[float], list[float], list[bool]],
) -> None:
    new_l, old_l, a_l, mask_l = batch
    new = torch.tensor(new_l, requires_grad=True)
    old, a, mask = torch.tensor(old_l), torch.tensor(a_l), torch.tensor(mask_l)
    out = ppo_clip_loss(new, old, a, mask, dual_clip=4.0)
    out.loss.sum().backward()
    assert new.grad is not None
    free = mask & ~out.clipped & ~out.dual_clipped
    assert torch.equal(new.grad[out.clipped], torch.zeros_like(new.grad[out.clipped]))
    assert torch.equal(new.grad[out.dual_clipped], torch.zeros_like(new.grad[out.dual_clipped]))
    assert torch.equal(new.grad[~mask], torch.zeros_like(new.grad[~mask]))
    torch.testing.assert_close(new.grad[free], (-out.ratio * a)[free], rtol=1e-5, atol=1e-6)


def test_no_in_place_on_inputs_and_bf16_gives_float32() -> None:
    new = torch.tensor([-1.0, -0.5, -3.0], dtype=torch.bfloat16)
    old, a, m = torch.tensor([-1.2, -0.4, -2.0]), torch.tensor([1.0, -1.0, 0.5]), torch.ones(3)
    copies = [t.clone() for t in (new, old, a, m)]
    out = ppo_clip_loss(new, old, a, m)
    kl_penalty(new, old, "low_var_kl")
    importance_weights(new, old, mode="icepop")
    aggregate_loss(out.loss, m, [3], mode="token_mean")
    for t, c in zip((new, old, a, m), copies, strict=True):
        assert torch.equal(t, c)
    assert out.loss.dtype == torch.float32


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.ones(3)), "old_logp"),
        ((torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(2)), "mask"),
        ((torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.full((3,), 0.5)), "0 and 1"),
        (
            (torch.zeros(3, dtype=torch.long), torch.zeros(3), torch.zeros(3), torch.ones(3)),
            "floating",
        ),
    ],
)
def test_ppo_bad_tensors_are_named(args: tuple[torch.Tensor, ...], match: str) -> None:
    with pytest.raises(GrpoInputError, match=match):
        ppo_clip_loss(*args)


@FAST
@given(st.lists(st.tuples(logprob, logprob), min_size=1, max_size=16))
def test_kl_estimators(pairs: list[tuple[float, float]]) -> None:
    new = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    x = (new - ref).float()
    torch.testing.assert_close(kl_penalty(new, ref, "k1"), x)
    torch.testing.assert_close(kl_penalty(new, ref, "k2"), 0.5 * x * x)
    k3 = kl_penalty(new, ref, "k3")
    torch.testing.assert_close(k3, torch.exp(-x) - 1 + x)
    assert (k3 >= -1e-6).all()
    low = kl_penalty(new, ref, "low_var_kl")
    assert (low <= 10.0).all()
    assert (low >= -10.0).all()
    torch.testing.assert_close(low, k3.clamp(max=10.0))
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(kl_penalty(new, new, kind), torch.zeros_like(x))  # type: ignore[arg-type]


def test_low_var_kl_clamps_extreme_ratios() -> None:
    out = kl_penalty(torch.tensor([-100.0, 100.0]), torch.tensor([0.0, 0.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]
    with pytest.raises(GrpoConfigError, match="k4"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]


@FAST
@given(
    st.integers(1, 5),
    st.integers(2, 9),
    st.floats(0.1, 30.0),
    st.integers(0, 2**31 - 1),
)
def test_entropy_matches_categorical(t: int, v: int, scale: float, seed: int) -> None:
    logits = torch.randn(t, v, generator=torch.Generator().manual_seed(seed)) * scale
    want = torch.distributions.Categorical(logits=logits).entropy()
    got = entropy_from_logits(logits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits + 1e3), got, rtol=1e-3, atol=1e-3)


def test_entropy_uniform_masked_vocab_and_gradient() -> None:
    assert float(entropy_from_logits(torch.zeros(1, 8))[0]) == pytest.approx(math.log(8))
    logits = torch.tensor([[0.0, 0.0, -math.inf, -math.inf], [1e4, 0.0, 0.0, 0.0]])
    logits.requires_grad_(True)
    h = entropy_from_logits(logits)
    assert h.tolist() == pytest.approx([math.log(2), 0.0], abs=1e-6)
    h.sum().backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()
    with pytest.raises(GrpoInputError, match=r"\[T, V\]"):
        entropy_from_logits(torch.zeros(3))


@FAST
@given(
    st.lists(st.tuples(logprob, logprob), min_size=1, max_size=16),
    st.floats(0.0, 0.9),
    st.floats(1.1, 5.0),
)
def test_tis_and_icepop_weights(pairs: list[tuple[float, float]], lo: float, hi: float) -> None:
    train = torch.tensor([p for p, _ in pairs])
    roll = torch.tensor([q for _, q in pairs])
    ratio = torch.exp(train - roll)
    tis = importance_weights(train, roll, mode="tis", clip_low=lo, clip_high=hi)
    torch.testing.assert_close(tis, ratio.clamp(lo, hi))
    ice = importance_weights(train, roll, mode="icepop", clip_low=lo, clip_high=hi)
    inside = (ratio >= lo) & (ratio <= hi)
    torch.testing.assert_close(ice[inside], ratio[inside])
    assert (ice[~inside] == 0).all()


def test_importance_weights_edges() -> None:
    train = torch.tensor([math.nan, 50.0, -200.0, -1.0])
    roll = torch.tensor([-1.0, 0.0, 0.0, -1.0])
    assert importance_weights(train, roll, mode="tis").tolist() == [0.0, 2.0, 0.0, 1.0]
    assert importance_weights(train, roll, mode="icepop", clip_low=0.5).tolist() == [0, 0, 0, 1]
    masked = importance_weights(train, roll, mode="tis", mask=torch.tensor([1, 1, 1, 0]))
    assert masked.tolist() == [0.0, 2.0, 0.0, 0.0]
    for lo, hi in ((2.0, 2.0), (-0.1, 2.0), (0.0, math.inf)):
        with pytest.raises(GrpoConfigError, match="clip_low"):
            importance_weights(train, roll, mode="tis", clip_low=lo, clip_high=hi)
    with pytest.raises(GrpoConfigError, match="mode"):
        importance_weights(train, roll, mode="is")  # type: ignore[arg-type]


def test_mismatch_metrics_values() -> None:
    train = torch.tensor([-1.0, -2.0, -3.0, math.nan])
    roll = torch.tensor([-1.0, -2.5, -2.0, 0.0])
    mask = torch.tensor([1, 1, 1, 0])
    got = mismatch_metrics(train, roll, mask)
    assert got["train_rollout_logprob_abs_diff"] == pytest.approx(0.5)
    assert got["train_rollout_logprob_max_abs_diff"] == pytest.approx(1.0)
    assert got["train_rollout_logprob_equal_frac"] == pytest.approx(1 / 3)
    # k3 of x = rollout - train: (0, -0.5, 1) -> e^-x - 1 + x
    k3 = [0.0, math.exp(0.5) - 1.5, math.exp(-1.0)]
    assert got["train_rollout_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    same = mismatch_metrics(train[:3], train[:3], mask[:3])
    assert same["train_rollout_logprob_abs_diff"] == 0.0
    assert same["train_rollout_kl"] == 0.0
    assert same["train_rollout_logprob_equal_frac"] == 1.0
    empty = mismatch_metrics(train, roll, torch.zeros(4))
    assert empty["train_rollout_logprob_abs_diff"] == 0.0


@FAST
@given(token_batch(), st.lists(logprob, min_size=16, max_size=16))
def test_mismatch_metrics_leave_their_inputs_untouched(
    batch: tuple[list[float], list[float], list[float], list[bool]], roll_l: list[float]
) -> None:
    """Metrics only read: no input is changed in place, so the loss computed after is the same
    (that the objective's loss ignores them is test_grpo_objective's property test)."""
    new_l, old_l, _, mask_l = batch
    new = torch.tensor(new_l, requires_grad=True)
    old, mask = torch.tensor(old_l), torch.tensor(mask_l)
    roll = torch.tensor(roll_l[: len(new_l)])
    copies = [t.detach().clone() for t in (new, old, mask, roll)]
    metrics = mismatch_metrics(old, roll, mask)
    metrics_again = mismatch_metrics(new, roll, mask)
    assert set(metrics) == set(metrics_again)
    for t, c in zip((new, old, mask, roll), copies, strict=True):
        assert torch.equal(t.detach(), c)


@st.composite
def packed(draw: st.DrawFn) -> tuple[list[float], list[bool], list[int]]:
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))
    t = sum(lengths)
    values = draw(st.lists(st.floats(-10, 10, width=32), min_size=t, max_size=t))
    mask = draw(st.lists(st.booleans(), min_size=t, max_size=t))
    return values, mask, lengths


def split(items: list, lengths: list[int]) -> list[list]:  # type: ignore[type-arg]
    out, i = [], 0
    for n in lengths:
        out.append(items[i : i + n])
        i += n
    return out


@FAST
@given(packed(), st.randoms(use_true_random=False))
def test_aggregation_is_permutation_invariant(
    data: tuple[list[float], list[bool], list[int]], rnd: object
) -> None:
    values, mask, lengths = data
    order = list(range(len(lengths)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    vs, ms = split(values, lengths), split(mask, lengths)
    pv = [x for i in order for x in vs[i]]
    pm = [x for i in order for x in ms[i]]
    pl = [lengths[i] for i in order]
    for mode in ("token_mean", "seq_mean_token_mean"):
        base = aggregate_loss(torch.tensor(values), torch.tensor(mask), lengths, mode=mode)  # type: ignore[arg-type]
        perm = aggregate_loss(torch.tensor(pv), torch.tensor(pm), pl, mode=mode)  # type: ignore[arg-type]
        torch.testing.assert_close(perm, base, rtol=1e-5, atol=1e-5)


@FAST
@given(packed())
def test_aggregation_matches_its_definition(
    data: tuple[list[float], list[bool], list[int]],
) -> None:
    values, mask, lengths = data
    x, m = torch.tensor(values), torch.tensor(mask)
    kept = [v for v, k in zip(values, mask, strict=True) if k]
    tok = aggregate_loss(x, m, lengths, mode="token_mean")
    assert float(tok) == pytest.approx(math.fsum(kept) / max(1, len(kept)), rel=1e-5, abs=1e-5)
    per_seq = [
        math.fsum(v for v, k in zip(sv, sm, strict=True) if k) / max(1, sum(sm))
        for sv, sm in zip(split(values, lengths), split(mask, lengths), strict=True)
    ]
    seq = aggregate_loss(x, m, lengths, mode="seq_mean_token_mean")
    assert float(seq) == pytest.approx(math.fsum(per_seq) / len(lengths), rel=1e-5, abs=1e-5)
    gbs = aggregate_loss(x, m, lengths, mode="seq_mean_token_mean", global_batch_size=10)
    assert float(gbs) == pytest.approx(math.fsum(per_seq) / 10, rel=1e-5, abs=1e-5)


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_equal_lengths_full_mask_modes_agree(n: int, length: int, seed: int) -> None:
    x = torch.randn(n * length, generator=torch.Generator().manual_seed(seed))
    m = torch.ones(n * length, dtype=torch.bool)
    a = aggregate_loss(x, m, [length] * n, mode="token_mean")
    b = aggregate_loss(x, m, [length] * n, mode="seq_mean_token_mean")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_aggregation_edges_and_gradient() -> None:
    x = torch.tensor([1.0, math.nan, 3.0, 4.0], requires_grad=True)
    m = torch.tensor([1, 0, 1, 1])
    out = aggregate_loss(x, m, [2, 2], mode="token_mean")
    assert float(out.detach()) == pytest.approx(8 / 3)
    out.backward()
    assert x.grad is not None
    assert x.grad.tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3])
    assert float(aggregate_loss(x.detach(), torch.zeros(4), [2, 2], mode="token_mean")) == 0.0
    assert float(aggregate_loss(x.detach(), torch.zeros(4), [4], mode="seq_mean_token_mean")) == 0.0
    assert float(
        aggregate_loss(x.detach(), m, [2, 2], mode="token_mean", global_token_count=6)
    ) == pytest.approx(8 / 6)
    with pytest.raises(GrpoInputError, match="lengths sum to 3"):
        aggregate_loss(x, m, [1, 2], mode="token_mean")
    with pytest.raises(GrpoConfigError, match="global_batch_size"):
        aggregate_loss(x, m, [4], mode="seq_mean_token_mean", global_batch_size=0)
    with pytest.raises(GrpoConfigError, match="mode"):
        aggregate_loss(x, m, [4], mode="sum")  # type: ignore[arg-type]
