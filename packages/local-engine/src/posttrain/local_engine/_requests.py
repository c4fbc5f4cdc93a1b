"""JSON request bodies to engine tasks, and engine results back to SGLang's JSON.

A batched ``/generate`` (a list of texts or of id lists) becomes one task per
prompt; per-item fields (``sampling_params``, ``return_logprob``, ``lora_path``,
``rid``, ...) may be lists of the batch length or one shared value, as in SGLang.
Field errors name the field and, in a batch, the item index. Sampling knobs this
engine does not implement (penalties, streaming) are refused with a 400 rather
than silently ignored. ``sampling_params.n`` > 1 (SGLang's parallel sampling) expands each
prompt into ``n`` tasks, and the reply is a list, as SGLang's.

Media (SGLang's ``image_data`` / ``audio_data``): each prompt holds one sentinel token per
item (``<|image|>`` / ``<|audio|>`` of a multimodal checkpoint); ``prompt_media`` decodes the
references (``posttrain.models.decode_media``) and expands each sentinel into its placeholder
run (``expand_media_tokens``), exactly as a trainer rebuilds the input. The task's
``input_ids`` are the expanded ids, so ``meta_info.prompt_tokens`` and the input logprob
positions count the placeholders. Undecodable media, a count that differs from the
sentinels, or media for a model without the tower: a 400 naming the field.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from posttrain.interface import GenerateRequest, SamplingParams, WireFormatError
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._errors import RequestTooLargeError
from posttrain.local_engine._sampling import SamplingConfig
from posttrain.models import (
    MediaBatch,
    MediaError,
    MediaFiles,
    ModelConfig,
    decode_media,
    expand_media_tokens,
)

__all__ = [
    "TextCodec",
    "check_text_fits",
    "drop_neutral_sglang_keys",
    "media_refs",
    "meta_info",
    "prompt_media",
    "tasks_from_generate",
]

DEFAULT_MAX_NEW_TOKENS = 128

# Keys of SGLang's GenerateReqInput that sgl-router (0.3.x) fills in when it re-serializes
# a body, with the values that need nothing from this engine (None: any value is fine).
_NEUTRAL_KEYS: dict[str, tuple[Any, ...] | None] = {
    "model": None,
    "log_metrics": None,
    "no_logs": None,
    "background": (False,),
    "return_hidden_states": (False,),
    "return_bytes": (False,),
    "return_entropy": (False,),
    "return_routed_experts": (False,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "custom_logit_processor": (None,),
}


def drop_neutral_sglang_keys(body: Any) -> Any:
    """Remove router-added SGLang keys that hold neutral values; others stay and fail validation.

    sgl-router re-serializes ``/generate`` bodies with SGLang's defaults filled in; the
    interface's request type rejects unknown keys (a misspelt field must not pass), so the
    neutral ones are taken out here, and a non-neutral one (``return_hidden_states: true``)
    still gets a 400 naming it.
    """
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key, neutral in _NEUTRAL_KEYS.items():
        if key in out and (neutral is None or out[key] in neutral):
            del out[key]
    return out


class TextCodec(Protocol):
    """A tokenizer as the HTTP layer needs it."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def chat_text(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str: ...

    @property
    def max_chars_per_token(self) -> int | None:
        """Input characters one token covers at most (None: no sound bound)."""
        ...


def check_text_fits(codec: TextCodec, text: str, max_context: int | None, *, field: str) -> None:
    """Refuse, before tokenizing, a text whose length alone proves it exceeds the context.

    A token covers at most ``codec.max_chars_per_token`` characters, so a longer text than
    ``max_context`` times that has more tokens than the context holds.
    """
    per_token = codec.max_chars_per_token
    if max_context is None or per_token is None or len(text) <= max_context * per_token:
        return
    raise WireFormatError(
        f"{field}: {len(text)} characters cannot fit the context of {max_context} tokens (one "
        f"token covers at most {per_token} characters); refused before tokenizing",
        field=field,
    )


def _item(value: Any, i: int, n: int, field: str, batch: bool) -> Any:
    """The i-th value of a per-item field: a list of length n in a batch, else shared."""
    if batch and isinstance(value, list) and field != "token_ids_logprob":
        if len(value) != n:
            raise WireFormatError(
                f"{field}: {len(value)} values for a batch of {n} prompts", field=field
            )
        return value[i]
    if batch and field == "token_ids_logprob" and value and isinstance(value[0], list):
        if len(value) != n:
            raise WireFormatError(
                f"{field}: {len(value)} id lists for a batch of {n} prompts", field=field
            )
        return value[i]
    return value


_UNSUPPORTED_PENALTIES = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def sampling_from_params(
    sp: SamplingParams | None, *, default_seed: int, where: str = ""
) -> tuple[SamplingConfig, int, dict[str, Any]]:
    """SamplingConfig, seed and stop settings from SGLang ``sampling_params``."""
    sp = sp or SamplingParams()
    for name, neutral in _UNSUPPORTED_PENALTIES.items():
        value = getattr(sp, name)
        if value is not None and value != neutral:
            raise WireFormatError(
                f"{where}sampling_params.{name}: {value} is not supported by local-engine",
                field=f"sampling_params.{name}",
            )
    cfg = SamplingConfig(
        temperature=1.0 if sp.temperature is None else sp.temperature,
        top_p=1.0 if sp.top_p is None else sp.top_p,
        top_k=-1 if sp.top_k is None else sp.top_k,
        min_p=0.0 if sp.min_p is None else sp.min_p,
    )
    seed = sp.sampling_seed if sp.sampling_seed is not None else sp.seed
    stop = sp.stop if isinstance(sp.stop, list) else ([sp.stop] if sp.stop else [])
    extra = {
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS
        if sp.max_new_tokens is None
        else sp.max_new_tokens,
        "stop": tuple(stop),
        "stop_token_ids": frozenset(sp.stop_token_ids or ()),
        "ignore_eos": bool(sp.ignore_eos),
        "no_stop_trim": bool(sp.no_stop_trim),
        "skip_special_tokens": sp.skip_special_tokens is not False,
    }
    return cfg, (default_seed if seed is None else seed), extra


def media_refs(value: Any, i: int, n: int, field: str, batch: bool) -> list[str]:
    """Prompt ``i``'s references of one media field (SGLang's shapes, see GenerateRequest)."""
    if value is None:
        return []
    if batch:
        if not isinstance(value, list) or len(value) != n:
            raise WireFormatError(
                f"{field}: a batch of {n} prompts needs a list of {n} entries (one per prompt)",
                field=field,
            )
        value = value[i]
        field = f"{field}[{i}]"
        if value is None:
            return []
    refs = [value] if isinstance(value, str) else list(value)
    for j, ref in enumerate(refs):
        if not isinstance(ref, str) or not ref:
            raise WireFormatError(
                f"{field}[{j}]: a media reference must be a non-empty string", field=field
            )
    return refs


def prompt_media(
    prompt: list[int],
    images: list[str],
    audio: list[str],
    config: ModelConfig | None,
    *,
    where: str = "",
    files: MediaFiles | None = None,
) -> tuple[list[int], MediaBatch | None]:
    """Decode a prompt's media and expand its sentinels: ``(expanded ids, MediaBatch)``.

    A model without towers (``config`` None or text-only) passes the prompt through unchanged
    and refuses any media; a multimodal model always expands, so a sentinel without its item
    is refused too. Errors are 400s naming ``image_data`` / ``audio_data``. The sentinel
    counts are checked before any reference is read or decoded; ``files`` is the engine's
    file-path policy (``MediaFiles``).
    """
    if config is None or not config.has_towers:
        for field, refs in (("image_data", images), ("audio_data", audio)):
            if refs:
                tower = "vision" if field == "image_data" else "audio"
                raise WireFormatError(
                    f"{where}{field}: this model has no {tower} tower (text-only model)",
                    field=field,
                )
        return prompt, None
    for field, refs, token, has_tower in (
        ("image_data", images, config.image_token_id, config.has_vision_tower),
        ("audio_data", audio, config.audio_token_id, config.has_audio_tower),
    ):
        if refs and not has_tower:
            kind = "vision" if field == "image_data" else "audio"
            raise WireFormatError(f"{where}{field}: this model has no {kind} tower", field=field)
        found = 0 if token is None else sum(1 for t in prompt if t == token)
        if found != len(refs):
            raise WireFormatError(
                f"{where}{field}: the prompt has {found} {field[:5]} sentinel token(s) but "
                f"{len(refs)} {field[:5]} item(s) were given; nothing was decoded",
                field=field,
            )
    if files is None:
        files = MediaFiles.engine(None)
    try:
        items = decode_media(config, images=images, audio=audio, files=files)
        ids, batch = expand_media_tokens(prompt, items, config)
    except MediaError as exc:
        field = f"{exc.kind or 'image'}_data"
        text = str(exc)
        message = text if text.startswith(field) else f"{field}: {text}"
        raise WireFormatError(f"{where}{message}", field=field) from exc
    return ids, (batch if len(batch) else None)


def tasks_from_generate(
    req: GenerateRequest,
    *,
    codec: TextCodec | None,
    next_seed: Callable[[], int],
    max_context: int | None = None,
    model_config: ModelConfig | None = None,
    media_files: MediaFiles | None = None,
    max_tasks: int | None = None,
) -> tuple[list[GenTask], list[dict[str, Any]]]:
    """Tasks for every sample of a request, plus per-item output options.

    ``sampling_params.n`` (SGLang's parallel sampling) gives ``n`` tasks per prompt, in
    prompt-major order (prompt 0's samples, then prompt 1's), sample ``j`` seeded with the
    prompt's seed plus ``j`` and, with a ``rid``, named ``{rid}_{j}``. More than ``max_tasks``
    tasks is refused (413) before any is built.

    With ``max_context``, a text too long for it is refused before it is tokenized. With a
    multimodal ``model_config``, media sentinels are expanded (``prompt_media``).
    """
    if req.stream:
        raise WireFormatError("stream: streaming is not supported by local-engine", field="stream")
    batch = req.is_batch
    n = req.batch_size
    if req.input_ids is not None:
        raw: list[Any] = list(req.input_ids)
        prompts: list[list[int]] = [list(x) for x in raw] if batch else [[int(x) for x in raw]]
    else:
        if codec is None:
            raise WireFormatError("text: this model has no tokenizer; send input_ids", field="text")
        texts = req.text if isinstance(req.text, list) else [req.text or ""]
        for i, t in enumerate(texts):
            check_text_fits(codec, t, max_context, field=f"text[{i}]" if batch else "text")
        prompts = [codec.encode(t) for t in texts]
    samples = parallel_samples(req)
    if max_tasks is not None and n * samples > max_tasks:
        raise RequestTooLargeError(
            f"sampling_params.n: {n} prompt(s) x n={samples} samples exceed "
            f"--max-queued-requests {max_tasks}",
            field="sampling_params.n",
        )
    tasks: list[GenTask] = []
    options: list[dict[str, Any]] = []
    for i in range(n):
        where = f"[{i}] " if batch else ""
        sp = _item(req.sampling_params, i, n, "sampling_params", batch)
        cfg, seed, extra = sampling_from_params(sp, default_seed=next_seed(), where=where)
        if seed + samples - 1 >= 2**64:
            raise WireFormatError(
                f"{where}sampling_params.sampling_seed: {seed} + n - 1 is past 2**64 - 1",
                field="sampling_params.sampling_seed",
            )
        lora = _item(req.lora_path, i, n, "lora_path", batch)
        rid = _item(req.rid, i, n, "rid", batch)
        start = _item(req.logprob_start_len, i, n, "logprob_start_len", batch)
        ids, media = prompt_media(
            prompts[i],
            media_refs(req.image_data, i, n, "image_data", batch),
            media_refs(req.audio_data, i, n, "audio_data", batch),
            model_config,
            where=where,
            files=media_files,
        )
        for j in range(samples):
            tasks.append(
                GenTask(
                    input_ids=ids,
                    media=media,
                    max_new_tokens=extra["max_new_tokens"],
                    sampling=cfg,
                    seed=seed + j,
                    stop_token_ids=extra["stop_token_ids"],
                    stop=extra["stop"],
                    ignore_eos=extra["ignore_eos"],
                    no_stop_trim=extra["no_stop_trim"],
                    return_logprob=bool(_item(req.return_logprob, i, n, "return_logprob", batch)),
                    logprob_start_len=-1 if start is None else start,
                    top_logprobs_num=_item(req.top_logprobs_num, i, n, "top_logprobs_num", batch)
                    or 0,
                    token_ids_logprob=_item(
                        req.token_ids_logprob, i, n, "token_ids_logprob", batch
                    ),
                    token_ids_logprob_positions=req.token_ids_logprob_positions,
                    lora_name=lora,
                    rid=_sample_rid(rid, j, samples),
                )
            )
            options.append(
                {
                    "skip_special_tokens": extra["skip_special_tokens"],
                    "return_text_in_logprobs": bool(req.return_text_in_logprobs),
                }
            )
    return tasks, options


def parallel_samples(req: GenerateRequest) -> int:
    """SGLang's ``parallel_sample_num``: ``sampling_params.n`` (default 1), which every item of
    a batch must share (SGLang refuses differing values the same way)."""
    sps = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
    ns = {1 if sp is None or sp.n is None else sp.n for sp in sps}
    if len(ns) > 1:
        raise WireFormatError(
            f"sampling_params.n: every prompt of a batch needs the same n, got {sorted(ns)}",
            field="sampling_params.n",
        )
    return ns.pop() if ns else 1


def _sample_rid(rid: str | None, j: int, samples: int) -> str:
    if not rid:
        return uuid.uuid4().hex
    return rid if samples == 1 else f"{rid}_{j}"


def json_logprob(lp: float | None) -> float | None:
    """A logprob as a reply carries it: a finite float, or ``null`` for NaN/Inf (documented
    in the README: JSON has no NaN/Infinity, and a 500 for a reply's number helps no one)."""
    return lp if lp is not None and math.isfinite(lp) else None


def _entries(
    rows: Sequence[tuple[float | None, int]] | None, text: Callable[[int], str | None]
) -> list[list[Any]] | None:
    if rows is None:
        return None
    return [[json_logprob(lp), tok, text(tok)] for lp, tok in rows]


def _nested(
    rows: Sequence[Sequence[tuple[float, int]] | None] | None, text: Callable[[int], str | None]
) -> list[list[list[Any]] | None] | None:
    if rows is None:
        return None
    return [
        None if r is None else [[json_logprob(lp), tok, text(tok)] for lp, tok in r] for r in rows
    ]


def meta_info(
    res: GenResult, *, token_text: Callable[[int], str | None], e2e_latency: float
) -> dict[str, Any]:
    """SGLang's ``meta_info`` for one result (logprob lists only when they were asked)."""
    out: dict[str, Any] = {
        "id": res.rid,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "weight_version": res.weight_version,
        "e2e_latency": e2e_latency,
    }
    lists = {
        "input_token_logprobs": _entries(res.input_token_logprobs, token_text),
        "output_token_logprobs": _entries(res.output_token_logprobs, token_text),
        "input_top_logprobs": _nested(res.input_top_logprobs, token_text),
        "output_top_logprobs": _nested(res.output_top_logprobs, token_text),
        "input_token_ids_logprobs": _nested(res.input_token_ids_logprobs, token_text),
        "output_token_ids_logprobs": _nested(res.output_token_ids_logprobs, token_text),
    }
    # As SGLang: top lists only with top_logprobs_num, id lists only with token ids asked.
    out.update({k: v for k, v in lists.items() if v is not None})
    return out


def seed_counter(base: int) -> Callable[[], int]:
    """Distinct default seeds per request: the engine's random seed plus a counter."""
    counter = itertools.count()
    return lambda: (base * 1_000_003 + next(counter)) % (2**63)
