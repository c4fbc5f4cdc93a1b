"""SGLang's weight-update protocol against a real engine process: the distributed group over
gloo, from-disk, the version route, LoRA from tensors in SGLang's body, and what a refused or
interrupted update leaves serving (the old version, checksum and greedy outputs)."""

from __future__ import annotations

import base64
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from posttrain.formats import (
    EngineClient,
    InitWeightsUpdateGroupReq,
    free_port,
    join_update_group,
    push_distributed,
)
from posttrain.interface import EngineError, StaleVersionError
from posttrain.interface.testing import ServerProcess
from posttrain.models import ModelConfig, build_model

TINY = {"torch_dtype": "bfloat16", "max_position_embeddings": 48}
PROMPT = [5, 17, 33, 9, 71]


@pytest.fixture(scope="module")
def server(ckpt_dir: Path) -> Iterator[str]:
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(
        [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(ckpt_dir),
         "--port", str(port), "--enable-lora", "--update-group-timeout", "20"],
        f"{url}/health",
        timeout_s=90,
    )  # fmt: skip
    proc.start()
    try:
        yield url
    finally:
        proc.stop()


def _state(url: str) -> tuple[Any, str, list[int]]:
    with httpx.Client(base_url=url, timeout=30) as c:
        sha = c.get("/weights_checksum").json()
        out = c.post(
            "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        ).json()
    return sha["weight_version"], sha["sha256"], out["output_ids"]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(build_model(ModelConfig.tiny(**TINY), seed=seed).hf_state_dict().items())


def test_distributed_update_commits_all_buckets_at_the_end(server: str) -> None:
    """Both of SGLang's forms (one broadcast per bucket, flattened, the default; one per
    tensor) serve the same weights: same checksum, same greedy output."""
    before = _state(server)
    new = _weights(7)
    with EngineClient(server) as client:
        sent = push_distributed([client], new, weight_version=3, bucket_bytes=4096, timeout_s=30)
    assert sent == sum(t.numel() * t.element_size() for _, t in new)
    version, sha, out = _state(server)
    assert version == 3
    assert sha != before[1]
    # the same weights again at a higher version, in one flattened bucket and one broadcast
    # per tensor: same checksum, same greedy output
    with EngineClient(server) as client:
        push_distributed([client], new, weight_version=4, bucket_bytes=1 << 20, timeout_s=30)
    assert _state(server) == (4, sha, out)
    with EngineClient(server) as client:
        push_distributed(
            [client], _weights(8), weight_version=5, bucket_bytes=4096, timeout_s=30,
            flattened=False,
        )  # fmt: skip
        assert _state(server)[1] not in (sha, before[1])
        push_distributed(
            [client], new, weight_version=6, bucket_bytes=4096, timeout_s=30, flattened=False
        )
    assert _state(server) == (6, sha, out)


def test_refused_and_interrupted_updates_leave_old_weights_serving(server: str) -> None:
    with EngineClient(server) as client:
        push_distributed([client], _weights(8), weight_version=10, timeout_s=30)
    before = _state(server)
    bad = _weights(9)
    name, t = bad[1]
    bad[1] = (name, torch.full_like(t, float("nan")))
    with EngineClient(server) as client, pytest.raises(EngineError) as err:
        push_distributed([client], bad, weight_version=11, bucket_bytes=4096, timeout_s=30)
    assert "/update_weights_from_distributed" in str(err.value)
    assert "NaN" in str(err.value)
    assert _state(server) == before
    # stale version: every bucket received, the end refused, nothing changed
    with (
        EngineClient(server) as client,
        pytest.raises(StaleVersionError, match="does not increase"),
    ):
        push_distributed([client], _weights(9), weight_version=10, timeout_s=30)
    assert _state(server) == before
    # begun and cut: the group is formed, one bucket staged, then the trainer goes away
    port = free_port("127.0.0.1")
    with EngineClient(server) as client:
        import threading

        init = InitWeightsUpdateGroupReq(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
            backend="gloo", group_name="cut",
        )  # fmt: skip
        th = threading.Thread(target=client.post, args=("/init_weights_update_group", init))
        th.start()
        group = join_update_group(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
            group_name="cut", backend="gloo", timeout_s=20,
        )  # fmt: skip
        th.join()
        names, tensors = zip(*_weights(9)[:2], strict=True)
        body = {
            "names": list(names),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": "cut",
            "flush_cache": False,
        }
        th = threading.Thread(target=client.post, args=("/update_weights_from_distributed", body))
        th.start()
        group.broadcast(list(tensors))
        th.join()
        group.destroy()
        client.post("/destroy_weights_update_group", {"group_name": "cut"})
    assert _state(server) == before


def test_version_route_and_unsafe_payloads_refused(server: str) -> None:
    with EngineClient(server) as client:
        version = _state(server)[0] or 0
        client.post("/update_weight_version", {"new_version": str(version + 1)})
        assert _state(server)[0] == version + 1
        with pytest.raises(EngineError, match="CUDA IPC"):
            client.post(
                "/update_weights_from_tensor",
                {"serialized_named_tensors": [base64.b64encode(b"x").decode()]},
            )
        # a pickle that names a callable is refused unread, by name
        evil = base64.b64encode(pickle.dumps(print)).decode()
        with pytest.raises(EngineError, match=r"builtins\.print"):
            client.post(
                "/load_lora_adapter_from_tensors",
                {"lora_name": "x", "config_dict": {}, "serialized_named_tensors": [evil]},
            )
