"""Fast-mode kernels (issue 37) against the computations they replace, on CPU.

Per-layer module calls (what FSDP2's per-layer units and activation checkpointing hook),
the chunked token logprob, the sorted-token expert path, the padded-batch SDPA and the bf16
kernel set: each equals what it replaces within fp32 tolerance (bf16: bf16 tolerance), and
strict numerics keep their bits.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.models import ModelConfig, Numerics, build_model
from posttrain.models._logprobs import chunked_token_logprobs
from posttrain.models._model import grouped_experts
from posttrain.models._ops import Bf16FastOps, FastOps

CFG = ModelConfig.tiny(max_position_embeddings=32)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_each_layer_runs_through_its_module_call() -> None:
    model = build_model(CFG, 1)
    calls: list[int] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, _args: calls.append(int(m.index)))
    model.forward_logits(_ids(12), [5, 7])
    assert calls == list(range(CFG.num_hidden_layers))


def test_activation_checkpointing_keeps_strict_bits() -> None:
    ids = _ids(14, 1)
    grads = []
    for checkpointed in (False, True):
        model = build_model(CFG, 3)
        model.activation_checkpointing = checkpointed
        lp = model.forward_logprobs(ids, [6, 8])
        lp.sum().backward()
        grads.append((lp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])
    for name, g in grads[0][1].items():
        assert g is not None, name
        assert torch.equal(g, grads[1][1][name]), name


@pytest.mark.parametrize(("chunk", "divisor"), [(3, 1.0), (64, 1.0), (4, 2.5)])
def test_chunked_logprobs_equal_the_unchunked_fp32_computation(chunk: int, divisor: float) -> None:
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(10, 16, generator=gen, requires_grad=True)
    w = torch.randn(40, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (10,), generator=gen)
    g_lp, g_ent = torch.randn(10, generator=gen), torch.randn(10, generator=gen)

    lp, ent = chunked_token_logprobs(h, w, targets, chunk_tokens=chunk, logits_divisor=divisor)
    (lp * g_lp + ent * g_ent).sum().backward()
    got = (lp.detach(), ent.detach(), h.grad, w.grad)
    h.grad, w.grad = None, None

    full = torch.log_softmax((h @ w.t()) / divisor, dim=-1)
    ref_lp = full.gather(1, targets[:, None])[:, 0]
    ref_ent = -(full.exp() * full).sum(-1)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
    for a, b in zip(got, (ref_lp.detach(), ref_ent.detach(), h.grad, w.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_without_the_entropy_in_the_loss() -> None:
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(6, 8, generator=gen, requires_grad=True)
    w = torch.randn(12, 8, generator=gen)
    targets = torch.randint(0, 12, (6,), generator=gen)
    lp, _ = chunked_token_logprobs(h, w, targets, chunk_tokens=4)
    lp.sum().backward()
    got = h.grad
    h.grad = None
    torch.log_softmax(h @ w.t(), -1).gather(1, targets[:, None]).sum().backward()
    torch.testing.assert_close(got, h.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(h, w, targets, chunk_tokens=0)


@pytest.mark.parametrize("numerics", [Numerics.FAST, Numerics.STRICT])
def test_forward_token_logprobs_equals_the_picked_logits(numerics: Numerics) -> None:
    model = build_model(CFG, 6, numerics=numerics)
    ids, lengths = _ids(20, 6), [9, 11]
    rows = torch.tensor([3, 4, 5, 7, 12, 13, 18])
    targets = ids[rows + 1]
    lp, ent = model.forward_token_logprobs(ids, lengths, rows, targets, chunk_tokens=3)
    logits = model.forward_logits(ids, lengths)[rows]
    ref = model.ops.log_softmax(logits).gather(1, targets[:, None])[:, 0]
    full = torch.log_softmax(logits, -1)
    if numerics is Numerics.STRICT:
        assert torch.equal(lp, ref)  # the engine's bits
    else:
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), rtol=1e-5, atol=1e-5)


def test_grouped_experts_equal_expert_by_expert() -> None:
    model = build_model(CFG, 7, numerics=Numerics.FAST)
    layer = next(layer for layer in model.layers if layer.is_moe)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(13, CFG.hidden_size, generator=gen)
    ids = torch.sort(torch.rand(13, CFG.num_experts, generator=gen).argsort(-1)[:, :2]).values
    ids[:4] = torch.tensor([0, 1])  # expert 0 busy; some experts may get no token at all
    got = grouped_experts(FastOps, x, ids, layer.experts_fc1, layer.experts_fc2)
    from posttrain.models._lora import LoraRouting

    routing = LoraRouting(None, torch.zeros(13, dtype=torch.long), 1, {})
    ref = model._experts_by_id(layer, x, ids, routing, "model.layers.1.")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lengths", [[8, 7, 6], [3, 17, 5], [1, 1, 30], [9, 9, 9]])
def test_fast_sdpa_over_packed_segments_matches_strict(lengths: list[int]) -> None:
    """The padded batch ([8, 7, 6]), the per-segment calls ([3, 17, 5]: padding would more
    than double the work) and equal lengths ([9, 9, 9]: the packing is the batch, no scatter)
    all give the strict masked-buffer attention within fp32 tolerance."""
    ids = _ids(sum(lengths), 8)
    strict = build_model(CFG, 8).forward_logits(ids, lengths)
    fast = build_model(CFG, 8, numerics=Numerics.FAST).forward_logits(ids, lengths)
    torch.testing.assert_close(fast, strict, rtol=1e-4, atol=1e-5)


def test_bf16_compute_is_bf16_with_fp32_logits() -> None:
    ids, lengths = _ids(20, 9), [12, 8]
    model = build_model(CFG, 9, numerics=Numerics.FAST)
    ref = model.forward_logprobs(ids, lengths)
    model.compute_dtype = torch.bfloat16
    assert model.ops is Bf16FastOps
    assert model.ops.linear(torch.ones(2, 4), torch.ones(3, 4)).dtype == torch.bfloat16
    logits = model.forward_logits(ids, lengths)
    assert logits.dtype == torch.float32
    lp = model.forward_logprobs(ids, lengths)
    assert lp.dtype == torch.float32
    assert not torch.equal(lp, ref)  # it really computed in bf16
    torch.testing.assert_close(lp, ref, rtol=0.0, atol=0.05)
    lp.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    rows = torch.arange(0, 11)
    chunked, _ = model.forward_token_logprobs(ids, lengths, rows, ids[rows + 1], chunk_tokens=4)
    torch.testing.assert_close(chunked, lp[1:12], rtol=1e-3, atol=1e-3)


def _reference_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``'s contract (rows ``offs[j-1]:offs[j]`` times ``b[j]``), in plain
    torch; rows past the last offset are NaN, so reading one would show."""
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=a.dtype)
    start = 0
    for j, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].float() @ b[j].float()).to(a.dtype)
        start = end
    return out


def test_the_grouped_mm_path_pads_and_unpads_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch's padded groups and static buffer, run here through a reference grouped
    matmul: the same bf16 values and gradients as the per-expert path."""
    import posttrain.models._model as model_module

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(13, 16, generator=gen, requires_grad=True)
    fc1 = torch.randn(4, 16, 16, generator=gen, requires_grad=True)
    fc2 = torch.randn(4, 16, 8, generator=gen, requires_grad=True)
    ids = torch.sort(torch.rand(13, 4, generator=gen).argsort(-1)[:, :2]).values
    ids[:5] = torch.tensor([0, 2])
    ref = grouped_experts(Bf16FastOps, x, ids, fc1, fc2)
    ref.float().sum().backward()
    ref_grads = [t.grad for t in (x, fc1, fc2)]
    x.grad = fc1.grad = fc2.grad = None
    monkeypatch.setattr(model_module, "use_grouped_mm", lambda *_: True)
    monkeypatch.setattr(torch, "_grouped_mm", _reference_grouped_mm, raising=False)
    monkeypatch.setattr(model_module, "_GROUPED_MM_FAILED", [])
    got = grouped_experts(Bf16FastOps, x, ids, fc1, fc2)
    assert not model_module._GROUPED_MM_FAILED  # the grouped branch ran
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref)
    got.float().sum().backward()
    for a, b in zip((x.grad, fc1.grad, fc2.grad), ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_a_failing_grouped_mm_falls_back_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import posttrain.models._model as model_module

    def broken(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise RuntimeError("no grouped GEMM kernel for this device")

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, 16, generator=gen)
    fc1, fc2 = torch.randn(4, 16, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    ids = torch.tensor([[0, 1], [1, 2], [0, 3], [2, 3], [0, 2]])
    ref = grouped_experts(Bf16FastOps, x, ids, fc1, fc2)
    monkeypatch.setattr(model_module, "_GROUPED_MM_FAILED", [])
    monkeypatch.setattr(model_module, "use_grouped_mm", lambda *_: True)
    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    with pytest.warns(RuntimeWarning, match="no grouped GEMM kernel"):
        got = grouped_experts(Bf16FastOps, x, ids, fc1, fc2)
    assert torch.equal(got, ref)
    assert model_module._GROUPED_MM_FAILED  # told once, not retried
