"""lora-core pushes an adapter to a local-engine process; rollouts with it match the trainer.

The composition the GRPO loop relies on after every optimizer step: the trainer's
adapter (PEFT names) goes to the engine through ``posttrain.lora.AdapterClient``,
verified by checksum, and every request that names it (``lora_path``) generates
with exactly the logprobs the trainer recomputes with ``posttrain.models``.
Real processes and real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from posttrain.formats import EngineClient, adapter_push_body, tensor_sha256
from posttrain.interface import EngineError
from posttrain.interface.testing import ServerProcess, free_port
from posttrain.lora import AdapterClient, LoraServing, request_fields, serves_lora
from posttrain.models import LoraAdapter, load_pretrained
from posttrain.models.__main__ import init_checkpoint

pytestmark = pytest.mark.multiproc

R, ALPHA = 4, 8.0
TARGETS = ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
           "model.layers.1.mlp.experts.2.gate_proj")  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=5, max_positions=128)


@pytest.fixture(scope="module")
def engine_url(checkpoint: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--enable-lora"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with ServerProcess(argv, f"{url}/health", timeout_s=120):
        yield url


def _adapter_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    shapes = load_pretrained(checkpoint).lora_targets()
    gen = torch.Generator().manual_seed(11)
    tensors = {}
    for module in TARGETS:
        fan_in, fan_out = shapes[module]
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(R, fan_in, generator=gen) * 0.3
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, R, generator=gen) * 0.3
    return tensors


def _generate(
    url: str, prompt: list[int], lora_fields: dict[str, str]
) -> tuple[list[int], list[float]]:
    body: dict[str, object] = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
        "return_logprob": True,
        **lora_fields,
    }
    reply = httpx.post(f"{url}/generate", json=body, timeout=60.0)
    assert reply.status_code == 200, reply.text
    entries = reply.json()["meta_info"]["output_token_logprobs"]
    return [int(e[1]) for e in entries], [float(e[0]) for e in entries]


def test_pushed_adapter_serves_trainer_exact_logprobs(checkpoint: Path, engine_url: str) -> None:
    tensors = _adapter_tensors(checkpoint)
    config = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "bias": "none",
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in TARGETS})}  # fmt: skip
    with AdapterClient(engine_url) as client:
        caps = client.capabilities()
        assert caps.lora_enabled
        assert caps.checksums
        reply = client.load_from_tensors("policy", tensors, config)
        assert "policy" in reply["loaded_adapters"]

    prompt = [1, 40, 41, 42, 43, 44]
    # The one predicate rollout code asks, and the fields it then adds to every request.
    assert serves_lora(LoraServing(adapter_name="policy"))
    ids_lora, lp_lora = _generate(engine_url, prompt, request_fields("policy", version=1))
    ids_base, lp_base = _generate(engine_url, prompt, {})

    trainer = load_pretrained(checkpoint)
    adapter = LoraAdapter.from_peft_state_dict(tensors, scaling=ALPHA / R, name="policy")
    for ids, logprobs, lora in ((ids_lora, lp_lora, adapter), (ids_base, lp_base, None)):
        sequence = torch.tensor(prompt + ids)
        with torch.no_grad():
            recomputed = trainer.forward_logprobs(sequence, [len(sequence)], lora=lora)
        assert recomputed[len(prompt) :].tolist() == logprobs  # bit for bit
    assert lp_lora != lp_base  # the adapter really changed the rollout


def test_checksum_mismatch_is_refused_and_nothing_loads(checkpoint: Path, engine_url: str) -> None:
    tensors = _adapter_tensors(checkpoint)
    config = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj"]}

    # bytes on the wire that differ from the checksums sent (a corrupting hop)
    changed = dict(tensors)
    key = next(iter(changed))
    changed[key] = changed[key] + 1.0
    sums = {k: tensor_sha256(v) for k, v in tensors.items()}
    body = adapter_push_body("tampered", config, changed, expected_checksums=sums)
    with EngineClient(engine_url) as client, pytest.raises(EngineError, match="expected_checksums"):
        client.post("/load_lora_adapter_from_tensors", body)
    info = httpx.get(f"{engine_url}/server_info", timeout=10.0).json()
    assert "tampered" not in info["loaded_adapters"]
