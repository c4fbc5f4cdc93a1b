"""quant-convert's NVFP4 checkpoint served by local-engine; rollouts match the dequantized model.

The quantized-rollout path on CPU: ``posttrain.models`` writes a checkpoint,
``posttrain.quant_convert`` converts its routed experts to NVFP4 (the ModelOpt
layout SGLang loads), ``posttrain.local_engine`` serves the converted directory
(dequantizing for CPU compute), and the logprobs it reports equal, bit for bit,
a trainer forward over the same weights dequantized by quant-convert's own
``dequantize_nvfp4``. The drift against the BF16/FP32 original is measured.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from posttrain.formats import dequantize_nvfp4
from posttrain.interface.testing import ServerProcess, free_port
from posttrain.models import load_pretrained
from posttrain.models.__main__ import init_checkpoint
from posttrain.quant_convert import convert_checkpoint

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("nvfp4")
    source = init_checkpoint(root / "bf16", seed=7, max_positions=128)
    target = root / "nvfp4"
    report = convert_checkpoint(source, target)
    assert report.tensors_quantized > 0
    return source, target


@pytest.fixture(scope="module")
def engine_url(checkpoints: tuple[Path, Path]) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(checkpoints[1]),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=120):
        yield f"http://127.0.0.1:{port}"


def _dequantized_state_dict(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        prefix = name.removesuffix(".weight")
        if value.dtype == torch.uint8 and f"{prefix}.weight_scale" in tensors:
            value = dequantize_nvfp4(
                value, tensors[f"{prefix}.weight_scale"], tensors[f"{prefix}.weight_scale_2"],
                dtype=dtype,
            )  # fmt: skip
        out[name] = value
    return out


def test_engine_serves_dequantized_nvfp4_logprobs_exactly(
    checkpoints: tuple[Path, Path], engine_url: str
) -> None:
    source, target = checkpoints
    info = httpx.get(f"{engine_url}/server_info", timeout=10.0).json()
    assert info["quantization"] == "modelopt_fp4"

    prompt = [1, 50, 51, 52, 53]
    reply = httpx.post(
        f"{engine_url}/generate",
        json={"input_ids": prompt, "return_logprob": True,
              "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}},
        timeout=60.0,
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    entries = reply.json()["meta_info"]["output_token_logprobs"]
    generated = [int(e[1]) for e in entries]
    served = [float(e[0]) for e in entries]

    original = load_pretrained(source)
    quantized = load_pretrained(source)
    dtype = next(quantized.parameters()).dtype
    quantized.load_hf_state_dict(_dequantized_state_dict(target, dtype), partial=False)
    sequence = torch.tensor(prompt + generated)
    with torch.no_grad():
        recomputed = quantized.forward_logprobs(sequence, [len(sequence)])[len(prompt) :]
        unquantized = original.forward_logprobs(sequence, [len(sequence)])[len(prompt) :]
    assert recomputed.tolist() == served  # bit for bit against quant-convert's dequantization
    drift = (recomputed - unquantized).abs().max().item()
    assert drift > 0.0  # the experts really are NVFP4 now
