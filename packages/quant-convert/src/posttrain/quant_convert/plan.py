"""Plan a conversion from safetensors headers and config.json alone (no weight is read).

The plan fixes everything the run needs: which tensors are quantized, each output shard's
exact layout (so the writer can lay the header out first), the gate/up partners (a partner
in another shard is read once more, for its amax only), the exclusion list, and a
fingerprint of inputs and options that a resume must match.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.formats import NVFP4Part, nvfp4_layout
from posttrain.interface import NVFP4Precision
from posttrain.quant_convert._errors import CheckpointError
from posttrain.quant_convert.exclusions import ExclusionPlan, ExclusionStyle, plan_exclusions
from posttrain.quant_convert.nvfp4 import NVFP4Config
from posttrain.quant_convert.safetensors_io import (
    DTYPE_BYTES,
    HeaderEntry,
    read_header,
    read_json_object,
)
from posttrain.quant_convert.selection import QuantPolicy, TensorInfo, gate_up_role, select_tensors

__all__ = ["ConvertOptions", "OutputTensor", "Plan", "ShardPlan", "plan_conversion"]

FORMAT_VERSION = 1
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "weight_scale_inv",
                   "k_scale", "v_scale", "weight_global_scale", "weight_packed")  # fmt: skip
_UNQUANTIZED_METHODS = (None, "", "bf16")
OutputKind = Literal["copy"] | NVFP4Part
"""``copy``: a source tensor written unchanged; else the NVFP4 part (``weight`` holds the codes)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ConvertOptions:
    """Everything besides the paths that decides the output bytes (recorded in the manifest).

    ``precision`` is the interface's NVFP4 contract (scale rounding, 4-over-6, input_scale,
    KV-cache algo) that trainer, converter and engine share; ``e4m3_max`` is TE's Emax switch
    for the global scale (None: 448, or 256 with 4-over-6).
    """

    precision: NVFP4Precision = field(default_factory=NVFP4Precision)
    e4m3_max: float | None = None
    policy: QuantPolicy = field(default_factory=QuantPolicy)
    exclusion_style: ExclusionStyle = "compact"

    @property
    def quant(self) -> NVFP4Config:
        return NVFP4Config.from_precision(self.precision, e4m3_max=self.e4m3_max)

    @property
    def input_scale(self) -> float | None:
        return self.precision.input_scale

    @property
    def kv_cache_quant_algo(self) -> Literal["FP8"] | None:
        return self.precision.kv_cache_quant_algo

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "precision": {
                "group_size": self.precision.group_size,
                "scale_rounding": self.precision.scale_rounding.value,
                "four_over_six": self.precision.four_over_six.value,
                "input_scale": self.precision.input_scale,
                "kv_cache_quant_algo": self.precision.kv_cache_quant_algo,
            },
            "e4m3_max": self.quant.emax,
            "num_layers_at_start_in_bf16": self.policy.num_layers_at_start_in_bf16,
            "num_layers_at_end_in_bf16": self.policy.num_layers_at_end_in_bf16,
            "keep_patterns": list(self.policy.keep_patterns),
            "include_shared_experts": self.policy.include_shared_experts,
            "quantize_3d_experts": self.policy.quantize_3d_experts,
            "exclusion_style": self.exclusion_style,
        }


@dataclass(slots=True, frozen=True)
class OutputTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    source: str
    kind: OutputKind

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True, frozen=True)
class ShardPlan:
    file: str
    source_bytes: int
    outputs: tuple[OutputTensor, ...]

    @property
    def output_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass(slots=True, frozen=True)
class Plan:
    src: Path
    options: ConvertOptions
    config: dict[str, Any]
    num_layers: int
    shards: tuple[ShardPlan, ...]
    quantized: frozenset[str]
    partners: dict[str, str]  # quantized gate <-> up
    tensor_file: dict[str, str]
    exclusions: ExclusionPlan
    fingerprints: dict[str, dict[str, Any]]
    fingerprint: str
    other_files: tuple[str, ...]

    @property
    def source_bytes(self) -> int:
        return sum(s.source_bytes for s in self.shards)

    @property
    def output_bytes(self) -> int:
        return sum(s.output_bytes for s in self.shards)


def _num_layers(config: dict[str, Any], src: Path) -> int:
    for holder in (config, config.get("text_config"), config.get("llm_config")):
        n = holder.get("num_hidden_layers") if isinstance(holder, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            return n
    raise CheckpointError(f"{src / 'config.json'}: no num_hidden_layers (nor text_config's)")


def _check_not_quantized(config: dict[str, Any], names: list[str], src: Path) -> None:
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in _UNQUANTIZED_METHODS:
        raise CheckpointError(
            f"{src}: already quantized (quantization_config.quant_method={method!r})"
        )
    for n in names:
        if n.rsplit(".", 1)[-1] in _SCALE_SUFFIXES:
            raise CheckpointError(f"{src}: already quantized (tensor {n} is a quantization scale)")


def _source_files(src: Path) -> list[Path]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        if list(src.glob("*.bin")):
            raise CheckpointError(
                f"{src}: only *.bin weights; convert them to safetensors first (torch.load of "
                "pickles is unsafe and cannot be streamed)"
            )
        raise CheckpointError(f"{src}: no *.safetensors files")
    index = src / "model.safetensors.index.json"
    if index.exists():
        wm = read_json_object(index, CheckpointError).get("weight_map")
        if not isinstance(wm, dict) or not all(
            isinstance(f, str) and f and "/" not in f and f not in (".", "..") for f in wm.values()
        ):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        listed = sorted({src / f for f in wm.values()})
        missing = [f for f in listed if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: lists {missing[0].name}, which does not exist")
        return listed
    return files


_REWRITTEN = frozenset({"model.safetensors.index.json", "config.json", "hf_quant_config.json"})


def _other_files(src: Path) -> tuple[str, ...]:
    """Files copied as they are: everything but weights, the rewritten metadata and VCS dirs."""
    out = []
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if not p.is_file() or rel.parts[0] in (".git", ".quant-convert"):
            continue
        if len(rel.parts) == 1 and (p.suffix in (".safetensors", ".bin") or p.name in _REWRITTEN):
            continue
        out.append(rel.as_posix())
    return tuple(sorted(out))


def _fingerprint(path: Path, raw_header: bytes) -> dict[str, Any]:
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "header_sha256": hashlib.sha256(raw_header).hexdigest(),
    }


def plan_conversion(src: Path | str, options: ConvertOptions | None = None) -> Plan:
    """Plan converting checkpoint ``src``; reads config.json and safetensors headers only."""
    src = Path(src)
    options = options or ConvertOptions()
    options.quant.validate()
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{src}: no config.json")
    config = read_json_object(cfg_path, CheckpointError)
    num_layers = _num_layers(config, src)
    files = _source_files(src)

    headers: dict[str, dict[str, HeaderEntry]] = {}
    fps: dict[str, dict[str, Any]] = {}
    tensor_file: dict[str, str] = {}
    for f in files:
        entries, _, raw = read_header(f)
        headers[f.name] = entries
        fps[f.name] = _fingerprint(f, raw)
        for name in entries:
            if name in tensor_file:
                raise CheckpointError(f"{name}: in both {tensor_file[name]} and {f.name}")
            tensor_file[name] = f.name
    names = sorted(tensor_file)
    _check_not_quantized(config, names, src)
    infos = [
        TensorInfo(n, headers[tensor_file[n]][n].dtype, headers[tensor_file[n]][n].shape)
        for n in names
    ]
    quantized = select_tensors(infos, options.policy, num_layers)
    exclusions = plan_exclusions(infos, quantized, options.exclusion_style)

    roles: dict[str, dict[str, str]] = {}
    for n in quantized:
        r = gate_up_role(n)
        if r is not None:
            roles.setdefault(r[0], {})[r[1]] = n
    partners: dict[str, str] = {}
    for slot in roles.values():
        partners[slot["gate"]] = slot["up"]
        partners[slot["up"]] = slot["gate"]

    shards = tuple(
        _plan_shard(f.name, headers[f.name], quantized, partners, options, set(tensor_file))
        for f in files
    )
    other = _other_files(src)
    blob = json.dumps({"inputs": fps, "options": options.to_json()}, sort_keys=True)
    return Plan(
        src=src,
        options=options,
        config=config,
        num_layers=num_layers,
        shards=shards,
        quantized=quantized,
        partners=partners,
        tensor_file=tensor_file,
        exclusions=exclusions,
        fingerprints=fps,
        fingerprint=hashlib.sha256(blob.encode()).hexdigest(),
        other_files=other,
    )


def _plan_shard(
    file: str,
    entries: dict[str, HeaderEntry],
    quantized: frozenset[str],
    partners: dict[str, str],
    options: ConvertOptions,
    all_names: set[str],
) -> ShardPlan:
    order = sorted(entries.values(), key=lambda e: e.begin)
    emitted: set[str] = set()
    outputs: list[OutputTensor] = []
    for e in order:
        if e.name in emitted:
            continue
        group = [e]
        partner = partners.get(e.name)
        if partner is not None and partner in entries and partner not in emitted:
            group.append(entries[partner])  # write the pair back to back: one read each
        for g in group:
            emitted.add(g.name)
            if g.name not in quantized:
                outputs.append(OutputTensor(g.name, g.dtype, g.shape, g.name, "copy"))
                continue
            layout = nvfp4_layout(g.name, g.shape, input_scale=options.input_scale is not None)
            new = [
                OutputTensor(t.name, t.safetensors_dtype, t.shape, g.name, t.part) for t in layout
            ]
            for o in new[1:]:
                if o.name in all_names:
                    raise CheckpointError(f"{o.name}: output key collides with a source tensor")
            outputs.extend(new)
    return ShardPlan(file, sum(e.nbytes for e in order), tuple(outputs))
