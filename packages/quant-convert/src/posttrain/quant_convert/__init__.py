"""posttrain.quant_convert: HF BF16 checkpoints to NVFP4 (ModelOpt layout) for SGLang rollouts.

The quantizer (:func:`quantize_nvfp4`) is bit-exact to TransformerEngine's 1-D NVFP4 reference;
:func:`plan_conversion` / :func:`convert_checkpoint` stream a safetensors checkpoint to the
layout SGLang's ``modelopt_fp4`` loader reads, with an exclusion list checked against SGLang's
own matching rules; :func:`quantize_named_params` applies the same math during weight sync.

The NVFP4 layout itself (E2M1 code packing, names, dtypes, the quant config) is
``posttrain.formats``' (``posttrain.formats.dequantize_nvfp4`` reads what this writes).
"""

from posttrain.quant_convert._errors import (
    CheckpointError,
    ExclusionError,
    OutputError,
    QuantConvertError,
    QuantInputError,
    ResumeError,
)
from posttrain.quant_convert.convert import ConversionReport, ProgressEvent, convert_checkpoint
from posttrain.quant_convert.exclusions import ExclusionPlan, plan_exclusions
from posttrain.quant_convert.live import quantize_named_params, read_input_scales
from posttrain.quant_convert.nvfp4 import (
    NVFP4Config,
    NVFP4Tensor,
    quantize_nvfp4,
    quantize_nvfp4_pair,
)
from posttrain.quant_convert.plan import ConvertOptions, Plan, plan_conversion
from posttrain.quant_convert.selection import QuantPolicy, TensorInfo

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConversionReport",
    "ConvertOptions",
    "ExclusionError",
    "ExclusionPlan",
    "NVFP4Config",
    "NVFP4Tensor",
    "OutputError",
    "Plan",
    "ProgressEvent",
    "QuantConvertError",
    "QuantInputError",
    "QuantPolicy",
    "ResumeError",
    "TensorInfo",
    "convert_checkpoint",
    "plan_conversion",
    "plan_exclusions",
    "quantize_named_params",
    "quantize_nvfp4",
    "quantize_nvfp4_pair",
    "read_input_scales",
]
