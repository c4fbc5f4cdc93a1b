"""The embedded CPU recipe: a tiny Dense/MoE policy warmed up on the toy task, and its teacher.

``prepare(cache, seed)`` writes (once per seed; later calls reuse the cache) the checkpoints
``posttrain grpo`` starts from:

* ``teacher``: a tiny ``posttrain.models`` decoder (4 layers: one dense, three MoE with 4
  experts, top-2; hidden 32; the local character tokenizer) after a short supervised warm-up
  on the ``addition`` task (``rewards``) to ``TEACHER_ACCURACY`` (~0.95): the "stronger local
  teacher" of on-policy distillation.
* ``policy``: the teacher after a few more steps on random answers, until its probability of
  the right answer falls to ``STUDENT_ACCURACY`` (~0.3). It keeps the format and, latent, the
  table, so GRPO has rewards to raise within a few dozen steps on a CPU.
* ``policy-nvfp4``: the policy converted by ``quant-convert`` (routed experts in NVFP4), what
  the engines serve with ``--rollout-quant nvfp4``.

The warm-up runs in fast numerics (BLAS; it only has to be deterministic, not engine-exact),
on one thread, from a seeded generator, so a given seed always writes the same bytes. Every
checkpoint is written to a temporary directory and renamed, so an interrupted prepare leaves
nothing that looks complete. ``python -m posttrain.grpo.recipe prepare`` prints the paths as
JSON (``launch`` runs it as a process; it never imports grpo).

``RECIPE`` holds the run settings the recipe trains with; ``posttrain grpo`` passes them to
the trainer command.

``prepare(cache, seed, task="shapes")`` (``--task shapes``) writes the multimodal recipe the
same way, under ``shapes-seed<N>``: a ``ModelConfig.multimodal_tiny`` policy (the tiny decoder
plus frozen, seeded vision and audio towers) warmed up on the ``shapes`` task, the images going
through the vision tower as in training (``expand_media_tokens``); the towers stay frozen
throughout, so only the decoder learns to read them. Its run settings are ``RECIPES["shapes"]``
(one-character answers: two new tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.formats import atomic_directory, write_text_atomic
from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.rewards import MULTIMODAL_TASKS, TASK_NAMES, Prompt, build_task
from posttrain.models import (
    VOCAB_SIZE,
    DecoderModel,
    MediaBatch,
    ModelConfig,
    Numerics,
    build_model,
    build_tokenizer,
    decode_media_refs,
    expand_media_tokens,
    save_pretrained,
)

RECIPE_VERSION = 3  # bump when the warm-up changes what it writes (3: dense+MoE written as mellum)
STUDENT_ACCURACY = 0.3
TEACHER_ACCURACY = 0.95
WARMUP_BATCH = 32
WARMUP_LR = 3e-3
WARMUP_MAX_STEPS = 600
EVAL_EVERY = 10
FORGET_LR_SCALE = 0.1

# Trainer settings of the default run (``posttrain grpo`` passes them as flags).
RECIPE: dict[str, Any] = {
    "prompts_per_step": 8,
    "samples_per_prompt": 8,
    "max_new_tokens": 4,
    "temperature": 1.0,
    "lr": 5e-3,
    "full_lr": 1e-3,
    "lora_r": 8,
    "lora_alpha": 16.0,
    "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "max_grad_norm": 1.0,
    "steps": 30,
    "opd_top_k": 0,
    "opd_kl_coef": 0.5,
    "tis": "tis",
}
RECIPES: dict[str, dict[str, Any]] = {
    "addition": RECIPE,
    "shapes": {**RECIPE, "max_new_tokens": 2, "steps": 12},
}


def model_config(task: str = "addition") -> ModelConfig:
    """The recipe's tiny Dense/MoE decoder (fp32 parameters, the local tokenizer's vocabulary);
    for a multimodal task, with frozen vision and audio towers."""
    if task in MULTIMODAL_TASKS:
        return ModelConfig.multimodal_tiny(max_position_embeddings=64)
    return ModelConfig.tiny(vocab_size=VOCAB_SIZE, max_position_embeddings=64)


def cache_dir() -> Path:
    """``$POSTTRAIN_CACHE``, else ``$XDG_CACHE_HOME/posttrain``, else ``~/.cache/posttrain``."""
    if os.environ.get("POSTTRAIN_CACHE"):
        return Path(os.environ["POSTTRAIN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "posttrain"


class _Examples:
    """Tokenized warm-up examples: chat prompt ids (media sentinels expanded into their
    placeholder runs, with the runs) and answer ids + ``<|im_end|>``."""

    def __init__(self, prompts: Sequence[Prompt], config: ModelConfig) -> None:
        tok = build_tokenizer(multimodal=config.image_token_id is not None)
        eos = tok.eos_token_id
        assert isinstance(eos, int)
        self.items: list[tuple[list[int], list[int]]] = []
        self.media: list[MediaBatch | None] = []
        for p in prompts:
            text = tok.apply_chat_template(
                list(p.messages), add_generation_prompt=True, tokenize=False
            )
            prompt_ids = list(tok.encode(str(text), add_special_tokens=False))
            batch = None
            if p.media:
                items = decode_media_refs(config, p.media)
                prompt_ids, batch = expand_media_tokens(prompt_ids, items, config)
            answer = [*tok.encode(str(p.metadata["answer"]), add_special_tokens=False), eos]
            self.items.append((prompt_ids, list(answer)))
            self.media.append(batch)

    def batch(
        self, picks: Sequence[int], random_answers: random.Random | None = None
    ) -> tuple[torch.Tensor, list[int], torch.Tensor, MediaBatch | None]:
        """Packed examples (and their media runs); with ``random_answers`` each answer is
        another one drawn at random."""
        ids: list[int] = []
        lengths: list[int] = []
        mask: list[bool] = []
        for i in picks:
            prompt, answer = self.items[i]
            if random_answers is not None:
                answer = self.items[random_answers.randrange(len(self.items))][1]
            ids += prompt + answer
            lengths.append(len(prompt) + len(answer))
            mask += [False] * len(prompt) + [True] * len(answer)
        media = [self.media[i] for i in picks]
        packed = MediaBatch.pack(media, lengths) if any(m is not None for m in media) else None
        return torch.tensor(ids), lengths, torch.tensor(mask), packed


def answer_probability(model: DecoderModel, examples: _Examples) -> float:
    """Mean probability (over the task's prompts) of sampling exactly the right answer."""
    ids, lengths, mask, media = examples.batch(range(len(examples.items)))
    with torch.no_grad():
        lp = model.forward_logprobs(ids, lengths, media=media)
    seq = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))
    per_seq = torch.zeros(len(lengths)).index_add(0, seq, torch.where(mask, lp, 0.0))
    return float(per_seq.exp().mean())


def _save(model: DecoderModel, path: Path) -> None:
    strict = build_model(model.config, seed=0, numerics=Numerics.STRICT)
    strict.load_state_dict(model.state_dict())
    tokenizer = build_tokenizer(multimodal=model.config.image_token_id is not None)
    with atomic_directory(path) as staging:  # a killed warm-up never leaves half a model
        save_pretrained(strict, staging, tokenizer=tokenizer)


def _task_prompts(task: str) -> tuple[Prompt, ...]:
    if task not in TASK_NAMES:
        raise GrpoConfigError(f"task={task!r} is not one of {', '.join(TASK_NAMES)}", field="task")
    return build_task(task, lambda ids: "").prompts


def warm_up(
    root: Path,
    seed: int,
    *,
    task: str = "addition",
    config: ModelConfig | None = None,
    log: Any = None,
) -> dict[str, float]:
    """Supervised warm-up; writes ``root/teacher`` and ``root/policy``; returns their accuracy.

    The teacher learns the task (clean labels) to ``TEACHER_ACCURACY``; the policy is that
    model after a few steps on random answers, until its accuracy falls to
    ``STUDENT_ACCURACY``: the skill is still latent in its weights, the kind of base RL with a
    verifiable reward brings back quickly.

    ``config`` is the decoder to warm up (default: ``model_config(task)``); another family's
    (a tiny Llama 3 or Qwen2.5, or an MLA/MoE ``ModelConfig.mla_tiny`` GLM-4.7-Flash, with the
    local vocabulary and ``max_position_embeddings`` >= the task's prompts) gives a policy of
    that family with the same latent skill.
    """
    torch.manual_seed(seed)
    config = model_config(task) if config is None else config
    examples = _Examples(_task_prompts(task), config)
    model = build_model(config, seed=seed, numerics=Numerics.FAST)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the towers stay frozen
    opt = torch.optim.AdamW(trainable, lr=WARMUP_LR, weight_decay=0.0)
    rng = random.Random(seed)
    teacher = student = None
    for step in range(1, WARMUP_MAX_STEPS + 1):
        picks = [rng.randrange(len(examples.items)) for _ in range(WARMUP_BATCH)]
        noisy = teacher is not None  # after the teacher: random answers
        ids, lengths, mask, media = examples.batch(picks, random_answers=rng if noisy else None)
        lp = model.forward_logprobs(ids, lengths, media=media)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if not noisy and step % EVAL_EVERY:
            continue
        accuracy = answer_probability(model, examples)
        if log is not None:
            log(f"warm-up step {step}: loss {float(loss):.3f}, P(right answer) {accuracy:.3f}")
        if teacher is None and accuracy >= TEACHER_ACCURACY:
            teacher = accuracy
            _save(model, root / "teacher")
            for group in opt.param_groups:  # forget gently: stop near STUDENT_ACCURACY
                group["lr"] = WARMUP_LR * FORGET_LR_SCALE
        elif teacher is not None and accuracy <= STUDENT_ACCURACY:
            student = accuracy
            _save(model, root / "policy")
            break
    if teacher is None or student is None:
        raise GrpoConfigError(
            f"recipe warm-up ({task}, seed {seed}) did not reach a teacher with P(right answer) >= "
            f"{TEACHER_ACCURACY} and a policy <= {STUDENT_ACCURACY} in {WARMUP_MAX_STEPS} steps"
        )
    return {"policy_accuracy": student, "teacher_accuracy": teacher}


def _convert_nvfp4(src: Path, dst: Path) -> None:
    from posttrain.quant_convert import ConvertOptions, QuantPolicy, convert_checkpoint

    # convert_checkpoint copies the tokenizer (every non-weight file) along with the weights.
    with atomic_directory(dst) as staging:
        convert_checkpoint(src, staging, options=ConvertOptions(policy=QuantPolicy()))


def prepare(
    cache: Path, seed: int, *, nvfp4: bool = False, task: str = "addition", log: Any = None
) -> dict[str, Any]:
    """The recipe's checkpoints under ``cache`` (made once per seed and task); returns their
    paths and run settings."""
    if task not in RECIPES:
        raise GrpoConfigError(
            f"task={task!r} has no embedded recipe (one of {', '.join(RECIPES)})", field="task"
        )
    if nvfp4 and task in MULTIMODAL_TASKS:
        raise GrpoConfigError(f"the {task} recipe has no NVFP4 copy (rollout_quant=none only)")
    leaf = f"seed{seed}" if task == "addition" else f"{task}-seed{seed}"
    root = Path(cache) / f"grpo-recipe-v{RECIPE_VERSION}" / leaf
    done = root / "recipe.json"
    info: dict[str, Any]
    if done.is_file():
        info = json.loads(done.read_text())
    else:
        started = time.perf_counter()
        info = warm_up(root, seed, task=task, log=log)
        info["warmup_s"] = round(time.perf_counter() - started, 2)
        write_text_atomic(done, json.dumps(info))
    if nvfp4 and not (root / "policy-nvfp4" / "config.json").is_file():
        _convert_nvfp4(root / "policy", root / "policy-nvfp4")
    return {
        **info,
        "policy": str(root / "policy"),
        "teacher": str(root / "teacher"),
        "policy_nvfp4": str(root / "policy-nvfp4") if nvfp4 else None,
        "task": task,
        "recipe": {k: list(v) if isinstance(v, tuple) else v for k, v in RECIPES[task].items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.grpo.recipe")
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write (or reuse) the recipe's checkpoints")
    prep.add_argument(
        "--cache", type=Path, default=None, help="default: $POSTTRAIN_CACHE or ~/.cache/posttrain"
    )
    prep.add_argument("--seed", type=int, default=0, help="seed of the recipe (default: 0)")
    prep.add_argument("--nvfp4", action="store_true", help="also the NVFP4 copy of the policy")
    prep.add_argument("--task", default="addition", help=f"one of {', '.join(RECIPES)}")
    prep.add_argument(
        "--settings-only",
        action="store_true",
        help="print the task's trainer settings only, writing no checkpoint (a run that "
        "trains the user's own --model-path)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.settings_only:
        if args.task not in RECIPES:
            print(
                f"error: task={args.task!r} has no embedded recipe (one of {', '.join(RECIPES)})",
                file=sys.stderr,
            )
            return 2
        settings = {
            k: list(v) if isinstance(v, tuple) else v for k, v in RECIPES[args.task].items()
        }
        print(json.dumps({"task": args.task, "recipe": settings}))
        return 0
    try:
        paths = prepare(
            args.cache or cache_dir(), args.seed, nvfp4=args.nvfp4, task=args.task,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
