"""One GRPO step's rollouts: per-sample sessions vs a group request vs a group with ``n``, on the
real stack.

The default ``posttrain grpo`` stack (2 local engines behind sgl-router and the session router,
the recipe's policy, one torch thread per process) is started once, plus a second session router
on the same sgl-router with ``--no-parallel-sampling``; then, interleaved, each ``--reps`` times:

* **per sample** (the loop before issue 38): a new event loop and a new ``SessionRolloutClient``
  per step, and per sample its own create / chat turn / collect / delete (4 HTTP requests per
  sample, 256 per step of 8 prompts x 8 samples), at most 32 sessions in flight;
* **group**: ``Rollouts``, one client and loop kept across steps, one ``POST /rollouts`` per
  prompt carrying its n seeds (8 requests per step), all at once; the session router (without
  ``--parallel-sampling``) sends one engine ``/generate`` per sample;
* **group n** (the loop now): the same, to the stack's session router, whose
  ``--parallel-sampling`` sends each group as ONE engine ``/generate`` with
  ``sampling_params.n`` (8 engine requests per step).

All three draw the same step's samples with the same per-sample seeds (base + j), so the script
also checks that they give identical token ids and logprobs, sample for sample. Reported per
path: the step's wall time and this process's CPU time (the trainer rank 0's share of a
rollout), medians over the reps, with the load average before each rep (the machine is shared).
Command::

    uv run python packages/grpo/benchmarks/bench_rollout_requests.py --reps 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from posttrain.grpo.recipe import RECIPE, cache_dir, prepare
from posttrain.grpo.rewards import Prompt, PromptStream, addition_prompts
from posttrain.grpo.rollout import Rollouts, RolloutSettings, _placed, _sampling_params
from posttrain.interface import Sample
from posttrain.interface.processes import free_ports
from posttrain.launch.runners import LocalRunner
from posttrain.launch.stack import LocalStackConfig, build_local_stack
from posttrain.session_router import SessionRolloutClient


async def per_sample(
    settings: RolloutSettings, prompts: Sequence[Prompt], step: int
) -> list[Sample]:
    """The pre-issue-38 rollout: a session (4 requests) per sample, a client per step."""
    async with SessionRolloutClient(settings.url, timeout_s=settings.timeout_s,
                                    max_concurrency=32) as client:  # fmt: skip

        async def one(prompt: Prompt, g: int, j: int) -> Sample:
            out = await client.rollout(
                prompt.messages, sampling_params=_sampling_params(settings, step, prompt, j),
                metadata={**prompt.metadata, "prompt_index": prompt.index},
            )  # fmt: skip
            return _placed(out, settings, g, j)

        jobs = [one(p, g, j) for g, p in enumerate(prompts)
                for j in range(settings.samples_per_prompt)]  # fmt: skip
        return list(await asyncio.gather(*jobs))


def _same(a: Sequence[Sample], b: Sequence[Sample]) -> bool:
    return all(
        (x.prompt_ids, x.response_ids, x.rollout_logprobs, x.loss_mask)
        == (y.prompt_ids, y.response_ids, y.rollout_logprobs, y.loss_mask)
        for x, y in zip(a, b, strict=True)
    )


def _timed(fn: Callable[[], list[Sample]]) -> tuple[list[Sample], float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _session_router(router_url: str, tokenizer: str) -> tuple[subprocess.Popen[bytes], str]:
    """A second session router on ``router_url``, one engine request per sample; its URL."""
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain.session_router", "--upstream", router_url,
         "--tokenizer", tokenizer, "--host", "127.0.0.1", "--port", str(port),
         "--no-parallel-sampling"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the second session router on {url} did not become healthy")


PATHS = ("per_sample", "group", "group_n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    recipe = prepare(cache_dir(), 0)
    plan = build_local_stack(LocalStackConfig(model_path=str(recipe["policy"]),
                                              engines=args.engines, ready_timeout_s=300.0))  # fmt: skip
    stream = PromptStream(addition_prompts(), seed=1)
    rows: list[dict[str, float]] = []
    with LocalRunner(plan, sink=lambda name, line: None,
                     base_env={**os.environ, "OMP_NUM_THREADS": "1"}) as runner:  # fmt: skip
        runner.start()
        plain, plain_url = _session_router(runner.urls["router"], str(recipe["policy"]))
        try:
            settings = RolloutSettings(
                url=runner.urls["session-router"],
                samples_per_prompt=int(RECIPE["samples_per_prompt"]),
                max_new_tokens=int(RECIPE["max_new_tokens"]),
                temperature=float(RECIPE["temperature"]), seed=1, timeout_s=120.0,
            )  # fmt: skip
            per_request = dataclasses.replace(settings, url=plain_url)
            with Rollouts() as with_n, Rollouts() as without_n:
                for step in range(args.reps + 1):  # step 0 warms every path up, not reported
                    prompts = stream.take(int(RECIPE["prompts_per_step"]))
                    load = os.getloadavg()[0]
                    runs = {
                        "per_sample": functools.partial(
                            asyncio.run, per_sample(per_request, prompts, step)
                        ),
                        "group": functools.partial(without_n.run, per_request, prompts, step=step),
                        "group_n": functools.partial(with_n.run, settings, prompts, step=step),
                    }
                    row: dict[str, float] = {"step": step, "load1": load}
                    drawn = {}
                    for name, fn in runs.items():
                        drawn[name], row[f"{name}_wall_s"], row[f"{name}_cpu_s"] = _timed(fn)
                    for name in PATHS[1:]:
                        if not _same(drawn["per_sample"], drawn[name]):
                            raise SystemExit(f"step {step}: {name} drew other samples")
                    print(json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
                    if step:
                        rows.append(row)
        finally:
            plain.terminate()
            plain.wait(timeout=30)
    summary = {
        f"{p}_{k}": statistics.median(r[f"{p}_{k}"] for r in rows)
        for p in PATHS
        for k in ("wall_s", "cpu_s")
    }
    summary["load1_min"] = min(r["load1"] for r in rows)
    summary["load1_max"] = max(r["load1"] for r in rows)
    summary["samples_identical"] = 1.0
    print(
        "median over", len(rows), "steps:", json.dumps({k: round(v, 4) for k, v in summary.items()})
    )
    if args.out is not None:
        args.out.write_text(json.dumps({"steps": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
