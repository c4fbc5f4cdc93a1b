"""Benchmark: engine decode throughput (generated tokens/s) on the GRPO recipe model.

Run from the repository root:

    uv run python packages/local-engine/benchmarks/bench_decode_batch.py [--quick]

The load is one GRPO rollout step of the embedded recipe: 8 chat prompts ("a+b=", rendered
with the local tokenizer's chat template) x 8 samples = 64 concurrent samples, temperature 1,
``--new-tokens`` new tokens each (the recipe's 4 by default; EOS ignored so every sample
decodes the same count), ``return_logprob`` on, strict numerics, one torch thread (as the
stack runs). The model is the recipe's decoder config (``posttrain.grpo.recipe.model_config``:
``ModelConfig.tiny(vocab_size=VOCAB_SIZE, max_position_embeddings=64)``, fp32), randomly
initialised: decode cost does not depend on the weights' values.

Part 1 (``engine``) times ``Engine.run_batch`` in this process: the 64 samples in batches of
``--max-running-requests`` (8, the old default) and all 64 in one batch.

Part 2 (``http``) starts one engine process per configuration on the same checkpoint (with
``--baseline COMMIT``, also that commit's engine code, so before and after run side by side) and
sends the step over real HTTP on loopback, the configurations interleaved, ``--reps``
times; the median wall time of a step gives tokens/s. Loads: ``per-sample`` (64 concurrent
``/generate`` requests, one per sample, each with its own ``sampling_seed``: what the rollout
sends today) and ``n`` (8 concurrent requests with ``sampling_params.n = 8``: one request
per prompt; an engine that refuses ``n`` is skipped for it).

The JSON goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from posttrain.interface.testing import ServerProcess, free_port
from posttrain.local_engine._engine import Engine, GenTask
from posttrain.local_engine._sampling import SamplingConfig
from posttrain.models import VOCAB_SIZE, ModelConfig, build_model, build_tokenizer

PROMPTS = 8
SAMPLES = 8


def recipe_config() -> ModelConfig:
    """The recipe's decoder config (the same call as ``posttrain.grpo.recipe.model_config``)."""
    return ModelConfig.tiny(vocab_size=VOCAB_SIZE, max_position_embeddings=64)


def recipe_prompts() -> list[list[int]]:
    """Eight chat prompts of the addition task, tokenized as the session router renders them."""
    tok = build_tokenizer()
    out = []
    for i in range(PROMPTS):
        messages = [{"role": "user", "content": f"{i}+{(3 * i + 1) % (10 - i)}="}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tok.encode(str(text), add_special_tokens=False)))
    return out


def bench_engine(prompts: list[list[int]], new_tokens: int, reps: int) -> dict[str, Any]:
    model = build_model(recipe_config(), seed=0)
    engine = Engine(model, eos_token_ids=[3])

    def tasks() -> list[GenTask]:
        return [
            GenTask(
                input_ids=prompts[i // SAMPLES],
                max_new_tokens=new_tokens,
                sampling=SamplingConfig(),
                seed=i,
                ignore_eos=True,
                return_logprob=True,
            )
            for i in range(PROMPTS * SAMPLES)
        ]

    sizes = (8, PROMPTS * SAMPLES)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    cpu: dict[int, list[float]] = {b: [] for b in sizes}  # this process's CPU: robust under load
    outputs: dict[int, list[list[int]]] = {}
    engine.run_batch(tasks()[:8])  # warm-up
    for _ in range(reps):
        for b in sizes:
            ts = tasks()
            t0, c0 = time.perf_counter(), time.process_time()
            res = [r for k in range(0, len(ts), b) for r in engine.run_batch(ts[k : k + b])]
            times[b].append(time.perf_counter() - t0)
            cpu[b].append(time.process_time() - c0)
            outputs[b] = [r.output_ids for r in res]
    assert outputs[8] == outputs[PROMPTS * SAMPLES], "batch size changed a sample's tokens"
    tokens = PROMPTS * SAMPLES * new_tokens
    out: dict[str, Any] = {}
    for b, ts_ in times.items():
        wall = statistics.median(ts_)
        out[f"batch{b}"] = {"tokens_per_s": tokens / wall, "median_wall_s": wall,
                            "median_cpu_s": statistics.median(cpu[b])}  # fmt: skip
    out["batch64_over_batch8"] = out["batch8"]["median_wall_s"] / out["batch64"]["median_wall_s"]
    return out


BASELINE = "baseline"


def _engine_process(
    ckpt: Path, flags: list[str], src: str | None = None
) -> tuple[ServerProcess, str]:
    """An engine process; with ``src`` (a ``src`` directory holding another commit's
    ``posttrain/local_engine``), that engine's code, first on ``PYTHONPATH``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(ckpt),
            "--port", str(port), "--num-threads", "1", *flags]  # fmt: skip
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH")) if x)
    return ServerProcess(argv, f"{url}/health", timeout_s=180, env=env), url


async def _step(
    client: httpx.AsyncClient, prompts: list[list[int]], new_tokens: int, load: str, seed: int
) -> int:
    """One rollout step's requests, all concurrent; returns the generated token count."""

    def body(ids: list[int], s: int, n: int) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": new_tokens, "ignore_eos": True,
                              "sampling_seed": s}  # fmt: skip
        if n > 1:
            sp["n"] = n
        return {"input_ids": ids, "sampling_params": sp, "return_logprob": True}

    if load == "per-sample":
        bodies = [
            body(p, seed + i * SAMPLES + j, 1)
            for i, p in enumerate(prompts)
            for j in range(SAMPLES)
        ]
    else:
        bodies = [body(p, seed + i * SAMPLES, SAMPLES) for i, p in enumerate(prompts)]

    async def one(b: dict[str, Any]) -> int:
        r = await client.post("/generate", json=b)
        r.raise_for_status()
        items = r.json()
        items = items if isinstance(items, list) else [items]
        return sum(int(x["meta_info"]["completion_tokens"]) for x in items)

    return sum(await asyncio.gather(*(one(b) for b in bodies)))


async def _forward_passes(client: httpx.AsyncClient) -> int | None:
    """The engine's model calls so far (``internal_states``; None on an engine without it)."""
    state = (await client.get("/server_info")).json()["internal_states"][0]
    value = state.get("forward_passes")
    return None if value is None else int(value)


async def _supports_n(client: httpx.AsyncClient, prompt: list[int]) -> bool:
    r = await client.post(
        "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "n": 2}},
    )
    return r.status_code == 200


def bench_http(
    tmp: Path,
    prompts: list[list[int]],
    new_tokens: int,
    reps: int,
    configs: dict[str, list[str]],
    baseline_src: str | None = None,
) -> dict[str, Any]:
    ckpt = tmp / "recipe-model"
    build_model(recipe_config(), seed=0).save_pretrained(ckpt, tokenizer=build_tokenizer())
    servers = {
        name: _engine_process(ckpt, flags, baseline_src if name == BASELINE else None)
        for name, flags in configs.items()
    }
    loads = ("per-sample", "n")
    times: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], int] = {}
    passes: dict[tuple[str, str], list[int]] = {}

    async def run_all() -> None:
        # A client per step: an idle keep-alive connection to one engine may be closed by its
        # server while the other engine runs, and a step must not pay for that race.
        limits = httpx.Limits(max_connections=PROMPTS * SAMPLES)

        def client(url: str) -> httpx.AsyncClient:
            return httpx.AsyncClient(base_url=url, timeout=300, limits=limits)

        usable = {(name, "per-sample") for name in servers}
        for name, (_, url) in servers.items():
            async with client(url) as c:
                if await _supports_n(c, prompts[0]):
                    usable.add((name, "n"))
                await _step(c, prompts, new_tokens, "per-sample", 10**6)  # warm-up
        for rep in range(reps):
            for load in loads:
                for name, (_, url) in servers.items():
                    if (name, load) not in usable:
                        continue
                    async with client(url) as c:
                        before = await _forward_passes(c)
                        t0 = time.perf_counter()
                        got = await _step(c, prompts, new_tokens, load, rep * 1000)
                        times.setdefault((name, load), []).append(time.perf_counter() - t0)
                        after = await _forward_passes(c)
                    tokens[(name, load)] = got
                    if before is not None and after is not None:
                        passes.setdefault((name, load), []).append(after - before)

    try:
        for s, _ in servers.values():
            s.start()
        asyncio.run(run_all())
    finally:
        for s, _ in servers.values():
            s.stop()
    out: dict[str, Any] = {"configs": configs}
    for (name, load), ts in times.items():
        wall = statistics.median(ts)
        out[f"{name}/{load}"] = {
            "tokens_per_s": tokens[(name, load)] / wall,
            "median_step_s": wall,
            "tokens": tokens[(name, load)],
            "forward_passes_per_step": passes.get((name, load)),
        }
    return out


def _extract_engine_src(commit: str, dest: Path) -> str:
    """``packages/local-engine/src`` of ``commit`` under ``dest``; returns the src path."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", commit, "packages/local-engine/src"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return str(dest / "packages" / "local-engine" / "src")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one rep (a smoke run)")
    p.add_argument("--new-tokens", type=int, default=4, help="new tokens per sample (recipe: 4)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="NAME=FLAGS",
        help="an engine configuration to time over HTTP, e.g. 'old=--max-running-requests 8' "
        "(repeatable; default: old=--max-running-requests 8 and default=(no flags))",
    )
    p.add_argument("--skip-http", action="store_true", help="Part 1 only")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="COMMIT",
        help="also time, over HTTP and interleaved with the others, the engine code of COMMIT "
        "(its packages/local-engine/src, extracted with git archive; default flags), as the "
        "configuration 'baseline': before and after in one run",
    )
    a = p.parse_args()
    if a.quick:
        a.reps = 1
    configs = {"old": ["--max-running-requests", "8"], "default": []}
    if a.config:
        configs = {}
        for c in a.config:
            name, _, flags = c.partition("=")
            configs[name] = flags.split()
    torch.set_num_threads(1)
    prompts = recipe_prompts()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "samples": PROMPTS * SAMPLES,
        "prompt_tokens": [len(x) for x in prompts],
        "new_tokens": a.new_tokens,
        "reps": a.reps,
        "engine": bench_engine(prompts, a.new_tokens, a.reps),
    }
    if not a.skip_http:
        with tempfile.TemporaryDirectory() as d:
            src = None
            if a.baseline:
                src = _extract_engine_src(a.baseline, Path(d) / "baseline")
                configs = {BASELINE: [], **configs}
                result["baseline_commit"] = a.baseline
            result["http"] = bench_http(Path(d), prompts, a.new_tokens, a.reps, configs, src)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
