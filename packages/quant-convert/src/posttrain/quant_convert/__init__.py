"""posttrain.quant_convert: HF BF16 checkpoints to NVFP4 (ModelOpt layout) for SGLang rollouts."""

from posttrain.quant_convert.errors import (
    CheckpointError,
    ExclusionError,
    QuantConvertError,
    QuantInputError,
    ResumeError,
)
from posttrain.quant_convert.nvfp4 import (
    NVFP4Config,
    NVFP4Tensor,
    dequantize_nvfp4,
    quantize_nvfp4,
    quantize_nvfp4_pair,
)

__all__ = [
    "CheckpointError",
    "ExclusionError",
    "NVFP4Config",
    "NVFP4Tensor",
    "QuantConvertError",
    "QuantInputError",
    "ResumeError",
    "dequantize_nvfp4",
    "quantize_nvfp4",
    "quantize_nvfp4_pair",
]
