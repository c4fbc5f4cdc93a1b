"""Checks of the user's inputs that ``--dry-run`` (and a real run, before anything starts) makes.

Plain callables of one ``GrpoConfig`` each; every one raises ``GrpoConfigError`` with one line
naming the flag, the file, the row or the keys:

* ``check_data``: ``--prompt-data`` exists, parses, is not empty, every row has
  ``--input-key`` (and ``--label-key`` / ``--metadata-key``) in the right shape; a
  ``--prompt-data`` run names a ``--reward``; with ``--apply-chat-template`` a local
  ``--model-path`` has a chat template (else ``--no-apply-chat-template`` is named); every
  prompt, tokenized as it will be sent, leaves ``--max-new-tokens`` of the model's context;
* ``check_reward``: every ``--reward`` imports and has a signature a reward can be called
  with, then is called once on the first prompt with its label as the response: it must
  return a finite number (or ``{"reward": finite, ...}``) and not raise;
* ``check_eval``: every ``--eval-data`` set loads like ``--prompt-data``; ``--eval-every``
  needs ``--eval-data``.

``check_inputs`` runs the three.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.data import config_prompts, eval_sets
from posttrain.grpo.rewards import TASK_NAMES, Prompt, build_task
from posttrain.grpo.scoring import Scorer, reward_input, score
from posttrain.interface import Sample


def _prompts(config: GrpoConfig) -> tuple[Prompt, ...]:
    if config.prompt_data is not None:
        return config_prompts(config, config.prompt_data)
    if config.task not in TASK_NAMES:
        raise GrpoConfigError(
            f"--task {config.task!r} is not one of {', '.join(TASK_NAMES)}; for your own "
            "prompts give --prompt-data FILE (with --input-key, --label-key, --reward)",
            field="task",
        )
    return build_task(config.task, lambda ids: "").prompts


def check_data(config: GrpoConfig) -> None:
    """``--prompt-data`` (or ``--task``) gives prompts; see the module docstring."""
    prompts = _prompts(config)
    if config.prompt_data is not None and not config.reward:
        raise GrpoConfigError(
            "--prompt-data needs --reward (math, exact, regex=PATTERN, length, "
            "module:function or path/file.py:function)",
            field="reward",
        )
    chat = any(p.text is None for p in prompts)
    if chat and config.apply_chat_template and config.model_path is not None:
        _check_chat_template(Path(config.model_path))
    if config.model_path is not None:
        _check_lengths(config, Path(config.model_path), prompts)


def _check_lengths(config: GrpoConfig, root: Path, prompts: tuple[Prompt, ...]) -> None:
    """Every prompt plus ``--max-new-tokens`` fits the model's context (a local checkpoint's
    ``max_position_embeddings``), tokenized as the session router will (template or raw)."""
    try:
        context = json.loads((root / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # a hub id, or no config: the engines decide
    source = f"max_position_embeddings in {root / 'config.json'}"
    if config.context_length is not None:  # the KV capacity the run asked for
        context, source = config.context_length, "--context-length"
    if not isinstance(context, int) or not (root / "tokenizer.json").is_file():
        return
    if any(p.media for p in prompts):
        return  # media placeholders expand on the engine; their length is the engine's to check
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(root))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GrpoConfigError(
            f"--model-path {root}: its tokenizer.json cannot be loaded ({type(exc).__name__}: "
            f"{exc})"
        ) from None
    flag = "--prompt-data" if config.prompt_data is not None else "--task"
    where = config.prompt_data if config.prompt_data is not None else config.task
    for p in prompts:
        if p.text is not None:
            length = len(tok.encode(p.text, add_special_tokens=False))
        else:
            rendered = tok.apply_chat_template(
                [dict(m) for m in p.messages], add_generation_prompt=True, tokenize=False
            )
            length = len(tok.encode(str(rendered), add_special_tokens=False))
        if length + config.max_new_tokens > context:
            raise GrpoConfigError(
                f"{flag} {where} row {p.index + 1}: the prompt is {length} tokens; with "
                f"--max-new-tokens {config.max_new_tokens} it does not fit the model's context "
                f"of {context} ({source})"
            )


def _check_chat_template(root: Path) -> None:
    if not (root / "tokenizer.json").is_file():
        return  # a hub id or a checkpoint without a local tokenizer: the engines decide
    if (root / "chat_template.jinja").is_file():
        return
    config_file = root / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (OSError, ValueError) as exc:
        raise GrpoConfigError(f"--model-path {root}: tokenizer_config.json: {exc}") from exc
    if not config.get("chat_template"):
        raise GrpoConfigError(
            f"--model-path {root}: the tokenizer has no chat template (a base model); give "
            "--no-apply-chat-template to send the prompts as raw text",
            field="apply_chat_template",
        )


def check_reward(config: GrpoConfig) -> None:
    """Every ``--reward`` loads and scores the first prompt (its label as the response)."""
    if not config.reward:
        return
    scorer = Scorer.from_specs(config.reward, max_new_tokens=config.max_new_tokens)
    first = _prompts(config)[0]
    response = "" if first.label is None else str(first.label)
    probe = Sample(prompt_ids=[0], response_ids=[0], rollout_logprobs=[0.0], loss_mask=[1],
                   metadata={**first.metadata, "prompt_index": first.index})  # fmt: skip
    x = reward_input(probe, first, lambda ids: response)
    for reward in scorer.rewards:
        (result,) = score([reward], [x])
        if result.failure is not None:
            raise GrpoConfigError(
                f"--reward {reward.name}: on row 1 (response = its label {response!r:.40}): "
                f"{result.failure}",
                field="reward",
            )


def check_eval(config: GrpoConfig) -> None:
    """Every ``--eval-data`` set loads; ``--eval-every`` has something to evaluate."""
    if config.eval_every and not config.eval_data:
        raise GrpoConfigError("--eval-every needs --eval-data (the prompts to evaluate on)")
    eval_sets(config)


def check_inputs(config: GrpoConfig) -> None:
    """``check_data``, ``check_reward`` and ``check_eval``."""
    check_data(config)
    check_reward(config)
    check_eval(config)
