"""Where a default step's non-train time goes, on the real stack: the rollout's hops and the
adapter push, for each engine count, interleaved.

For each ``--engines`` count (default ``1,2``) the default ``posttrain grpo`` stack is started
(local engines with LoRA on behind sgl-router and the session router with
``--parallel-sampling``, the recipe's policy, one torch thread per process), all of them up at
once; then, ``--reps`` times, on each stack in turn:

* **push**: the recipe's LoRA adapter (its shapes and targets, r 8, fp32) to every engine, the
  way ``EngineFleet`` pushes it (``AdapterClient.push``: unload, load from tensors with sha256
  checksums), engine after engine;
* **session**: one step's rollout as the loop makes it (``Rollouts``: one ``POST /rollouts``
  per prompt, 8 prompts x 8 samples, 4 new tokens, with the adapter);
* **router**: the same 8 groups as 8 ``/generate`` bodies with ``sampling_params.n`` straight
  to sgl-router (the body the session router sends: the same prompt ids, seeds, adapter
  fields), skipping the session router;
* **engine**: the same 8 bodies straight to the engines (group g to engine g mod E), skipping
  both routers; ``engine_e2e`` is the longest ``meta_info.e2e_latency`` the engines report for
  them (time inside the engine's handler: queueing, prefill, decode).

With ``--baseline-src DIR`` (a checkout of another commit, e.g. ``git archive COMMIT | tar -x
-C DIR``) every engine count also gets a stack whose processes run DIR's packages (its
``packages/*/src`` first on ``PYTHONPATH``), labelled ``E-base``: before and after side by
side, in the same reps.

So ``session - router`` is the session router's hop (sessions, template, records, assembly,
samples/1 encoding, the trainer's client), ``router - engine`` sgl-router's, ``engine -
engine_e2e`` the engines' HTTP and JSON. The three paths must draw the same tokens, and every
stack the same samples (the script checks both). Medians over the reps, the load average
before each rep (the machine is shared). Commands::

    uv run python packages/grpo/benchmarks/bench_step_overhead.py --reps 10
    mkdir /tmp/base && git archive 7dfd741 | tar -x -C /tmp/base
    uv run python packages/grpo/benchmarks/bench_step_overhead.py --reps 12 --baseline-src /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import torch

from posttrain.grpo.recipe import RECIPE, cache_dir, prepare
from posttrain.grpo.rewards import Prompt, PromptStream, addition_prompts
from posttrain.grpo.rollout import Rollouts, RolloutSettings, group_seed
from posttrain.launch.runners import LocalRunner
from posttrain.launch.stack import LocalStackConfig, build_local_stack, policy_engine_names
from posttrain.lora import AdapterClient
from posttrain.models import load_pretrained
from posttrain.session_router import (
    ROUTING_KEY_HEADER,
    ChatTokenizer,
    SessionRouterConfig,
    build_generate_body,
)

ADAPTER = "policy"


def adapter(policy: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA adapter with the recipe's targets on ``policy`` (routed experts are no LoRA sites)."""
    r, targets = int(RECIPE["lora_r"]), tuple(RECIPE["lora_targets"])
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for module, (fan_in, fan_out) in load_pretrained(policy).lora_targets().items():
        if module.rsplit(".", 1)[-1] in targets and ".experts." not in module:
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * 0.01
    config = {"peft_type": "LORA", "r": r, "lora_alpha": float(RECIPE["lora_alpha"]),
              "bias": "none", "target_modules": sorted(targets)}  # fmt: skip
    return tensors, config


def bodies(
    tok: ChatTokenizer, prompts: Sequence[Prompt], step: int, version: int, adapter: str | None
) -> list[dict[str, Any]]:
    """The ``/generate`` body the session router sends for each prompt's group (``n``)."""
    cfg = SessionRouterConfig(upstream_url="http://127.0.0.1:9", tokenizer="unused",
                              lora_adapter=adapter, parallel_sampling=True)  # fmt: skip
    n = int(RECIPE["samples_per_prompt"])
    out = []
    for p in prompts:
        ids = tok.encode(tok.render(list(p.messages), add_generation_prompt=True))
        turn = {"max_tokens": int(RECIPE["max_new_tokens"]), "logprobs": True,
                "temperature": float(RECIPE["temperature"]), "seed": group_seed(1, step, p.index)}  # fmt: skip
        body = build_generate_body(turn, cfg, ids, weight_version=version if adapter else None)
        body["sampling_params"]["n"] = n
        out.append(body)
    return out


async def post_all(
    http: httpx.AsyncClient, urls: Sequence[str], groups: Sequence[dict[str, Any]]
) -> list[list[dict[str, Any]]]:
    async def one(g: int, body: dict[str, Any]) -> list[dict[str, Any]]:
        reply = await http.post(f"{urls[g % len(urls)]}/generate", json=body,
                                headers={ROUTING_KEY_HEADER: uuid.uuid4().hex})  # fmt: skip
        reply.raise_for_status()
        items: list[dict[str, Any]] = reply.json()
        return items

    return list(await asyncio.gather(*(one(g, b) for g, b in enumerate(groups))))


def tokens(groups: Sequence[Sequence[dict[str, Any]]]) -> list[list[int]]:
    return [[int(e[1]) for e in item["meta_info"]["output_token_logprobs"]]
            for items in groups for item in items]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--engines", default="1,2", help="engine counts, comma-separated")
    ap.add_argument(
        "--train",
        choices=("lora", "full"),
        default="lora",
        help="full: the engines serve no adapter and nothing is pushed (push_s 0)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="another commit's checkout: its stacks run beside this one's")  # fmt: skip
    args = ap.parse_args(argv)
    served = ADAPTER if args.train == "lora" else None
    counts = [int(x) for x in args.engines.split(",")]
    labels = [(str(e), e, None) for e in counts]
    if args.baseline_src is not None:
        src = os.pathsep.join(str(p) for p in sorted(args.baseline_src.glob("packages/*/src")))
        labels += [(f"{e}-base", e, src) for e in counts]
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    recipe = prepare(cache_dir(), 0)
    policy = str(recipe["policy"])
    tok = ChatTokenizer.from_dir(policy)
    tensors, config = adapter(policy)
    stream = PromptStream(addition_prompts(), seed=1)
    rows: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    http = httpx.AsyncClient(timeout=120.0)
    with ExitStack() as scope:
        stacks = {}
        for label, e, src in labels:
            plan = build_local_stack(LocalStackConfig(model_path=policy, engines=e,
                                                      lora_adapter=served, ready_timeout_s=300.0))  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if src is not None:
                env["PYTHONPATH"] = src
            runner = scope.enter_context(
                LocalRunner(plan, sink=lambda name, line: None, base_env=env)
            )
            runner.start()
            urls = [runner.urls[n] for n in policy_engine_names(plan)]
            clients = [scope.enter_context(AdapterClient(u)) for u in urls]
            rollouts = scope.enter_context(Rollouts())
            stacks[label] = (runner, urls, clients, rollouts)
        for step in range(args.reps + 1):  # step 0 warms every path up, not reported
            prompts = stream.take(int(RECIPE["prompts_per_step"]))
            version = step + 1
            groups = bodies(tok, prompts, step, version, served)
            reference: list[list[int]] | None = None  # every stack draws the same samples
            for label, (runner, urls, clients, rollouts) in stacks.items():
                row: dict[str, Any] = {"stack": label, "step": step, "load1": os.getloadavg()[0]}
                t0 = time.perf_counter()
                for client in clients if served else ():
                    client.push(ADAPTER, tensors, config)
                row["push_s"] = time.perf_counter() - t0
                settings = RolloutSettings(
                    url=runner.urls["session-router"],
                    samples_per_prompt=int(RECIPE["samples_per_prompt"]),
                    max_new_tokens=int(RECIPE["max_new_tokens"]),
                    temperature=float(RECIPE["temperature"]), seed=1, timeout_s=120.0,
                    weight_version=version if served else None,
                )  # fmt: skip
                t0 = time.perf_counter()
                samples = rollouts.run(settings, prompts, step=step)
                row["session_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                via_router = loop.run_until_complete(
                    post_all(http, [runner.urls["router"]], groups)
                )
                row["router_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                direct = loop.run_until_complete(post_all(http, urls, groups))
                row["engine_s"] = time.perf_counter() - t0
                row["engine_e2e_s"] = max(float(i["meta_info"]["e2e_latency"])
                                          for items in direct for i in items)  # fmt: skip
                drawn = [list(s.response_ids) for s in samples]
                if not drawn == tokens(via_router) == tokens(direct):
                    raise SystemExit(f"step {step}, stack {label}: the paths drew other tokens")
                if reference is not None and drawn != reference:
                    raise SystemExit(f"step {step}, stack {label}: other samples than the first")
                reference = drawn
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)  # fmt: skip
                if step:
                    rows.append(row)
    loop.run_until_complete(http.aclose())
    loop.close()
    keys = ("push_s", "session_s", "router_s", "engine_s", "engine_e2e_s", "load1")
    summary = {
        label: {k: round(statistics.median(r[k] for r in rows if r["stack"] == label), 4)
                for k in keys}
        for label, _, _ in labels
    }  # fmt: skip
    for label, _, _ in labels:
        summary[label]["reps"] = sum(r["stack"] == label for r in rows)
    print("medians over", args.reps, "reps:", json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
