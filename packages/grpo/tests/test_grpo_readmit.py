"""``readmit``'s parts that need no trainer: which lost engines answer again (real sockets on
127.0.0.1: one serving ``/health``, one that accepts connections and never replies, a port with
nothing listening), which samples came from weights the trainer no longer holds, and a sync
whose re-admission push fails (one gloo rank): the engine stays lost, the sync goes on."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.grpo.readmit import answering, is_stale, turn_versions
from posttrain.interface import Sample
from posttrain.interface.processes import free_port
from posttrain.interface.testing import run_workers


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = 200 if self.path == "/health" else 404
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def healthy() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def frozen() -> Iterator[str]:
    """A listening socket nobody reads: a connection is accepted by the kernel, no reply comes
    (what a SIGSTOPped engine looks like)."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_only_engines_that_answer_health_come_back(healthy: str, frozen: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    assert answering([dead, frozen, healthy], timeout_s=0.3) == [healthy]
    assert answering([], timeout_s=0.3) == []


def _sample(version: int | None, per_turn: list[int | None] | None = None) -> Sample:
    metadata = {} if per_turn is None else {"weight_versions": per_turn}
    return Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.5], loss_mask=[1],
                  weight_version=version, metadata=metadata)  # fmt: skip


def test_a_sample_any_turn_of_which_came_from_another_version_is_stale() -> None:
    current = _sample(5)
    unknown = _sample(None)  # an engine that reports no version: nothing to compare
    old = _sample(4)
    mixed = _sample(5, per_turn=[4, 5])  # its first turn came from the old weights
    whole = _sample(5, per_turn=[5, None, 5])
    samples = [current, unknown, old, mixed, whole]
    assert [is_stale(s, 5) for s in samples] == [False, False, True, True, False]
    assert turn_versions(mixed) == [4, 5]
    assert turn_versions(old) == [4]


def _sync_with_readmission(rank: int, world: int, ckpt: str, dead: str) -> dict[str, object]:
    """One trainer rank: a full-weight sync to an in-process sink that also re-admits ``dead``
    (nothing listens there: forming its update group fails at once); then a LoRA sync that
    would re-admit without a base checkpoint."""
    import torch

    from posttrain.grpo import GrpoRunError
    from posttrain.grpo.config import GrpoConfig
    from posttrain.grpo.sync import SyncTarget, sync_weights
    from posttrain.grpo.trainer import build_policy

    torch.set_num_threads(1)
    from grpo_workers import RecordingSink

    sink = RecordingSink()
    policy = build_policy(GrpoConfig(model_path=Path(ckpt), train="full", replicate=1, shard=1))
    target = SyncTarget(engine_urls=(), sinks=(sink,), timeout_s=10.0)
    synced = sync_weights(policy, target, 3, first=False, readmit=(dead,))
    lora = build_policy(GrpoConfig(model_path=Path(ckpt), train="lora", replicate=1, shard=1))
    try:
        sync_weights(lora, SyncTarget(engine_urls=(), sinks=(sink,)), 4, readmit=(dead,))
        refused = ""
    except GrpoRunError as exc:
        refused = str(exc)
    return {"metrics": synced.metrics, "readmitted": synced.readmitted,
            "failed": synced.readmit_failed, "live_version": sink.version, "refused": refused}  # fmt: skip


def test_a_failed_readmission_leaves_the_engine_lost_and_the_step_goes_on(tiny_ckpt: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    (out,) = run_workers(_sync_with_readmission, 1, args=(tiny_ckpt, dead), timeout_s=120)
    assert out["live_version"] == 3  # the live target took the update
    assert out["readmitted"] == ()
    ((url, why),) = out["failed"]
    assert url == dead
    assert "ConnectError" in why or "refused" in why
    assert out["metrics"]["sync_engines_readmitted"] == 0.0
    assert out["metrics"]["sync_engines_lost"] == 0.0
    assert "base_model_path is unset" in out["refused"]
