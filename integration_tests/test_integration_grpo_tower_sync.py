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
The trainer's rank runs ``tower_sync_worker.offload_cycle`` in a spawned interpreter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tower_sync_worker import IMAGE, PROMPT, RESPONSE, offload_cycle

from posttrain.formats import tensors_sha256
from posttrain.interface.testing import ServerProcess, free_port, run_workers
from posttrain.models import (
    decode_media,
    expand_media_tokens,
    load_pretrained,
    tower_parameter_names,
)
from posttrain.models.__main__ import init_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


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


def _trainer_logprobs(checkpoint: str) -> list[float]:
    model = load_pretrained(checkpoint)
    items = decode_media(model.config, images=[IMAGE])
    ids, media = expand_media_tokens(PROMPT, items, model.config)
    with torch.no_grad():
        lp = model.forward_logprobs(torch.tensor(ids + RESPONSE), [len(ids) + 3], media=media)
    return lp[-len(RESPONSE) :].tolist()


@pytest.mark.parametrize(("train", "gate"), [("full", "structure"), ("full", "buggy_gate"),
                                             ("lora", "structure")])  # fmt: skip
def test_towers_are_resent_after_an_offload_cycle(
    checkpoint: Path, engine: str, train: str, gate: str
) -> None:
    (out,) = run_workers(offload_cycle, 1, args=(str(checkpoint), engine, train, gate),
                         timeout_s=240, start_method="spawn")  # fmt: skip
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
