"""Save and load model directories: ``config.json`` + ``model.safetensors`` in the HF layout.

A directory written here loads with ``transformers.AutoModelForCausalLM`` (as
``Qwen3MoeForCausalLM``) and, when a tokenizer was passed, with ``AutoTokenizer``.
Each file is written atomically (``posttrain.formats.write_bytes_atomic``: temp name,
fsync, rename, fsync of the directory), weights before ``config.json``, so a crash never
leaves a directory that looks complete. Loading reads
``model.safetensors`` or the shards listed by ``model.safetensors.index.json``.

safetensors is imported on first use, so the model code imports without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from posttrain.formats import write_bytes_atomic
from posttrain.models._config import ModelConfig
from posttrain.models._errors import CheckpointError
from posttrain.models._hub import resolve_model_dir
from posttrain.models._model import DecoderModel, Numerics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def save_pretrained(
    model: DecoderModel,
    path: str | Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Write ``model`` (and ``tokenizer``, if given) to directory ``path``; return it."""
    out = save_hf_weights(path, model.hf_state_dict(), model.config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def save_hf_weights(path: str | Path, tensors: dict[str, Tensor], config: ModelConfig) -> Path:
    """Write HF-named ``tensors`` (``model.safetensors``) and ``config`` (``config.json``) to
    directory ``path``, each file atomically: a model directory ``load_pretrained`` opens
    (e.g. weights gathered from shards that no single ``DecoderModel`` holds)."""
    from safetensors.torch import save

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_bytes_atomic(out / WEIGHTS_NAME, save(cpu, metadata={"format": "pt"}))
    text = json.dumps(config.to_hf_dict(), indent=2, sort_keys=True) + "\n"
    write_bytes_atomic(out / CONFIG_NAME, text.encode())
    return out


def load_config(path: str | Path, *, kv_capacity: int | None = None) -> ModelConfig:
    """Read ``config.json`` from a model directory (or a cached hub id, see ``_hub``) through
    the family gate; ``kv_capacity`` sets ``ModelConfig.kv_capacity``."""
    file = resolve_model_dir(path) / CONFIG_NAME
    try:
        data: dict[str, Any] = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    config = ModelConfig.from_hf_dict(data)
    return config if kv_capacity is None else config.replace(kv_capacity=kv_capacity)


def load_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory under their HF names (single file or shards)."""
    from safetensors import safe_open

    root = resolve_model_dir(path)
    if (root / INDEX_NAME).exists():
        index = json.loads((root / INDEX_NAME).read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
    elif (root / WEIGHTS_NAME).exists():
        files = [WEIGHTS_NAME]
    else:
        raise CheckpointError(f"{root} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = root / name
        if not file.exists():
            raise CheckpointError(f"shard {file} listed in {INDEX_NAME} does not exist")
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if key in tensors:
                    raise CheckpointError(f"tensor {key!r} appears in two shards of {root}")
                tensors[key] = f.get_tensor(key)
    return tensors


def load_pretrained(
    path: str | Path, *, numerics: Numerics = Numerics.STRICT, kv_capacity: int | None = None
) -> DecoderModel:
    """Build a model from a directory written by ``save_pretrained`` (or any supported
    family's HF directory, or a cached hub id); ``kv_capacity``: see ``ModelConfig``.

    Tensors must have exactly the config's dtype; a dtype change raises
    ``TensorSpecMismatchError`` rather than being cast (G1).
    """
    config = load_config(path, kv_capacity=kv_capacity)
    model = DecoderModel(config, numerics=numerics)
    model.load_hf_state_dict(load_hf_tensors(path))
    return model
