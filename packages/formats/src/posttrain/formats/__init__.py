"""posttrain.formats: every format two posttrain packages exchange, implemented once.

Each format lives here in both directions (write and read), so the two packages
that exchange it cannot drift apart. Depends only on ``posttrain-interface``,
torch, safetensors and httpx (for the one client it owns).

* NVFP4 tensors (ModelOpt layout): ``nvfp4_layout`` (names, dtypes, shapes),
  ``pack_e2m1_codes`` / ``unpack_e2m1_codes`` / ``e2m1_code_values``, ``dequantize_nvfp4``,
  ``dequantize_nvfp4_state_dict``, and the checkpoint's quant config
  (``nvfp4_config_sections`` / ``read_nvfp4_quant_config``).
* PEFT LoRA adapters: ``write_peft_adapter`` / ``read_peft_adapter``, key normalisation
  (``peft_key``, ``parse_peft_key``, ``peft_modules``), ``adapter_config.json`` <-> ``LoraSpec``
  (``peft_config_from_spec`` / ``parse_peft_config``), ``build_peft_adapter`` for tensors that
  arrive without a directory.
* safetensors writing without numpy: ``write_safetensors``, ``safetensors_header`` (the
  layout, for writers that stream), ``tensor_bytes``, ``SAFETENSORS_DTYPES``.
* Atomic writes with directory fsync: ``write_bytes_atomic``, ``write_text_atomic``,
  ``AtomicFile``, ``atomic_directory``, ``replace_directory``, ``fsync_dir``, ``fsync_tree``.

Error tree (rooted in ``posttrain.interface.PosttrainError``)::

    FormatsError                     a payload, file or request in one of our formats is invalid
    ├── NVFP4FormatError (ValueError)  an NVFP4 tensor group or quant config is malformed
    └── PeftFormatError (ValueError)   a PEFT LoRA adapter is malformed
        ├── PeftConfigError            adapter_config.json: not an object, a field missing or
        │                              invalid, target_modules that do not select the tensors
        └── PeftTensorError            adapter_model.safetensors: corrupt, a non-PEFT key, a
                                       non-float dtype, NaN/Inf, a shape that disagrees with r,
                                       a factor without its pair

Atomic writes raise ``OSError`` as the operating system reports it; the target is left as it was.
"""

from posttrain.formats._atomic import (
    AtomicFile,
    atomic_directory,
    fsync_dir,
    fsync_tree,
    replace_directory,
    write_bytes_atomic,
    write_text_atomic,
)
from posttrain.formats._errors import (
    FormatsError,
    NVFP4FormatError,
    PeftConfigError,
    PeftFormatError,
    PeftTensorError,
)
from posttrain.formats._nvfp4 import (
    E2M1_VALUES,
    GROUP_SIZE,
    NVFP4Part,
    NVFP4TensorSpec,
    dequantize_nvfp4,
    dequantize_nvfp4_state_dict,
    e2m1_code_values,
    nvfp4_layout,
    pack_e2m1_codes,
    unpack_e2m1_codes,
)
from posttrain.formats._nvfp4_config import (
    NVFP4QuantConfig,
    nvfp4_config_sections,
    read_nvfp4_quant_config,
)
from posttrain.formats._peft import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    ALL_LINEAR,
    PEFT_KEY_PREFIX,
    PEFT_TENSOR_DTYPES,
    PeftAdapter,
    build_peft_adapter,
    module_is_targeted,
    parse_peft_config,
    parse_peft_key,
    peft_config_from_spec,
    peft_key,
    peft_modules,
    read_peft_adapter,
    write_peft_adapter,
)
from posttrain.formats._safetensors import (
    SAFETENSORS_DTYPES,
    safetensors_header,
    tensor_bytes,
    write_safetensors,
)

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ALL_LINEAR",
    "E2M1_VALUES",
    "GROUP_SIZE",
    "PEFT_KEY_PREFIX",
    "PEFT_TENSOR_DTYPES",
    "SAFETENSORS_DTYPES",
    "AtomicFile",
    "FormatsError",
    "NVFP4FormatError",
    "NVFP4Part",
    "NVFP4QuantConfig",
    "NVFP4TensorSpec",
    "PeftAdapter",
    "PeftConfigError",
    "PeftFormatError",
    "PeftTensorError",
    "atomic_directory",
    "build_peft_adapter",
    "dequantize_nvfp4",
    "dequantize_nvfp4_state_dict",
    "e2m1_code_values",
    "fsync_dir",
    "fsync_tree",
    "module_is_targeted",
    "nvfp4_config_sections",
    "nvfp4_layout",
    "pack_e2m1_codes",
    "parse_peft_config",
    "parse_peft_key",
    "peft_config_from_spec",
    "peft_key",
    "peft_modules",
    "read_nvfp4_quant_config",
    "read_peft_adapter",
    "replace_directory",
    "safetensors_header",
    "tensor_bytes",
    "unpack_e2m1_codes",
    "write_bytes_atomic",
    "write_peft_adapter",
    "write_safetensors",
    "write_text_atomic",
]
