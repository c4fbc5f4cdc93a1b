"""Save and load model directories: ``config.json`` + ``model.safetensors`` in the HF layout.

A directory written here loads with ``transformers.AutoModelForCausalLM`` (as
``Qwen3MoeForCausalLM``) and, when a tokenizer was passed, with ``AutoTokenizer``.
Each file is written atomically (``posttrain.formats.write_bytes_atomic``: temp name,
fsync, rename, fsync of the directory), weights before ``config.json``, so a crash never
leaves a directory that looks complete. Loading reads
``model.safetensors`` or the shards listed by ``model.safetensors.index.json``.

**Multi-token-prediction (MTP) layers.** DeepSeek-V3 and GLM-4.x checkpoints carry
``num_nextn_predict_layers`` extra layers after the decoder, ``model.layers.{num_hidden_layers
+ i}.*`` (a decoder layer plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``,
``embed_tokens``), which transformers' ``DeepseekV3ForCausalLM`` / ``Glm4MoeLiteForCausalLM``
ignore on load and SGLang reads only as the draft model of speculative decoding (NEXTN /
EAGLE). ``load_hf_tensors`` skips exactly the layers ``config.json`` declares, without reading
them, and says so once per directory (a ``posttrain.models`` warning); a tensor past the
decoder that the config does not declare is still an unknown tensor. Nothing trains them and
``save_pretrained`` writes only the decoder (DeepSeek-V3's ``config.json`` then says
``num_nextn_predict_layers: 0``): to serve a trained checkpoint with speculative decoding,
copy the MTP layers back from the base checkpoint.

safetensors is imported on first use, so the model code imports without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
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
MTP_LAYERS_FIELD = "num_nextn_predict_layers"

_log = logging.getLogger("posttrain.models")
_reported_mtp: set[str] = set()  # directories whose skipped MTP layers were already reported


def mtp_layer_prefixes(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The name prefixes (``model.layers.{j}.``) of the MTP layers a ``config.json`` dict
    declares: ``num_nextn_predict_layers`` layers right after ``num_hidden_layers``."""
    count = config.get(MTP_LAYERS_FIELD) or 0
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise CheckpointError(f"config.json: {MTP_LAYERS_FIELD}={count!r} must be an int >= 0")
    layers = config.get("num_hidden_layers")
    if not count or not isinstance(layers, int) or isinstance(layers, bool):
        return ()
    return tuple(f"model.layers.{layers + i}." for i in range(count))


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
    mtp = _mtp_prefixes_of(root)
    tensors: dict[str, torch.Tensor] = {}
    skipped: set[str] = set()
    for name in files:
        file = root / name
        if not file.exists():
            raise CheckpointError(f"shard {file} listed in {INDEX_NAME} does not exist")
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if key in tensors or key in skipped:
                    raise CheckpointError(f"tensor {key!r} appears in two shards of {root}")
                if mtp and key.startswith(mtp):
                    skipped.add(key)  # never read (module doc)
                    continue
                tensors[key] = f.get_tensor(key)
    if skipped and str(root) not in _reported_mtp:
        _reported_mtp.add(str(root))
        layers = ", ".join(f"{p}*" for p in mtp)
        _log.warning(
            "%s: skipped the %d tensors of its multi-token-prediction layers (%s; "
            "%s=%d): posttrain does not train or save them, so a checkpoint it writes has "
            "none (copy them back from this checkpoint to serve it with speculative decoding)",
            root, len(skipped), layers, MTP_LAYERS_FIELD, len(mtp),
        )  # fmt: skip
    return tensors


def _mtp_prefixes_of(root: Path) -> tuple[str, ...]:
    """``mtp_layer_prefixes`` of the directory's ``config.json`` (none without one)."""
    file = root / CONFIG_NAME
    if not file.exists():
        return ()
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    return mtp_layer_prefixes(data) if isinstance(data, dict) else ()


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
