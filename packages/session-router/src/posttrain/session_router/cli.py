"""The session server's command line (``python -m posttrain.session_router``; ``__main__.py``).

    python -m posttrain.session_router --upstream ROUTER_URL --tokenizer PATH
        [--lora-adapter NAME [--lora-weight-version N]] [--host 127.0.0.1] [--port P]
        [--api-key-file FILE] [--session-ttl-s S] [--upstream-timeout-s S] [--encode-cache-tokens N]
        [--allocator {mimalloc,system}]

Before serving, the passthrough probe checks that the upstream router forwards every field this
server sends to ``/generate``; an incompatible router stops startup with exit code 2 and the
dropped fields named. An upstream without a ``/workers`` API is an engine, not a router (nothing
re-serializes the body), and is not probed.

argparse rather than typer (the project's CLI library) on purpose: ``__main__`` re-executes the
process for its allocator before anything heavy is imported (allocator.py reads ``--allocator``
with a stdlib parser), and the whole command line must stay importable at that point; typer and
click would add their imports to every start, for one flat list of options. Every option shows
its help and default (``--help``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import httpx
import uvicorn

from posttrain.formats import FormatsConfigError, resolve_api_key
from posttrain.interface import PosttrainError
from posttrain.session_router._errors import RouterIncompatible
from posttrain.session_router.allocator import ALLOCATORS, DEFAULT_ALLOCATOR
from posttrain.session_router.app import create_app
from posttrain.session_router.config import (
    DEFAULT_ENCODE_CACHE_TOKENS,
    DEFAULT_UPSTREAM_TIMEOUT_S,
    SessionRouterConfig,
)
from posttrain.session_router.router import default_probe_body, probe_passthrough


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks; appends each optional flag's default to its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or action.default in (None, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The command line (the flags above), each with its help and default."""
    p = argparse.ArgumentParser(
        prog="python -m posttrain.session_router",
        description=(
            "Token-in/token-out chat sessions in front of sgl-router (or one engine).\n"
            "Agents talk OpenAI chat to /sessions/{id}/v1/chat/completions; the trajectory\n"
            "comes back as a training sample from /sessions/{id}/samples."
        ),
        epilog=(
            "Before serving, a router upstream is probed: it must forward every field this\n"
            "server sends to /generate (exit code 2 naming the dropped fields otherwise)."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="base URL of the sgl-router (or of one engine) that serves /generate",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH",
        help="model or tokenizer directory (tokenizer.json and a chat template)",
    )
    p.add_argument(
        "--lora-adapter",
        default=None,
        metavar="NAME",
        help="adapter name sent as lora_path on every generation (default: base weights)",
    )
    p.add_argument(
        "--lora-weight-version",
        type=int,
        default=None,
        metavar="N",
        help="version of the adapter the engines load at startup (extra_key '<name>:v<N>'); "
        "a session created with its own weight_version uses that (default: none; then every "
        "session must be created with a weight_version when an adapter is served)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8080, help="TCP port to bind")
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="bearer token every route then requires; it shows in ps: prefer --api-key-file "
        "or $POSTTRAIN_API_KEY (default: no token)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token (one token); without it and without --api-key, "
        "$POSTTRAIN_API_KEY if set (default: none)",
    )
    p.add_argument(
        "--session-ttl-s",
        type=float,
        default=3600.0,
        metavar="S",
        help="seconds an idle session is kept before it is reclaimed",
    )
    p.add_argument(
        "--upstream-timeout-s",
        type=float,
        default=DEFAULT_UPSTREAM_TIMEOUT_S,
        metavar="S",
        help="seconds one turn waits for the upstream's reply (one whole generation); past it "
        "the turn fails with 504 naming the upstream and is not recorded. 'inf' waits forever",
    )
    p.add_argument(
        "--encode-cache-tokens",
        type=int,
        default=DEFAULT_ENCODE_CACHE_TOKENS,
        metavar="N",
        help="token ids the exact-text tokenization cache may hold (0: off)",
    )
    p.add_argument(
        "--parallel-sampling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="send a POST /rollouts group upstream as one /generate with sampling_params.n "
        "(sample j seeded sampling_seed + j); only for engines that seed parallel samples so "
        "(posttrain.local_engine; SGLang gives all n samples one seed); off: one /generate per "
        "sample",
    )
    p.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default=DEFAULT_ALLOCATOR,
        help="memory allocator of the server process (mimalloc: preloaded by one re-exec at start)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (the flags above)."""
    return build_parser().parse_args(argv)


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
    if not 0 <= args.port < 65536:
        print(f"error: --port {args.port} is not a TCP port (0-65535)", file=sys.stderr)
        return 2
    try:
        if args.api_key is not None and args.api_key_file is not None:
            print("error: give --api-key or --api-key-file, not both", file=sys.stderr)
            return 2
        api_key = args.api_key if args.api_key is not None else resolve_api_key(args.api_key_file)
        cfg = SessionRouterConfig(
            upstream_url=args.upstream,
            tokenizer=args.tokenizer,
            lora_adapter=args.lora_adapter,
            lora_weight_version=args.lora_weight_version,
            api_key=api_key,
            session_ttl_s=args.session_ttl_s,
            upstream_timeout_s=args.upstream_timeout_s,
            encode_cache_tokens=args.encode_cache_tokens,
            parallel_sampling=args.parallel_sampling,
        )
        app = create_app(cfg)
        if upstream_is_router(cfg.upstream_url):
            probe_passthrough(cfg.upstream_url, default_probe_body(cfg))
        else:
            print(
                f"upstream {cfg.upstream_url} has no /workers API: not a router, probe skipped",
                file=sys.stderr,
            )
    except (RouterIncompatible, FormatsConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:  # the start-up probe: name the upstream it could not reach
        print(f"error: --upstream {args.upstream}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except PosttrainError as exc:
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
