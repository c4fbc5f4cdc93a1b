"""The GRPO loop: rollout, reward, (OPD), advantages, train, weight sync, checkpoint.

Read top to bottom, one step is::

    prompts  = stream.take(prompts_per_step)                 # seeded epochs: resumable
    samples  = rollout(session-router, prompts, n)           # exact ids + engine logprobs
    samples  = fleet.screen(samples)                         # aborted (and stale) left out
    rewards  = score_samples(task.reward, samples)           # RewardFunction / --reward
    adv      = group_normalized_advantages(rewards, groups)  # GRPO, per sample
    adv_t    = apply_opd(adv_t, coef, teacher rkl)           # optional: teacher's reverse KL
    metrics  = train_step(policy, my share of samples)       # every rank, FSDP/HSDP (+ LoRA)
    fleet.sync(policy, version + 1)                          # adapter push or SGLang's update
    checkpoint.save(...) every ``checkpoint_every`` steps    # and at the end

Rank 0 talks HTTP (rollouts, rewards, teacher, weight pushes) and hands each rank its share of
the step's samples; every rank trains. ``run`` is what ``python -m posttrain.grpo`` calls:
under torchrun it is one rank; alone it forks ``replicate * shard`` local gloo ranks itself
(``posttrain.interface.processes.run_workers``: one deadline, ranks die with their parent).

Rank 0 decides and every rank learns through ``_controller.run_on_rank0``: each rank gets rank
0's value (the step's batch, the eval metrics, the checkpoint's ``extra``) or raises the same
exception. The engines' faults are the fleet's (``fleet.EngineFleet``, whose docstring and
integration_tests/test_integration_engine_faults.py tell them): ``fleet.screen`` leaves out of
a step the samples an engine aborted (``aborted_samples``; a turn with no reply within
``turn_timeout_s``) and, in full-weight training, those produced at another weight version
(``stale_samples``); ``fleet.sync`` sets aside the engines it cannot reach
(``sync_engines_lost``) and re-admits those that answer again (``sync_engines_readmitted``).
A sample whose reward failed is left out too, named in a warning; a step that keeps no sample
fails with a named error.

A pipeline of one's own plugs in through the interface Protocols, not our concrete classes:
``run(config, task=Task(...), engine=..., weight_sinks=[...])`` takes the prompts and the
``RewardFunction`` from ``task``, rolls out through ``engine`` (a ``RolloutEngine``) instead of
the session router at ``rollout_url``, and pushes every update to each ``WeightSink`` as well
as to ``engine_urls`` (docs/compose.md). They are used by rank 0; when ``run`` forks the ranks
itself, rank 0 works on the forked copy of them.

Where it departs from textbook GRPO (Shao et al.): one optimizer step per rollout batch (so the
PPO ratio starts at exactly 1), sequence-mean-token-mean loss aggregation by default (miles),
and the trainer's recompute of the rollout tokens is the "old" policy, checked against the
engine's logprobs every step (``train_rollout_logprob_abs_diff``, exactly 0 in strict numerics).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.formats import write_text_atomic
from posttrain.grpo import checkpoint, data, evaluation
from posttrain.grpo._controller import run_on_rank0
from posttrain.grpo._errors import GrpoConfigError, GrpoRunError
from posttrain.grpo.advantages import group_normalized_advantages
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.data import task_from_config
from posttrain.grpo.fleet import EngineFleet, SyncTarget
from posttrain.grpo.metrics import MetricsLog, write_report
from posttrain.grpo.model_check import resolve_model_paths
from posttrain.grpo.overlap import StepBatches
from posttrain.grpo.preflight import run_preflight
from posttrain.grpo.rewards import Prompt, PromptStream, Task
from posttrain.grpo.rollout import Rollouts, RolloutSettings
from posttrain.grpo.scoring import StepScores, as_bound, score_samples
from posttrain.grpo.trainer import Policy, TrainSample, backend_for, build_policy, train_step
from posttrain.interface import (
    RolloutEngine,
    Sample,
    WeightSink,
    WorkerError,
)
from posttrain.interface.processes import free_port, run_workers

_log = logging.getLogger("posttrain.grpo")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plugged:
    """What a caller plugs into the loop in place of the config's own (see the docstring)."""

    task: Task | None = None
    engine: RolloutEngine | None = None
    weight_sinks: tuple[WeightSink, ...] = field(default_factory=tuple)


def run(
    config: GrpoConfig,
    *,
    task: Task | None = None,
    engine: RolloutEngine | None = None,
    weight_sinks: Sequence[WeightSink] = (),
) -> dict[str, Any] | None:
    """Run a GRPO job; returns the summary on rank 0 (None elsewhere).

    ``task`` (prompts and reward), ``engine`` and ``weight_sinks`` replace the config's task,
    session router and (alongside ``engine_urls``) engines; see the module docstring.
    """
    if config.dry_run:
        return {"dry_run": True, "config": config.to_dict()}
    plugged = Plugged(task=task, engine=engine, weight_sinks=tuple(weight_sinks))
    _check_runnable(config, plugged)  # the plugged parts and the fields a run cannot do without
    # Every preflight check (the model gate, the user's data, reward and eval sets, the out dir,
    # the resume checkpoint) before any rank or engine starts and before anything is written;
    # a plugged task brings its own prompts and reward. Under torchrun rank 0 checks, once.
    skip = ("data", "reward") if task is not None else ()
    if "RANK" in os.environ:
        _init_process_group(config)
        try:
            # rank 0 checks, once (it hashes the resume checkpoint and calls the reward on the
            # first rows); every rank raises the same PreflightError, or none
            run_on_rank0(functools.partial(run_preflight, config, skip=skip), group=None)
            config = _resolved(config, task)
        except BaseException:
            dist.destroy_process_group()
            raise
        return _run_rank(config, plugged)
    run_preflight(config, skip=skip)
    config = _resolved(config, task)
    if config.world_size == 1:
        return _run_rank(config, plugged)
    return _spawn_ranks(config, plugged)


def _resolved(config: GrpoConfig, task: Task | None) -> GrpoConfig:
    """Hub ids -> their cached directories; a plugged reward whose parameters bind, or a
    ``GrpoConfigError`` now."""
    config = resolve_model_paths(config)
    if task is not None:
        as_bound(task.reward)
    return config


def _check_runnable(cfg: GrpoConfig, plugged: Plugged) -> None:
    if cfg.model_path is None:
        raise GrpoConfigError("model_path is required to train (--model-path)")
    if engine := plugged.engine:
        if not isinstance(engine, RolloutEngine):
            raise GrpoConfigError(
                f"engine is a {type(engine).__name__}, which has no async rollout() "
                "(posttrain.interface.RolloutEngine)"
            )
    elif cfg.rollout_url is None:
        raise GrpoConfigError("rollout_url is required: the session router rollouts go through")
    for k, sink in enumerate(plugged.weight_sinks):
        if not isinstance(sink, WeightSink):
            raise GrpoConfigError(
                f"weight_sinks[{k}] is a {type(sink).__name__}, not a "
                "posttrain.interface.WeightSink (update_weights)"
            )
    if not cfg.engine_urls and not plugged.weight_sinks:
        raise GrpoConfigError(
            "engine_urls (or weight_sinks) is required: the engines weight updates go to"
        )
    if cfg.opd and cfg.teacher_url is None:
        raise GrpoConfigError(
            "opd needs teacher_url (--teacher-url); `posttrain grpo --opd` starts a local teacher"
        )


# --------------------------------------------------------------------------- one rank


def _run_rank(cfg: GrpoConfig, plugged: Plugged) -> dict[str, Any] | None:
    """One trainer rank. A single rank run in the caller's own process (``run`` from Python, a
    test) leaves that process as it found it: the group destroyed, the torchrun variables it set
    removed and the thread count restored, so a later run or fork starts clean."""
    threads = torch.get_num_threads()
    added = _init_process_group(cfg)
    torch.set_num_threads(int(os.environ.get("POSTTRAIN_TRAINER_THREADS", "1")))
    try:
        return _train(cfg, plugged)
    finally:
        dist.destroy_process_group()
        for name in added:
            os.environ.pop(name, None)
        torch.set_num_threads(threads)


@dataclass(frozen=True, kw_only=True, slots=True)
class _LeadParts:
    """What rank 0 alone holds: the tokenizer's ``decode``, the task, its prompt stream, the
    prompts' fingerprint and the eval sets."""

    decode: Callable[[Sequence[int]], str]
    task: Task
    stream: PromptStream
    fingerprint: str
    evals: dict[str, tuple[Prompt, ...]]


def _lead_parts(cfg: GrpoConfig, plugged: Plugged) -> _LeadParts:
    """Rank 0: the tokenizer, the task (plugged or from the config) and its prompts."""
    decode = _decoder(cfg)
    task = plugged.task or task_from_config(cfg, decode)
    stream = PromptStream(task.prompts, seed=cfg.seed)
    fingerprint = data.fingerprint(task.prompts)
    return _LeadParts(
        decode=decode, task=task, stream=stream, fingerprint=fingerprint, evals=data.eval_sets(cfg)
    )


def _open_run_on_lead(
    cfg: GrpoConfig, parts: _LeadParts | None, extra: dict[str, Any] | None
) -> None:
    """Rank 0: the prompt stream at the resumed checkpoint's position (the same prompts, or a
    ``GrpoRunError``), then ``config.json`` in the out dir."""
    assert parts is not None, "rank 0 holds the task"
    if extra is not None:
        parts.stream.position = int(extra["data_position"])
        saved = extra.get("data_fingerprint")
        if saved is not None and saved != parts.fingerprint:
            raise GrpoRunError(
                f"--resume {cfg.resume}: the prompts differ from the checkpoint's (data "
                f"fingerprint {parts.fingerprint}, saved {saved}); resume with the same data"
            )
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "config.json", json.dumps(cfg.to_dict(), indent=2))


def _train(cfg: GrpoConfig, plugged: Plugged) -> dict[str, Any] | None:
    policy = build_policy(cfg)
    # Only rank 0 rolls out and scores: the tokenizer, task and prompt stream live there (they
    # stay there; every rank learns whether making them failed).
    held: list[_LeadParts] = []
    run_on_rank0(lambda: held.append(_lead_parts(cfg, plugged)), group=None)
    lead = held[0] if held else None
    start, extra = 0, None
    if cfg.resume is not None:
        extra = checkpoint.load(checkpoint.find(cfg.resume), policy)
        start = int(extra["next_step"])
    run_on_rank0(lambda: _open_run_on_lead(cfg, lead, extra), group=None)
    task, stream, evals, decode, fingerprint = (
        (lead.task, lead.stream, lead.evals, lead.decode, lead.fingerprint)
        if lead is not None
        else (None, None, {}, None, None)
    )
    out = Path(cfg.out_dir)
    api_key = cfg.api_key()
    target = SyncTarget(
        engine_urls=tuple(cfg.engine_urls), lora_name=cfg.lora_name,
        rollout_quant=cfg.rollout_quant, timeout_s=cfg.rollout_timeout_s, api_key=api_key,
        sinks=plugged.weight_sinks, base_model_path=_served_base(cfg),
        weight_sync_backend=cfg.weight_sync_backend, weight_sync_address=cfg.weight_sync_address,
        weight_sync=cfg.weight_sync, lora_sync=cfg.lora_sync,
        sync_dir=str(cfg.sync_dir or out / "sync"),
    )  # fmt: skip
    fleet = EngineFleet(target, router_url=cfg.router_url, readmit_lost=cfg.readmit_lost_engines)
    with fleet:  # the update group lives as long as the run; destroyed on the way out
        return _steps(cfg, policy, fleet, task, stream, evals, decode, plugged, out, start,
                      fingerprint, api_key)  # fmt: skip


def _steps(
    cfg: GrpoConfig,
    policy: Policy,
    fleet: EngineFleet,
    task: Task | None,
    stream: PromptStream | None,
    evals: dict[str, tuple[Prompt, ...]],
    decode: Callable[[Sequence[int]], str] | None,
    plugged: Plugged,
    out: Path,
    start: int,
    fingerprint: str | None,
    api_key: str | None,
) -> dict[str, Any] | None:
    """The steps from ``start`` (every rank; rank 0 logs them and returns the report)."""
    lead = dist.get_rank() == 0
    ckpt_root = out / "checkpoints"
    version = fleet.first_version()
    fleet.sync(policy, version, first=True, when="start")  # before the first rollout, and resumes
    log = MetricsLog(out, total_steps=cfg.steps, start_step=start) if lead else None
    opd_mode: dict[str, bool] = {}  # per-position scoring or not: probed once, on the first step
    # Rank 0's rollout client and event loop: made once, reused by every step.
    rollouts = Rollouts(engine=plugged.engine) if task is not None else None
    batches: StepBatches | None = None
    if task is not None and stream is not None and decode is not None and rollouts is not None:
        batches = StepBatches(
            functools.partial(_rollout_and_score, cfg, task, stream, api_key=api_key,
                              opd_mode=opd_mode, rollouts=rollouts, fleet=fleet,
                              decode=decode),
            overlap=cfg.off_policy_overlap, steps=cfg.steps,
        )  # fmt: skip
    saved_s = 0.0  # seconds of the checkpoint saved after the step before
    with contextlib.ExitStack() as scope:
        if log is not None:
            scope.enter_context(log)
        if rollouts is not None:
            scope.enter_context(rollouts)
        if batches is not None:
            scope.callback(batches.close)  # before the rollout client closes
        for step in range(start, cfg.steps):
            t_step = time.perf_counter()
            batch = run_on_rank0(functools.partial(_lead_batch, batches, step, version),
                                 group=None)  # fmt: skip
            mine = policy.data_parallel_share(batch["train"])
            if cfg.offload_engines:  # the engines' memory is the trainer's while it steps
                fleet.set_memory(resident=False, when=f"step {step}")
            if batches is not None and stream is not None:  # --off-policy-overlap only
                batches.start_next(step, version, stream.position)
            t0 = time.perf_counter()
            metrics = train_step(
                policy, mine, cfg,
                global_batch_size=len(batch["train"]),
                global_token_count=max(1, batch["masked_tokens"]),
            )  # fmt: skip
            times = {**batch["times"], "train": time.perf_counter() - t0}
            if batches is not None and batches.overlap:  # the next rollout, before weights change
                times["rollout_wait"] = batches.wait()
            t0 = time.perf_counter()
            version += 1
            if cfg.offload_engines:
                fleet.set_memory(resident=True, when=f"step {step}")
            synced = fleet.sync(
                policy, version, engines_resumed=cfg.offload_engines, when=f"step {step}"
            )
            metrics.update(synced.metrics)
            times["sync"] = time.perf_counter() - t0
            if evaluation.due(cfg, step):  # every rank knows when: one broadcast of the outcome
                t0 = time.perf_counter()
                metrics.update(_evaluate(cfg, task, evals, decode, step, version, api_key,
                                         plugged.engine))  # fmt: skip
                times["eval"] = time.perf_counter() - t0
            # The step's line before its checkpoint: a run killed between the two resumes from
            # the checkpoint before (whose later lines it rewrites), never past a missing line.
            # So a step's line times the checkpoint saved after the step before (``checkpoint``).
            times["checkpoint"] = saved_s
            times["step"] = time.perf_counter() - t_step + saved_s
            if log is not None:
                record = {"step": step, **batch["stats"], **metrics}
                record["train_tokens_per_s"] = metrics["train_tokens"] / max(times["train"], 1e-9)
                record.update({f"time/{k}": round(v, 4) for k, v in times.items()})
                log.log(record)
            t0 = time.perf_counter()
            last = step == cfg.steps - 1
            every = cfg.checkpoint_every
            if last or (every and (step + 1) % every == 0):
                extra = run_on_rank0(functools.partial(_checkpoint_extra, step + 1, stream,
                                                       batches, fingerprint), group=None)  # fmt: skip
                checkpoint.save(ckpt_root, step, policy, extra)
            saved_s = time.perf_counter() - t0
    if log is None:
        return None
    extra = {"out_dir": str(out), "train": cfg.train, "rollout_quant": cfg.rollout_quant,
             "opd": cfg.opd, "seed": cfg.seed}  # fmt: skip
    return write_report(out, log.records, extra)


def _rollout_and_score(
    cfg: GrpoConfig,
    task: Any,
    stream: PromptStream,
    step: int,
    version: int,
    *,
    api_key: str | None,
    opd_mode: dict[str, bool],
    rollouts: Rollouts,
    fleet: EngineFleet,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> dict[str, Any]:
    """Rank 0: the step's samples, rewards, advantages and stats; a failure is a
    ``GrpoRunError`` naming the step."""
    try:
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        prompts = stream.take(cfg.prompts_per_step)
        settings = RolloutSettings(
            url=str(cfg.rollout_url or ""),
            samples_per_prompt=cfg.samples_per_prompt,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed,
            top_logprobs=cfg.opd_top_k if cfg.opd else 0,
            weight_version=version,
            timeout_s=cfg.rollout_timeout_s,
            turn_timeout_s=min(cfg.turn_timeout_s, cfg.rollout_timeout_s),
            api_key=api_key,
        )
        samples = rollouts.run(settings, prompts, step=step)
        times["rollout"] = time.perf_counter() - t0
        screened = fleet.screen(samples, step=step, version=version,
                                check_versions=cfg.train == "full")  # fmt: skip
        samples = screened.kept
        t0 = time.perf_counter()
        assert decode is not None
        scored = score_samples(task.reward, samples, {p.index: p for p in prompts}, decode)
        samples = _drop_failed(scored, step)
        times["reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
        groups = [int(s.group_index or 0) for s in samples]
        adv = group_normalized_advantages(rewards, groups, std_normalize=cfg.std_normalize)
        per_token = [
            torch.full((s.response_length,), float(a)) for s, a in zip(samples, adv, strict=True)
        ]
        times["advantages"] = time.perf_counter() - t0
        stats: dict[str, float] = {}
        if cfg.opd:
            t0 = time.perf_counter()
            per_token, rkl = _apply_teacher(cfg, samples, per_token, stats, opd_mode)
            stats["opd_reverse_kl"] = _masked_mean(rkl, samples)
            times["opd"] = time.perf_counter() - t0
        stats.update(_rollout_stats(samples, rewards, times["rollout"]))
        stats["aborted_samples"] = float(len(screened.aborted))
        stats["epoch"] = stream.position / len(task.prompts)
        stats.update(scored.metrics)
        if screened.stale is not None:
            stats["stale_samples"] = float(len(screened.stale))
        train = [
            TrainSample(
                tokens=s.tokens,
                prompt_len=len(s.prompt_ids),
                loss_mask=s.loss_mask,
                rollout_logprobs=s.rollout_logprobs,
                advantages=a.tolist(),
                media=list(s.media),
            )
            for s, a in zip(samples, per_token, strict=True)
        ]
        masked = sum(sum(s.loss_mask) for s in samples)
        return {"train": train, "masked_tokens": masked, "stats": stats, "times": times}
    except Exception as exc:  # every rank hears of it (run_on_rank0)
        raise GrpoRunError(f"step {step}: {type(exc).__name__}: {exc}") from exc


def _checkpoint_extra(
    next_step: int,
    stream: PromptStream | None,
    batches: StepBatches | None,
    fingerprint: str | None,
) -> dict[str, Any]:
    """Rank 0: what a checkpoint records besides the policy (the first prompt not yet trained)."""
    position = stream.position if stream is not None else 0
    if batches is not None:
        position = batches.data_position(position)
    return {"next_step": next_step, "data_position": position, "data_fingerprint": fingerprint}


def _lead_batch(batches: StepBatches | None, step: int, version: int) -> dict[str, Any]:
    """Rank 0's batch for ``step`` (made now, or the one overlapped with the step before)."""
    assert batches is not None, "rank 0 makes the step batches"
    return batches.get(step, version)


def _evaluate(
    cfg: GrpoConfig,
    task: Task | None,
    evals: dict[str, Any],
    decode: Callable[[Sequence[int]], str] | None,
    step: int,
    version: int,
    api_key: str | None,
    engine: RolloutEngine | None,
) -> dict[str, float]:
    """Rank 0 evaluates (``evaluation``); every rank gets the metrics or raises its error."""

    def evaluate() -> dict[str, float]:
        if task is None or decode is None:
            return {}
        try:
            return evaluation.evaluate(
                cfg, evals, task.reward, decode, step=step, version=version, api_key=api_key,
                engine=engine,
            )  # fmt: skip
        except Exception as exc:
            raise GrpoRunError(f"step {step}: eval: {type(exc).__name__}: {exc}") from exc

    return run_on_rank0(evaluate, group=None)


def _drop_failed(scored: StepScores, step: int) -> list[Sample]:
    """The samples whose reward succeeded; a warning names each failed one, and a step where
    every reward failed is a ``GrpoRunError``."""
    if not scored.failed:
        return scored.kept
    named = "; ".join(
        f"prompt {s.metadata.get('prompt_index')} sample {s.index}: {failure}"
        for s, failure in scored.failed[:8]
    )
    if not scored.kept:
        raise GrpoRunError(
            f"the reward failed on every one of the {len(scored.failed)} samples: {named}"
        )
    _log.warning(
        "step %d: the reward failed on %d of %d samples, left out of the step: %s",
        step, len(scored.failed), len(scored.failed) + len(scored.kept), named,
    )  # fmt: skip
    return scored.kept


def _served_base(cfg: GrpoConfig) -> str | None:
    """The checkpoint an engine reloads its base from: the one the engines serve."""
    path = cfg.engine_model_path or cfg.model_path
    return None if path is None else str(path)


def _apply_teacher(
    cfg: GrpoConfig,
    samples: Sequence[Sample],
    per_token: list[torch.Tensor],
    stats: dict[str, float],
    opd_mode: dict[str, bool],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Score the samples with the teacher and shape the advantages: A_t - coef * rkl_t.

    ``opd_mode`` remembers, after the first step, whether the teacher scores per position, so
    the capability probe runs once per run, not once per step.
    """
    from posttrain.opd import (
        CapabilityError,
        OPDConfig,
        TeacherRouter,
        TeacherScoringClient,
        Timeouts,
        apply_opd,
    )

    assert cfg.teacher_url is not None
    router = TeacherRouter({}, fallback_url=cfg.teacher_url)
    timeouts = Timeouts(connect=10.0, read=cfg.rollout_timeout_s, deadline=cfg.rollout_timeout_s)

    async def score() -> tuple[list[Any], bool]:
        # Top-k ids are scored per position (each position's own ids: a reply k*R long, not
        # L*|U|) where the teacher supports it (probed), else as one flat id set.
        known = opd_mode.get("per_position")
        modes = (known,) if known is not None else (cfg.opd_top_k > 0, False)
        for per_position in modes:
            opd_cfg = OPDConfig(
                top_k=cfg.opd_top_k, kl_coef=cfg.opd_kl_coef, per_position=per_position
            )
            async with TeacherScoringClient(
                router, opd_cfg, timeouts=timeouts, max_concurrency=32
            ) as scorer:
                if per_position and known is None:
                    try:
                        await scorer.probe()
                    except CapabilityError:
                        continue
                return list(await scorer.score_batch(list(samples))), per_position
        raise AssertionError("unreachable: the flat mode needs no probe")

    signals, per_position = asyncio.run(score())
    opd_mode["per_position"] = per_position
    stats["opd_per_position"] = float(per_position)
    # Attempts beyond one per request: the teacher answered 429/5xx or dropped the connection
    # and the client retried (within the deadline). 0 on a healthy teacher.
    stats["opd_teacher_retries"] = float(sum(s.stats.attempts - s.stats.requests for s in signals))
    if cfg.opd_top_k > 0:
        return apply_opd(
            per_token, coef=cfg.opd_kl_coef, reverse_kl=[s.reverse_kl for s in signals]
        )
    # Sampled tokens only: rkl = s - tau with s the rollout logprob (= the trainer's, strict).
    old = [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
    return apply_opd(
        per_token, coef=cfg.opd_kl_coef, old_logp=old,
        teacher_logp=[s.teacher_log_probs for s in signals],
    )  # fmt: skip


def _masked_mean(values: Sequence[torch.Tensor], samples: Sequence[Sample]) -> float:
    total, count = 0.0, 0
    for v, s in zip(values, samples, strict=True):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        total += float(v[m].double().sum())
        count += int(m.sum())
    return total / max(count, 1)


def _rollout_stats(
    samples: Sequence[Sample], rewards: torch.Tensor, seconds: float
) -> dict[str, float]:
    lengths = [s.response_length for s in samples]
    generated = sum(sum(s.loss_mask) for s in samples)
    return {
        "reward_mean": float(rewards.double().mean()),
        "reward_std": float(rewards.double().std(unbiased=False)),
        "response_length_mean": sum(lengths) / max(len(lengths), 1),
        "truncated_frac": sum(s.status.value == "truncated" for s in samples)
        / max(len(samples), 1),
        "samples": float(len(samples)),
        "tokens_per_s": generated / max(seconds, 1e-9),
    }


def _decoder(cfg: GrpoConfig) -> Any:
    # A tokenizer.json is read by the fast class directly: AutoTokenizer reads config.json to
    # pick a class and warns on model types transformers does not know (posttrain_multimodal).
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(str(cfg.model_path))
    tokenizer_class = (
        PreTrainedTokenizerFast if (path / "tokenizer.json").is_file() else AutoTokenizer
    )
    tok = tokenizer_class.from_pretrained(str(path))

    def decode(ids: Sequence[int]) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=True))

    return decode


# --------------------------------------------------------------------------- process groups


def _init_process_group(cfg: GrpoConfig) -> list[str]:
    """Join (or, for a single rank on its own, form) the trainer's gloo group; the names of
    the environment variables it set (a single rank's torchrun variables), for the caller to
    remove when the group is destroyed."""
    if dist.is_initialized():
        return []
    added: list[str] = []
    if "RANK" not in os.environ:  # a single rank on its own
        single = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                  "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # fmt: skip
        for name, value in single.items():
            if name not in os.environ:
                os.environ[name] = value
                added.append(name)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        cfg.check_supported(world_size=int(os.environ["WORLD_SIZE"]))
        # Finite: a rank waiting on a peer that hung gives up (rank 0 may spend a whole rollout).
        dist.init_process_group("gloo", timeout=timedelta(seconds=_collective_timeout_s(cfg)))
    except BaseException:
        for name in added:
            os.environ.pop(name, None)
        raise
    return added


def _rank(rank: int, world: int, cfg: GrpoConfig, plugged: Plugged) -> dict[str, Any] | None:
    return _run_rank(cfg, plugged)


def _spawn_ranks(cfg: GrpoConfig, plugged: Plugged) -> dict[str, Any] | None:
    """Fork ``world_size`` local gloo ranks with interface's ``run_workers`` (torch is already
    imported: each starts in a moment); rank 0's summary, or the first failure as a run error."""
    cfg.check_supported()  # before forking; each rank checks its WORLD_SIZE too
    backend_for(cfg.backend).preload()  # megatron-core (~10 s) once here, not in every rank
    try:
        results = run_workers(
            _rank,
            cfg.world_size,
            args=(cfg, plugged),
            backend="gloo",
            timeout_s=_run_budget_s(cfg),
            collective_timeout_s=_collective_timeout_s(cfg),
            threads_per_rank=None,  # _run_rank sets the trainer's own thread count
        )
    except WorkerError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        cause = lines[-1] if lines else type(exc).__name__  # the rank's exception, not its stack
        raise GrpoRunError(f"trainer rank {exc.rank}: {cause}") from exc
    value = results[0]
    return value if isinstance(value, dict) else None


def _collective_timeout_s(cfg: GrpoConfig) -> float:
    """A rank waits this long on a peer (rank 0 may spend a whole rollout between collectives)."""
    return max(600.0, 3 * cfg.rollout_timeout_s)


def _run_budget_s(cfg: GrpoConfig) -> float:
    """The whole run's deadline: every step may take a full rollout and a collective wait."""
    return 600.0 + cfg.steps * (cfg.rollout_timeout_s + _collective_timeout_s(cfg))


def summary_text(summary: dict[str, Any]) -> str:
    """One line a person reads at the end of a run."""
    gain = summary.get("reward_gain", math.nan)
    return (
        f"reward {summary.get('reward_first', math.nan):.3f} -> "
        f"{summary.get('reward_last', math.nan):.3f} ({gain:+.3f}); "
        f"train/rollout logprob |diff| max {summary.get('train_rollout_logprob_abs_diff_max')}; "
        f"report in {summary.get('out_dir')}"
    )
