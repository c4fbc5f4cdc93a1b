"""posttrain.formats: every format two posttrain packages exchange, implemented once.

Each format lives here in both directions (write and read), so the two packages that exchange
it cannot drift apart. Depends only on ``posttrain-interface``, torch, safetensors (with numpy)
and httpx (for the one client it owns).

- LoRA request fields: ``LoraServing``, ``serves_lora``, ``request_fields(name, version)``
  (``lora_path`` + ``extra_key``) and ``apply_lora_fields``, the one writer of those keys.
- samples/1 and samples/2 (with media references): ``encode_samples`` / ``decode_samples`` (numpy + safetensors; no server, no torch).
- SGLang's weight-update protocol: the request bodies as SGLang's ``io_struct`` declares them
  (``InitWeightsUpdateGroupReq``, ``UpdateWeightsFromDistributedReq``,
  ``DestroyWeightsUpdateGroupReq``, ``UpdateWeightsFromTensorReq``, ``UpdateWeightFromDiskReq``,
  ``LoadLoraAdapterReq``, ``LoadLoraAdapterFromTensorsReq``, ``UpdateWeightVersionReq``), the
  update group both sides join (``join_update_group`` / ``UpdateGroup``), buckets
  (``plan_buckets``, ``bucket_request``), named tensors by value (``serialize_named_tensors``,
  ``deserialize_named_tensors``: a restricted unpickler) and one client per engine
  (``EngineClient``, errors naming engine, route and SGLang's message).

- NVFP4 tensors (ModelOpt layout): ``nvfp4_layout`` (names, dtypes, shapes),
  ``pack_e2m1_codes`` / ``unpack_e2m1_codes`` / ``e2m1_code_values``, ``dequantize_nvfp4``,
  ``dequantize_nvfp4_state_dict``, and the checkpoint's quant config
  (``nvfp4_config_sections`` / ``read_nvfp4_quant_config``).
- PEFT LoRA adapters: ``write_peft_adapter`` / ``read_peft_adapter``, key normalisation
  (``peft_key``, ``parse_peft_key``, ``peft_modules``), ``adapter_config.json`` <-> ``LoraSpec``
  (``peft_config_from_spec`` / ``parse_peft_config``), ``build_peft_adapter`` for tensors that
  arrive without a directory.
- safetensors writing without numpy: ``write_safetensors``, ``safetensors_header`` (the
  layout, for writers that stream), ``tensor_bytes``, ``SAFETENSORS_DTYPES``.
- The LoRA forward: ``lora_delta`` computes ``linear(reduce(linear(x, A)), B) * scaling`` with
  the caller's kernel (``LinearKernel``; ``matmul_kernel`` by default), the one op order the
  trainer (``lora-core``) and the engines (``models``' adapter hook) share.
- The adapter push payload (``/load_lora_adapter_from_tensors``, SGLang's body):
  ``adapter_push_body`` with ``tensor_sha256`` checksums (``lora-core``'s client writes it),
  ``decode_adapter_payload`` and ``verify_adapter_checksums`` (the engine reads it).
- Finite weights: ``check_finite`` / ``count_non_finite``, the one NaN/Inf check (one
  ``aminmax`` pass) that the PEFT and NVFP4 readers and the engines run.
- Atomic writes with directory fsync: ``write_bytes_atomic``, ``write_text_atomic``,
  ``AtomicFile``, ``atomic_directory``, ``replace_directory``, ``fsync_dir``, ``fsync_tree``.

Importing the package is light: every name that needs torch (all but the LoRA fields, samples/1,
atomic writes and the errors) loads its module on first use (PEP 562, ``_NEEDS_TORCH`` below),
so a session server that needs only the LoRA fields and samples/1 never imports torch.

Errors: every one is a ``FormatsError`` (a ``posttrain.interface.PosttrainError``), one subtree
per format; the tree is drawn once, in ``_errors.py``'s docstring. Atomic writes raise
``OSError`` as the operating system reports it; the target is left as it was.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    AdapterPayloadError,
    BucketFormatError,
    FormatsConfigError,
    FormatsError,
    NamedTensorsError,
    NVFP4FormatError,
    PeftConfigError,
    PeftFormatError,
    PeftNonFiniteError,
    PeftTensorError,
    SamplesFormatError,
    UpdateGroupError,
)
from posttrain.formats._lora_fields import (
    LoraServing,
    apply_lora_fields,
    request_fields,
    serves_lora,
)
from posttrain.formats._samples_wire import (
    MEDIA_SAMPLES_FORMAT,
    SAMPLES_FORMAT,
    STUDENT_TOP_LOGPROBS_KEY,
    DecodedSamples,
    decode_samples,
    encode_samples,
)

if TYPE_CHECKING:
    from posttrain.formats._adapter_payload import (
        AdapterPayload,
        adapter_push_body,
        decode_adapter_payload,
        tensor_sha256,
        verify_adapter_checksums,
    )
    from posttrain.formats._api_key import API_KEY_ENV, resolve_api_key
    from posttrain.formats._buckets import (
        DTYPES,
        FLATTENED_BUCKET,
        bucket_request,
        dtype_from_name,
        dtype_name,
        flat_bytes,
        flat_order,
        plan_buckets,
        tensors_sha256,
        unflatten,
    )
    from posttrain.formats._distributed_update import (
        DEFAULT_BUCKET_BYTES,
        WeightUpdateGroup,
        free_port,
        push_distributed,
    )
    from posttrain.formats._engine_client import EngineClient, reply_message
    from posttrain.formats._finite import (
        DEFAULT_MAX_ABS_WEIGHT,
        MAX_ABS_WEIGHT_ENV,
        check_finite,
        count_non_finite,
        max_abs_weight,
    )
    from posttrain.formats._lora_delta import LinearKernel, lora_delta, matmul_kernel
    from posttrain.formats._named_tensors import (
        deserialize_named_tensors,
        serialize_named_tensors,
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
    from posttrain.formats._peft_moe import (
        MOE_CONVENTIONS,
        MoeConvention,
        expert_modules,
        stack_expert_adapter,
        unstack_expert_adapter,
    )
    from posttrain.formats._safetensors import (
        SAFETENSORS_DTYPES,
        safetensors_header,
        tensor_bytes,
        write_safetensors,
    )
    from posttrain.formats._sglang_requests import (
        DEFAULT_GROUP_NAME,
        DestroyWeightsUpdateGroupReq,
        InitWeightsUpdateGroupReq,
        LoadLoraAdapterFromTensorsReq,
        LoadLoraAdapterReq,
        UpdateWeightFromDiskReq,
        UpdateWeightsFromDistributedReq,
        UpdateWeightsFromTensorReq,
        UpdateWeightVersionReq,
        version_string,
    )
    from posttrain.formats._tensor_update import (
        flatten_bucket,
        serialize_for_engine,
        tensor_update_requests,
    )
    from posttrain.formats._update_group import UpdateGroup, join_update_group

# Module -> the names that need torch (see the docstring): loaded by __getattr__ on first use.
_NEEDS_TORCH = {
    "_adapter_payload": (
        "AdapterPayload",
        "adapter_push_body",
        "decode_adapter_payload",
        "tensor_sha256",
        "verify_adapter_checksums",
    ),
    "_buckets": (
        "DTYPES",
        "FLATTENED_BUCKET",
        "bucket_request",
        "dtype_from_name",
        "dtype_name",
        "flat_bytes",
        "flat_order",
        "plan_buckets",
        "tensors_sha256",
        "unflatten",
    ),
    "_api_key": ("API_KEY_ENV", "resolve_api_key"),
    "_finite": (
        "DEFAULT_MAX_ABS_WEIGHT",
        "MAX_ABS_WEIGHT_ENV",
        "check_finite",
        "count_non_finite",
        "max_abs_weight",
    ),
    "_engine_client": ("EngineClient", "reply_message"),
    "_distributed_update": (
        "DEFAULT_BUCKET_BYTES",
        "WeightUpdateGroup",
        "free_port",
        "push_distributed",
    ),
    "_named_tensors": ("deserialize_named_tensors", "serialize_named_tensors"),
    "_sglang_requests": (
        "DEFAULT_GROUP_NAME",
        "DestroyWeightsUpdateGroupReq",
        "InitWeightsUpdateGroupReq",
        "LoadLoraAdapterFromTensorsReq",
        "LoadLoraAdapterReq",
        "UpdateWeightFromDiskReq",
        "UpdateWeightsFromDistributedReq",
        "UpdateWeightsFromTensorReq",
        "UpdateWeightVersionReq",
        "version_string",
    ),
    "_update_group": ("UpdateGroup", "join_update_group"),
    "_tensor_update": (
        "flatten_bucket",
        "serialize_for_engine",
        "tensor_update_requests",
    ),
    "_lora_delta": ("LinearKernel", "lora_delta", "matmul_kernel"),
    "_nvfp4": (
        "E2M1_VALUES",
        "GROUP_SIZE",
        "NVFP4Part",
        "NVFP4TensorSpec",
        "dequantize_nvfp4",
        "dequantize_nvfp4_state_dict",
        "e2m1_code_values",
        "nvfp4_layout",
        "pack_e2m1_codes",
        "unpack_e2m1_codes",
    ),
    "_nvfp4_config": (
        "NVFP4QuantConfig",
        "nvfp4_config_sections",
        "read_nvfp4_quant_config",
    ),
    "_peft": (
        "ADAPTER_CONFIG_FILE",
        "ADAPTER_WEIGHTS_FILE",
        "ALL_LINEAR",
        "PEFT_KEY_PREFIX",
        "PEFT_TENSOR_DTYPES",
        "PeftAdapter",
        "build_peft_adapter",
        "module_is_targeted",
        "parse_peft_config",
        "parse_peft_key",
        "peft_config_from_spec",
        "peft_key",
        "peft_modules",
        "read_peft_adapter",
        "write_peft_adapter",
    ),
    "_peft_moe": (
        "MOE_CONVENTIONS",
        "MoeConvention",
        "expert_modules",
        "stack_expert_adapter",
        "unstack_expert_adapter",
    ),
    "_safetensors": (
        "SAFETENSORS_DTYPES",
        "safetensors_header",
        "tensor_bytes",
        "write_safetensors",
    ),
}

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ALL_LINEAR",
    "API_KEY_ENV",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_GROUP_NAME",
    "DEFAULT_MAX_ABS_WEIGHT",
    "DTYPES",
    "E2M1_VALUES",
    "FLATTENED_BUCKET",
    "GROUP_SIZE",
    "MAX_ABS_WEIGHT_ENV",
    "MEDIA_SAMPLES_FORMAT",
    "MOE_CONVENTIONS",
    "PEFT_KEY_PREFIX",
    "PEFT_TENSOR_DTYPES",
    "SAFETENSORS_DTYPES",
    "SAMPLES_FORMAT",
    "STUDENT_TOP_LOGPROBS_KEY",
    "AdapterPayload",
    "AdapterPayloadError",
    "AtomicFile",
    "BucketFormatError",
    "DecodedSamples",
    "DestroyWeightsUpdateGroupReq",
    "EngineClient",
    "FormatsConfigError",
    "FormatsError",
    "InitWeightsUpdateGroupReq",
    "LinearKernel",
    "LoadLoraAdapterFromTensorsReq",
    "LoadLoraAdapterReq",
    "LoraServing",
    "MoeConvention",
    "NVFP4FormatError",
    "NVFP4Part",
    "NVFP4QuantConfig",
    "NVFP4TensorSpec",
    "NamedTensorsError",
    "PeftAdapter",
    "PeftConfigError",
    "PeftFormatError",
    "PeftNonFiniteError",
    "PeftTensorError",
    "SamplesFormatError",
    "UpdateGroup",
    "UpdateGroupError",
    "UpdateWeightFromDiskReq",
    "UpdateWeightVersionReq",
    "UpdateWeightsFromDistributedReq",
    "UpdateWeightsFromTensorReq",
    "WeightUpdateGroup",
    "adapter_push_body",
    "apply_lora_fields",
    "atomic_directory",
    "bucket_request",
    "build_peft_adapter",
    "check_finite",
    "count_non_finite",
    "decode_adapter_payload",
    "decode_samples",
    "dequantize_nvfp4",
    "dequantize_nvfp4_state_dict",
    "deserialize_named_tensors",
    "dtype_from_name",
    "dtype_name",
    "e2m1_code_values",
    "encode_samples",
    "expert_modules",
    "flat_bytes",
    "flat_order",
    "flatten_bucket",
    "free_port",
    "fsync_dir",
    "fsync_tree",
    "join_update_group",
    "lora_delta",
    "matmul_kernel",
    "max_abs_weight",
    "module_is_targeted",
    "nvfp4_config_sections",
    "nvfp4_layout",
    "pack_e2m1_codes",
    "parse_peft_config",
    "parse_peft_key",
    "peft_config_from_spec",
    "peft_key",
    "peft_modules",
    "plan_buckets",
    "push_distributed",
    "read_nvfp4_quant_config",
    "read_peft_adapter",
    "replace_directory",
    "reply_message",
    "request_fields",
    "resolve_api_key",
    "safetensors_header",
    "serialize_for_engine",
    "serialize_named_tensors",
    "serves_lora",
    "stack_expert_adapter",
    "tensor_bytes",
    "tensor_sha256",
    "tensor_update_requests",
    "tensors_sha256",
    "unflatten",
    "unpack_e2m1_codes",
    "unstack_expert_adapter",
    "verify_adapter_checksums",
    "version_string",
    "write_bytes_atomic",
    "write_peft_adapter",
    "write_safetensors",
    "write_text_atomic",
]


def __getattr__(name: str) -> Any:
    module = next((m for m, names in _NEEDS_TORCH.items() if name in names), None)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
