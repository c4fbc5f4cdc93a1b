"""Bounded memory on a ~200 MB checkpoint: the converter never holds a whole shard.

Two 100 MB shards of 8 MB BF16 tensors (pass-through, copied in 8 MiB pieces) plus a small
quantized expert layer. A fresh child process first converts a tiny checkpoint of the same
layout (so every import, lazily compiled module and allocator arena is in place: without
compiled bytecode those alone cost ~30 MB), then reports its peak RSS (VmHWM) before and after
the real conversion. The increase must stay far below one shard, which a load-whole-shard
converter needs at least, and within a few of the largest tensors it reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

CHILD = r"""
import json, sys
def hwm():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024
from posttrain.quant_convert import convert_checkpoint
convert_checkpoint(sys.argv[3], sys.argv[4])  # the same code paths on tiny tensors
before = hwm()
rep = convert_checkpoint(sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "after": hwm(), "bytes_in": rep.bytes_in,
                  "quantized": rep.tensors_quantized}))
"""


def _write_checkpoint(src: Path, dense_rows: int) -> int:
    """Two shards of dense BF16 [dense_rows, 2048] tensors and quantized experts; largest shard."""
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    shard_bytes = 0
    for k in range(2):
        tensors = {
            f"model.layers.{k}.dense.{i}.weight": torch.full(
                (dense_rows, 2048), 0.5, dtype=torch.bfloat16
            )
            for i in range(12)
        }
        for e in range(4):
            for p in ("gate_proj", "up_proj", "down_proj"):
                tensors[f"model.layers.{k}.mlp.experts.{e}.{p}.weight"] = torch.randn(
                    64, 256, dtype=torch.float32
                ).to(torch.bfloat16)
        save_file(tensors, str(src / f"model-{k + 1}-of-2.safetensors"))
        shard_bytes = max(shard_bytes, (src / f"model-{k + 1}-of-2.safetensors").stat().st_size)
        del tensors
    return shard_bytes


@pytest.mark.slow
@pytest.mark.multiproc
def test_peak_memory_stays_far_below_a_shard(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shard_bytes = _write_checkpoint(src, dense_rows=2048)
    _write_checkpoint(tmp_path / "warm-src", dense_rows=16)
    largest_tensor = 2048 * 2048 * 2
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(tmp_path / "dst"),
         str(tmp_path / "warm-src"), str(tmp_path / "warm-dst")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["quantized"] == 2 * 4 * 3
    assert shard_bytes > 95e6
    increase = r["after"] - r["before"]
    print(f"peak increase {increase / 1e6:.1f} MB, shard {shard_bytes / 1e6:.1f} MB")
    assert increase < 0.3 * shard_bytes
    # A tensor is streamed in 8 MiB pieces: one piece plus the writer's buffer, never the shard.
    assert increase < 3 * largest_tensor
    assert r["bytes_in"] == sum(
        f.stat().st_size - 8 - _header_len(f) for f in src.glob("*.safetensors")
    )


def _header_len(f: Path) -> int:
    with open(f, "rb") as h:
        return int.from_bytes(h.read(8), "little")
