"""The model gate of a GRPO run: the checkpoint's family, applied before anything starts.

``check_model(config)`` reads ``--model-path``'s ``config.json`` (a local directory, or a hub
id from the local Hugging Face cache; never a download) and ``--engine-model-path``'s when
given, and applies ``posttrain.models``' family gate: an architecture or a feature the
decoder does not compute exactly (a rope type, MLA, Gemma's norms, ...) fails here, in about a
second, with a ``GrpoConfigError`` naming the flag, the architecture and the feature, rather
than after the engines and trainer ranks have started. It also checks that every
``--lora-targets`` name exists in that architecture, and refuses q/k/v biases (Qwen2) on the
megatron backend, whose parallel linears have none (MLA models, DeepSeek-V3 and
GLM-4.x-MoE-Lite, train there under TP, EP and sequence parallel like the others).

``resolve_model_paths(config)`` gives the config back with hub ids replaced by their cached
directories (what the trainer and the engines load). ``--dry-run`` runs ``check_model``;
so does a real run, before spawning ranks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.config import GrpoConfig

__all__ = ["check_model", "resolve_model_paths"]


def _resolve(flag: str, location: Path) -> Path:
    from posttrain.models import ModelsError, resolve_model_dir

    try:
        return resolve_model_dir(location)
    except ModelsError as exc:
        raise GrpoConfigError(f"{flag}: {exc}", field=flag[2:].replace("-", "_")) from None


def check_model(config: GrpoConfig) -> None:
    """Apply the model gate to ``config`` (see the module doc); None when it passes or when
    there is no ``--model-path`` to check."""
    if config.model_path is None:
        return
    from posttrain.grpo.trainer import backend_for
    from posttrain.models import ModelConfigError, ModelsError, load_config, lora_targets

    for flag, location in (
        ("--model-path", config.model_path),
        ("--engine-model-path", config.engine_model_path),
    ):
        if location is None:
            continue
        directory = _resolve(flag, location)
        try:
            model = load_config(directory, kv_capacity=config.context_length)
        except (ModelConfigError, ModelsError) as exc:
            field = flag[2:].replace("-", "_")
            raise GrpoConfigError(f"{flag} {location}: {exc}", field=field) from None
        if flag != "--model-path":
            continue
        backend_for(config.backend).check_model(config, model, str(location))
        if config.train != "lora":
            continue
        leaves = {name.rsplit(".", 1)[-1] for name in lora_targets(model)}
        missing = [t for t in config.lora_targets if t.rsplit(".", 1)[-1] not in leaves]
        if missing:
            raise GrpoConfigError(
                f"--lora-targets {','.join(missing)}: no such linear in {location} "
                f"({model.family} family); its linears are {sorted(leaves)}",
                field="lora_targets",
            )


def resolve_model_paths(config: GrpoConfig) -> GrpoConfig:
    """``config`` with ``model_path`` / ``engine_model_path`` hub ids replaced by their cached
    directories (unchanged when both are local directories or unset)."""
    model, engine = config.model_path, config.engine_model_path
    if model is not None and not Path(model).is_dir():
        model = _resolve("--model-path", model)
    if engine is not None and not Path(engine).is_dir():
        engine = _resolve("--engine-model-path", engine)
    if (model, engine) == (config.model_path, config.engine_model_path):
        return config
    return dataclasses.replace(config, model_path=model, engine_model_path=engine)
