"""Benchmark: requests/s and tokens/s of the CPU engine, weight-update GB/s per route vs memcpy.

Run from the repository root:

    uv run python packages/local-engine/benchmarks/bench_local_engine.py [--quick]

Part 1 starts two engine processes on one tiny checkpoint, one with batching
(``--max-running-requests 8``) and one without (``1``), and sends the same load
(N requests, C concurrent, 16 new tokens each) to both, interleaved, R times.
Part 2 starts one engine on a larger dense checkpoint and times full weight updates over
SGLang's routes: the distributed update (group formed, buckets broadcast over gloo, staged,
committed, group destroyed) and from disk (a checkpoint written, then
``/update_weights_from_disk``), interleaved with a plain memcpy of the same bytes in the
pushing process; each update's engine checksum is verified.
Medians are reported with ratios side by side; the JSON goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from posttrain.formats import EngineClient, push_distributed, tensors_sha256, write_safetensors
from posttrain.interface.testing import ServerProcess, free_port
from posttrain.models import ModelConfig, build_model, build_tokenizer


def _engine(ckpt: Path, *extra: str) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "posttrain.local_engine",
        "--model-path",
        str(ckpt),
        "--port",
        str(port),
        *extra,
    ]
    return ServerProcess(argv, f"{url}/health", timeout_s=180), url


async def _load(url: str, n: int, concurrency: int, new_tokens: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        async with sem:
            r = await client.post(
                "/generate",
                json={
                    "input_ids": [5 + i % 50, 6, 7, 8, 9, 10, 11, 12],
                    "sampling_params": {
                        "max_new_tokens": new_tokens,
                        "ignore_eos": True,
                        "sampling_seed": i,
                    },
                    "return_logprob": True,
                },
            )
            r.raise_for_status()
            tokens += r.json()["meta_info"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(n)))
        return time.perf_counter() - t0, tokens


def bench_throughput(tmp: Path, n: int, concurrency: int, reps: int) -> dict[str, Any]:
    ckpt = tmp / "tiny"
    build_model(
        ModelConfig.tiny(torch_dtype="bfloat16", max_position_embeddings=48), seed=0
    ).save_pretrained(ckpt, tokenizer=build_tokenizer())
    modes = {"batch8": ("--max-running-requests", "8"), "batch1": ("--max-running-requests", "1")}
    servers = {m: _engine(ckpt, *flags) for m, flags in modes.items()}
    rows: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
    try:
        for s, _ in servers.values():
            s.start()
        for _, url in servers.values():  # warm-up
            asyncio.run(_load(url, 4, 4, 4))
        for _ in range(reps):
            for m, (_, url) in servers.items():
                rows[m].append(asyncio.run(_load(url, n, concurrency, 16)))
    finally:
        for s, _ in servers.values():
            s.stop()
    out: dict[str, Any] = {
        "requests": n,
        "concurrency": concurrency,
        "new_tokens": 16,
        "reps": reps,
    }
    for m, runs in rows.items():
        wall = statistics.median(w for w, _ in runs)
        toks = runs[0][1]
        out[m] = {"requests_per_s": n / wall, "tokens_per_s": toks / wall, "median_wall_s": wall}
    out["batch8_over_batch1"] = out["batch8"]["requests_per_s"] / out["batch1"]["requests_per_s"]
    return out


def bench_weight_update(tmp: Path, payload_mb: int, reps: int) -> dict[str, Any]:
    hidden = 512
    inter = max(256, (payload_mb * 2**20 // 2 // 4 - 4 * hidden * hidden) // (3 * hidden))
    cfg = ModelConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, moe_intermediate_size=0,
        num_experts=0, num_experts_per_tok=0, max_position_embeddings=16, torch_dtype="bfloat16",
    )  # fmt: skip
    ckpt = tmp / "dense"
    build_model(cfg, seed=0).save_pretrained(ckpt)
    versions = [build_model(cfg, seed=s).hf_state_dict() for s in (1, 2)]
    versions = [{k: v.detach().contiguous() for k, v in w.items()} for w in versions]
    shas = [tensors_sha256(w) for w in versions]
    nbytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    flat_src = torch.cat([t.reshape(-1).view(torch.uint8) for t in versions[0].values()])
    flat_dst = torch.empty_like(flat_src)
    server, url = _engine(ckpt)
    times: dict[str, list[float]] = {"memcpy": [], "distributed": [], "disk": []}
    version = 0
    try:
        server.start()
        with EngineClient(url, timeout_s=600) as client:
            for rep in range(reps + 1):  # the first round warms up and is dropped
                for mode in ("memcpy", "distributed", "disk"):
                    t0 = time.perf_counter()
                    if mode == "memcpy":
                        flat_dst.copy_(flat_src)
                    else:
                        version += 1
                        w = versions[version % 2]
                        if mode == "distributed":
                            push_distributed(
                                [client], list(w.items()), weight_version=version,
                                bucket_bytes=64 * 2**20, timeout_s=600,
                            )  # fmt: skip
                        else:
                            out = ckpt.parent / f"update-{version}"
                            out.mkdir()
                            (out / "config.json").write_bytes((ckpt / "config.json").read_bytes())
                            with open(out / "model.safetensors", "wb") as f:
                                write_safetensors(f, w)
                            client.post(
                                "/update_weights_from_disk",
                                {"model_path": str(out), "weight_version": str(version)},
                            )
                    dt = time.perf_counter() - t0
                    if mode != "memcpy":
                        got = httpx.get(f"{url}/weights_checksum", timeout=120).json()["sha256"]
                        assert got == shas[version % 2], f"{mode}: engine checksum mismatch"
                    if rep:
                        times[mode].append(dt)
    finally:
        server.stop()
    gbps = {m: nbytes / statistics.median(t) / 1e9 for m, t in times.items()}
    return {
        "payload_bytes": nbytes,
        "bucket_bytes": 64 * 2**20,
        "reps": reps,
        "GB_per_s": gbps,
        "distributed_over_memcpy": gbps["distributed"] / gbps["memcpy"],
        "disk_over_memcpy": gbps["disk"] / gbps["memcpy"],
        "distributed_over_disk": gbps["distributed"] / gbps["disk"],
        "checksums_verified": True,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--payload-mb", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    if a.quick:
        a.requests, a.concurrency, a.payload_mb, a.reps = 8, 4, 16, 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        result = {
            "machine": "2-core CPU sandbox",
            "date": time.strftime("%Y-%m-%d"),
            "throughput": bench_throughput(Path(d), a.requests, a.concurrency, a.reps),
            "weight_update": bench_weight_update(Path(d), a.payload_mb, a.reps),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
