"""The session server's command line (``python -m posttrain.session_router``; ``__main__.py``).

    python -m posttrain.session_router --upstream ROUTER_URL --tokenizer PATH
        [--lora-adapter NAME [--lora-weight-version N]] [--host 127.0.0.1] [--port P]
        [--api-key KEY] [--session-ttl-s S] [--encode-cache-tokens N]
        [--allocator {mimalloc,system}]

Before serving, the passthrough probe checks that the upstream router forwards every field this
server sends to ``/generate``; an incompatible router stops startup with exit code 2 and the
dropped fields named. An upstream without a ``/workers`` API is an engine, not a router (nothing
re-serializes the body), and is not probed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import httpx
import uvicorn

from posttrain.interface import PosttrainError
from posttrain.session_router._errors import RouterIncompatible
from posttrain.session_router.allocator import ALLOCATORS, DEFAULT_ALLOCATOR
from posttrain.session_router.app import create_app
from posttrain.session_router.config import DEFAULT_ENCODE_CACHE_TOKENS, SessionRouterConfig
from posttrain.session_router.router import default_probe_body, probe_passthrough


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (the flags above)."""
    p = argparse.ArgumentParser(prog="python -m posttrain.session_router", description=__doc__)
    p.add_argument("--upstream", required=True, help="sgl-router (or engine) base URL")
    p.add_argument("--tokenizer", required=True, help="tokenizer or model directory")
    p.add_argument("--lora-adapter", default=None, help="adapter name to send as lora_path")
    p.add_argument(
        "--lora-weight-version",
        type=int,
        default=None,
        help="version of the adapter the engines load at startup (extra_key '<name>:v<N>'); "
        "a session created with its own weight_version uses that",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, help="bearer token required on every route")
    p.add_argument("--session-ttl-s", type=float, default=3600.0)
    p.add_argument(
        "--encode-cache-tokens",
        type=int,
        default=DEFAULT_ENCODE_CACHE_TOKENS,
        help="token ids the exact-text tokenization cache may hold (0: off)",
    )
    p.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default=DEFAULT_ALLOCATOR,
        help="memory allocator of the server process (mimalloc: preloaded by one re-exec at start)",
    )
    return p.parse_args(argv)


def upstream_is_router(url: str, *, timeout_s: float = 10.0) -> bool:
    """Whether ``url`` exposes sgl-router's worker API (``GET /workers``)."""
    reply = httpx.get(f"{url.rstrip('/')}/workers", timeout=timeout_s)
    return reply.status_code == 200


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, build the app, probe the upstream router, serve; the exit code.

    ``--allocator`` acts in ``__main__`` (a re-exec before this runs); a caller that runs
    ``main`` in its own process keeps that process's allocator.
    """
    args = parse_args(argv)
    try:
        cfg = SessionRouterConfig(
            upstream_url=args.upstream,
            tokenizer=args.tokenizer,
            lora_adapter=args.lora_adapter,
            lora_weight_version=args.lora_weight_version,
            api_key=args.api_key,
            session_ttl_s=args.session_ttl_s,
            encode_cache_tokens=args.encode_cache_tokens,
        )
        app = create_app(cfg)
        if upstream_is_router(cfg.upstream_url):
            probe_passthrough(cfg.upstream_url, default_probe_body(cfg))
        else:
            print(
                f"upstream {cfg.upstream_url} has no /workers API: not a router, probe skipped",
                file=sys.stderr,
            )
    except RouterIncompatible as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (PosttrainError, httpx.HTTPError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    # httptools parses requests in C: ~0.12 ms less CPU per request than h11 (benchmarks/).
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        http="httptools",
        proxy_headers=False,  # the client address is never used; skip the middleware
        log_level="warning",
        access_log=False,
    )
    return 0
