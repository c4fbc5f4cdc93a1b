"""Client throughput against a 200 ms loopback teacher at concurrency 64: sharded vs one pool.

Run: uv run python packages/opd-scoring/benchmarks/bench_throughput.py [--requests 640] [--rounds 3]

The teacher (posttrain.opd.testing, a subprocess) answers each request 200 ms after it
arrived (its forward runs inside that window, as a batching server's would), so 64
requests in flight can reach at most 64 / 0.2 = 320 req/s (the ideal). Every client
sends the same sampled-token scoring requests (P=24, R=16, top_k=0: the lightest reply,
so that on a shared 2-core machine the teacher process's CPU is not what is measured)
and validates the replies with the same parser; they differ only in how they hold
connections:

* ``TeacherScoringClient``: 8 httpx transports (pools) x 8 connections, least-loaded shard per
  request, requests sent on the transports directly;
* ``one httpx client``: one ``AsyncClient`` with a 64-connection pool (the naive port);
* ``TeacherScoringClient, 1 shard``: TeacherScoringClient with ``connections_per_client=64`` (control);
* ``aiohttp, session per request``: miles' pattern (only when aiohttp is importable; it
  is not a dependency of this package).

Rounds interleave the clients; the table reports medians of req/s and of the client
process's CPU time per request (``time.process_time``), which stays meaningful when a
busy shared machine makes wall-clock rates CPU-bound. ``os.getloadavg()`` is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from posttrain.interface.testing import ServerProcess, free_port
from posttrain.opd import (
    OPDConfig,
    ScoringSample,
    TeacherRouter,
    TeacherScoringClient,
    Timeouts,
    build_score_payload,
    parse_score_response,
)

DELAY_S = 0.2
CONCURRENCY = 64
VOCAB = 512


def make_samples(n: int) -> list[ScoringSample]:
    rng = random.Random(0)
    return [
        ScoringSample(tokens=[rng.randrange(VOCAB) for _ in range(40)], response_length=16)
        for _ in range(n)
    ]


async def run_scorer(url: str, samples: list[ScoringSample], per_client: int) -> float:
    cfg = OPDConfig()
    async with TeacherScoringClient(
        TeacherRouter(fallback_url=url), cfg, per_url_concurrency=CONCURRENCY,
        max_concurrency=CONCURRENCY, connections_per_client=per_client,
        timeouts=Timeouts(read=60, deadline=120),
    ) as s:  # fmt: skip
        await s.probe()
        t0 = time.perf_counter()
        outs = await s.score_batch(samples)
        dt = time.perf_counter() - t0
    assert len(outs) == len(samples)
    assert all(o.teacher_log_probs is not None for o in outs)
    return len(samples) / dt


async def run_one_client(url: str, samples: list[ScoringSample]) -> float:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0)) as client:

        async def one(s: ScoringSample) -> None:
            payload = build_score_payload(s.tokens)
            async with sem:
                resp = await client.post(f"{url}/generate", json=payload)
            resp.raise_for_status()
            parse_score_response(resp.json(), s.tokens, s.response_length)

        await one(samples[0])  # warm one connection, as probe() does for the scorer
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in samples))
        return len(samples) / (time.perf_counter() - t0)


async def run_aiohttp_per_request(url: str, samples: list[ScoringSample]) -> float:
    import aiohttp

    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(s: ScoringSample) -> None:
        payload = build_score_payload(s.tokens)
        async with (
            sem,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
            session.post(f"{url}/generate", json=payload) as resp,
        ):
            resp.raise_for_status()
            obj = await resp.json()
        parse_score_response(obj, s.tokens, s.response_length)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(s) for s in samples))
    return len(samples) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    samples = make_samples(a.requests)
    port = free_port()
    argv = [
        sys.executable, "-m", "posttrain.opd.testing", "--port", str(port),
        "--vocab", str(VOCAB), "--delay", str(DELAY_S),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    clients: dict[str, Callable[[], Coroutine[Any, Any, float]]] = {
        "TeacherScoringClient (8 shards x 8 conns)": lambda: run_scorer(url, samples, 8),
        "one httpx client (64 conns)": lambda: run_one_client(url, samples),
        "TeacherScoringClient, 1 shard (64 conns)": lambda: run_scorer(url, samples, 64),
    }
    if importlib.util.find_spec("aiohttp") is not None:
        clients["aiohttp, session per request"] = lambda: run_aiohttp_per_request(url, samples)
    rates: dict[str, list[float]] = {k: [] for k in clients}
    cpu_ms: dict[str, list[float]] = {k: [] for k in clients}
    load_before = os.getloadavg()[0]
    with ServerProcess(argv, f"{url}/health", timeout_s=120):
        for _ in range(a.rounds):
            for name, fn in clients.items():
                c0 = time.process_time()
                rates[name].append(asyncio.run(fn()))
                cpu_ms[name].append(1000 * (time.process_time() - c0) / a.requests)
    ideal = CONCURRENCY / DELAY_S
    base = statistics.median(rates["one httpx client (64 conns)"])
    result = {
        "requests": a.requests,
        "concurrency": CONCURRENCY,
        "delay_s": DELAY_S,
        "ideal_req_s": ideal,
        "loadavg_1min_before": load_before,
        "loadavg_1min_after": os.getloadavg()[0],
        "clients": {
            name: {
                "req_s_median": statistics.median(r),
                "req_s_all": [round(x, 1) for x in r],
                "fraction_of_ideal": statistics.median(r) / ideal,
                "ratio_vs_one_client": statistics.median(r) / base,
                "client_cpu_ms_per_request_median": statistics.median(cpu_ms[name]),
            }
            for name, r in rates.items()
        },
    }
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
