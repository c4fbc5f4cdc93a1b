"""Strict parity on a CUDA device (skipped without one): train == decode there, close to CPU."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import ModelConfig, build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


CFG = ModelConfig.tiny(max_position_embeddings=32)
IDS = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(0))


def test_strict_train_forward_equals_decode_on_cuda() -> None:
    gpu = build_model(CFG, 0).to("cuda")
    ids = IDS
    with torch.no_grad():
        on_gpu = gpu.forward_logprobs(ids, [18, 22]).cpu()
    cache = gpu.new_kv_cache(1)
    seq = ids[:18].tolist()
    step = gpu.prefill(cache, 0, seq[:5])
    decoded = [0.0] + [float(step.logprobs[n - 1, seq[n]]) for n in range(1, 5)]
    dist = step.logprobs[-1]
    for tok in seq[5:]:
        decoded.append(float(dist[tok]))
        dist = gpu.decode_step(cache, [0], [tok]).logprobs[0]
    assert torch.equal(on_gpu[:18], torch.tensor(decoded))


def test_cuda_strict_is_close_to_cpu_strict() -> None:
    """CUDA strict runs the Triton kernels (``CudaStrictOps``), CPU strict the ``tree_sum`` /
    ``exp_strict`` kernels: each device is bit-identical across its own paths, and the two
    agree to rounding, not bit for bit (a different reduction order by design)."""
    gpu = build_model(CFG, 0).to("cuda")
    assert gpu.ops.__name__ == "CudaStrictOps"
    with torch.no_grad():
        on_cpu = build_model(CFG, 0).forward_logprobs(IDS, [18, 22])
        on_gpu = gpu.forward_logprobs(IDS, [18, 22]).cpu()
    assert (on_gpu - on_cpu).abs().max() < 1e-4
