"""Bytes per weight sync: the LoRA adapter versus the full weights of the same model.

Models are built from ``transformers`` configs on the meta device (no weights are allocated),
LoRA is attached with ``attach_lora`` on all linear projections, and bytes are counted in the
export dtype (bf16) for both. A small model is also built for real and both payloads are
serialized (SGLang's serialized_named_tensors form, what ``AdapterClient`` sends) to time them side by side.
Prints one JSON object. Run: ``python packages/lora-core/benchmarks/bench_sync_bytes.py``.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.formats import serialize_named_tensors
from posttrain.lora import LoraConfig, attach_lora, export_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    # Llama-3.1-8B-shaped
    "llama-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # Llama-3.1-70B-shaped
    "llama-70b": {
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}


def count(shape: dict[str, Any], r: int) -> dict[str, Any]:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    base_bytes = sum(p.numel() for p in model.parameters()) * 2
    handle = attach_lora(model, LoraConfig(r=r, alpha=2.0 * r), TARGETS)
    lora_bytes = sum(p.numel() for p in handle.parameters()) * 2
    return {
        "r": r,
        "full_bytes": base_bytes,
        "adapter_bytes": lora_bytes,
        "ratio_full_over_adapter": base_bytes / lora_bytes,
    }


def timed_serialize(r: int) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    full = {k: v.detach() for k, v in model.state_dict().items()}
    handle = attach_lora(model, LoraConfig(r=r, alpha=2.0 * r), TARGETS)
    out: dict[str, Any] = {"model": "llama 4x1024 (real weights)", "r": r}
    for label, fn in (("full", lambda: full), ("adapter", lambda: export_adapter(handle))):
        times, size = [], 0
        for _ in range(5):
            t0 = time.perf_counter()
            payload = serialize_named_tensors(fn())
            times.append(time.perf_counter() - t0)
            size = len(payload)
        out[label] = {"payload_bytes": size, "median_s": statistics.median(times)}
    out["bytes_ratio"] = out["full"]["payload_bytes"] / out["adapter"]["payload_bytes"]
    out["time_ratio"] = out["full"]["median_s"] / out["adapter"]["median_s"]
    return out


def main() -> None:
    res = {name: [count(shape, r) for r in (16, 64)] for name, shape in SHAPES.items()}
    res["serialize"] = timed_serialize(16)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
