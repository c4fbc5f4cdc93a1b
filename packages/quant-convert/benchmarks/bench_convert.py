"""B1/B2: streaming converter vs a load-whole-shard baseline on a synthetic Qwen3-MoE checkpoint.

Each variant runs in a fresh subprocess (so peak RSS is its own); reported side by side:
peak RSS (``VmHWM``, absolute and above the ``import torch`` floor), bytes read from the checkpoint (the
converter counts its preads; /proc/self/io rchar cross-checks it), wall time, and the share of
expert gate/up pairs whose ``weight_scale_2`` are equal. The baseline is what miles' tool does:
``safetensors.torch.load_file`` of every shard once to find pairs and their amaxes, then again
to quantize (same quantizer), building each output shard in memory and ``save_file``-ing it.
B2 kills the converter after the first shard and times the resume against a fresh run.

    uv run python packages/quant-convert/benchmarks/bench_convert.py --size-mb 2048 --repeats 3

Prints one JSON object. ``--size-mb 200`` is the quick variant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, sys, time
from pathlib import Path
mode, src, dst = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

def rchar():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("rchar")).split()[1])

def hwm_mb():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) / 1024

import torch
r0 = rchar()
t0 = time.perf_counter()
out = {"mode": mode}
if mode == "floor":
    pass
elif mode in ("stream", "stream-kill"):
    from posttrain.quant_convert import ConvertOptions, QuantPolicy, convert_checkpoint
    progress = None
    if mode == "stream-kill":
        def progress(e):
            if e.shard_done:
                os.kill(os.getpid(), 9)
    rep = convert_checkpoint(src, dst, options=ConvertOptions(policy=QuantPolicy()), progress=progress)
    out["bytes_read"] = rep.bytes_in
    out["resumed"] = len(rep.shards_resumed)
elif mode == "baseline":
    from safetensors.torch import load_file, save_file
    from posttrain.quant_convert.nvfp4 import global_amax, quantize_nvfp4
    from posttrain.quant_convert.selection import gate_up_role
    files = sorted(src.glob("*.safetensors"))
    read = 0
    amax = {}
    for f in files:  # pass 1: find pairs and amaxes (the whole shard in memory)
        sd = load_file(str(f)); read += f.stat().st_size
        for n, t in sd.items():
            if ".experts." in n:
                amax[n] = global_amax(t)
        del sd
    partner = {}
    roles = {}
    for n in amax:
        r = gate_up_role(n)
        if r: roles.setdefault(r[0], {})[r[1]] = n
    for s in roles.values():
        partner[s["gate"]], partner[s["up"]] = s["up"], s["gate"]
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:  # pass 2: quantize, build the output shard in memory, save it
        sd = load_file(str(f)); read += f.stat().st_size
        res = {}
        for n, t in sd.items():
            if n in amax and n.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
                a = torch.maximum(amax[n], amax[partner[n]]) if n in partner else amax[n]
                q = quantize_nvfp4(t, global_amax=a)
                b = n[: -len("weight")]
                res[n] = q.packed; res[b + "weight_scale"] = q.scale
                res[b + "weight_scale_2"] = q.scale_2; res[b + "input_scale"] = torch.ones(())
            else:
                res[n] = t
        save_file(res, str(dst / f.name), metadata={"format": "pt"})
        del sd, res
    out["bytes_read"] = read
out["seconds"] = time.perf_counter() - t0
out["rchar"] = rchar() - r0
out["peak_rss_mb"] = hwm_mb()  # VmHWM: ru_maxrss would carry the parent's peak across exec
print(json.dumps(out))
"""


def run_child(mode: str, src: Path, dst: Path) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(src), str(dst)],
        capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    if mode == "stream-kill":
        return {"returncode": proc.returncode}
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed: {proc.stderr[-2000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def equal_pair_scales(dst: Path) -> float:
    from safetensors import safe_open

    s2: dict[str, float] = {}
    for f in dst.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118
                if k.endswith("weight_scale_2"):
                    s2[k] = h.get_tensor(k).item()
    gates = [k for k in s2 if "gate_proj" in k]
    same = sum(s2[k] == s2[k.replace("gate_proj", "up_proj")] for k in gates)
    return same / max(len(gates), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    from posttrain.quant_convert.testing import SyntheticSpec, write_synthetic_checkpoint

    hidden, inter = 1024, 512  # 1 MiB per bf16 expert matrix
    experts = 32
    layers = max(1, round(args.size_mb / (experts * 3)))
    spec = SyntheticSpec(layers=layers, experts=experts, hidden=hidden, intermediate=inter,
                         vocab=4096, shards=3)  # fmt: skip
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qc-bench-"))
    src = work / "src"
    if not src.exists():
        write_synthetic_checkpoint(src, spec)
    ckpt_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    shard_bytes = max(f.stat().st_size for f in src.glob("*.safetensors"))
    rows: dict[str, list[dict[str, float]]] = {"floor": [], "stream": [], "baseline": []}
    for _ in range(args.repeats):
        for mode in rows:
            dst = work / f"out-{mode}"
            shutil.rmtree(dst, ignore_errors=True)
            rows[mode].append(run_child(mode, src, dst))
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"}
        for m, rs in rows.items()
    }
    floor = med["floor"]["peak_rss_mb"]
    # B2: kill after the first shard, resume; against a fresh run (median of the stream runs)
    dst = work / "out-resume"
    shutil.rmtree(dst, ignore_errors=True)
    run_child("stream-kill", src, dst)
    resumed = run_child("stream", src, dst)
    result = {
        "machine": "2-core CPU sandbox",
        "date": time.strftime("%Y-%m-%d"),
        "checkpoint_bytes": ckpt_bytes,
        "largest_shard_bytes": shard_bytes,
        "layout": {"layers": layers, "experts": experts, "shape": [inter, hidden], "shards": 3},
        "median": med,
        "ratios_stream_over_baseline": {
            "peak_rss": med["stream"]["peak_rss_mb"] / med["baseline"]["peak_rss_mb"],
            "peak_rss_above_import_floor": (med["stream"]["peak_rss_mb"] - floor)
            / (med["baseline"]["peak_rss_mb"] - floor),
            "wall_time": med["stream"]["seconds"] / med["baseline"]["seconds"],
        },
        "bytes_read_over_checkpoint": {
            "stream": med["stream"]["bytes_read"] / ckpt_bytes,
            "stream_rchar": med["stream"]["rchar"] / ckpt_bytes,
            "baseline": med["baseline"]["bytes_read"] / ckpt_bytes,
        },
        "equal_pair_scale_fraction": {
            "stream": equal_pair_scales(work / "out-stream"),
            "baseline": equal_pair_scales(work / "out-baseline"),
        },
        "resume_after_1_of_3_shards": {
            "shards_resumed": resumed["resumed"],
            "seconds": resumed["seconds"],
            "fresh_seconds": med["stream"]["seconds"],
            "ratio": resumed["seconds"] / med["stream"]["seconds"],
        },
    }
    print(json.dumps(result, indent=2))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    os.sync()


if __name__ == "__main__":
    main()
