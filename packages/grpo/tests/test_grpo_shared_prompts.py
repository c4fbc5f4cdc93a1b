"""The trainer's batch with shared prompts: a group's samples after its first are packed as
their response tokens only, scored from the first sample's prompt rows; the response logprobs
are the bits of every sample packed whole (strict numerics), and the trainer's gradient the
same to fp32 rounding."""

from __future__ import annotations

import torch

from posttrain.grpo.batch import pack
from posttrain.grpo.step import _response_logprobs
from posttrain.grpo.trainer import TrainSample
from posttrain.models import ModelConfig, build_model

CFG = ModelConfig.tiny()


def _samples() -> list[TrainSample]:
    """Two groups of one prompt each, a lone sample between them, an empty response (packed
    whole: the samples after it share its prompt)."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(4, CFG.vocab_size, (n,), generator=gen).tolist()

    p1, p2 = ids(9), ids(5)
    out = []
    for prompt, response in ((p1, ids(3)), (p1, ids(1)), (p1, ids(2)), (ids(4), ids(2)),
                             (p2, ids(2)), (p2, []), (p2, ids(4))):  # fmt: skip
        n = len(response)
        out.append(TrainSample(tokens=prompt + response, prompt_len=len(prompt), loss_mask=[1] * n,
                               rollout_logprobs=[0.0] * n, advantages=[1.0] * n))  # fmt: skip
    return out


def test_pack_shares_each_groups_prompt_and_scores_the_same_tokens() -> None:
    model = build_model(CFG, 0)
    samples = _samples()
    whole = pack(samples, torch.device("cpu"), model)
    shared = pack(samples, torch.device("cpu"), model, share_prompts=True)
    assert whole.shared_prefixes is None
    assert shared.shared_prefixes == [(-1, 0), (0, 9), (0, 9), (-1, 0), (-1, 0), (-1, 0), (5, 5)]
    assert shared.lengths == [12, 1, 2, 6, 7, 5, 4]  # the empty response keeps its prompt
    assert torch.equal(shared.targets, whole.targets)
    assert shared.rows.tolist()[:6] == [8, 9, 10, 8, 8, 13]  # a child's first: the prompt's last
    for attr in ("mask", "rollout", "advantages"):
        assert torch.equal(getattr(shared, attr), getattr(whole, attr))
    assert shared.response_lengths == whole.response_lengths
    lp_whole, _ = _response_logprobs(model, whole, with_logits=False)
    lp_shared, _ = _response_logprobs(model, shared, with_logits=False)
    assert torch.equal(lp_shared.view(torch.int32), lp_whole.view(torch.int32))
    grads = []
    for batch in (whole, shared):
        model.zero_grad()
        _response_logprobs(model, batch, with_logits=False)[0].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
