"""The real sgl-router (sglang-router wheel) in front of two local engines.

The router is started from its Python API (``Router.from_args(RouterArgs(...))``) in a
subprocess, which is ready in well under a second, instead of ``smg launch`` (which
imports sglang and torch first). Engines register through ``POST /workers`` as SGLang
engines do; the router probes ``/health``, ``/server_info`` and ``/model_info``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from posttrain.formats import EngineClient, push_distributed, tensors_sha256
from posttrain.interface.testing import ServerProcess, free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(150)]

ROUTER = (
    "from sglang_router.router import Router; from sglang_router.router_args import RouterArgs; "
    "Router.from_args(RouterArgs(host='127.0.0.1', port={port}, policy='round_robin', "
    "log_level='warn', prometheus_port={prom}, health_check_interval_secs=2)).start()"
)


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _served(url: str) -> int:
    return int(httpx.get(f"{url}/server_info").json()["internal_states"][0]["generated_tokens"])


def test_router_registers_routes_removes_and_readds_engines(  # type: ignore[no-untyped-def]
    ckpt_dir, reference, trainer_lp, other_weights
) -> None:
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rport, prom = free_port(), free_port()
    router = f"http://127.0.0.1:{rport}"
    servers = [
        ServerProcess(
            [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(ckpt_dir),
             "--port", str(p), "--random-seed", str(i)],
            f"{u}/health",
            timeout_s=90,
        )
        for i, (p, u) in enumerate(zip(ports, urls, strict=True))
    ]  # fmt: skip
    servers.append(
        ServerProcess(
            [sys.executable, "-c", ROUTER.format(port=rport, prom=prom)],
            f"{router}/health",
            timeout_s=30,
        )
    )
    with ExitStack() as stack, httpx.Client(base_url=router, timeout=30) as rc:
        for s in servers:
            stack.callback(s.stop)
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.start(), servers))
        assert rc.get("/readiness").status_code == 503  # no workers yet
        for u in urls:
            assert rc.post("/workers", json={"url": u, "worker_type": "regular"}).status_code == 202

        def workers() -> dict[str, Any]:
            return {w["url"]: w for w in rc.get("/workers").json()["workers"]}

        _wait(
            lambda: set(workers()) == set(urls) and rc.get("/readiness").status_code == 200,
            "registration",
        )
        assert all(w["model_id"] == str(ckpt_dir) for w in workers().values())

        def generate(seed: int) -> dict[str, Any]:
            r = rc.post(
                "/generate",
                json={
                    "input_ids": [5, 6, 7, 8],
                    "sampling_params": {
                        "max_new_tokens": 4,
                        "sampling_seed": seed,
                        "ignore_eos": True,
                    },
                    "return_logprob": True,
                    "logprob_start_len": 0,
                },
            )
            assert r.status_code == 200, r.text
            return dict(r.json())

        before = [_served(u) for u in urls]
        outs = [generate(s) for s in range(4)]
        after = [_served(u) for u in urls]
        assert all(a > b for a, b in zip(after, before, strict=True)), "round robin reached both"
        # parity through the router: the same bits as the trainer's forward
        out = outs[0]
        ids = [5, 6, 7, 8, *out["output_ids"]]
        got = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        got += [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert got == trainer_lp(reference, ids)[1:]
        # sampling_seed survives the router's re-serialization: same seed, same tokens
        assert generate(0)["output_ids"] == outs[0]["output_ids"]
        # batched form and chat through the router
        batch = rc.post(
            "/generate",
            json={"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 2}},
        )
        assert batch.status_code == 200
        assert len(batch.json()) == 2
        # sampling_params.n survives the router: SGLang's list, sample j = seed + j
        group = rc.post(
            "/generate",
            json={
                "input_ids": [5, 6, 7, 8],
                "sampling_params": {"max_new_tokens": 4, "sampling_seed": 0, "ignore_eos": True,
                                    "n": 3},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        )  # fmt: skip
        assert group.status_code == 200, group.text
        assert [g["output_ids"] for g in group.json()] == [o["output_ids"] for o in outs[:3]]
        chat = rc.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status_code == 200
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"

        # remove engine 0: everything goes to engine 1
        wid = workers()[urls[0]]["id"]
        assert rc.delete(f"/workers/{wid}").status_code == 202
        _wait(lambda: set(workers()) == {urls[1]}, "removal")
        frozen = _served(urls[0])
        for s in range(3):
            generate(10 + s)
        assert _served(urls[0]) == frozen
        # re-add it: it serves again
        assert (
            rc.post("/workers", json={"url": urls[0], "worker_type": "regular"}).status_code == 202
        )
        _wait(lambda: set(workers()) == set(urls), "re-registration")
        for s in range(4):
            generate(20 + s)
        assert _served(urls[0]) > frozen

        # weight updates across processes: SGLang's distributed update to both engines at once
        clients = [EngineClient(url) for url in urls]
        push_distributed(clients, list(other_weights.items()), weight_version=1, timeout_s=60)
        for url in urls:
            assert httpx.get(f"{url}/weights_checksum").json()["sha256"] == tensors_sha256(
                other_weights
            )
        assert {generate(30 + s)["meta_info"]["weight_version"] for s in range(2)} == {1}
