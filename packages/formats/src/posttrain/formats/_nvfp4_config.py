"""The NVFP4 quant config of a checkpoint directory, both directions.

A ModelOpt NVFP4 checkpoint declares itself twice, and SGLang reads the first it finds:

* ``config.json`` -> ``quantization_config``: ``quant_algo "NVFP4"``, ``quant_method
  "modelopt"``, ``group_size 16``, ``ignore`` (the modules kept in high precision) and, with
  an FP8 KV cache, ``kv_cache_scheme {"dynamic": false, "num_bits": 8, "type": "float"}``;
* ``hf_quant_config.json`` -> ``quantization``: ``quant_algo``, ``kv_cache_quant_algo``,
  ``group_size``, ``exclude_modules``.

:func:`nvfp4_config_sections` writes both (merged into what the source checkpoint had), and
:func:`read_nvfp4_quant_config` reads them back in SGLang's order. Unreadable JSON, a section
that is not an object, another ``quant_algo`` or a group size other than 16 raise
:class:`NVFP4FormatError` naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.formats._errors import NVFP4FormatError
from posttrain.formats._nvfp4 import GROUP_SIZE

__all__ = ["NVFP4QuantConfig", "nvfp4_config_sections", "read_nvfp4_quant_config"]

_FP8_KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
_FP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float"}


@dataclass(frozen=True, slots=True, kw_only=True)
class NVFP4QuantConfig:
    """What an NVFP4 checkpoint declares: the modules left unquantized and the KV-cache algo."""

    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = "FP8"
    group_size: int = GROUP_SIZE
    source: str = ""
    """The file it was read from (empty for one built in memory)."""


def nvfp4_config_sections(
    config: NVFP4QuantConfig,
    *,
    config_section: Mapping[str, Any] | None = None,
    hf_quant_config: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config.json quantization_config, hf_quant_config.json)`` declaring ``config``.

    ``config_section`` / ``hf_quant_config`` are what the source checkpoint had (kept, with our
    keys set over them); existing ``config_groups`` get NVFP4 weight/activation arguments.
    """
    exclude = list(config.exclude_modules)
    qc = dict(config_section) if isinstance(config_section, Mapping) else {}
    qc.update(quant_algo="NVFP4", quant_method="modelopt", group_size=GROUP_SIZE, ignore=exclude)
    if config.kv_cache_quant_algo == "FP8":
        qc.setdefault("kv_cache_scheme", dict(_FP8_KV_SCHEME))
    else:
        qc.pop("kv_cache_scheme", None)
    groups = qc.get("config_groups")
    if isinstance(groups, dict):  # copied where changed: the caller's section stays as it was
        qc["config_groups"] = groups = dict(groups)
        for name, g in groups.items():
            if not isinstance(g, dict):  # source bytes: untrusted
                continue
            g = groups[name] = dict(g)
            g.setdefault("targets", ["Linear"])
            for key in ("weights", "input_activations"):
                args = g.get(key, _FP4_ARGS)
                if isinstance(args, dict):
                    g[key] = {**args, "group_size": GROUP_SIZE}
    hq: dict[str, Any] = {"producer": {"name": "modelopt"}}
    if hf_quant_config is not None:
        hq = dict(hf_quant_config)
    hq["quantization"] = {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": config.kv_cache_quant_algo,
        "group_size": GROUP_SIZE,
        "exclude_modules": exclude,
    }
    return qc, hq


def _json_object(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise NVFP4FormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise NVFP4FormatError(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


def _section(path: Path, key: str) -> dict[str, Any] | None:
    data = _json_object(path)
    section = None if data is None else data.get(key)
    if section is None or section == {}:
        return None
    if not isinstance(section, dict):
        raise NVFP4FormatError(f"{path}: {key} is a {type(section).__name__}, not an object")
    return section


def _strings(path: Path, field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise NVFP4FormatError(f"{path}: {field} must be a list of module names")
    if not all(isinstance(v, str) for v in value):
        raise NVFP4FormatError(f"{path}: {field} holds a value that is not a string")
    return tuple(value)


def read_nvfp4_quant_config(model_dir: str | os.PathLike[str]) -> NVFP4QuantConfig | None:
    """The NVFP4 declaration of ``model_dir``, or None when it declares no quantization.

    ``config.json``'s ``quantization_config`` is read first, then ``hf_quant_config.json``
    (SGLang's order). A ``quant_algo`` other than NVFP4 raises :class:`NVFP4FormatError`.
    """
    root = Path(model_dir)
    path = root / "config.json"
    qc = _section(path, "quantization_config")
    if qc is None:
        path = root / "hf_quant_config.json"
        qc = _section(path, "quantization")
    if qc is None:
        return None
    algo = qc.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != "NVFP4":
        raise NVFP4FormatError(f"{path}: quant_algo {algo!r} is not supported (only NVFP4)")
    group = qc.get("group_size", GROUP_SIZE)
    if group != GROUP_SIZE or isinstance(group, bool):
        raise NVFP4FormatError(f"{path}: NVFP4 group_size {group!r}, expected {GROUP_SIZE}")
    field = "exclude_modules" if "exclude_modules" in qc else "ignore"
    exclude = _strings(path, field, qc.get(field))
    if "kv_cache_quant_algo" in qc:
        kv = qc["kv_cache_quant_algo"]
        if kv is not None and not isinstance(kv, str):
            raise NVFP4FormatError(f"{path}: kv_cache_quant_algo {kv!r} is not a string")
    else:
        scheme = qc.get("kv_cache_scheme")
        fp8 = isinstance(scheme, dict) and (scheme.get("num_bits"), scheme.get("type")) == (
            8,
            "float",
        )
        kv = "FP8" if fp8 else None
    return NVFP4QuantConfig(exclude_modules=exclude, kv_cache_quant_algo=kv, source=str(path))
