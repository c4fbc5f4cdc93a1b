"""posttrain.interface: the typed contract every posttrain package exchanges.

It imports nothing heavy (no torch, no httpx): the RL data model is plain
validated dataclasses, the SGLang wire schema is pydantic models, and the
Protocols decouple engines, teachers, rewards and weight sinks from the code
that drives them. The test harness lives in ``posttrain.interface.testing``
and is not imported here.

Error tree (every posttrain error derives from ``PosttrainError``)::

    PosttrainError
    ├── ConfigError (ValueError)       a spec or option is invalid
    ├── WireFormatError (ValueError)   a wire payload fails validation (.field)
    ├── TransportError                 an HTTP peer failed or answered badly (.url)
    │   └── EngineError                an engine answered an error or success=false (.status)
    └── WeightSyncError                a weight update did not complete
        ├── IncompleteUpdateError      missing, unknown or duplicate tensors
        └── StaleVersionError          a weight version that does not increase
"""

from posttrain.interface._errors import (
    ConfigError,
    EngineError,
    IncompleteUpdateError,
    PosttrainError,
    StaleVersionError,
    TransportError,
    WeightSyncError,
    WireFormatError,
)
from posttrain.interface._protocols import RewardFunction, RolloutEngine, TeacherScorer, WeightSink
from posttrain.interface._samples import (
    PositionScores,
    Sample,
    SampleGroup,
    SampleStatus,
    TeacherScores,
)
from posttrain.interface._specs import (
    EngineEndpoint,
    FourOverSix,
    LoraSpec,
    MeshAxis,
    MeshSpec,
    NVFP4Precision,
    ScaleRounding,
)
from posttrain.interface._weight_sync import (
    BUCKET_ALIGNMENT,
    WIRE_DTYPES,
    BucketManifest,
    ExpectedTensor,
    TensorEntry,
    WeightUpdateBegin,
    WeightUpdateResult,
)
from posttrain.interface._wire_base import WireModel
from posttrain.interface._wire_sglang import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    FinishReason,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    LoadLoraAdapterRequest,
    SamplingParams,
    ToolCall,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
    Usage,
)

__all__ = [
    "BUCKET_ALIGNMENT",
    "WIRE_DTYPES",
    "BucketManifest",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "ConfigError",
    "EngineEndpoint",
    "EngineError",
    "ExpectedTensor",
    "FinishReason",
    "FourOverSix",
    "GenerateMetaInfo",
    "GenerateRequest",
    "GenerateResponse",
    "IncompleteUpdateError",
    "LoadLoraAdapterRequest",
    "LoraSpec",
    "MeshAxis",
    "MeshSpec",
    "NVFP4Precision",
    "PositionScores",
    "PosttrainError",
    "RewardFunction",
    "RolloutEngine",
    "Sample",
    "SampleGroup",
    "SampleStatus",
    "SamplingParams",
    "ScaleRounding",
    "StaleVersionError",
    "TeacherScorer",
    "TeacherScores",
    "TensorEntry",
    "ToolCall",
    "TransportError",
    "UnloadLoraAdapterRequest",
    "UpdateWeightsFromDiskRequest",
    "UpdateWeightsResponse",
    "Usage",
    "WeightSink",
    "WeightSyncError",
    "WeightUpdateBegin",
    "WeightUpdateResult",
    "WireFormatError",
    "WireModel",
]
