"""One GRPO step's rollouts, per-sample sessions vs one group request per prompt, on the real stack.

The default ``posttrain grpo`` stack (2 local engines behind sgl-router and the session router,
the recipe's policy, one torch thread per process) is started once; then, interleaved, each
``--reps`` times:

* **per sample** (the loop before issue 38): a new event loop and a new ``SessionRolloutClient``
  per step, and per sample its own create / chat turn / collect / delete (4 HTTP requests per
  sample, 256 per step of 8 prompts x 8 samples), at most 32 sessions in flight;
* **group** (the loop now): ``Rollouts``, one client and loop kept across steps, one
  ``POST /rollouts`` per prompt carrying its n seeds (8 requests per step), all at once.

Both draw the same step's samples with the same per-sample seeds, so the script also checks
that the two give identical token ids and logprobs, sample for sample. Reported per path: the
step's wall time and this process's CPU time (the trainer rank 0's share of a rollout), medians
over the reps, with the load average before each rep (the machine is shared). Command::

    uv run python packages/grpo/benchmarks/bench_rollout_requests.py --reps 8
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from posttrain.grpo.recipe import RECIPE, cache_dir, prepare
from posttrain.grpo.rewards import Prompt, PromptStream, addition_prompts
from posttrain.grpo.rollout import Rollouts, RolloutSettings, _placed, _sampling_params
from posttrain.interface import Sample
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
        settings = RolloutSettings(
            url=runner.urls["session-router"],
            samples_per_prompt=int(RECIPE["samples_per_prompt"]),
            max_new_tokens=int(RECIPE["max_new_tokens"]), temperature=float(RECIPE["temperature"]),
            seed=1, timeout_s=120.0,
        )  # fmt: skip
        with Rollouts() as rollouts:
            for step in range(args.reps + 1):  # step 0 warms both paths up, not reported
                prompts = stream.take(int(RECIPE["prompts_per_step"]))
                load = os.getloadavg()[0]
                old, old_wall, old_cpu = _timed(
                    functools.partial(asyncio.run, per_sample(settings, prompts, step))
                )
                new, new_wall, new_cpu = _timed(
                    functools.partial(rollouts.run, settings, prompts, step=step)
                )
                if not _same(old, new):
                    raise SystemExit(f"step {step}: the two paths drew different samples")
                row = {"step": step, "load1": load, "per_sample_wall_s": old_wall,
                       "per_sample_cpu_s": old_cpu, "group_wall_s": new_wall,
                       "group_cpu_s": new_cpu}  # fmt: skip
                print(json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
                if step:
                    rows.append(row)
    summary = {
        k: statistics.median(r[k] for r in rows)
        for k in ("per_sample_wall_s", "per_sample_cpu_s", "group_wall_s", "group_cpu_s")
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
