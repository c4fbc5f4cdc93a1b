"""grpo's weight sync and a real multimodal ``posttrain.local_engine`` through an offload cycle.

The engine (a process on 127.0.0.1) serves a ``multimodal-tiny`` checkpoint; the trainer is a
one-rank grpo ``Policy`` on the same checkpoint. Full-weight sync sends the frozen towers on the
run's first sync and then only after the engine's memory went through
``/release_memory_occupation`` + ``/resume_memory_occupation`` (zero-filled, stale until
re-sent): ``towers_due`` reads the model's structure (``has_towers``). After the cycle the
engine's ``tower_sha256`` equals the trainer's and its logprobs on an image prompt equal the
trainer's bit for bit. ``buggy_gate`` replays the published bug (the re-send condition never
fires after the cycle): the engine is left with stale towers and refuses to generate, naming
them. Adapter training reloads the base (towers included) from the checkpoint after a cycle.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from posttrain.formats import tensors_sha256
from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.rewards import shapes_image
from posttrain.grpo.sync import SyncTarget, set_engine_memory, sync_weights
from posttrain.grpo.trainer import build_policy
from posttrain.interface.testing import ServerProcess, free_port, run_workers
from posttrain.models import (
    decode_media,
    encode_png_base64,
    expand_media_tokens,
    load_pretrained,
    to_hf_state_dict,
    tower_parameter_names,
)
from posttrain.models.__main__ import init_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

IMAGE = "data:image/png;base64," + encode_png_base64(shapes_image((0, 255, 0), [0, 3]))
PROMPT = [1, 30, 101, 31, 32]  # one image sentinel (id 101)
RESPONSE = [40, 41, 42]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mm") / "mm-tiny"
    return init_checkpoint(path, seed=4, max_positions=64, arch="multimodal-tiny")


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
            "--enable-lora"]  # fmt: skip
    with ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=120):
        yield f"http://127.0.0.1:{port}"


def _engine_logprobs(url: str) -> list[float] | str:
    """The engine's logprobs of ``RESPONSE`` after the image prompt, or its refusal."""
    body = {"input_ids": PROMPT + RESPONSE, "image_data": [IMAGE], "return_logprob": True,
            "logprob_start_len": len(PROMPT) - 1, "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    reply = httpx.post(f"{url}/generate", json=body, timeout=30)
    if reply.status_code != 200:
        return f"{reply.status_code}: {reply.text}"
    entries = reply.json()["meta_info"]["input_token_logprobs"]
    return [float(e[0]) for e in entries[-len(RESPONSE) :]]


def _trainer_logprobs(checkpoint: str) -> list[float]:
    model = load_pretrained(checkpoint)
    items = decode_media(model.config, images=[IMAGE])
    ids, media = expand_media_tokens(PROMPT, items, model.config)
    with torch.no_grad():
        lp = model.forward_logprobs(torch.tensor(ids + RESPONSE), [len(ids) + 3], media=media)
    return lp[-len(RESPONSE) :].tolist()


def offload_cycle(rank: int, world: int, ckpt: str, url: str, train: str, gate: str) -> Any:
    torch.set_num_threads(1)
    cfg = GrpoConfig(model_path=Path(ckpt), train=train, replicate=1, shard=world, seed=0)  # type: ignore[arg-type]
    policy = build_policy(cfg)
    version = int(httpx.get(f"{url}/model_info", timeout=10).json().get("weight_version") or 0)
    target = SyncTarget(engine_urls=(url,), base_model_path=ckpt, timeout_s=60)
    first = sync_weights(policy, target, version + 1, first=True).metrics
    later = sync_weights(policy, target, version + 2, first=False).metrics
    assert set_engine_memory(target, resident=False) == []
    assert set_engine_memory(target, resident=True) == []
    resumed = gate == "structure"  # buggy_gate: the condition never sees the cycle
    after = sync_weights(policy, target, version + 3, first=False, engines_resumed=resumed).metrics
    mine = None
    if train == "full":  # the trainer's own tower bytes, as the sync converts them
        hf = to_hf_state_dict(dict(iter_full_state_dict(policy.model)), policy.model.config)
        mine = tensors_sha256({n: hf[n] for n in tower_parameter_names(policy.model)})
    checksum = httpx.get(f"{url}/weights_checksum", timeout=30)
    return {"first": first, "later": later, "after": after, "tower_sha256": mine,
            "engine": checksum.json() if checksum.status_code == 200 else checksum.text,
            "logprobs": _engine_logprobs(url)}  # fmt: skip


@pytest.mark.parametrize(("train", "gate"), [("full", "structure"), ("full", "buggy_gate"),
                                             ("lora", "structure")])  # fmt: skip
def test_towers_are_resent_after_an_offload_cycle(
    checkpoint: Path, engine: str, train: str, gate: str
) -> None:
    (out,) = run_workers(offload_cycle, 1, args=(str(checkpoint), engine, train, gate),
                         timeout_s=240)  # fmt: skip
    if train == "full":
        assert out["first"]["sync_towers"] == 1.0
        assert out["later"]["sync_towers"] == 0.0  # frozen towers are not re-sent every step
        assert out["later"]["sync_bytes"] < out["first"]["sync_bytes"]
    if gate == "buggy_gate":
        assert out["after"]["sync_towers"] == 0.0
        assert isinstance(out["logprobs"], str)
        assert out["logprobs"].startswith("503")
        assert "tower" in out["logprobs"]  # the engine names the stale tensors
        return
    assert out["after"]["sync_towers"] == 1.0  # sent (full) or reloaded from disk (lora)
    engine_info = out["engine"]
    assert engine_info["stale_tensors"] == 0
    reference = load_pretrained(checkpoint)
    names = tower_parameter_names(reference)
    hf = reference.hf_state_dict()
    assert engine_info["tower_sha256"] == tensors_sha256({n: hf[n] for n in names})
    if out["tower_sha256"] is not None:
        assert engine_info["tower_sha256"] == out["tower_sha256"]
    assert out["logprobs"] == _trainer_logprobs(str(checkpoint))  # bit for bit
