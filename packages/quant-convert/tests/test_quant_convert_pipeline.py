"""The overlapped converter (reader thread -> quantizer -> writer thread) writes the bytes of
the sequential one, stops every stage on the first error wherever it happens, and keeps the
atomic/resumable behaviour. On by default for a GPU device; forced on here on the CPU."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from posttrain.quant_convert import (
    ConvertOptions,
    ProgressEvent,
    QuantConvertError,
    QuantPolicy,
    convert_checkpoint,
)
from posttrain.quant_convert.testing import SyntheticSpec, write_synthetic_checkpoint

SPEC = SyntheticSpec(layers=3, experts=3, shards=3, shared_experts=True)
OPTS = ConvertOptions(policy=QuantPolicy(num_layers_at_end_in_bf16=1))


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "src", SPEC)


def test_pipelined_equals_sequential(src: Path, tmp_path: Path) -> None:
    convert_checkpoint(src, tmp_path / "seq", options=OPTS, pipeline=False)
    convert_checkpoint(src, tmp_path / "pipe", options=OPTS, pipeline=True)
    convert_checkpoint(src, tmp_path / "pipe2", options=OPTS, pipeline=True, workers=2)
    reference = _files(tmp_path / "seq")
    assert _files(tmp_path / "pipe") == reference
    assert _files(tmp_path / "pipe2") == reference
    assert not [t for t in threading.enumerate() if t.name.startswith(("read ", "write "))]


def test_an_error_in_the_writer_stage_stops_the_run_and_resume_finishes(
    src: Path, tmp_path: Path
) -> None:
    """Progress ticks run on the writer thread: a callback failing after the first finished
    shard raises here, leaves that shard recorded, and a resume completes byte-identically."""
    reference = tmp_path / "ref"
    convert_checkpoint(src, reference, options=OPTS, pipeline=False)

    class StopHereError(Exception):
        pass

    def progress(event: ProgressEvent) -> None:
        if event.shard_done or event.bytes_done == 0:
            return
        state = tmp_path / "dst" / ".quant-convert" / "state.json"
        if state.exists() and json.loads(state.read_text())["shards"]:
            raise StopHereError(event.shard)

    with pytest.raises(StopHereError):
        convert_checkpoint(src, tmp_path / "dst", options=OPTS, pipeline=True, progress=progress)
    assert not list((tmp_path / "dst").glob("*.tmp"))
    assert not (tmp_path / "dst" / "quant_convert_manifest.json").exists()
    report = convert_checkpoint(src, tmp_path / "dst", options=OPTS, pipeline=True)
    assert report.shards_resumed
    assert _files(tmp_path / "dst") == _files(reference)
    assert not [t for t in threading.enumerate() if t.name.startswith(("read ", "write "))]


def test_an_error_in_the_quantize_stage_names_the_tensor(tmp_path: Path) -> None:
    src = tmp_path / "nan"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    gate = torch.zeros(16, 16, dtype=torch.bfloat16)
    gate[3, 5] = float("nan")
    save_file(
        {"model.layers.0.mlp.experts.0.gate_proj.weight": gate,
         "model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(16, 16, dtype=torch.bfloat16),
         "model.layers.0.mlp.experts.0.down_proj.weight": torch.ones(16, 16, dtype=torch.bfloat16),
         "model.norm.weight": torch.ones(16, dtype=torch.bfloat16)},
        str(src / "m.safetensors"),
    )  # fmt: skip
    with pytest.raises(QuantConvertError, match=r"experts\.0\.gate_proj\.weight: contains NaN"):
        convert_checkpoint(src, tmp_path / "out", pipeline=True)
    assert not (tmp_path / "out").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith(("read ", "write "))]
