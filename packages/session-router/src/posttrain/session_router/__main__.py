"""``python -m posttrain.session_router``: run the session server in front of an sgl-router.

    python -m posttrain.session_router --upstream ROUTER_URL --tokenizer PATH
        [--lora-adapter NAME [--lora-weight-version N]] [--host 127.0.0.1] [--port P]
        [--api-key-file FILE] [--session-ttl-s S] [--upstream-timeout-s S] [--encode-cache-tokens N]
        [--allocator {mimalloc,system}]

The allocator is settled first (allocator.py: a re-exec with mimalloc preloaded, before anything
heavy is imported); then ``cli.main`` parses the flags, probes the router and serves.
"""

from __future__ import annotations

import sys

from posttrain.session_router.allocator import reexec_with_allocator, requested_allocator

if __name__ == "__main__":
    reexec_with_allocator(requested_allocator(sys.argv[1:]))
    from posttrain.session_router.cli import main

    sys.exit(main())
