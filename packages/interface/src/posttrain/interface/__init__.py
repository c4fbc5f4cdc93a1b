"""posttrain.interface: the typed contract every posttrain package exchanges.

It imports nothing heavy (no torch, no httpx): the RL data model is plain
validated dataclasses, the SGLang wire schema is pydantic models, and the
Protocols decouple engines, teachers, rewards and weight sinks from the code
that drives them. Child processes (free ports, servers stopped by pid, groups
of gloo/NCCL ranks) are ``posttrain.interface.processes``; the test harness is
``posttrain.interface.testing``; neither is imported here.

Error tree (every posttrain error derives from ``PosttrainError``)::

    PosttrainError
    ├── ConfigError (ValueError)       a spec or option is invalid
    ├── WireFormatError (ValueError)   a wire payload fails validation (.field)
    ├── TransportError                 an HTTP peer failed or answered badly (.url)
    │   └── EngineError                an engine answered an error or success=false (.status)
    ├── WeightSyncError                a weight update did not complete
    │   ├── IncompleteUpdateError      missing, unknown or duplicate tensors
    │   └── StaleVersionError          a weight version that does not increase
    └── ProcessError                   a child process hung, crashed, raised or never got ready
        ├── ServerStartError           a server exited or did not answer ready in time
        └── WorkerError                a rank of a worker group failed (.rank)
            ├── WorkerTimeoutError (TimeoutError)   ranks did not finish in time (all killed)
            ├── WorkerCrashedError     a rank exited without reporting a result
            └── WorkerFailedError      a rank raised (its traceback in the message)

Weight versions are one type everywhere: a non-negative ``int`` (``None`` before the first
versioned update). Versions are compared (an engine refuses one that does not increase) and
subtracted (staleness), which a string does wrongly ("10" < "9"); SGLang's strings are converted
once, where they are read (``parse_weight_version``; ``_weight_version.py`` says more).

Sample metadata keys that one package writes and another reads are constants here
(``WEIGHT_VERSIONS_KEY``, ``SESSION_ID_KEY``, ``ABORT_REASON_KEY``), never a string spelled on
both sides.
"""

from posttrain.interface._errors import (
    ConfigError,
    EngineError,
    IncompleteUpdateError,
    PosttrainError,
    ProcessError,
    ServerStartError,
    StaleVersionError,
    TransportError,
    WeightSyncError,
    WireFormatError,
    WorkerCrashedError,
    WorkerError,
    WorkerFailedError,
    WorkerTimeoutError,
)
from posttrain.interface._media import (
    MediaKind,
    MediaRef,
    media_from_request,
    media_request_fields,
)
from posttrain.interface._protocols import (
    RewardFunction,
    RewardInput,
    RolloutEngine,
    TeacherScorer,
    WeightSink,
)
from posttrain.interface._samples import (
    ABORT_REASON_KEY,
    SESSION_ID_KEY,
    WEIGHT_VERSIONS_KEY,
    PositionScores,
    Sample,
    SampleGroup,
    SampleStatus,
    TeacherScores,
)
from posttrain.interface._specs import (
    FourOverSix,
    LoraSpec,
    MeshAxis,
    MeshSpec,
    NVFP4Precision,
    ScaleRounding,
)
from posttrain.interface._weight_version import is_weight_version, parse_weight_version
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
    "ABORT_REASON_KEY",
    "SESSION_ID_KEY",
    "WEIGHT_VERSIONS_KEY",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "ConfigError",
    "EngineError",
    "FinishReason",
    "FourOverSix",
    "GenerateMetaInfo",
    "GenerateRequest",
    "GenerateResponse",
    "IncompleteUpdateError",
    "LoadLoraAdapterRequest",
    "LoraSpec",
    "MediaKind",
    "MediaRef",
    "MeshAxis",
    "MeshSpec",
    "NVFP4Precision",
    "PositionScores",
    "PosttrainError",
    "ProcessError",
    "RewardFunction",
    "RewardInput",
    "RolloutEngine",
    "Sample",
    "SampleGroup",
    "SampleStatus",
    "SamplingParams",
    "ScaleRounding",
    "ServerStartError",
    "StaleVersionError",
    "TeacherScorer",
    "TeacherScores",
    "ToolCall",
    "TransportError",
    "UnloadLoraAdapterRequest",
    "UpdateWeightsFromDiskRequest",
    "UpdateWeightsResponse",
    "Usage",
    "WeightSink",
    "WeightSyncError",
    "WireFormatError",
    "WireModel",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerFailedError",
    "WorkerTimeoutError",
    "is_weight_version",
    "media_from_request",
    "media_request_fields",
    "parse_weight_version",
]
