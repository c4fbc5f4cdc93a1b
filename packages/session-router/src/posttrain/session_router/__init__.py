"""posttrain.session_router: token-in/token-out chat sessions in front of the stock sgl-router.

An agent talks OpenAI chat to ``/sessions/{id}/v1/chat/completions``; the server renders the chat
template itself, sends token ids (plus ``lora_path`` when the adapter is served) through
sgl-router's ``/generate`` with the session as routing key, keeps the exact token ids and logprobs
of every turn, and assembles them into training samples (``/sessions/{id}/samples``).
"""

from posttrain.session_router._errors import (
    BadChatRequestError,
    RouterIncompatible,
    RouterStartError,
    SampleAssemblyError,
    SessionNotFoundError,
    SessionRouterError,
    TitoMismatchError,
    UpstreamReplyError,
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
from posttrain.session_router.client import SessionClient
from posttrain.session_router.config import SessionRouterConfig, serves_lora
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
from posttrain.session_router.wire import DecodedSamples, decode_samples, encode_samples

__all__ = [
    "ROUTING_KEY_HEADER",
    "AssembledSamples",
    "BadChatRequestError",
    "ChatRequest",
    "ChatTokenizer",
    "DecodedSamples",
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
    "SessionRouterConfig",
    "SessionRouterError",
    "SessionState",
    "TitoMismatchError",
    "TurnRecord",
    "Upstream",
    "UpstreamReply",
    "UpstreamReplyError",
    "UpstreamTransportError",
    "apply_lora",
    "assemble_samples",
    "build_generate_body",
    "commit_turn",
    "create_app",
    "decode_samples",
    "default_probe_body",
    "encode_samples",
    "forward_headers",
    "merge_template_kwargs",
    "parse_chat_body",
    "parse_generate_reply",
    "prepare_turn",
    "probe_passthrough",
    "serves_lora",
    "start_router",
    "strip_rank",
]
