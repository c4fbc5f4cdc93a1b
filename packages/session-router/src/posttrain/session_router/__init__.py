"""posttrain.session_router: token-in/token-out chat sessions in front of the stock sgl-router.

An agent talks OpenAI chat to ``/sessions/{id}/v1/chat/completions``; the server renders the chat
template itself, sends token ids (plus ``lora_path`` and ``extra_key`` when the adapter is
served, written by ``posttrain.formats.apply_lora_fields`` as on the trainer's generate path)
through sgl-router's ``/generate`` with the session as routing key, keeps the exact token ids and
logprobs of every turn, and assembles them into training samples (``/sessions/{id}/samples``, in
the samples/1 format of ``posttrain.formats``). ``SessionRolloutClient`` is the interface's
``RolloutEngine``: one session per rollout.

Importing the package is light: each name below is loaded from its module on first use (PEP 562
``__getattr__``), so ``python -m posttrain.session_router`` settles its allocator (allocator.py)
before uvicorn, tokenizers and the rest are imported, and a client does not pull in the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.session_router._errors import (
        BadChatRequestError,
        RouterIncompatible,
        RouterStartError,
        SampleAssemblyError,
        SessionNotFoundError,
        SessionRouterError,
        TitoMismatchError,
        UpstreamReplyError,
        UpstreamTimeoutError,
        UpstreamTransportError,
    )
    from posttrain.session_router.app import create_app
    from posttrain.session_router.assembly import (
        ROUTING_KEY_HEADER,
        ChatRequest,
        apply_lora,
        build_generate_body,
        forward_headers,
        merge_template_kwargs,
        parse_chat_body,
    )
    from posttrain.session_router.client import SessionClient, SessionRolloutClient
    from posttrain.session_router.config import SessionRouterConfig
    from posttrain.session_router.loopback import LoopbackWorker
    from posttrain.session_router.router import (
        RouterHandle,
        RouterSpec,
        default_probe_body,
        probe_passthrough,
        start_router,
        strip_rank,
    )
    from posttrain.session_router.samples import AssembledSamples, assemble_samples
    from posttrain.session_router.template import ChatTokenizer
    from posttrain.session_router.tito import (
        ParsedReply,
        PreparedTurn,
        SessionState,
        TurnRecord,
        commit_turn,
        parse_generate_reply,
        prepare_turn,
    )
    from posttrain.session_router.upstream import (
        HttpxUpstream,
        PooledUpstream,
        Upstream,
        UpstreamReply,
    )

# public name -> the module of this package that defines it
_EXPORTS = {
    "BadChatRequestError": "_errors",
    "RouterIncompatible": "_errors",
    "RouterStartError": "_errors",
    "SampleAssemblyError": "_errors",
    "SessionNotFoundError": "_errors",
    "SessionRouterError": "_errors",
    "TitoMismatchError": "_errors",
    "UpstreamReplyError": "_errors",
    "UpstreamTimeoutError": "_errors",
    "UpstreamTransportError": "_errors",
    "create_app": "app",
    "ROUTING_KEY_HEADER": "assembly",
    "ChatRequest": "assembly",
    "apply_lora": "assembly",
    "build_generate_body": "assembly",
    "forward_headers": "assembly",
    "merge_template_kwargs": "assembly",
    "parse_chat_body": "assembly",
    "SessionClient": "client",
    "SessionRolloutClient": "client",
    "SessionRouterConfig": "config",
    "LoopbackWorker": "loopback",
    "RouterHandle": "router",
    "RouterSpec": "router",
    "default_probe_body": "router",
    "probe_passthrough": "router",
    "start_router": "router",
    "strip_rank": "router",
    "AssembledSamples": "samples",
    "assemble_samples": "samples",
    "ChatTokenizer": "template",
    "ParsedReply": "tito",
    "PreparedTurn": "tito",
    "SessionState": "tito",
    "TurnRecord": "tito",
    "commit_turn": "tito",
    "parse_generate_reply": "tito",
    "prepare_turn": "tito",
    "HttpxUpstream": "upstream",
    "PooledUpstream": "upstream",
    "Upstream": "upstream",
    "UpstreamReply": "upstream",
}

__all__ = [
    "ROUTING_KEY_HEADER",
    "AssembledSamples",
    "BadChatRequestError",
    "ChatRequest",
    "ChatTokenizer",
    "HttpxUpstream",
    "LoopbackWorker",
    "ParsedReply",
    "PooledUpstream",
    "PreparedTurn",
    "RouterHandle",
    "RouterIncompatible",
    "RouterSpec",
    "RouterStartError",
    "SampleAssemblyError",
    "SessionClient",
    "SessionNotFoundError",
    "SessionRolloutClient",
    "SessionRouterConfig",
    "SessionRouterError",
    "SessionState",
    "TitoMismatchError",
    "TurnRecord",
    "Upstream",
    "UpstreamReply",
    "UpstreamReplyError",
    "UpstreamTimeoutError",
    "UpstreamTransportError",
    "apply_lora",
    "assemble_samples",
    "build_generate_body",
    "commit_turn",
    "create_app",
    "default_probe_body",
    "forward_headers",
    "merge_template_kwargs",
    "parse_chat_body",
    "parse_generate_reply",
    "prepare_turn",
    "probe_passthrough",
    "start_router",
    "strip_rank",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
