"""Rank function for the multimodal trainer test (forked gloo ranks, see conftest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.rewards import shapes_image
from posttrain.grpo.trainer import TrainSample, build_policy, expand_sample_media, train_step
from posttrain.interface import MediaKind, MediaRef
from posttrain.lora import export_adapter
from posttrain.models import encode_png_base64, load_pretrained

PROMPT = [1, 30, 101, 31, 32]  # the image sentinel (101) in the middle of the prompt
RESPONSE = 4
COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 0, 0)]
CELLS = [[0], [1, 2], [0, 1, 3], [0, 1, 2, 3]]


def image(i: int) -> MediaRef:
    ref = "data:image/png;base64," + encode_png_base64(shapes_image(COLORS[i], CELLS[i]))
    return MediaRef(kind=MediaKind.IMAGE, ref=ref)


def mm_samples(ckpt: str) -> list[TrainSample]:
    """Four image samples; rollout logprobs from a fresh load of the checkpoint."""
    model = load_pretrained(ckpt)
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(4):
        response = torch.randint(4, 90, (RESPONSE,), generator=gen).tolist()
        s = TrainSample(tokens=PROMPT + response, prompt_len=len(PROMPT), loss_mask=[1] * RESPONSE,
                        rollout_logprobs=[0.0] * RESPONSE, advantages=[(-1.0) ** i] * RESPONSE,
                        media=[image(i)])  # fmt: skip
        ids, prompt_len, media = expand_sample_media(s, model)
        with torch.no_grad():
            lp = model.forward_logprobs(torch.tensor(ids), [len(ids)], media=media)
        s.rollout_logprobs = lp[prompt_len:].tolist()
        out.append(s)
    return out


def mm_step(rank: int, world: int, ckpt: str, train: str) -> dict[str, Any]:
    """One GRPO step on image samples: metrics, what the optimizer holds, weights moved."""
    torch.set_num_threads(1)
    cfg = GrpoConfig(model_path=Path(ckpt), train=train, replicate=1, shard=world, lr=1e-2,  # type: ignore[arg-type]
                     lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))  # fmt: skip
    policy = build_policy(cfg)
    towers = {name: p for name, p in policy.model.named_parameters() if "_tower." in name}
    before = {k: v.clone() for k, v in iter_full_state_dict(policy.model)}
    batch = mm_samples(ckpt)
    requires = {name: p.requires_grad for name, p in towers.items()}
    grads: dict[str, bool] = {}

    def record_grads(*_: Any) -> None:  # what the towers hold when the optimizer steps
        grads.update({name: p.grad is not None for name, p in towers.items()})

    policy.optimizer.register_step_pre_hook(record_grads)
    metrics = train_step(policy, batch[rank::world], cfg, global_batch_size=4,
                         global_token_count=4 * RESPONSE)  # fmt: skip
    in_optimizer = {id(p) for g in policy.optimizer.param_groups for p in g["params"]}
    with_state = {id(p) for p in policy.optimizer.state}
    after = dict(iter_full_state_dict(policy.model))
    return {
        "metrics": metrics,
        "towers": sorted(towers),
        "tower_requires_grad": requires,
        "tower_grads_at_step": grads,
        "towers_in_optimizer": [n for n, p in towers.items() if id(p) in in_optimizer],
        "towers_with_state": [n for n, p in towers.items() if id(p) in with_state],
        "moved": sorted(k for k in before if not torch.equal(before[k], after[k])),
        "adapter": None if policy.lora is None else sorted(export_adapter(policy.lora)),
    }


def mm_context_parallel(rank: int, world: int, ckpt: str) -> None:
    """A multimodal step under context parallel (refused on every rank alike)."""
    torch.set_num_threads(1)
    cfg = GrpoConfig(model_path=Path(ckpt), replicate=1, shard=world,
                     context_parallel_size=world)  # fmt: skip
    policy = build_policy(cfg)
    batch = mm_samples(ckpt)
    train_step(policy, policy.data_parallel_share(batch), cfg, global_batch_size=4,
               global_token_count=4 * RESPONSE)  # fmt: skip
