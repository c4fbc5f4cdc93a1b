"""SGLang's HTTP wire schema, as far as posttrain sends and reads it.

Covers native ``/generate`` (single and batched) with its ``meta_info``, the
OpenAI chat-completions subset we use, LoRA load/unload and weight-update
payloads. Request types reject unknown keys (a misspelt ``lora_path`` would
otherwise roll out from the base model without a word); response types keep
unknown keys, since engines add fields between versions.

``weight_version`` is an int here (see ``_weight_version``): SGLang's strings are converted
where they are read, and a request SGLang reads sends it back as a string.

``token_ids_logprob_positions`` is the per-position scoring extension (one id
list per input position); it excludes the flat ``token_ids_logprob``.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from posttrain.interface._weight_version import SGLangWeightVersion, WireWeightVersion
from posttrain.interface._wire_base import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    StrictBool,
    WireModel,
)

# One logprob entry as SGLang sends it: [logprob or null, token id] or [logprob, id, text or null].
LogprobEntry = tuple[float | None, NonNegativeInt] | tuple[float | None, NonNegativeInt, str | None]
TopLogprobRow = list[LogprobEntry] | None


class SamplingParams(WireModel):
    """SGLang ``sampling_params``; keys SGLang knows but posttrain does not type are kept as is."""

    model_config = pydantic.ConfigDict(extra="allow")

    max_new_tokens: NonNegativeInt | None = None
    temperature: NonNegativeFloat | None = None
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = pydantic.Field(default=None, ge=-1)
    min_p: float | None = pydantic.Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    n: PositiveInt | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None

    @pydantic.field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, not 0")
        return value


class GenerateRequest(WireModel):
    """A native SGLang ``POST /generate`` body (one prompt or a batch)."""

    text: str | list[str] | None = None
    input_ids: list[NonNegativeInt] | list[list[NonNegativeInt]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: NonNegativeInt | list[NonNegativeInt] | None = None
    token_ids_logprob: list[NonNegativeInt] | list[list[NonNegativeInt]] | None = None
    token_ids_logprob_positions: list[list[NonNegativeInt]] | None = None
    return_text_in_logprobs: StrictBool | None = None
    lora_path: str | list[str | None] | None = None
    # SGLang keeps prefix-cache entries apart by this key (one per adapter version).
    extra_key: str | list[str | None] | None = None
    rid: str | list[str] | None = None
    stream: StrictBool | None = None
    data_parallel_rank: NonNegativeInt | None = None
    # SGLang's media fields: each reference is a file path, a data: URL or base64. One request:
    # a string or a list (its items, in sentinel order); a batch: one entry per prompt (a
    # string, a list or null).
    image_data: str | list[str | list[str] | None] | None = None
    audio_data: str | list[str | list[str] | None] | None = None

    @pydantic.model_validator(mode="after")
    def _check_shape(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given")
        if self.token_ids_logprob is not None and self.token_ids_logprob_positions is not None:
            raise ValueError(
                "token_ids_logprob and token_ids_logprob_positions are exclusive: send one"
            )
        if self.token_ids_logprob_positions is not None:
            if self.is_batch:
                raise ValueError("token_ids_logprob_positions needs a single (unbatched) request")
            assert self.input_ids is not None or self.text is not None
            if self.input_ids is not None and len(self.token_ids_logprob_positions) != len(
                self.input_ids
            ):
                raise ValueError(
                    f"token_ids_logprob_positions has {len(self.token_ids_logprob_positions)} rows "
                    f"but input_ids has {len(self.input_ids)} positions"
                )
        return self

    @property
    def is_batch(self) -> bool:
        """True when the body carries several prompts (a list of texts or of id lists)."""
        if isinstance(self.text, list):
            return True
        ids = self.input_ids
        return bool(ids) and isinstance(ids[0], list)  # type: ignore[index]

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if isinstance(self.text, list) else self.input_ids or [])


class FinishReason(WireModel):
    """Why generation stopped: ``stop`` (with the matched id or string), ``length`` or ``abort``."""

    model_config = pydantic.ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: NonNegativeInt | None = None
    message: str | None = None


class GenerateMetaInfo(WireModel):
    """``meta_info`` of a ``/generate`` reply.

    Input lists are indexed by absolute position from ``logprob_start_len``;
    entry 0 of ``input_token_logprobs`` carries a null logprob (nothing
    predicts the first token).
    """

    model_config = pydantic.ConfigDict(extra="allow")

    id: str | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: NonNegativeInt | None = None
    completion_tokens: NonNegativeInt | None = None
    cached_tokens: NonNegativeInt | None = None
    weight_version: WireWeightVersion = None
    input_token_logprobs: list[LogprobEntry] | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[TopLogprobRow] | None = None
    output_top_logprobs: list[TopLogprobRow] | None = None
    input_token_ids_logprobs: list[TopLogprobRow] | None = None
    output_token_ids_logprobs: list[TopLogprobRow] | None = None


class GenerateResponse(WireModel):
    """One item of a ``/generate`` reply (a batched request answers with a JSON list of these)."""

    model_config = pydantic.ConfigDict(extra="allow")

    text: str
    output_ids: list[NonNegativeInt] | None = None
    meta_info: GenerateMetaInfo


class ToolCallFunction(WireModel):
    model_config = pydantic.ConfigDict(extra="allow")

    name: str
    arguments: str


class ToolCall(WireModel):
    model_config = pydantic.ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None


class ChatMessage(WireModel):
    """One OpenAI chat message."""

    model_config = pydantic.ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(WireModel):
    """The OpenAI ``/v1/chat/completions`` subset posttrain sends, with SGLang's extensions."""

    model_config = pydantic.ConfigDict(extra="allow")

    model: str = "default"
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    temperature: NonNegativeFloat | None = None
    top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: NonNegativeInt | None = None
    max_completion_tokens: NonNegativeInt | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: PositiveInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: NonNegativeInt | None = None
    stream: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    lora_path: str | None = None
    rid: str | None = None
    return_meta_info: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    input_ids: list[NonNegativeInt] | None = None
    # SGLang's media fields (as on /generate, one request): a reference or a list of them.
    image_data: str | list[str] | None = None
    audio_data: str | list[str] | None = None


class ChatLogprobTop(WireModel):
    model_config = pydantic.ConfigDict(extra="allow")

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(WireModel):
    model_config = pydantic.ConfigDict(extra="allow")

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatLogprobTop] = pydantic.Field(default_factory=list)


class ChatChoiceLogprobs(WireModel):
    model_config = pydantic.ConfigDict(extra="allow")

    content: list[ChatLogprobContent] | None = None


class ChatChoice(WireModel):
    model_config = pydantic.ConfigDict(extra="allow")

    index: NonNegativeInt
    message: ChatMessage
    finish_reason: str | None = None
    logprobs: ChatChoiceLogprobs | None = None
    meta_info: GenerateMetaInfo | None = None


class Usage(WireModel):
    model_config = pydantic.ConfigDict(extra="allow")

    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    total_tokens: NonNegativeInt


class ChatCompletionResponse(WireModel):
    """An OpenAI chat completion (non-streamed)."""

    model_config = pydantic.ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: NonNegativeInt
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class LoadLoraAdapterRequest(WireModel):
    """``POST /load_lora_adapter``: register a PEFT adapter directory under a name."""

    lora_name: str = pydantic.Field(min_length=1)
    lora_path: str = pydantic.Field(min_length=1)
    pinned: StrictBool | None = None


class UnloadLoraAdapterRequest(WireModel):
    """``POST /unload_lora_adapter``."""

    lora_name: str = pydantic.Field(min_length=1)


class UpdateWeightsFromDiskRequest(WireModel):
    """``POST /update_weights_from_disk``: reload the base weights from a checkpoint directory."""

    model_path: str = pydantic.Field(min_length=1)
    load_format: str | None = None
    weight_version: SGLangWeightVersion = None
    abort_all_requests: StrictBool | None = None


class UpdateWeightsResponse(WireModel):
    """The reply of every weight or adapter update route."""

    model_config = pydantic.ConfigDict(extra="allow")

    success: StrictBool
    message: str = ""
    weight_version: WireWeightVersion = None
