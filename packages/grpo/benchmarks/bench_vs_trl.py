"""GRPO side by side with TRL's ``GRPOTrainer`` on the embedded recipe's model, task and reward.

What it measures (CPU by default; docs/benchmarks/grpo.md, "GRPO side by side with TRL"):

1. **Load check.** ``transformers`` loads the recipe's policy checkpoint (our ``posttrain.models``
   checkpoint in the HF Qwen3-MoE layout) with no missing, unexpected or mismatched keys, and
   its per-token logprobs on a few chat sequences match ours (strict and fast numerics): the
   max abs difference is printed.
2. **Runs, interleaved.** For each run seed: ``posttrain grpo --train full`` (the embedded CPU
   default otherwise: its local engines, 1 below 4 cores and 2 from 4, behind sgl-router and
   the session router, 2 gloo trainer ranks), then TRL's ``GRPOTrainer`` on the same checkpoint, each as its own process, one
   after the other (ours, TRL, ours, TRL, ...). Both sides get the same prompts in the same
   order (our ``PromptStream`` at the run seed), the same number of samples per prompt, max new
   tokens, temperature, learning rate and AdamW settings, gradient clipping, PPO clip range and
   loss aggregation, and the same reward (our ``addition`` task's ``RewardFunction``, wrapped
   for TRL's reward-function signature). Every setting that must match is in ``matched_settings``.
3. **Report.** Per run: median wall time per step (the first step of each side is left out as
   warm-up), ours / TRL; the mean training reward over the last ``--reward-window`` steps (equal
   sample counts: both sides draw ``prompts x samples`` per step) and its difference; the whole
   process's wall time. ``--out`` gets ``results.json`` with every step of every run.

Needs TRL, which is in the ``bench-trl`` dependency group (CI never installs it)::

    uv run --group bench-trl python packages/grpo/benchmarks/bench_vs_trl.py   # --trl-threads 1 by default

The TRL side runs in a child process of this script (``--side trl``), so neither side's
imports, threads or allocator state leak into the other's timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.recipe import RECIPE, cache_dir, prepare
from posttrain.grpo.rewards import Prompt, PromptStream, addition_prompts, build_task
from posttrain.interface import Sample

RECIPE_SEED = 0  # the recipe's checkpoints (warm-up seed); the run seeds vary the rollouts only


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSettings:
    """What both sides are run with (``matched_settings`` maps each to TRL's name)."""

    steps: int
    prompts_per_step: int = int(RECIPE["prompts_per_step"])
    samples_per_prompt: int = int(RECIPE["samples_per_prompt"])
    max_new_tokens: int = int(RECIPE["max_new_tokens"])
    temperature: float = float(RECIPE["temperature"])
    lr: float = float(RECIPE["full_lr"])  # `posttrain grpo --train full` trains with full_lr
    max_grad_norm: float = float(RECIPE["max_grad_norm"])
    weight_decay: float = GrpoConfig().weight_decay
    clip: float = GrpoConfig().clip_low


def matched_settings(s: BenchSettings) -> list[tuple[str, str, str]]:
    """(setting, ours, TRL) for every setting the two runs must share."""
    ours = GrpoConfig()
    return [
        ("policy", "recipe policy, full-parameter training", "same checkpoint via transformers"),
        ("prompts per step", str(s.prompts_per_step), "generation_batch_size / num_generations"),
        ("samples per prompt", str(s.samples_per_prompt), "num_generations"),
        ("max new tokens", str(s.max_new_tokens), "max_completion_length"),
        (
            "temperature / top-p / top-k",
            f"{s.temperature} / 1 / off",
            "temperature, top_p=1, top_k=0",
        ),
        ("optimizer", f"torch AdamW lr {s.lr}, wd {s.weight_decay}", "adamw_torch, same lr, wd"),
        ("lr schedule", "constant, no warm-up", "lr_scheduler_type=constant, warmup 0"),
        ("grad clip", str(s.max_grad_norm), "max_grad_norm"),
        ("optimizer steps per batch", "1", "num_iterations=1, generation_batch_size = batch"),
        ("PPO clip", f"[1-{s.clip}, 1+{s.clip}]", "epsilon=epsilon_high"),
        ("loss aggregation", ours.loss_aggregation, "loss_type=grpo"),
        ("KL to reference", f"off (kl_coef {ours.kl_coef})", "beta=0"),
        ("advantages", "group mean, / (unbiased std + eps)", "scale_rewards=group"),
        ("MoE aux loss", "none", "router_aux_loss_coef=0"),
        ("precision", "fp32", "bf16=False, fp32 weights"),
        ("rollout engine", "local engines (no vLLM)", "use_vllm=False (model.generate)"),
    ]


# --------------------------------------------------------------------------- load check


def load_check(policy: Path, prompts: Sequence[Prompt], count: int = 8) -> dict[str, Any]:
    """Load ``policy`` with transformers; compare its logprobs with ours on ``count`` sequences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models import Numerics, load_pretrained

    hf, info = AutoModelForCausalLM.from_pretrained(
        str(policy), output_loading_info=True, dtype=torch.float32
    )
    hf.eval()
    tok = AutoTokenizer.from_pretrained(str(policy))
    sequences: list[list[int]] = []
    for prompt in prompts[:count]:
        text = tok.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, tokenize=False
        )
        answer = f"{prompt.metadata['answer']}{tok.eos_token}"
        sequences.append(list(tok.encode(str(text) + answer, add_special_tokens=False)))
    with torch.no_grad():
        reference = []
        for ids in sequences:
            logits = hf(torch.tensor([ids])).logits[0].float()
            picked = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            reference.append(picked)
        diffs: dict[str, float] = {}
        for numerics in (Numerics.STRICT, Numerics.FAST):
            ours = load_pretrained(policy, numerics=numerics)
            packed = torch.tensor([t for ids in sequences for t in ids])
            lp = ours.forward_logprobs(packed, [len(ids) for ids in sequences])
            worst = 0.0
            start = 0
            for ids, ref in zip(sequences, reference, strict=True):
                mine = lp[start + 1 : start + len(ids)]  # position 0 of a segment holds no logprob
                worst = max(worst, float((mine - ref).abs().max()))
                start += len(ids)
            diffs[numerics.value] = worst
    return {
        "model_class": type(hf).__name__,
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "mismatched_keys": sorted(str(k) for k in info["mismatched_keys"]),
        "sequences": len(sequences),
        "tokens": sum(len(ids) - 1 for ids in sequences),
        "max_abs_logprob_diff": diffs,
    }


# --------------------------------------------------------------------------- our side


def run_ours(s: BenchSettings, seed: int, out: Path, extra: Sequence[str] = ()) -> dict[str, Any]:
    """``posttrain grpo --train full`` for ``s.steps`` steps; per-step times and rewards.

    ``extra``: more trainer flags (e.g. ``--off-policy-overlap --tis tis``), after the seed."""
    argv = [
        sys.executable, "-m", "posttrain.launch", "grpo", "--train", "full",
        "--steps", str(s.steps), "--seed", str(RECIPE_SEED), "--out", str(out),
        # The recipe's settings already are ``s``; the run seed goes to the trainer (last wins).
        "--", "--seed", str(seed), *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "argv": argv[1:],
        "process_wall_s": wall,
        "step_s": [float(r["time/step"]) for r in records],
        "rollout_s": [float(r["time/rollout"]) for r in records],
        "train_s": [float(r["time/train"]) for r in records],
        "sync_s": [float(r["time/sync"]) for r in records],
        "reward": [float(r["reward_mean"]) for r in records],
        "samples_per_step": [int(r["samples"]) for r in records],
        "train_rollout_logprob_max_abs_diff": max(
            float(r["train_rollout_logprob_max_abs_diff"]) for r in records
        ),
    }


# --------------------------------------------------------------------------- TRL side


def trl_child(s: BenchSettings, seed: int, result: Path, work: Path, threads: int = 0) -> None:
    """Run TRL's GRPOTrainer in this process; write its per-step times and rewards to ``result``.

    ``threads``: torch's intra-op threads here (0: torch's default, one per core).
    """
    if threads:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    policy = Path(prepare(cache_dir(), RECIPE_SEED)["policy"])
    tok = AutoTokenizer.from_pretrained(str(policy))

    def decode(ids: Sequence[int]) -> str:  # what `posttrain grpo`'s reward decodes with
        return str(tok.decode(list(ids), skip_special_tokens=True))

    task = build_task("addition", decode)
    prompts = PromptStream(task.prompts, seed=seed).take(s.steps * s.prompts_per_step)
    rows = [{"prompt": list(p.messages), "answer": p.metadata["answer"]} for p in prompts]

    def addition_reward(
        prompts: list[Any], completion_ids: list[list[int]], answer: list[str], **_: Any
    ) -> list[float]:
        """Our task's RewardFunction on each completion, as a TRL reward function."""
        scores = []
        for i, (messages, ids, expected) in enumerate(
            zip(prompts, completion_ids, answer, strict=True)
        ):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_ids = list(tok.encode(str(text), add_special_tokens=False))
            sample = Sample(
                prompt_ids=prompt_ids, response_ids=list(ids),
                rollout_logprobs=[0.0] * len(ids), loss_mask=[1] * len(ids),
                metadata={"answer": expected}, index=i,
            )  # fmt: skip
            scores.append(float(task.reward(sample)))
        return scores

    step_s: list[float] = []
    rewards: list[float] = []

    class StepClock(TrainerCallback):  # type: ignore[misc]
        """Wall time of each optimizer step (generation, reward, loss, backward, AdamW)."""

        def __init__(self) -> None:
            self.t0 = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    batch = s.prompts_per_step * s.samples_per_prompt
    config = GRPOConfig(
        output_dir=str(work),
        seed=seed,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=s.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        generation_batch_size=batch,
        num_generations=s.samples_per_prompt,
        max_completion_length=s.max_new_tokens,
        shuffle_dataset=False,  # the rows already are our PromptStream's order
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        learning_rate=s.lr,
        optim="adamw_torch",
        weight_decay=s.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=s.max_grad_norm,
        num_iterations=1,
        epsilon=s.clip,
        epsilon_high=s.clip,
        loss_type="grpo",
        beta=0.0,
        scale_rewards="group",
        router_aux_loss_coef=0.0,
        mask_truncated_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[StepClock()],
    )
    # Timing only: the share of a step spent sampling and scoring (TRL's own method, unchanged).
    rollout_s: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = generate_and_score(*args, **kwargs)
        rollout_s.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    result.write_text(
        json.dumps(
            {
                "trl_version": __import__("trl").__version__,
                "torch_threads": torch.get_num_threads(),
                "setup_and_train_s": time.perf_counter() - started,
                "step_s": step_s,
                "rollout_s": rollout_s,
                "reward": rewards,
                "samples_per_step": [batch] * len(step_s),
            }
        )
    )


def run_trl(s: BenchSettings, seed: int, out: Path, threads: int = 0) -> dict[str, Any]:
    """This script as ``--side trl`` in a child process; its result plus the process wall."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "trl.json"
    argv = [
        sys.executable, __file__, "--side", "trl", "--seed", str(seed),
        "--steps", str(s.steps), "--result", str(result), "--out", str(out),
        "--trl-threads", str(threads),
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"TRL side failed ({proc.returncode}): {proc.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    data["process_wall_s"] = wall
    return data


# --------------------------------------------------------------------------- report


@dataclass(slots=True)
class RunPair:
    """One seed's run of each side and their comparison (``summarize``)."""

    seed: int
    ours: dict[str, Any]
    trl: dict[str, Any]
    summary: dict[str, float] = field(default_factory=dict)


def summarize(pair: RunPair, window: int) -> dict[str, float]:
    """Median step time (first step left out), mean reward of the last ``window`` steps."""
    out: dict[str, float] = {}
    for side in ("ours", "trl"):
        data = getattr(pair, side)
        steps = data["step_s"][1:] or data["step_s"]
        out[f"{side}_step_s"] = statistics.median(steps)
        if data.get("rollout_s"):  # sampling and scoring (TRL: generate + reward + advantages)
            out[f"{side}_rollout_s"] = statistics.median(data["rollout_s"][1:] or data["rollout_s"])
        out[f"{side}_reward_first"] = data["reward"][0]
        out[f"{side}_reward_last{window}"] = statistics.fmean(data["reward"][-window:])
        out[f"{side}_reward_all"] = statistics.fmean(data["reward"])
        out[f"{side}_process_wall_s"] = data["process_wall_s"]
    out["step_time_ratio_ours_over_trl"] = out["ours_step_s"] / out["trl_step_s"]
    out["process_wall_ratio_ours_over_trl"] = out["ours_process_wall_s"] / out["trl_process_wall_s"]
    trl_reward = out[f"trl_reward_last{window}"]
    out[f"reward_last{window}_ours_minus_trl"] = out[f"ours_reward_last{window}"] - trl_reward
    out[f"reward_last{window}_ratio_ours_over_trl"] = (
        out[f"ours_reward_last{window}"] / trl_reward if trl_reward > 0 else float("inf")
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps per run (each side)")
    parser.add_argument("--seeds", default="1,2,3", help="run seeds, one run of each side per seed")
    parser.add_argument("--reward-window", type=int, default=4, help="last steps averaged")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-vs-trl"))
    parser.add_argument(
        "--trl-threads", type=int, default=1,
        help="torch threads of the TRL process (default 1, as each of our processes runs; "
        "0: torch's default, one per core)",
    )  # fmt: skip
    parser.add_argument(
        "--ours-args", default="",
        help="more flags for our trainer, space-separated (e.g. '--off-policy-overlap --tis tis')",
    )  # fmt: skip
    parser.add_argument("--side", choices=("both", "trl"), default="both", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = BenchSettings(steps=args.steps)
    if args.side == "trl":
        assert args.result is not None
        trl_child(settings, args.seed, args.result, args.out / "trl-work", args.trl_threads)
        return 0

    import trl  # fail here, before any run, when the bench-trl group is not installed

    args.out.mkdir(parents=True, exist_ok=True)
    policy = Path(prepare(cache_dir(), RECIPE_SEED)["policy"])
    check = load_check(policy, addition_prompts())
    print(f"load check: {json.dumps(check)}", flush=True)
    pairs: list[RunPair] = []
    for seed in (int(x) for x in args.seeds.split(",")):
        # Interleaved (ours, TRL, ours, TRL, ...), the load average beside each run: the
        # machine may be shared, and a loaded machine slows whichever side runs then.
        load = os.getloadavg()
        ours = run_ours(settings, seed, args.out / f"ours-seed{seed}", args.ours_args.split())
        ours["load_average_before"], ours["load_average_after"] = load, os.getloadavg()
        print(f"seed {seed} ours: {json.dumps(ours)}", flush=True)
        load = os.getloadavg()
        theirs = run_trl(settings, seed, args.out / f"trl-seed{seed}", args.trl_threads)
        theirs["load_average_before"], theirs["load_average_after"] = load, os.getloadavg()
        print(f"seed {seed} trl:  {json.dumps(theirs)}", flush=True)
        print(f"seed {seed} load average (1 min) before/after: ours "
              f"{ours['load_average_before'][0]:.1f}/{ours['load_average_after'][0]:.1f}, TRL "
              f"{theirs['load_average_before'][0]:.1f}/{theirs['load_average_after'][0]:.1f}",
              flush=True)  # fmt: skip
        pair = RunPair(seed, ours, theirs)
        pair.summary = summarize(pair, args.reward_window)
        print(f"seed {seed} summary: {json.dumps(pair.summary)}", flush=True)
        pairs.append(pair)
    ratios = [p.summary["step_time_ratio_ours_over_trl"] for p in pairs]
    report = {
        "settings": asdict(settings),
        "matched_settings": matched_settings(settings),
        "trl_version": trl.__version__,
        "load_check": check,
        "runs": [asdict(p) for p in pairs],
        "step_time_ratio_ours_over_trl": ratios,
        "trl_threads": args.trl_threads,
        "ours_args": args.ours_args.split(),
        "load_average": os.getloadavg(),
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print(f"step time ours/TRL per run: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
