"""An inkling-tiny checkpoint (every optional block of ``posttrain.models`` on) served over HTTP:
the logprobs local-engine returns equal the trainer's packed forward, bit for bit.

The checkpoint comes from ``python -m posttrain.models init --arch inkling-tiny``; its sconv
weights start at zero (the identity), so the test gives them and the expert biases random
values before serving, or the convolution states would not be exercised.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch

from posttrain.interface.testing import ServerProcess, free_port
from posttrain.models import build_tokenizer, load_pretrained
from posttrain.models.__main__ import main as init_main

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def inkling_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inkling")
    argv = ["init", "--arch", "inkling-tiny", "--max-positions", "64", "--seed", "5"]
    assert init_main([*argv, str(root / "init")]) == 0  # the CLI's entry point, in process
    model = load_pretrained(root / "init")
    assert model.config.uses_extensions
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_conv"):
                assert not param.any()  # written as the identity
            if name.endswith(("_conv", "expert_bias")):
                param.copy_((torch.randn(param.shape, generator=gen) * 0.3).to(param.dtype))
    model.save_pretrained(root / "served", tokenizer=build_tokenizer())
    return root / "served"


def test_http_logprobs_equal_the_training_forward(inkling_dir: Path) -> None:
    prompts = [[1, 40, 41, 42, 43, 44], [1, 60], [1, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79]]
    port = free_port()
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(inkling_dir),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=120):
        reply = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            json={"input_ids": prompts, "return_logprob": True, "logprob_start_len": 0,
                  "sampling_params": {"temperature": 1.0, "max_new_tokens": 20,
                                      "ignore_eos": True, "sampling_seed": 3}},
            timeout=120.0,
        )  # fmt: skip
    assert reply.status_code == 200, reply.text
    trainer = load_pretrained(inkling_dir)
    sequences, served = [], []
    for prompt, item in zip(prompts, reply.json(), strict=True):
        meta = item["meta_info"]
        out = [int(e[1]) for e in meta["output_token_logprobs"]]
        assert len(prompt) + len(out) > 16  # past the window (8) and the global bias extent (16)
        sequences.append(prompt + out)
        served += [e[0] for e in meta["input_token_logprobs"]][1:]
        served += [e[0] for e in meta["output_token_logprobs"]]
    ids = torch.tensor([t for s in sequences for t in s])
    with torch.no_grad():
        packed = trainer.forward_logprobs(ids, [len(s) for s in sequences])
    starts = {sum(len(s) for s in sequences[:j]) for j in range(len(sequences))}
    want = [float(x) for t, x in enumerate(packed.tolist()) if t not in starts]
    assert served == want  # bit for bit, the three sequences packed into one forward
