"""``posttrain grpo``: the command that runs the embedded CPU GRPO recipe (``grpo.py``).

Registered on the ``posttrain`` app in ``cli.py`` (see its docstring for the CLI's conventions).
Arguments after ``--`` go to the trainer (``python -m posttrain.grpo``) unchanged, last wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from posttrain.launch._console import err as _err
from posttrain.launch._console import fail_with_logs, interrupted, require
from posttrain.launch._console import stop_on_signals as _stop_on_signals
from posttrain.launch._errors import LaunchError
from posttrain.launch.runners import console_sink, tail_sink

__all__ = ["GRPO_CONTEXT", "grpo_command"]

GRPO_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}
"""The trainer's own flags pass through after ``--``."""


# The options of `posttrain grpo`, one alias each, so the command's signature reads as a list.
_GrpoTrain = Annotated[
    str,
    typer.Option(
        "--train",
        metavar="MODE",
        help="lora (adapter only, pushed as a LoRA) or full "
        "(every weight, synced with SGLang's distributed weight update)",
    ),
]

_GrpoTask = Annotated[
    str,
    typer.Option(
        "--task",
        metavar="NAME",
        help="the toy task and its recipe: addition, or shapes (multimodal: count or name "
        "the coloured squares in an image)",
    ),
]

_GrpoOpd = Annotated[
    bool,
    typer.Option("--opd", help="distil from a stronger local teacher engine (OPD) [default: off]"),
]

_GrpoTeacher = Annotated[
    str | None,
    typer.Option(
        "--teacher",
        metavar="URL",
        help="an SGLang-API teacher to distil from instead (implies --opd) [default: none]",
    ),
]

_GrpoRolloutQuant = Annotated[
    str,
    typer.Option(
        "--rollout-quant",
        metavar="QUANT",
        help="none, or nvfp4: the engines serve NVFP4 weights and the trainer applies TIS",
    ),
]

_GrpoSteps = Annotated[
    int | None,
    typer.Option("--steps", min=1, metavar="N", help="GRPO steps [default: the recipe's, 30]"),
]

_GrpoSeed = Annotated[
    int, typer.Option("--seed", metavar="N", help="seed of the recipe, rollouts and trainer")
]

_GrpoResume = Annotated[
    Path | None,
    typer.Option(
        "--resume",
        metavar="DIR",
        help="continue from this checkpoint (or run) directory [default: a fresh run]",
    ),
]

_GrpoOut = Annotated[
    Path,
    typer.Option("--out", metavar="DIR", help="metrics, reward curve, summary, checkpoints"),
]

_GrpoTurnTimeout = Annotated[
    float | None,
    typer.Option(
        "--turn-timeout",
        metavar="S",
        help="seconds one rollout turn may take (the session router's --upstream-timeout-s "
        "and the trainer's --turn-timeout-s); past it the sample is aborted and left out of "
        "the step [default: 120]",
    ),
]

_GrpoModelPath = Annotated[
    Path | None,
    typer.Option(
        "--model-path",
        metavar="DIR",
        help="train your own checkpoint instead of the recipe's tiny policy: a Hugging Face "
        "directory (Qwen3, Qwen3-MoE, Qwen2/2.5, Llama 3.x, Mistral) with its tokenizer; "
        "the engines serve it and the trainer trains it [default: the recipe's]",
    ),
]

_GrpoContextLength = Annotated[
    int | None,
    typer.Option(
        "--context-length",
        min=1,
        metavar="N",
        help="KV capacity of the engines and the trainer, prompt and output together "
        "[default: the model's max_position_embeddings]",
    ),
]

_GrpoEngines = Annotated[
    int | None,
    typer.Option(
        "--engines",
        min=1,
        metavar="N",
        help="policy engines behind the router [default: 1 below 4 cores, else 2; the trainer "
        "runs as many ranks, `-- --shard N` to change]",
    ),
]

_GrpoDryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="run every check a run makes before it starts a process (the recipe's settings, "
        "the model gate, your data, reward and eval sets, --out, --resume) and print the "
        "trainer's config; start no engine, router or trainer (a first run still prepares the "
        "recipe's cached checkpoints) [default: off]",
    ),
]

_GrpoVerbose = Annotated[
    bool,
    typer.Option("--verbose", help="stream every server's log to the terminal [default: off]"),
]

_GrpoPromptData = Annotated[
    Path | None,
    typer.Option(
        "--prompt-data",
        metavar="PATH",
        help="your prompts: JSONL, JSON, parquet or a datasets save_to_disk directory "
        "(replaces --task's prompts; needs --reward) [default: none]",
    ),
]

_GrpoInputKey = Annotated[
    str | None,
    typer.Option("--input-key", metavar="KEY", help="row key of the prompt [default: prompt]"),
]

_GrpoLabelKey = Annotated[
    str | None,
    typer.Option("--label-key", metavar="KEY", help="row key of the label [default: label]"),
]

_GrpoMetadataKey = Annotated[
    str | None,
    typer.Option(
        "--metadata-key", metavar="KEY", help="row key of the reward's metadata [default: none]"
    ),
]

_GrpoApplyChatTemplate = Annotated[
    bool | None,
    typer.Option(
        "--apply-chat-template/--no-apply-chat-template",
        help="render prompts with the chat template, or send raw text (base models) "
        "[default: apply]",
        show_default=False,
    ),
]

_GrpoSystemPrompt = Annotated[
    str | None,
    typer.Option("--system-prompt", metavar="TEXT", help="system message before each prompt"),
]

_GrpoReward = Annotated[
    list[str] | None,
    typer.Option(
        "--reward",
        metavar="SPEC",
        help="math, exact, regex=PATTERN, length, module:function or path/file.py:function, "
        "each optionally :WEIGHT; repeat to sum [default: the task's]",
    ),
]

_GrpoEvalData = Annotated[
    list[str] | None,
    typer.Option("--eval-data", metavar="PATH", help="an evaluation set (repeatable)"),
]

_GrpoEvalEvery = Annotated[
    int | None,
    typer.Option(
        "--eval-every",
        metavar="N",
        help="evaluate every N steps and after the last [default: 0: after the last only]",
    ),
]

_GrpoEvalSamplesPerPrompt = Annotated[
    int | None,
    typer.Option(
        "--eval-samples-per-prompt",
        metavar="K",
        help="1: greedy; K > 1: sampled, pass@K [default: 1]",
    ),
]


def grpo_command(
    ctx: typer.Context,
    train: _GrpoTrain = "lora",
    task: _GrpoTask = "addition",
    opd: _GrpoOpd = False,
    teacher: _GrpoTeacher = None,
    rollout_quant: _GrpoRolloutQuant = "none",
    steps: _GrpoSteps = None,
    seed: _GrpoSeed = 0,
    resume: _GrpoResume = None,
    out: _GrpoOut = Path("runs/grpo"),
    turn_timeout: _GrpoTurnTimeout = None,
    model_path: _GrpoModelPath = None,
    context_length: _GrpoContextLength = None,
    engines: _GrpoEngines = None,
    verbose: _GrpoVerbose = False,
    dry_run: _GrpoDryRun = False,
    prompt_data: _GrpoPromptData = None,
    input_key: _GrpoInputKey = None,
    label_key: _GrpoLabelKey = None,
    metadata_key: _GrpoMetadataKey = None,
    apply_chat_template: _GrpoApplyChatTemplate = None,
    system_prompt: _GrpoSystemPrompt = None,
    reward: _GrpoReward = None,
    eval_data: _GrpoEvalData = None,
    eval_every: _GrpoEvalEvery = None,
    eval_samples_per_prompt: _GrpoEvalSamplesPerPrompt = None,
) -> None:
    """Run the embedded CPU GRPO recipe: tiny Dense/MoE policy, toy task, engines, trainer."""
    require(
        "posttrain grpo",
        ["posttrain.grpo", "posttrain.formats", "sglang_router", "posttrain.local_engine",
         "posttrain.session_router"],
    )  # fmt: skip
    from posttrain.launch.grpo import (
        GrpoRecipeConfig,
        data_flags,
        local_topology,
        run_grpo,
        usable_cores,
    )

    sink, kept = (console_sink(_err), None) if verbose else tail_sink()
    _stop_on_signals()
    try:
        cfg = GrpoRecipeConfig(
            train=train,  # type: ignore[arg-type]  # checked by GrpoRecipeConfig
            task=task,
            opd=opd or teacher is not None,
            teacher_url=teacher,
            rollout_quant=rollout_quant,  # type: ignore[arg-type]
            steps=steps,
            seed=seed,
            resume=resume,
            out=out,
            trainer_args=tuple(ctx.args),
            data_args=data_flags(
                prompt_data=prompt_data,
                input_key=input_key,
                label_key=label_key,
                metadata_key=metadata_key,
                apply_chat_template=apply_chat_template,
                system_prompt=system_prompt,
                reward=reward,
                eval_data=eval_data,
                eval_every=eval_every,
                eval_samples_per_prompt=eval_samples_per_prompt,
            ),
            turn_timeout_s=turn_timeout,
            model_path=model_path,
            context_length=context_length,
            engines=engines,
            dry_run=dry_run,
        )
        topology = local_topology(usable_cores(), cfg.engines, cfg.trainer_args)
        starting = f"starting {topology.describe()}, sgl-router and the session router"
        _err.print(
            "posttrain grpo --dry-run: the recipe's settings (a first run warms up a tiny model, "
            "about 30 s), then every check; nothing is started"
            if cfg.dry_run
            else f"posttrain grpo: training {cfg.model_path}; {starting}; metrics and plots go "
            f"to {cfg.out}"
            if cfg.model_path is not None
            else "posttrain grpo: preparing the recipe's checkpoints (a first run warms up a tiny "
            f"model, about 30 s), then {starting}; metrics and plots go to {cfg.out}",
            highlight=False,
        )
        code = run_grpo(cfg, sink, topology=topology)
    except KeyboardInterrupt:
        interrupted()
    except LaunchError as exc:
        fail_with_logs(exc, kept)
    if code != 0:
        fail_with_logs(LaunchError(f"the trainer exited with code {code}"), kept)
