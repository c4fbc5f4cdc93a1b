"""The trainer side of ``test_integration_grpo_tower_sync``, importable so its rank is spawned.

``offload_cycle`` runs in a fresh interpreter (``run_workers(..., start_method="spawn")``):
a rank forked from the long-lived pytest process once died with SIGSEGV there, and a module
of the test directory cannot be imported by a spawned child under pytest's importlib mode.
``conftest.py`` puts this directory on ``sys.path``, which spawn passes to the child.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import torch

from posttrain.formats import tensors_sha256
from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.fleet import EngineFleet, SyncTarget
from posttrain.grpo.rewards import shapes_image
from posttrain.grpo.trainer import build_policy
from posttrain.models import encode_png_base64, to_hf_state_dict, tower_parameter_names

IMAGE = "data:image/png;base64," + encode_png_base64(shapes_image((0, 255, 0), [0, 3]))
PROMPT = [1, 30, 101, 31, 32]  # one image sentinel (id 101)
RESPONSE = [40, 41, 42]


def engine_logprobs(url: str) -> list[float] | str:
    """The engine's logprobs of ``RESPONSE`` after the image prompt, or its refusal."""
    body = {"input_ids": PROMPT + RESPONSE, "image_data": [IMAGE], "return_logprob": True,
            "logprob_start_len": len(PROMPT) - 1, "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    reply = httpx.post(f"{url}/generate", json=body, timeout=30)
    if reply.status_code != 200:
        return f"{reply.status_code}: {reply.text}"
    entries = reply.json()["meta_info"]["input_token_logprobs"]
    return [float(e[0]) for e in entries[-len(RESPONSE) :]]


def offload_cycle(rank: int, world: int, ckpt: str, url: str, train: str, gate: str) -> Any:
    """Sync, sync, release + resume the engine, sync again; return the metrics, both tower
    checksums and the engine's logprobs on the image prompt (or its refusal)."""
    torch.set_num_threads(1)
    cfg = GrpoConfig(model_path=Path(ckpt), train=train, replicate=1, shard=world, seed=0)  # type: ignore[arg-type]
    policy = build_policy(cfg)
    target = SyncTarget(engine_urls=(url,), base_model_path=ckpt, timeout_s=60)
    with EngineFleet(target) as fleet:  # one update group for every sync of the cycle
        version = fleet.first_version() - 1
        first = fleet.sync(policy, version + 1, first=True).metrics
        later = fleet.sync(policy, version + 2).metrics
        fleet.set_memory(resident=False, when="offload")
        fleet.set_memory(resident=True, when="onload")
        assert fleet.engine_urls == (url,)
        resumed = gate == "structure"  # buggy_gate: the condition never sees the cycle
        after = fleet.sync(policy, version + 3, engines_resumed=resumed).metrics
    mine = None
    if train == "full":  # the trainer's own tower bytes, as the sync converts them
        hf = to_hf_state_dict(dict(iter_full_state_dict(policy.model)), policy.model.config)
        mine = tensors_sha256({n: hf[n] for n in tower_parameter_names(policy.model)})
    checksum = httpx.get(f"{url}/weights_checksum", timeout=30)
    return {"first": first, "later": later, "after": after, "tower_sha256": mine,
            "engine": checksum.json() if checksum.status_code == 200 else checksum.text,
            "logprobs": engine_logprobs(url)}  # fmt: skip
