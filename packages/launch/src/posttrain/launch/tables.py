"""The per-(model, hardware) and per-(family, generation) tables rules read.

Every table has an entry for every ``Hardware`` (or ``Generation``) member and every model or
family; a test walks the enums. "Not supported" is an explicit entry (an empty node set),
never a missing key, so a new member cannot reach a ``KeyError`` at launch time.

Provenance of the numbers: GLM-4.7-Flash rollout TP 2 on B200 and 1 on H200, the B200 MLA
ragged-prefill fix, Qwen3-MoE ``trtllm_mha`` + mxfp8 on Blackwell and blockwise fp8 on Hopper
come from the design note (measured upstream). The other Blackwell SKUs follow B200 by
generation; H100 and AMD entries are memory-budget defaults of ours, not measurements.
"""

from __future__ import annotations

from enum import StrEnum

from posttrain.launch.catalog import ModelFamily
from posttrain.launch.hardware import Generation, Hardware


class Precision(StrEnum):
    """The trainer's low-precision recipe (and, for nvfp4, the rollout checkpoint format)."""

    BF16 = "bf16"
    FP8_BLOCKWISE = "fp8-blockwise"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"


class EngineKind(StrEnum):
    SGLANG = "sglang"
    LOCAL = "local-engine"


class TrainerBackend(StrEnum):
    MEGATRON = "megatron"
    FSDP = "fsdp"


_H = Hardware
_ALL_GPU = frozenset({_H.H100, _H.H200, _H.B200, _H.B300, _H.GB200, _H.GB300, _H.MI300X, _H.MI355X})

# Rollout tensor parallel size per model and hardware; None: the model is not offered there.
ROLLOUT_TP: dict[str, dict[Hardware, int | None]] = {
    "glm-4.7-flash": {
        _H.H100: 2, _H.H200: 1, _H.B200: 2, _H.B300: 2, _H.GB200: 2, _H.GB300: 2,
        _H.MI300X: 1, _H.MI355X: 1, _H.CPU: None,
    },
    "qwen3-30b-a3b": {
        _H.H100: 2, _H.H200: 1, _H.B200: 1, _H.B300: 1, _H.GB200: 1, _H.GB300: 1,
        _H.MI300X: 1, _H.MI355X: 1, _H.CPU: None,
    },
    "qwen3-235b-a22b": {
        _H.H100: 8, _H.H200: 4, _H.B200: 4, _H.B300: 4, _H.GB200: 4, _H.GB300: 4,
        _H.MI300X: 4, _H.MI355X: 4, _H.CPU: None,
    },
    "qwen3-8b": {
        _H.H100: 1, _H.H200: 1, _H.B200: 1, _H.B300: 1, _H.GB200: 1, _H.GB300: 1,
        _H.MI300X: 1, _H.MI355X: 1, _H.CPU: None,
    },
    "posttrain-tiny-moe": {
        _H.H100: 1, _H.H200: 1, _H.B200: 1, _H.B300: 1, _H.GB200: 1, _H.GB300: 1,
        _H.MI300X: 1, _H.MI355X: 1, _H.CPU: 1,
    },
}  # fmt: skip

# Node counts a plan may span per model and hardware; empty: not offered.
SUPPORTED_NODES: dict[str, dict[Hardware, frozenset[int]]] = {
    "glm-4.7-flash": {h: frozenset({1, 2, 4}) for h in _ALL_GPU} | {_H.CPU: frozenset()},
    "qwen3-30b-a3b": {h: frozenset({1, 2, 4, 8}) for h in _ALL_GPU} | {_H.CPU: frozenset()},
    "qwen3-235b-a22b": {
        _H.H100: frozenset({4, 8, 16}), _H.H200: frozenset({2, 4, 8, 16}),
        _H.B200: frozenset({2, 4, 8, 16}), _H.B300: frozenset({2, 4, 8, 16}),
        _H.GB200: frozenset({4, 8, 16}), _H.GB300: frozenset({4, 8, 16}),
        _H.MI300X: frozenset({2, 4, 8, 16}), _H.MI355X: frozenset({2, 4, 8, 16}),
        _H.CPU: frozenset(),
    },
    "qwen3-8b": {h: frozenset({1, 2}) for h in _ALL_GPU} | {_H.CPU: frozenset()},
    "posttrain-tiny-moe": {h: frozenset({1}) for h in _ALL_GPU} | {_H.CPU: frozenset({1})},
}  # fmt: skip

# Trainer (Megatron) tensor parallel size per model; expert parallel is derived (rules.py).
TRAINER_TP: dict[str, int] = {
    "glm-4.7-flash": 1,
    "qwen3-30b-a3b": 1,
    "qwen3-235b-a22b": 4,
    "qwen3-8b": 1,
    "posttrain-tiny-moe": 1,
}

# Default trainer precision per family and generation: the upstream Megatron recipes. A
# backend that cannot run a recipe (BACKEND_PRECISIONS) trains that default in bf16 instead,
# and the plan says so; an explicit --precision it cannot run is refused.
DEFAULT_PRECISION: dict[ModelFamily, dict[Generation, Precision]] = {
    ModelFamily.QWEN3_MOE: {
        Generation.HOPPER: Precision.FP8_BLOCKWISE, Generation.BLACKWELL: Precision.MXFP8,
        Generation.CDNA3: Precision.BF16, Generation.CDNA4: Precision.BF16,
        Generation.CPU: Precision.BF16,
    },
    ModelFamily.GLM4_MOE_LITE: dict.fromkeys(Generation, Precision.BF16),
    ModelFamily.QWEN3: dict.fromkeys(Generation, Precision.BF16),
}  # fmt: skip

# Generations each precision may run on (fp4/mxfp8 are Blackwell-only).
PRECISION_GENERATIONS: dict[Precision, frozenset[Generation]] = {
    Precision.BF16: frozenset(Generation),
    Precision.FP8_BLOCKWISE: frozenset({Generation.HOPPER, Generation.BLACKWELL}),
    Precision.MXFP8: frozenset({Generation.BLACKWELL}),
    Precision.NVFP4: frozenset({Generation.BLACKWELL}),
}

# The SGLang attention backend a family gets by default per generation; None: SGLang's own.
DEFAULT_ATTENTION_BACKEND: dict[ModelFamily, dict[Generation, str | None]] = {
    ModelFamily.QWEN3_MOE: {
        Generation.HOPPER: None, Generation.BLACKWELL: "trtllm_mha",
        Generation.CDNA3: "aiter", Generation.CDNA4: "aiter", Generation.CPU: None,
    },
    ModelFamily.GLM4_MOE_LITE: {
        Generation.HOPPER: None, Generation.BLACKWELL: None,
        Generation.CDNA3: "aiter", Generation.CDNA4: "aiter", Generation.CPU: None,
    },
    ModelFamily.QWEN3: {
        Generation.HOPPER: None, Generation.BLACKWELL: None,
        Generation.CDNA3: "aiter", Generation.CDNA4: "aiter", Generation.CPU: None,
    },
}  # fmt: skip

ENGINE_KIND: dict[Generation, EngineKind] = {
    Generation.HOPPER: EngineKind.SGLANG,
    Generation.BLACKWELL: EngineKind.SGLANG,
    Generation.CDNA3: EngineKind.SGLANG,
    Generation.CDNA4: EngineKind.SGLANG,
    Generation.CPU: EngineKind.LOCAL,
}

# The trainer backend per generation: GPUs train on posttrain.grpo's megatron backend
# (tensor, sequence and expert parallel over the trainer ranks); the CPU default on FSDP.
TRAINER_BACKEND: dict[Generation, TrainerBackend] = {
    Generation.HOPPER: TrainerBackend.MEGATRON,
    Generation.BLACKWELL: TrainerBackend.MEGATRON,
    Generation.CDNA3: TrainerBackend.MEGATRON,
    Generation.CDNA4: TrainerBackend.MEGATRON,
    Generation.CPU: TrainerBackend.FSDP,
}

# The precisions each trainer backend can train in. Both train in bf16; nvfp4 there means
# bf16 training with NVFP4 rollout weights (the trainer re-quantizes on every weight sync).
# The fp8/fp4 training recipes need Transformer Engine's low-precision linears, which
# neither backend of this build uses: a plan whose table recipe is one of them trains in
# bf16 and says so (``Resolved.deferred_precision``).
BACKEND_PRECISIONS: dict[TrainerBackend, frozenset[Precision]] = {
    TrainerBackend.FSDP: frozenset({Precision.BF16, Precision.NVFP4}),
    TrainerBackend.MEGATRON: frozenset({Precision.BF16, Precision.NVFP4}),
}

# The variable that selects visible accelerators on a node, per generation.
VISIBLE_DEVICES_VAR: dict[Generation, str | None] = {
    Generation.HOPPER: "CUDA_VISIBLE_DEVICES",
    Generation.BLACKWELL: "CUDA_VISIBLE_DEVICES",
    Generation.CDNA3: "HIP_VISIBLE_DEVICES",
    Generation.CDNA4: "HIP_VISIBLE_DEVICES",
    Generation.CPU: None,
}

# Attention backends for which the GLM-4.7-Flash Blackwell fix (paged MLA prefill) applies.
FLASHINFER_MLA_BACKENDS: frozenset[str | None] = frozenset({None, "default", "flashinfer"})
