"""GPU check: the parity command with NCCL on 2 GPUs, layouts r1s2 and r2s1, plus step times.

Self-contained (torch + this package and posttrain-interface on PYTHONPATH):

    PYTHONPATH=packages/interface/src:packages/fsdp-mesh/src \
        python packages/fsdp-mesh/benchmarks/gpu_parity.py

Each layout runs ``python -m posttrain.fsdp_mesh.parity --replicate R --shard S --backend nccl``
in its self-spawning mode (rank g on cuda:g) and a second time with 8 micro-batches and a wider
model for step times. ``--device cpu`` runs the two base commands with gloo (a dry run).
Prints one JSON object; exit code 1 if any layout failed. About 1-2 minutes on 2 H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _run(
    replicate: int, shard: int, backend: str, extra: list[str], timeout: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "posttrain.fsdp_mesh.parity",
            "--replicate", str(replicate), "--shard", str(shard),
            "--backend", backend, "--json", str(out), "--timeout", str(timeout), *extra,
        ]  # fmt: skip
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout + 60, env=os.environ.copy()
            )
        except subprocess.TimeoutExpired as exc:
            return {"cmd": " ".join(cmd[1:]), "returncode": None, "error": f"timed out: {exc}"}
        wall = time.perf_counter() - t0
        result: dict[str, Any] = {
            "cmd": " ".join(cmd[1:]),
            "returncode": proc.returncode,
            "wall_s": round(wall, 2),
        }
        if out.exists():
            report = json.loads(out.read_text())
            result |= {k: v for k, v in report.items() if k != "ranks"}
            result["per_rank_median_step_s"] = [r["median_step_s"] for r in report["ranks"]]
            result["failures"] = [f for r in report["ranks"] for f in r["failures"]]
            result["notes"] = sorted({n for r in report["ranks"] for n in r["notes"]})
            result["checkpoint_exact"] = all(r["checkpoint_exact"] for r in report["ranks"])
            result["replicate_all_reduces"] = report["ranks"][0]["replicate_all_reduces"]
        else:
            result["stderr_tail"] = proc.stderr[-3000:]
        result["last_line"] = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=float, default=150.0)
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    info: dict[str, Any] = {"device": args.device, "backend": backend}
    try:
        import torch

        info["torch"] = torch.__version__
        if args.device == "cuda":
            info["gpus"] = torch.cuda.device_count()
            info["gpu_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
            if info["gpus"] < 2:
                print(json.dumps(info | {"error": "needs 2 GPUs"}))
                return 1
    except ImportError as exc:
        print(json.dumps(info | {"error": f"torch missing: {exc}"}))
        return 1
    runs = []
    for r, s in ((1, 2), (2, 1)):
        # Ranks are spawned on GPU (CUDA-safe); the CPU dry run forks them (no torch import each).
        base = [] if args.device == "cuda" else ["--start-method", "fork"]
        runs.append(_run(r, s, backend, base, args.timeout))
        if args.device == "cuda":  # step times at a less toy size; skipped in the CPU dry run
            wide = ["--micro-batches", "8", "--dim", "1024", "--steps", "5"]
            runs.append(_run(r, s, backend, wide, args.timeout))
    info["runs"] = runs
    info["passed"] = all(run["returncode"] == 0 and run.get("passed") for run in runs)
    print(json.dumps(info, indent=2))
    return 0 if info["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
