"""The engine fleet's parts that need no trainer: an engine's current weight version (read the
way every package reads one, ``interface``), which engines a push could not reach (lost, not
fatal, while one took the push), an update to an in-process ``WeightSink``, which lost engines
answer again (real sockets on 127.0.0.1: one serving ``/health``, one that accepts connections
and never replies, a port with nothing listening), which samples came from weights the trainer
no longer holds, and a sync whose re-admission push fails (one gloo rank): the engine stays
lost, the sync goes on; a step's samples screened: the aborted and stale ones left out and
named."""

from __future__ import annotations

import http.server
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from grpo_workers import RecordingSink

from posttrain.grpo import GrpoRunError
from posttrain.grpo.fleet import (
    EngineFleet,
    Screened,
    SyncResult,
    SyncTarget,
    _push_to_sink,
    is_stale,
    push_each,
    turn_versions,
    unreachable,
)
from posttrain.interface import (
    WEIGHT_VERSIONS_KEY,
    Sample,
    SampleStatus,
    TransportError,
    WeightSink,
)
from posttrain.interface.processes import free_port
from posttrain.interface.testing import run_workers
from posttrain.lora import AdapterClient, AdapterPushError


def _weight_version(transport: httpx.MockTransport) -> int:
    target = SyncTarget(engine_urls=("http://e",), timeout_s=5, transport=transport)
    with EngineFleet(target) as fleet:
        return fleet.weight_version("http://e")


def _engine(reply: httpx.Response) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/model_info"
        return reply

    return httpx.MockTransport(handle)


@pytest.mark.parametrize(("reported", "version"), [(7, 7), ("3", 3), ("default", 0), (None, 0)])
def test_reported_versions_are_read_as_ints(reported: object, version: int) -> None:
    transport = _engine(httpx.Response(200, json={"weight_version": reported}))
    assert _weight_version(transport) == version


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (httpx.Response(200, json={"weight_version": "v3"}), "'v3' is not a weight version"),
        (httpx.Response(200, json={"weight_version": [1]}), "model_info"),
        (httpx.Response(503, json={"error": "x"}), "HTTP 503: x"),
    ],
)
def test_a_bad_answer_is_a_named_run_error(reply: httpx.Response, match: str) -> None:
    with pytest.raises(GrpoRunError, match=match):
        _weight_version(_engine(reply))


def _refusing(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _silent(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("no reply", request=request)


def _push_with(transports: dict[str, httpx.MockTransport]) -> Callable[[str], None]:
    """A push that asks each engine (lora-core's real client) what it can do."""

    def push(url: str) -> None:
        with AdapterClient(url, transport=transports[url], timeout=5) as client:
            client.capabilities()

    return push


def _answering(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"weight_version": "1", "lora_enabled": True})


def test_an_engine_that_cannot_be_reached_is_lost_not_fatal() -> None:
    transports = {
        "http://dead": httpx.MockTransport(_refusing),
        "http://frozen": httpx.MockTransport(_silent),
        "http://alive": httpx.MockTransport(_answering),
    }
    pushed: list[str] = []
    inner = _push_with(transports)

    def push(url: str) -> None:
        inner(url)
        pushed.append(url)

    lost = push_each(["http://dead", "http://alive", "http://frozen"], push)
    assert pushed == ["http://alive"]
    assert [url for url, _ in lost] == ["http://dead", "http://frozen"]
    assert "connection refused" in lost[0][1]
    assert "timed out" in lost[1][1]


def test_losing_every_engine_or_a_refusal_is_a_named_run_error() -> None:
    transports = {
        "http://a": httpx.MockTransport(_refusing),
        "http://b": httpx.MockTransport(_silent),
    }
    with pytest.raises(GrpoRunError, match=r"no engine could be reached \(http://a: .*http://b: "):
        push_each(["http://a", "http://b"], _push_with(transports))

    def refused(url: str) -> None:  # an engine that answered and said no is not "lost"
        raise AdapterPushError(f"{url}: checksum mismatch")

    with pytest.raises(GrpoRunError, match="weight sync to http://a: AdapterPushError"):
        push_each(["http://a", "http://b"], refused)


def test_unreachable_follows_the_raise_from_chain() -> None:
    cause = httpx.ConnectError("refused", request=httpx.Request("GET", "http://e"))
    wrapped = TransportError("GET failed", url="http://e")
    wrapped.__cause__ = cause  # what ``raise TransportError(...) from cause`` sets
    assert unreachable(wrapped)
    context_only = TransportError("GET failed", url="http://e")
    context_only.__context__ = cause  # raised while handling it, not from it: not counted
    assert not unreachable(context_only)
    assert unreachable(TimeoutError())
    assert not unreachable(AdapterPushError("refused"))
    assert not unreachable(ValueError("x"))


def test_a_weight_sink_gets_the_full_weights_or_its_refusal_is_a_run_error() -> None:
    full = None  # full weights: no PEFT config (an adapter would bring its own)
    target = SyncTarget(engine_urls=())
    tensors = {"model.embed_tokens.weight": torch.randn(5, 3), "lm_head.weight": torch.ones(5, 3)}
    sink = RecordingSink()
    assert isinstance(sink, WeightSink)
    _push_to_sink(sink, full, target, tensors, 4)
    assert (sink.version, sink.lora_name) == (4, None)
    assert all(torch.equal(sink.received[k], v) for k, v in tensors.items())
    with pytest.raises(
        GrpoRunError, match="RecordingSink refused version 5: RuntimeError: disk full"
    ):
        _push_to_sink(RecordingSink(refuse="disk full"), full, target, tensors, 5)


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
    target = SyncTarget(engine_urls=(), timeout_s=0.3)
    with EngineFleet(target) as fleet:  # one client per engine, the probe's included
        assert fleet.answering([dead, frozen, healthy]) == [healthy]
        assert fleet.answering([]) == []


def _sample(version: int | None, per_turn: list[int | None] | None = None) -> Sample:
    metadata = {} if per_turn is None else {WEIGHT_VERSIONS_KEY: per_turn}
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
    from posttrain.grpo.fleet import EngineFleet, SyncTarget
    from posttrain.grpo.trainer import build_policy

    torch.set_num_threads(1)
    from grpo_workers import RecordingSink

    sink = RecordingSink()
    policy = build_policy(GrpoConfig(model_path=Path(ckpt), train="full", replicate=1, shard=1))
    target = SyncTarget(engine_urls=(), sinks=(sink,), timeout_s=10.0)
    with EngineFleet(target) as fleet:
        synced = fleet.sync(policy, 3, readmit=(dead,))
    lora = build_policy(GrpoConfig(model_path=Path(ckpt), train="lora", replicate=1, shard=1))
    try:
        with EngineFleet(SyncTarget(engine_urls=(), sinks=(sink,))) as fleet:
            fleet.sync(lora, 4, first=True, readmit=(dead,))
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


def test_engines_a_sync_could_not_reach_leave_the_fleet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = EngineFleet(SyncTarget(engine_urls=("http://a", "http://b", "http://c")))
    with caplog.at_level(logging.WARNING, logger="posttrain.grpo"):
        fleet._set_aside((("http://b", "TransportError: refused"),), "step 3")
    assert fleet.engine_urls == ("http://a", "http://c")
    assert fleet.lost == ("http://b",)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "weight sync (step 3): engine http://b is unreachable (TransportError: refused)" in (
        message
    )
    assert "2 of 3 engines remain" in message
    fleet._set_aside((), "start")
    assert fleet.engine_urls == ("http://a", "http://c")
    fleet._take_back(SyncResult(metrics={}, readmitted=("http://b",)), "step 4")
    assert (fleet.engine_urls, fleet.lost) == (("http://a", "http://c", "http://b"), ())


def _fleet() -> EngineFleet:
    return EngineFleet(SyncTarget(engine_urls=("http://127.0.0.1:9",)))


def _step_sample(index: int, *, aborted: bool = False) -> Sample:
    if aborted:
        return Sample(prompt_ids=[], response_ids=[], rollout_logprobs=[], loss_mask=[],
                      status=SampleStatus.ABORTED, index=index, group_index=0,
                      metadata={"prompt_index": 7, "session_id": f"s{index}",
                                "abort_reason": "no reply within turn_timeout_s=3 s"})  # fmt: skip
    return Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.5], loss_mask=[1],
                  index=index, group_index=0)  # fmt: skip


def test_aborted_samples_are_left_out_of_the_step_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    samples = [_step_sample(0), _step_sample(1, aborted=True), _step_sample(2)]
    with caplog.at_level(logging.WARNING, logger="posttrain.grpo"):
        screened = _fleet().screen(samples, step=5, version=1, check_versions=False)
    assert [s.index for s in screened.kept] == [0, 2]
    assert [s.index for s in screened.aborted] == [1]
    assert screened.stale is None  # not checked: adapter training
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("step 5: 1 of 3 samples aborted, left out of the step")
    assert "prompt 7 sample 1 (session s1): no reply within turn_timeout_s=3 s" in message
    assert _fleet().screen([_step_sample(0)], step=0, version=1, check_versions=True) == Screened(
        kept=[_step_sample(0)], aborted=(), stale=()
    )
    with pytest.raises(GrpoRunError, match="every one of the 2 samples was aborted"):
        _fleet().screen([_step_sample(0, aborted=True), _step_sample(1, aborted=True)], step=0, version=1,
                        check_versions=True)  # fmt: skip


def test_stale_samples_are_left_out_of_the_step_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    samples = [_step_sample(0), _step_sample(1), _step_sample(2)]
    samples[1].weight_version = 3
    samples[2].weight_version = 4
    with caplog.at_level(logging.WARNING, logger="posttrain.grpo"):
        screened = _fleet().screen(samples, step=2, version=4, check_versions=True)
    assert [s.index for s in screened.kept] == [0, 2]  # no version reported: nothing to compare
    assert [s.index for s in screened.stale or ()] == [1]
    assert _fleet().screen(samples, step=2, version=4, check_versions=False).kept == samples
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("step 2: 1 of 3 samples came from an engine not at weight version 4")
    assert "sample 1 (engine weight versions [3])" in message
    with pytest.raises(GrpoRunError, match="every one of the 1 samples came from weights other"):
        _fleet().screen([samples[1]], step=2, version=4, check_versions=True)
