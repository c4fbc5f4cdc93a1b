"""Run the stock sgl-router in this process through the ``sglang_router`` Python API.

``python -m posttrain.launch.sgl_router --host ... --port ... --worker-urls ...`` takes the
router's own flags (parsed by ``RouterArgs.add_cli_args``) and blocks in ``Router.start()``.
Departure from ``python -m sglang_router.launch_router``: that module also imports the
Python mini load balancer (and through it sglang and torch: 10-54 s on 2 cores), while the
Rust router alone answers ``/health`` in well under a second. Needs the ``local`` extra
(``sglang-router``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="python -m posttrain.launch.sgl_router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    router_args = RouterArgs.from_cli_args(ns, use_router_prefix=False)
    validate = getattr(router_args, "_validate_router_args", None)
    if callable(validate):
        validate()
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main()
