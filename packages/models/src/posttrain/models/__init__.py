"""Dense/MoE decoders in the Qwen3-MoE HF layout whose training and decode logprobs agree bit for bit.

Public surface (see the package README for a tour):

* ``ModelConfig`` -- typed Qwen3-MoE ``config.json`` fields (``mlp_only_layers`` picks dense layers).
* ``build_model(config, seed)`` -> ``DecoderModel``; ``Numerics.STRICT | FAST``.
* ``DecoderModel.forward_logprobs(input_ids, segment_lengths)`` -- packed training forward.
* ``DecoderModel.new_kv_cache / extend / prefill / decode_step`` -- incremental decode (``Step``).
* ``save_pretrained`` / ``load_pretrained`` -- safetensors + config.json (+ tokenizer) dirs.
* ``weight_groups`` / ``to_hf_state_dict`` / ``from_hf_state_dict`` -- name conversion.
* ``LoraAdapter`` -- per-request low-rank deltas on named linears.
* ``LinearSite`` / ``DecoderModel.linear_sites()`` -- each fused linear as a module with the
  model's kernel, for wrappers such as ``lora-core``'s ``LoraLinear``.
* ``build_tokenizer`` -- a local character-level fast tokenizer with a ChatML template.
* ``packed_logprobs`` / ``decoded_logprobs`` (``parity``) -- the same tokens scored as a trainer
  and as an engine scores them (packed forward; prefill + batched KV-cache decode): in strict
  numerics the two are equal bit for bit.
* Optional Inkling-style blocks (``ModelConfig.inkling_tiny``) and the context-parallel seams:
  ``TokenLayout`` / ``PackedLayout`` / ``CacheLayout``, ``residual_sconv`` (with a halo),
  ``attend`` (queries against gathered keys, masks from positions), ``rel_logits_of``,
  ``DecoderModel.forward_with_layout`` (see ``_blocks``).
* Multimodal (``ModelConfig.multimodal_tiny``; ``_media``, ``_media_io``, ``_towers``):
  frozen vision/audio towers; ``decode_media`` / ``decode_image`` / ``decode_audio`` turn
  SGLang-style references (file path, ``data:`` URL, base64) into ``MediaItem``s;
  ``expand_media_tokens(prompt_ids, media, config)`` -> ``(ids, MediaBatch)``;
  ``forward_logprobs(..., media=MediaBatch.pack(...))`` and ``extend``/``prefill(media=)``;
  ``has_towers`` / ``tower_parameter_names`` for weight sync (derived from the structure).
* Extension points for a subclass of ``DecoderModel`` that splits it over ranks (grpo's
  megatron ``TensorParallelDecoder``): the public methods ``moe`` (a MoE layer's output;
  expert parallelism replaces it), ``scatter_sequence`` / ``gather_sequence`` (the residual
  stream entering and leaving the layers; sequence parallelism) and ``gather_layer_tokens``
  (MLA's rope key); the README's "Extension points" says what each receives and returns and
  the invariants an override keeps. Their argument types are public here: ``MoeLayer`` /
  ``MlaLayer`` (the layer modules ``moe`` receives), ``LoraRouting`` (which adapter each
  token uses in one forward) and ``AdapterArg`` (the ``lora=`` argument of the forwards: one
  ``LoraAdapter``, one per segment, or ``None``). A subclass overrides nothing else and reads
  no ``_name`` of the decoder or its layers.
* ``context_parallel`` -- CP/SP primitives: zigzag/contiguous layouts, autograd K/V gather,
  position-masked attention with relative bias, halo exchange for short convolutions; and the
  model level: ``forward_context_parallel`` (this rank's logits/logprobs of a ``DecoderModel``,
  bit-identical to the single-process rows in strict mode), ``ContextParallelLayout`` and
  ``all_reduce_gradients``.
"""

from posttrain.models import context_parallel, parity
from posttrain.models._blocks import (
    CacheLayout,
    PackedLayout,
    TokenLayout,
    attend,
    attend_buffers,
    rel_logits_of,
    residual_sconv,
)
from posttrain.models._cache import KVCache
from posttrain.models._checkpoint import (
    load_config,
    load_hf_tensors,
    load_pretrained,
    save_hf_weights,
    save_pretrained,
)
from posttrain.models._compile import (
    COMPILE_MODES,
    CompileMode,
    check_compile_mode,
    compile_layers,
    layers_compiled,
)
from posttrain.models._config import AttentionShape, ModelConfig
from posttrain.models._convert import (
    WeightGroup,
    from_hf_state_dict,
    lora_targets,
    to_hf_state_dict,
    weight_groups,
)
from posttrain.models._ds_moe import group_limited_routing
from posttrain.models._errors import (
    CacheError,
    CheckpointError,
    DuplicateTensorError,
    LoraError,
    MediaError,
    MissingTensorError,
    ModelConfigError,
    ModelInputError,
    ModelsError,
    TensorSpecError,
    TensorSpecMismatchError,
    UnknownTensorError,
)
from posttrain.models._families import (
    Family,
    architecture_of,
    family_named,
    register_family,
    supported_architectures,
)
from posttrain.models._hub import is_hub_id, resolve_model_dir
from posttrain.models._lora import AdapterArg, LoraAdapter, LoraRouting
from posttrain.models._media import (
    MediaBatch,
    MediaItem,
    MediaKind,
    MediaSpan,
    expand_media_tokens,
    sentinel_id,
)
from posttrain.models._media_files import MAX_MEDIA_FILE_BYTES, MediaFiles
from posttrain.models._media_io import (
    AUDIO_HOP,
    AUDIO_N_FFT,
    AUDIO_SAMPLE_RATE,
    decode_audio,
    decode_image,
    decode_media,
    decode_media_refs,
    encode_npy_base64,
    encode_png_base64,
    encode_wav_base64,
    mel_bins,
    read_media_bytes,
)
from posttrain.models._model import (
    DecoderModel,
    MlaLayer,
    MoeLayer,
    Numerics,
    Step,
    StrictKernels,
    build_model,
    moe_routing,
    strict_ops_for,
)
from posttrain.models._ops import FastOps, StrictOps
from posttrain.models._rope import RopeScaling
from posttrain.models._sites import LinearSite
from posttrain.models._tokenizer import (
    CHAT_TEMPLATE,
    MEDIA_TOKENS,
    MULTIMODAL_VOCAB_SIZE,
    VOCAB_SIZE,
    build_tokenizer,
)
from posttrain.models._towers import MediaTower, has_towers, tower_parameter_names
from posttrain.models.parity import decoded_logprobs, packed_logprobs

__all__ = [
    "AUDIO_HOP",
    "AUDIO_N_FFT",
    "AUDIO_SAMPLE_RATE",
    "CHAT_TEMPLATE",
    "COMPILE_MODES",
    "MAX_MEDIA_FILE_BYTES",
    "MEDIA_TOKENS",
    "MULTIMODAL_VOCAB_SIZE",
    "VOCAB_SIZE",
    "AdapterArg",
    "AttentionShape",
    "CacheError",
    "CacheLayout",
    "CheckpointError",
    "CompileMode",
    "DecoderModel",
    "DuplicateTensorError",
    "Family",
    "FastOps",
    "KVCache",
    "LinearSite",
    "LoraAdapter",
    "LoraError",
    "LoraRouting",
    "MediaBatch",
    "MediaError",
    "MediaFiles",
    "MediaItem",
    "MediaKind",
    "MediaSpan",
    "MediaTower",
    "MissingTensorError",
    "MlaLayer",
    "ModelConfig",
    "ModelConfigError",
    "ModelInputError",
    "ModelsError",
    "MoeLayer",
    "Numerics",
    "PackedLayout",
    "RopeScaling",
    "Step",
    "StrictKernels",
    "StrictOps",
    "TensorSpecError",
    "TensorSpecMismatchError",
    "TokenLayout",
    "UnknownTensorError",
    "WeightGroup",
    "architecture_of",
    "attend",
    "attend_buffers",
    "build_model",
    "build_tokenizer",
    "check_compile_mode",
    "compile_layers",
    "context_parallel",
    "decode_audio",
    "decode_image",
    "decode_media",
    "decode_media_refs",
    "decoded_logprobs",
    "encode_npy_base64",
    "encode_png_base64",
    "encode_wav_base64",
    "expand_media_tokens",
    "family_named",
    "from_hf_state_dict",
    "group_limited_routing",
    "has_towers",
    "is_hub_id",
    "layers_compiled",
    "load_config",
    "load_hf_tensors",
    "load_pretrained",
    "lora_targets",
    "mel_bins",
    "moe_routing",
    "packed_logprobs",
    "parity",
    "read_media_bytes",
    "register_family",
    "rel_logits_of",
    "residual_sconv",
    "resolve_model_dir",
    "save_hf_weights",
    "save_pretrained",
    "sentinel_id",
    "strict_ops_for",
    "supported_architectures",
    "to_hf_state_dict",
    "tower_parameter_names",
    "weight_groups",
]
