"""A weight push cut halfway: the engine keeps serving the old version, the next succeeds.

The trainer side is formats' ``push_distributed`` (what grpo's full-weight sync calls: SGLang's
``/init_weights_update_group``, per bucket ``/update_weights_from_distributed`` with a gloo
broadcast, ``/destroy_weights_update_group``), the engine a real ``posttrain.local_engine``
process, and between them, on the HTTP side, a TCP proxy (``faults.CuttingProxy``) that drops
the connection as a dying trainer host would, just before the request of the update's last
bucket (the one that ends it): every earlier bucket was received and staged.

After the cut the trainer's call raised a posttrain error naming the route, and the engine still
reports the old weight version, the same weight digest and, for a fixed greedy prompt, the same
tokens and logprobs bit for bit: nothing was applied (all or nothing). The next push, straight
to the engine, forms the group again and succeeds: the new version is served, the engine's
digest is that of the pushed tensors and the logprobs change. Then one group
(``WeightUpdateGroup``, as grpo's engine fleet keeps it for a run) takes two updates in a row.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from faults import CuttingProxy

from posttrain.formats import EngineClient, WeightUpdateGroup, push_distributed, tensors_sha256
from posttrain.interface import PosttrainError
from posttrain.interface.testing import ServerProcess, free_port
from posttrain.models import load_pretrained
from posttrain.models.__main__ import init_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

PROMPT = [1, 30, 31, 32, 33]
BUCKET_BYTES = 32 * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=3, max_positions=64)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1"]  # fmt: skip
    with ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=120):
        yield f"http://127.0.0.1:{port}", port


def _perturbed(checkpoint: Path, seed: int) -> dict[str, torch.Tensor]:
    """Every base tensor of the checkpoint (HF names, engine dtypes), moved by seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in load_pretrained(checkpoint).hf_state_dict().items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.05
        out[name] = (t.float() + noise).to(t.dtype).contiguous()
    return out


def _served(url: str) -> tuple[int | None, str, list[int], list[float]]:
    """(weight version, weight digest, greedy tokens, their logprobs) the engine serves now."""
    with httpx.Client(timeout=60.0) as http:
        info = http.get(f"{url}/model_info")
        digest = http.get(f"{url}/weights_checksum")
        reply = http.post(
            f"{url}/generate",
            json={"input_ids": PROMPT, "return_logprob": True,
                  "sampling_params": {"temperature": 0.0, "max_new_tokens": 6,
                                      "ignore_eos": True}},
        )  # fmt: skip
    for r in (info, digest, reply):
        assert r.status_code == 200, r.text
    entries = reply.json()["meta_info"]["output_token_logprobs"]
    return (
        info.json()["weight_version"],
        digest.json()["sha256"],
        [int(e[1]) for e in entries],
        [float(e[0]) for e in entries],
    )


def _push(url: str, tensors: dict[str, torch.Tensor], version: int, timeout_s: float) -> None:
    with EngineClient(url, timeout_s=timeout_s) as client:
        push_distributed(
            [client], list(tensors.items()), weight_version=version,
            bucket_bytes=BUCKET_BYTES, timeout_s=timeout_s,
        )  # fmt: skip


def test_interrupted_push_leaves_the_old_version_serving(
    checkpoint: Path, engine: tuple[str, int]
) -> None:
    url, port = engine
    first = _perturbed(checkpoint, seed=1)
    total = sum(t.numel() * t.element_size() for t in first.values())
    assert total > 4 * BUCKET_BYTES  # several buckets: "halfway" is between them
    before = _served(url)

    # Cut just before the last bucket's request: every other bucket received and staged.
    cut = CuttingProxy(("127.0.0.1", port), cut_before=b'"flush_cache":true')
    with cut, pytest.raises(PosttrainError, match="/update_weights_from_distributed"):
        _push(cut.url, first, 1, timeout_s=10.0)  # the last broadcast waits out its timeout
    assert cut.cut.is_set()
    assert _served(url) == before  # version, digest, tokens and logprobs: bit for bit

    # The next push forms the group again and succeeds (the same version: never installed).
    _push(url, first, 1, timeout_s=60.0)
    after = _served(url)
    assert after[0] == 1
    assert after[1] == tensors_sha256(first)  # every tensor arrived, exactly as sent
    assert after[3] != before[3]

    # One group kept for several updates (what a run's engine fleet does at every sync).
    second = _perturbed(checkpoint, seed=2)
    with EngineClient(url, timeout_s=60.0) as client:
        group = WeightUpdateGroup.form([client], timeout_s=60.0)
        try:
            group.push(list(second.items()), weight_version=2, bucket_bytes=BUCKET_BYTES)
            assert _served(url)[:2] == (2, tensors_sha256(second))
            group.push(list(first.items()), weight_version=3, bucket_bytes=BUCKET_BYTES)
        finally:
            group.close()
    assert _served(url)[:2] == (3, tensors_sha256(first))
