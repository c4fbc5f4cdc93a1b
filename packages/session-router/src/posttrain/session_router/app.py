"""The session server's routes: an ASGI app (dispatch.py) in front of sgl-router's ``/generate``.

    GET    /health                                 instance id (stable per process), allocator
    GET    /metrics                                Prometheus text
    POST   /sessions      [{"weight_version": N}]  -> {"session_id"}
    GET    /sessions/{id}                          records and TITO metadata
    DELETE /sessions/{id}                          204; waits for an in-flight prepare/commit
    POST   /sessions/{id}/v1/chat/completions      one TITO turn (OpenAI compatible)
    POST   /sessions/{id}/v1/completions           one raw-prompt turn: a text or token ids,
                                                   no chat template (base models)
    POST   /sessions/{id}/samples                  assembled samples (samples/1: posttrain.formats)
    POST   /rollouts      {"n", "turn", "seeds"}   a group: n one-turn samples, each its own
                                                   session (created, run, assembled, deleted);
                                                   with parallel_sampling one upstream /generate
                                                   with sampling_params.n
    *      /sessions/{id}/{path}                   raw proxy with the routing key, not recorded,
                                                   for the upstream routes in PROXY_ROUTES only

The raw proxy is an allow-list, not a catch-all: sgl-router serves its admin API (``/workers``,
``/flush_cache``, ...) on the same port as generation, and a session client must not be able to
deregister engines or register a worker URL of its choosing through a session. Any other path
under a session is 404, a listed path with another method 405.

A session names the adapter version its LoRA requests carry (``extra_key``): the
``weight_version`` it was created with, else the server's ``lora_weight_version``; serving an
adapter with neither is refused when the session is created (400).

Every route is behind the bearer token when one is configured. Errors are ``{"error": str}``:
400 bad JSON or messages (the field is named), 401 missing/wrong token, 404 unknown session or
route, 405 a method the route does not serve, 413 body over ``max_body_bytes``, 422 sample
assembly failed (text/plain), 500 TITO prefix mismatch or an unexpected server error (still
JSON, naming the exception type), 502 upstream transport failure, an upstream 5xx (sgl-router
answers 500 when the worker died mid-request) or a reply without what TITO needs, 504 no
upstream reply within ``upstream_timeout_s``. An upstream 4xx is passed through. A failed turn is
never recorded, and neither is a turn whose client disconnected before the reply (answered 499
to nobody, counted as ``abandoned`` in the turn metrics).

The session lock is held while preparing and while committing a turn, never during the upstream
call, so a worker that dies mid-turn (502) leaves the session unchanged and the turn retryable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from posttrain.formats import encode_samples
from posttrain.interface import (
    ConfigError,
    PosttrainError,
    Sample,
    SampleStatus,
    is_weight_version,
)
from posttrain.session_router._errors import (
    BadChatRequestError,
    SampleAssemblyError,
    SessionNotFoundError,
    TitoMismatchError,
    UpstreamReplyError,
    UpstreamTimeoutError,
    UpstreamTransportError,
)
from posttrain.session_router.assembly import (
    REPLY_DROP_HEADERS,
    ChatRequest,
    apply_lora,
    build_generate_body,
    forward_headers,
    parse_chat_body,
    parse_completion_body,
)
from posttrain.session_router.config import SessionRouterConfig, is_positive_seconds
from posttrain.session_router.dispatch import App, Routes
from posttrain.session_router.openai_reply import (
    SSE_HEADERS,
    chat_completion,
    dumps,
    fake_stream,
    text_completion,
)
from posttrain.session_router.samples import AssembledSamples, assemble_samples
from posttrain.session_router.server import BodyTooLargeError, SessionServer
from posttrain.session_router.template import ChatTokenizer, NotCachedError
from posttrain.session_router.tito import (
    PreparedTurn,
    SessionState,
    TurnRecord,
    commit_turn,
    parse_generate_reply,
    prepare_raw_turn,
    prepare_turn,
)
from posttrain.session_router.upstream import Upstream, UpstreamReply

Handler = Callable[[Request], Awaitable[Response]]
# The upstream routes the raw proxy forwards (path under /sessions/{id}/ -> methods): generation
# and read-only information. SGLang renamed get_model_info/get_server_info to model_info and
# server_info; both spellings are read-only. Everything else (sgl-router's /workers, /flush_cache,
# engines' weight and adapter routes) is 404 through a session.
PROXY_ROUTES: Mapping[str, tuple[str, ...]] = {
    "generate": ("POST",),
    "health": ("GET",),
    "model_info": ("GET",),
    "get_model_info": ("GET",),
    "server_info": ("GET",),
    "get_server_info": ("GET",),
    "v1/models": ("GET",),
}
_log = logging.getLogger(__name__)
# Tokenizing more text than this (~4k tokens, ~4 ms) is handed to a thread unless cached.
_INLINE_TOKENIZE_CHARS = 16 * 1024


def _error(status: int, message: str) -> Response:
    return Response(dumps({"error": message}), status_code=status, media_type="application/json")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def _server(request: Request) -> SessionServer:
    server: SessionServer = request.app.state.server
    return server


def _transport_error(exc: UpstreamTransportError) -> Response:
    if isinstance(exc, UpstreamTimeoutError):
        return _error(504, f"upstream timeout: {exc.url} gave no reply within {exc.timeout_s:g} s")
    return _error(502, f"backend transport error: {exc.cause_name}: {exc.detail}")


def _handled(route: str, fn: Handler) -> Handler:
    """Auth, error mapping and request metrics around one route."""

    async def wrapper(request: Request) -> Response:
        server = _server(request)
        server.start_reaper()
        key = server.cfg.api_key
        if key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                response = _error(401, "missing or wrong bearer token")
                server.metrics.requests.labels(route, "401").inc()
                return response
        try:
            response = await fn(request)
        except SessionNotFoundError as exc:
            response = _error(404, str(exc))
        except BodyTooLargeError:
            response = _error(413, f"request body exceeds {server.cfg.max_body_bytes} bytes")
        except BadChatRequestError as exc:
            response = _error(400, str(exc))
        except TitoMismatchError as exc:
            response = _error(500, str(exc))
        except UpstreamReplyError as exc:
            response = _error(502, str(exc))
        except UpstreamTransportError as exc:
            response = _transport_error(exc)
        except PosttrainError as exc:  # anything else we raise is still a JSON error
            response = _error(500, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug, not bad input: still JSON, and logged with its traceback
            _log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
            response = _error(500, f"internal error: {type(exc).__name__}: {exc}")
        server.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    return wrapper


async def health(request: Request) -> Response:
    server = _server(request)
    return _json(
        {
            "status": "ok",
            "session_server_instance_id": server.instance_id,
            "allocator": server.allocator,
        }
    )


async def metrics(request: Request) -> Response:
    return Response(
        generate_latest(_server(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


async def create_session(request: Request) -> Response:
    server = _server(request)
    body = _json_object(await server.read_body(request))
    version = body.get("weight_version")
    if version is not None and not is_weight_version(version):
        raise BadChatRequestError(f"weight_version: must be an int >= 0 or null, got {version!r}")
    # A served adapter needs a version for extra_key: refuse the session now, not per turn.
    apply_lora({}, server.cfg, version)
    return _json({"session_id": server.create(weight_version=version).session_id})


def _json_object(raw: bytes) -> dict[str, Any]:
    """An optional JSON object body (empty means ``{}``); 400 on anything else."""
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise BadChatRequestError(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadChatRequestError("invalid JSON body: expected an object")
    return body


async def get_session(request: Request) -> Response:
    server = _server(request)
    state = server.get(request.path_params["session_id"])
    meta: dict[str, Any] = {
        "accumulated_token_ids": state.accumulated_token_ids,
        "weight_version": state.weight_version,
        "max_trim_tokens": server.cfg.max_trim_tokens,
        "rollbacks": state.rollbacks,
    }
    if state.mismatch is not None:
        meta["tito_session_mismatch"] = state.mismatch
    return _json(
        {
            "session_id": state.session_id,
            "records": [r.to_json() for r in state.records],
            "metadata": meta,
        }
    )


async def delete_session(request: Request) -> Response:
    server = _server(request)
    state = server.get(request.path_params["session_id"])
    state.closing = True
    async with state.lock:  # an in-flight prepare/commit finishes first
        server.drop(state.session_id)
    return Response(status_code=204)


async def chat(request: Request) -> Response:
    return await _one_turn(request, raw=False)


async def _one_turn(request: Request, *, raw: bool) -> Response:
    """A chat turn, or (``raw``) a completions turn, on the request's session."""
    server = _server(request)
    state = server.get(request.path_params["session_id"])
    prepare = _prepare_completion if raw else _prepare_chat
    req, prepared = await prepare(server, state, await server.read_body(request))
    # The client may leave while the upstream generates. One task waits for its disconnect
    # (~9 us a turn; polling Request.is_disconnected costs ~38 us), read before committing.
    left: asyncio.Future[Any] = asyncio.ensure_future(request.receive())
    try:
        return await _generate_and_commit(request.headers.items(), server, state, req, prepared,
                                          left, raw=raw)  # fmt: skip
    finally:
        left.cancel()


async def _prepare_chat(
    server: SessionServer, state: SessionState, raw: bytes
) -> tuple[ChatRequest, PreparedTurn]:
    """Parse a chat body and prepare its turn on ``state`` (rendered and tokenized)."""
    cfg, tok = server.cfg, server.tok
    req = parse_chat_body(raw, cfg.chat_template_kwargs)
    async with state.lock:
        if state.closing:
            raise SessionNotFoundError(state.session_id)
        prepare = functools.partial(
            prepare_turn,
            state,
            req.messages,
            tok,
            tools=req.tools,
            template_kwargs=req.template_kwargs,
            matcher=cfg.matcher,
            max_rollback_checkpoints=cfg.max_rollback_checkpoints,
            max_trim_tokens=cfg.max_trim_tokens,
        )
        # Tokenizing a long uncached text takes milliseconds: off the event loop then, so other
        # sessions' turns proceed (prepare_turn only reads the state, and we hold its lock).
        try:
            return req, prepare(max_uncached_chars=_INLINE_TOKENIZE_CHARS)
        except NotCachedError:
            return req, await asyncio.to_thread(prepare)


async def completion(request: Request) -> Response:
    """A raw-prompt turn (OpenAI completions): the text tokenized as it is (no chat template),
    or the token ids given; recorded like a chat turn, so ``/samples`` assembles it."""
    return await _one_turn(request, raw=True)


async def _prepare_completion(
    server: SessionServer, state: SessionState, raw: bytes
) -> tuple[ChatRequest, PreparedTurn]:
    """Parse a completions body and prepare its raw turn on ``state``."""
    tok = server.tok
    req, prompt = parse_completion_body(raw, tok.tokenizer.get_vocab_size())
    if isinstance(prompt, str):
        try:
            prompt_ids = tok.encode(prompt, max_uncached_chars=_INLINE_TOKENIZE_CHARS)
        except NotCachedError:
            prompt_ids = await asyncio.to_thread(tok.encode, prompt)
    else:
        prompt_ids = prompt
    async with state.lock:
        if state.closing:
            raise SessionNotFoundError(state.session_id)
        return req, prepare_raw_turn(state, prompt_ids)


def _client_left(left: asyncio.Future[Any]) -> bool:
    if not left.done() or left.cancelled() or left.exception() is not None:
        return False
    message = left.result()
    return isinstance(message, dict) and message.get("type") == "http.disconnect"


async def _generate_and_commit(
    headers: Iterable[tuple[str, str]],
    server: SessionServer,
    state: SessionState,
    req: ChatRequest,
    prepared: PreparedTurn,
    left: asyncio.Future[Any],
    *,
    raw: bool = False,
) -> Response:
    """The upstream call, the reply checks and the commit of one prepared turn (``raw``: a
    completions turn, answered as a ``text_completion``)."""
    cfg, tok, session_id = server.cfg, server.tok, state.session_id
    body = build_generate_body(
        req.body, cfg, prepared.prompt_ids, weight_version=state.weight_version
    )
    request_ts = time.time()
    upstream = await _post_generate(server, headers, session_id, body)
    if upstream.status_code != 200:
        server.metrics.turns.labels("upstream_error").inc()
        if upstream.status_code >= 500:
            # sgl-router answers 500 (call_upstream_request_error) when the worker died mid-turn
            # and 503 when none is available: to the agent both are a bad gateway.
            return _error(502, f"upstream answered {upstream.status_code}: {upstream.text[:500]}")
        return _passthrough(upstream)
    try:
        payload = orjson.loads(upstream.content)
    except orjson.JSONDecodeError as exc:
        raise UpstreamReplyError(f"upstream reply is not JSON: {exc}", url=upstream.url) from exc
    reply = parse_generate_reply(
        payload,
        prompt_len=len(prepared.prompt_ids),
        url=upstream.url,
        with_media="image_data" in body or "audio_data" in body,
    )
    shape = text_completion if raw else chat_completion
    completion = shape(reply, body=req.body, prompt_tokens=len(prepared.prompt_ids), tok=tok)
    record = TurnRecord(
        timestamp=time.time(),
        request_timestamp=request_ts,
        method="POST",
        path="/generate",
        request=body,
        response=payload if isinstance(payload, dict) else {"reply": payload},
        status_code=upstream.status_code,
        prompt_ids=prepared.prompt_ids,
        output_ids=reply.output_ids,
        output_logprobs=reply.output_logprobs,
        finish_reason=reply.finish_reason,
    )
    if _client_left(left):
        # The client gave up (its own timeout, a cancelled rollout): nobody reads this reply, and
        # a retry of the same turn must find the session as it was.
        server.metrics.turns.labels("abandoned").inc()
        return _error(499, "client disconnected before the reply; the turn was not committed")
    async with state.lock:
        committed = commit_turn(
            state,
            prepared,
            reply,
            record,
            {"role": "assistant", "content": reply.text},
            max_trim_tokens=cfg.max_trim_tokens,
        )
    server.metrics.turns.labels("committed" if committed else "not_committed").inc()
    if req.stream:
        return Response(
            fake_stream(completion), media_type="text/event-stream", headers=SSE_HEADERS
        )
    return _json(completion)


async def _post_generate(
    server: SessionServer,
    headers: Iterable[tuple[str, str]],
    session_id: str,
    body: dict[str, Any],
) -> UpstreamReply:
    """POST ``body`` to the upstream's ``/generate`` with the session's routing key (timed)."""
    started = time.perf_counter()
    upstream = await server.upstream.request(
        "POST",
        "/generate",
        content=dumps(body),
        headers=forward_headers(list(headers), session_id) | {"content-type": "application/json"},
    )
    server.metrics.upstream_seconds.observe(time.perf_counter() - started)
    return upstream


async def samples(request: Request) -> Response:
    server = _server(request)
    state = server.get(request.path_params["session_id"])
    body = _json_object(await server.read_body(request))
    max_seq_len = body.get("max_seq_len")
    metadata = body.get("metadata") or {}
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
    ):
        raise BadChatRequestError(f"max_seq_len: must be an int or null, got {max_seq_len!r}")
    if not isinstance(metadata, dict):
        raise BadChatRequestError("metadata: must be an object")
    try:
        result = await _assemble(server, state, max_seq_len, metadata)
    except (SampleAssemblyError, ConfigError) as exc:  # ConfigError: Sample validation
        return Response(str(exc), status_code=422, media_type="text/plain")
    data = encode_samples(
        result.samples, session_metadata=result.session_metadata, empty_reason=result.empty_reason
    )
    return Response(data, media_type="application/octet-stream")


async def _assemble(
    server: SessionServer,
    state: SessionState,
    max_seq_len: int | None,
    metadata: Mapping[str, Any],
) -> AssembledSamples:
    """The session's records assembled into 0 or 1 training sample."""
    async with state.lock:
        records, accumulated = list(state.records), state.accumulated_token_ids
        session_meta = {"session_id": state.session_id, "rollbacks": state.rollbacks}
    return assemble_samples(
        records,
        accumulated,
        max_trim_tokens=server.cfg.max_trim_tokens,
        max_seq_len=max_seq_len,
        metadata=metadata,
        session_metadata=session_meta,
    )


_MAX_GROUP = 4096  # samples in one POST /rollouts


class _SampleTurnFailedError(Exception):
    """One sample's turn of a group got an error reply: the group answers it, naming the sample."""

    def __init__(self, index: int, response: Response) -> None:
        super().__init__(index)
        self.index, self.response = index, response


async def rollouts(request: Request) -> Response:
    """A group in one request: ``n`` single-turn samples of one prompt, each in its own session.

    Body: ``{"n", "turn", "seeds"?, "weight_version"?, "metadata"?, "turn_timeout_s"?}``. ``turn``
    is a chat body (``messages``) or a completions body (``prompt``); sample ``i`` sends it with
    ``seeds[i]`` as its OpenAI ``seed``. Every sample is a session of its own, created, run,
    assembled and deleted here exactly as a client doing those four requests would, so its token
    ids and logprobs are the engine's; the n upstream turns go concurrently (the engine batches
    them). The reply is samples/1 with the n samples in order, each naming its ``session_id``.
    With ``turn_timeout_s``, a turn with no reply within it (or the upstream's 504) is an
    ``aborted`` sample with no tokens and ``metadata["abort_reason"]``; any other failure of a
    sample fails the group with that sample's error, and no session outlives the request.

    With ``parallel_sampling`` (``--parallel-sampling``) and seeds ``s, s+1, ..., s+n-1`` (or
    none, and no ``seed`` in ``turn``), the n turns go upstream as ONE ``/generate`` with
    ``sampling_params.n`` and ``sampling_seed=s`` (``_rollouts_with_n``): the engine draws sample
    j with seed ``s + j``, exactly what sample j's own request would draw. An engine that
    refuses ``n`` (a 4xx) or answers it with one object falls back to one request per sample.
    """
    server = _server(request)
    body = _json_object(await server.read_body(request))
    n, turn, seeds, version, metadata, deadline = _group_fields(body)
    apply_lora({}, server.cfg, version)  # a served adapter needs a version: refuse it now
    raw = "prompt" in turn
    headers = list(request.headers.items())
    left: asyncio.Future[Any] = asyncio.ensure_future(request.receive())
    base = _parallel_base_seed(server.cfg.parallel_sampling, n, turn, seeds)
    if base is not False:
        one = _Group(server, headers, turn, n, base, version, metadata, deadline, left, raw)
        try:
            answered = await _rollouts_with_n(one)
        except BaseException:
            left.cancel()
            raise
        if answered is not None:
            left.cancel()
            return answered
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(
                    _group_sample(
                        server,
                        headers,
                        {**turn, "seed": seeds[i]} if seeds else turn,
                        i,
                        version=version,
                        metadata=metadata,
                        deadline=deadline,
                        left=left,
                        raw=raw,
                    )
                )
                for i in range(n)
            ]
    except BaseExceptionGroup as eg:  # the first failure, as the single-sample routes answer it
        first = eg.exceptions[0]
        if isinstance(first, _SampleTurnFailedError):
            return _sample_error(first)
        raise first from None
    finally:
        left.cancel()
    data = encode_samples([t.result() for t in tasks])
    return Response(data, media_type="application/octet-stream")


def _group_fields(
    body: dict[str, Any],
) -> tuple[int, dict[str, Any], list[int] | None, int | None, dict[str, Any], float | None]:
    """The validated fields of a ``POST /rollouts`` body (400 naming the field otherwise)."""
    n = body.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= _MAX_GROUP:
        raise BadChatRequestError(f"n: must be an int in [1, {_MAX_GROUP}], got {n!r}")
    turn = body.get("turn")
    if not isinstance(turn, dict):
        raise BadChatRequestError("turn: must be an object (a chat or completions body)")
    seeds = body.get("seeds")
    if seeds is not None and (
        not isinstance(seeds, list)
        or len(seeds) != n
        or any(isinstance(x, bool) or not isinstance(x, int) for x in seeds)
    ):
        raise BadChatRequestError(f"seeds: must be a list of {n} ints (one per sample) or null")
    version = body.get("weight_version")
    if version is not None and not is_weight_version(version):
        raise BadChatRequestError(f"weight_version: must be an int >= 0 or null, got {version!r}")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise BadChatRequestError("metadata: must be an object")
    deadline = body.get("turn_timeout_s")
    if deadline is not None and not is_positive_seconds(deadline):
        raise BadChatRequestError(
            f"turn_timeout_s: must be a finite number > 0 or null, got {deadline!r}"
        )
    return n, turn, seeds, version, metadata, deadline


async def _group_sample(
    server: SessionServer,
    headers: list[tuple[str, str]],
    turn: dict[str, Any],
    index: int,
    *,
    version: int | None,
    metadata: dict[str, Any],
    deadline: float | None,
    left: asyncio.Future[Any],
    raw: bool,
) -> Sample:
    """Sample ``index`` of a group: a session created, one turn, assembled, deleted."""
    state = server.create(weight_version=version)
    try:
        prepare = _prepare_completion if raw else _prepare_chat
        try:
            async with asyncio.timeout(deadline):
                req, prepared = await prepare(server, state, dumps(turn))
                response = await _generate_and_commit(
                    headers, server, state, req, prepared, left, raw=raw
                )
        except TimeoutError:
            return _aborted(state, metadata, f"no reply within turn_timeout_s={deadline:g} s")
        except UpstreamTimeoutError as exc:
            if deadline is None:
                raise
            return _aborted(state, metadata, f"the session server's upstream call timed out "
                                             f"(504): {exc.url}")  # fmt: skip
        if response.status_code != 200:
            raise _SampleTurnFailedError(index, response)
        return await _one_sample(server, state, metadata, index)
    finally:
        server.drop(state.session_id)


async def _one_sample(
    server: SessionServer, state: SessionState, metadata: dict[str, Any], index: int
) -> Sample:
    """Sample ``index`` of a group: its one-turn session assembled (422 naming it otherwise)."""
    try:
        result = await _assemble(server, state, None, metadata)
    except (SampleAssemblyError, ConfigError) as exc:
        raise _SampleTurnFailedError(index, Response(str(exc), status_code=422)) from exc
    if len(result.samples) != 1:
        why = result.empty_reason or "expected exactly 1"
        raise _SampleTurnFailedError(index, Response(
            f"session {state.session_id} assembled {len(result.samples)} samples ({why})",
            status_code=422,
        ))  # fmt: skip
    sample = result.samples[0]
    sample.metadata.setdefault("session_id", state.session_id)
    return sample


def _parallel_base_seed(
    enabled: bool, n: int, turn: Mapping[str, Any], seeds: list[int] | None
) -> int | Literal[False] | None:
    """The ``sampling_seed`` of a group's one ``n`` request: ``seeds[0]`` when the seeds are
    consecutive (sample j's is ``seeds[0] + j``, as the engine draws), None for no seeds (and no
    ``seed`` or ``sampling_params.sampling_seed`` in the turn, which the per-sample path would
    give every sample alike); False when the group must go one request per sample."""
    if not enabled or n < 2:
        return False
    if seeds is None:
        explicit = turn.get("sampling_params")
        pinned = isinstance(explicit, dict) and explicit.get("sampling_seed") is not None
        return None if turn.get("seed") is None and not pinned else False
    return seeds[0] if seeds == list(range(seeds[0], seeds[0] + n)) else False


@dataclass(frozen=True, slots=True)
class _Group:
    """A ``POST /rollouts`` group on its way upstream as one request with ``n``."""

    server: SessionServer
    headers: list[tuple[str, str]]
    turn: dict[str, Any]
    n: int
    seed: int | None
    version: int | None
    metadata: dict[str, Any]
    deadline: float | None
    left: asyncio.Future[Any]
    raw: bool


async def _rollouts_with_n(group: _Group) -> Response | None:
    """The group's n samples from one upstream ``/generate`` with ``sampling_params.n``; None
    when the engine refused ``n`` (the caller then sends one request per sample).

    Each sample is still its own session (created, its turn committed, assembled, deleted), its
    record the request its own ``/generate`` would have been (``sampling_seed`` s + j, no ``n``)
    and reply item j, so its token ids and logprobs are the engine's and ``/samples`` assembles
    it as it would the per-sample turn. The one request carries sample 0's routing key. A turn
    past ``turn_timeout_s`` (or the upstream's 504) aborts every sample; a reply item that is
    not a valid turn fails the group naming that sample.
    """
    server, n = group.server, group.n
    states = [server.create(weight_version=group.version) for _ in range(n)]
    try:
        prepare = _prepare_completion if group.raw else _prepare_chat
        first = group.turn if group.seed is None else {**group.turn, "seed": group.seed}
        try:
            async with asyncio.timeout(group.deadline):
                # A fresh session's turn: the same prompt for every sample, tokenized once.
                req, prepared = await prepare(server, states[0], dumps(first))
                body = build_generate_body(
                    req.body, server.cfg, prepared.prompt_ids, weight_version=group.version
                )
                body["sampling_params"]["n"] = n
                request_ts = time.time()
                upstream = await _post_generate(server, group.headers, states[0].session_id, body)
        except TimeoutError:
            why = f"no reply within turn_timeout_s={group.deadline:g} s"
            return _all_aborted(states, group.metadata, why)
        except UpstreamTimeoutError as exc:
            if group.deadline is None:
                raise
            why = f"the session server's upstream call timed out (504): {exc.url}"
            return _all_aborted(states, group.metadata, why)
        if 400 <= upstream.status_code < 500:
            _log.warning("upstream refused n=%d (%d): one request per sample", n,
                         upstream.status_code)  # fmt: skip
            return None
        if upstream.status_code != 200:
            server.metrics.turns.labels("upstream_error").inc(n)
            return _error(502, f"samples 0-{n - 1} (one /generate with n={n}): upstream "
                               f"answered {upstream.status_code}: {upstream.text[:500]}")  # fmt: skip
        try:
            payload = orjson.loads(upstream.content)
        except orjson.JSONDecodeError as exc:
            raise UpstreamReplyError(
                f"upstream reply is not JSON: {exc}", url=upstream.url
            ) from exc
        if isinstance(payload, dict):
            _log.warning("upstream answered n=%d with one object: one request per sample", n)
            return None
        if not isinstance(payload, list) or len(payload) != n:
            count = len(payload) if isinstance(payload, list) else type(payload).__name__
            raise UpstreamReplyError(
                f"upstream reply to n={n}: expected a list of {n} samples, got {count}",
                url=upstream.url,
            )
        if _client_left(group.left):
            server.metrics.turns.labels("abandoned").inc(n)
            return _error(499, "client disconnected before the reply; no turn was committed")
        samples: list[Sample] = []
        for j, (state, item) in enumerate(zip(states, payload, strict=True)):
            try:
                reply = parse_generate_reply(
                    item, prompt_len=len(prepared.prompt_ids), url=upstream.url,
                    with_media="image_data" in body or "audio_data" in body,
                )  # fmt: skip
            except UpstreamReplyError as exc:
                return _sample_error(_SampleTurnFailedError(j, _error(502, str(exc))))
            record = TurnRecord(
                timestamp=time.time(), request_timestamp=request_ts, method="POST",
                path="/generate", request=_sample_body(body, group.seed, j), response=item,
                status_code=200, prompt_ids=prepared.prompt_ids, output_ids=reply.output_ids,
                output_logprobs=reply.output_logprobs, finish_reason=reply.finish_reason,
            )  # fmt: skip
            async with state.lock:
                committed = commit_turn(
                    state, prepared, reply, record, {"role": "assistant", "content": reply.text},
                    max_trim_tokens=server.cfg.max_trim_tokens,
                )  # fmt: skip
            server.metrics.turns.labels("committed" if committed else "not_committed").inc()
            try:
                samples.append(await _one_sample(server, state, group.metadata, j))
            except _SampleTurnFailedError as failed:
                return _sample_error(failed)
        return Response(encode_samples(samples), media_type="application/octet-stream")
    finally:
        for state in states:
            server.drop(state.session_id)


def _sample_body(body: Mapping[str, Any], seed: int | None, j: int) -> dict[str, Any]:
    """Sample j's share of an ``n`` request: the body its own ``/generate`` would have sent."""
    sampling = {k: v for k, v in body["sampling_params"].items() if k != "n"}
    if seed is not None:
        sampling["sampling_seed"] = seed + j
    return {**body, "sampling_params": sampling}


def _all_aborted(states: list[SessionState], metadata: dict[str, Any], reason: str) -> Response:
    return Response(
        encode_samples([_aborted(s, metadata, reason) for s in states]),
        media_type="application/octet-stream",
    )


def _aborted(state: SessionState, metadata: dict[str, Any], reason: str) -> Sample:
    return Sample(
        prompt_ids=[], response_ids=[], rollout_logprobs=[], loss_mask=[],
        status=SampleStatus.ABORTED,
        metadata={**metadata, "session_id": state.session_id, "abort_reason": reason},
    )  # fmt: skip


def _sample_error(failed: _SampleTurnFailedError) -> Response:
    """A sample's error reply, its message prefixed with the sample's index."""
    reply = failed.response
    text = bytes(reply.body).decode("utf-8", errors="replace")
    try:
        message = orjson.loads(text)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = text
    return _error(reply.status_code, f"sample {failed.index}: {message}")


async def proxy(request: Request, *, path: str) -> Response:
    """Forward one allow-listed upstream route (``PROXY_ROUTES``) with the session's routing key."""
    server = _server(request)
    session_id = request.path_params["session_id"]
    state = server.get(session_id)
    raw = await server.read_body(request)
    if path == "generate" and raw:
        # The same LoRA fields as the chat path (and the trainer's generate path).
        with contextlib.suppress(orjson.JSONDecodeError):
            body = orjson.loads(raw)
            if isinstance(body, dict):
                raw = dumps(apply_lora(body, server.cfg, state.weight_version))
    upstream = await server.upstream.request(
        request.method,
        "/" + path,
        query=request.scope["query_string"].decode("latin-1"),
        content=raw,
        headers=forward_headers(request.headers.items(), session_id),
    )
    return _passthrough(upstream)


def _passthrough(upstream: UpstreamReply) -> Response:
    headers = {k: v for k, v in upstream.headers if k not in REPLY_DROP_HEADERS}
    return Response(upstream.content, status_code=upstream.status_code, headers=headers)


def create_app(
    cfg: SessionRouterConfig,
    *,
    tokenizer: ChatTokenizer | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    upstream: Upstream | None = None,
) -> App:
    """The session server as an ASGI app.

    ``upstream`` replaces the upstream client (default: ``PooledUpstream``); ``transport``
    instead puts an httpx transport (e.g. ``httpx.MockTransport``) behind an ``HttpxUpstream``.
    """
    server = SessionServer(
        cfg,
        tokenizer
        or ChatTokenizer.from_dir(cfg.tokenizer, encode_cache_tokens=cfg.encode_cache_tokens),
        transport,
        upstream=upstream,
    )

    async def startup() -> None:
        server.start_reaper()

    sid = "/sessions/{session_id}"
    routes = Routes()
    routes.add("/health", {"GET": _handled("health", health)})
    routes.add("/metrics", {"GET": _handled("metrics", metrics)})
    routes.add("/sessions", {"POST": _handled("create", create_session)})
    routes.add(
        sid, {"GET": _handled("get", get_session), "DELETE": _handled("delete", delete_session)}
    )
    routes.add(f"{sid}/v1/chat/completions", {"POST": _handled("chat", chat)})
    routes.add(f"{sid}/v1/completions", {"POST": _handled("completion", completion)})
    routes.add(f"{sid}/samples", {"POST": _handled("samples", samples)})
    routes.add("/rollouts", {"POST": _handled("rollouts", rollouts)})
    for path, methods in PROXY_ROUTES.items():
        proxied = _handled("proxy", functools.partial(proxy, path=path))
        routes.add(f"{sid}/{path}", dict.fromkeys(methods, proxied))
    return App(
        routes,
        state=SimpleNamespace(server=server),
        on_startup=startup,
        on_shutdown=server.aclose,
    )
