"""Start-to-ready of the stock sgl-router: our entry module vs ``sglang_router.launch_router``.

``posttrain up`` starts the router as ``python -m posttrain.launch.sgl_router`` (the Rust
router through ``RouterArgs``/``Router``, nothing else imported) instead of
``python -m sglang_router.launch_router`` (which also imports the Python mini load balancer
and, where sglang is installed, sglang and torch). This measures spawn -> ``GET /health`` 200,
interleaved, and prints medians and their ratio as JSON.

    uv run python packages/launch/benchmarks/bench_launch_router_start.py [--runs 5]

With sglang importable (e.g. ``PYTHONPATH=<dir with sglang installed --no-deps>``) the
second entry also imports sglang.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from posttrain.interface.processes import free_port, stop_process_group, wait_until_ready

ENTRIES = {
    "posttrain.launch.sgl_router": "posttrain.launch.sgl_router",
    "sglang_router.launch_router": "sglang_router.launch_router",
}


def start_to_ready(module: str, timeout_s: float = 120.0) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_until_ready(
            f"http://127.0.0.1:{port}/health",
            timeout_s=timeout_s,
            process=proc,
            poll_interval_s=0.02,
        )
        return time.perf_counter() - t0
    finally:
        stop_process_group(proc, grace_s=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in ENTRIES}
    for _ in range(args.runs):
        for name, module in ENTRIES.items():  # interleaved: both see the same machine load
            times[name].append(start_to_ready(module))
    med = {name: statistics.median(v) for name, v in times.items()}
    print(
        json.dumps(
            {
                "runs": args.runs,
                "median_s": med,
                "all_s": times,
                "ratio_launch_router_over_ours": med["sglang_router.launch_router"]
                / med["posttrain.launch.sgl_router"],
                "load_average": os.getloadavg(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
