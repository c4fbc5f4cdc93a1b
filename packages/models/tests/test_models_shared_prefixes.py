"""``forward_logits(..., shared_prefixes=)``: segments that share another's first tokens, packed
once, give every token the logits it gets with its segment packed whole (strict: the same bits;
gradients to fp32 rounding); bad entries are refused naming the segment."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import (
    LoraAdapter,
    ModelConfig,
    ModelInputError,
    Numerics,
    StrictOps,
    build_model,
)

CFG = ModelConfig.tiny()


def _case(seed: int) -> tuple[list[list[int]], list[int], list[tuple[int, int]], list[int]]:
    """Two prompts with three and two samples, and a lone sequence: the whole segments, the
    packed stream's segments (children as their own tokens), their shared prefixes, and for
    each packed token its row in the whole packing."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(4, CFG.vocab_size, (n,), generator=gen).tolist()

    p1, p2 = ids(11), ids(6)
    whole = [p1 + ids(3), p1 + ids(1), p1 + ids(4), ids(7), p2 + ids(2), p2 + ids(5)]
    shared = [(-1, 0), (0, 11), (0, 11), (-1, 0), (-1, 0), (4, 6)]
    packed, rows, start = [], [], 0
    for seq, (_, n) in zip(whole, shared, strict=True):
        packed.append(seq[n:])
        rows.extend(range(start + n, start + len(seq)))
        start += len(seq)
    return whole, [t for s in packed for t in s], shared, rows


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("row_attention", [True, False])
def test_shared_prefixes_give_each_token_its_whole_segments_logits(
    seed: int, row_attention: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the fused row attention and through the segment buffers (torch's kernels)."""
    if not row_attention:
        monkeypatch.setattr(StrictOps, "uses_row_attention", classmethod(lambda cls, q: False))
    whole, stream, shared, rows = _case(seed)
    model = build_model(CFG, 0)
    full = model.forward_logits(
        torch.tensor([t for s in whole for t in s]), [len(s) for s in whole]
    )
    lengths = [len(s) - n for s, (_, n) in zip(whole, shared, strict=True)]
    got = model.forward_logits(torch.tensor(stream), lengths, shared_prefixes=shared)
    assert torch.equal(got.view(torch.int32), full[rows].view(torch.int32))
    picked = torch.tensor([0, 5, 14, 15, len(stream) - 1])  # ``rows=``: the same bits
    again = model.forward_logits(torch.tensor(stream), lengths, shared_prefixes=shared, rows=picked)
    assert torch.equal(again, got[picked])
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(9))
    grads = []
    for logits in (
        lambda: model.forward_logits(
            torch.tensor([t for s in whole for t in s]), [len(s) for s in whole]
        )[rows],
        lambda: model.forward_logits(torch.tensor(stream), lengths, shared_prefixes=shared),
    ):
        model.zero_grad()
        (logits() * upstream).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_shared_prefixes_with_an_adapter_and_a_sliding_window() -> None:
    """One adapter on every segment, and a window shorter than the prompt: the same bits."""
    cfg = ModelConfig.tiny(sliding_window_layers=(0, 2), sliding_window_size=5)
    model = build_model(cfg, 0)
    targets = model.lora_targets()
    gen = torch.Generator().manual_seed(3)
    adapter = LoraAdapter(
        weights={
            n: (torch.randn(2, i, generator=gen), torch.randn(o, 2, generator=gen) * 0.1)
            for n, (i, o) in list(targets.items())[:6]
        },
        scaling=0.5,
    )
    whole, stream, shared, rows = _case(2)
    shared = [list(e) for e in shared]  # as JSON gives them: the same layout
    full = model.forward_logits(
        torch.tensor([t for s in whole for t in s]), [len(s) for s in whole], lora=adapter
    )
    lengths = [len(s) - n for s, (_, n) in zip(whole, shared, strict=True)]
    got = model.forward_logits(torch.tensor(stream), lengths, lora=adapter, shared_prefixes=shared)
    assert torch.equal(got, full[rows])


@pytest.mark.parametrize(
    ("shared", "lengths", "match"),
    [
        ([(-1, 0)], [4, 3], "1 entries for 2 segments"),
        (
            [(-1, 0), (1, 2)],
            [4, 3],
            r"shared_prefixes\[1\]=\(1, 2\): the parent must be an earlier",
        ),
        ([(-1, 0), (0, 5)], [4, 3], r"shared_prefixes\[1\]=\(0, 5\): n must be in \[1, 4\]"),
        ([(-1, 0), (0, 0)], [4, 3], r"shared_prefixes\[1\]=\(0, 0\)"),
        ([(-1, 0), (0, 2), (1, 1)], [4, 1, 2], r"shared_prefixes\[2\]=\(1, 1\)"),
        ([(-1, 0), (0, 2)], [4, 63], "at most the capacity 64"),
        (
            [(-1, 0), (0, 2, 1)],
            [4, 3],
            r"shared_prefixes\[1\]=\(0, 2, 1\): not a \(parent, n\) pair",
        ),
        ([(-1, 0), (0, 2.0)], [4, 3], r"shared_prefixes\[1\]=\(0, 2.0\): not a"),
    ],
)
def test_bad_shared_prefixes_are_refused_naming_the_segment(
    shared: list[tuple[int, int]], lengths: list[int], match: str
) -> None:
    model = build_model(CFG, 0)
    with pytest.raises(ModelInputError, match=match):
        model.forward_logits(torch.ones(sum(lengths), dtype=torch.long), lengths,
                             shared_prefixes=shared)  # fmt: skip


def test_fast_numerics_and_per_segment_adapters_refuse_shared_prefixes() -> None:
    fast = build_model(CFG, 0, numerics=Numerics.FAST)
    assert not fast.takes_shared_prefixes()
    assert build_model(CFG, 0).takes_shared_prefixes()
    with pytest.raises(ModelInputError, match="fast numerics"):
        fast.forward_logits(torch.ones(5, dtype=torch.long), [3, 2],
                            shared_prefixes=[(-1, 0), (0, 2)])  # fmt: skip
    with pytest.raises(ModelInputError, match="one adapter"):
        build_model(CFG, 0).forward_logits(
            torch.ones(5, dtype=torch.long), [3, 2], lora=[None, None],
            shared_prefixes=[(-1, 0), (0, 2)],
        )  # fmt: skip
