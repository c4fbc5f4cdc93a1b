"""Check: a Dense/MoE adapter from lora-core loads in PEFT on transformers 4 with every target applied.

CI runs transformers 5 (``integration_tests/test_integration_peft_moe.py``); transformers 4 needs another
environment, so this is a two-stage, documented check (result in docs/benchmarks/lora-core.md):

1. ``make DIR`` (workspace venv, transformers 5): build a tiny Dense/MoE ``posttrain.models``
   checkpoint (layer 0 dense), adapt attention, the dense MLP and the stacked experts with
   ``attach_lora``, and write, for the full adapter and for each target kind alone (all other
   factors zero), the per-expert PEFT adapter plus our logits. ``config.json`` is written as
   ``qwen3_moe`` with ``mlp_only_layers`` (transformers 4 reads that type).
2. ``check DIR`` (a side venv with transformers 4.57 and PEFT 0.21.2, no workspace packages):
   load each adapter with ``PeftModel.from_pretrained`` and compare with our logits
   (max |diff| <= 1e-5 fp32) and with the base model (each target kind moves the output).

    uv run python packages/lora-core/benchmarks/peft_moe_tf4.py make /tmp/peft-moe-tf4
    uv venv /tmp/tf4 && uv pip install --python /tmp/tf4/bin/python \\
        "transformers==4.57.*" peft==0.21.2 torch==2.13.0 safetensors
    /tmp/tf4/bin/python packages/lora-core/benchmarks/peft_moe_tf4.py check /tmp/peft-moe-tf4

Exits non-zero if any check fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

IDS = [[1, 5, 9, 3, 17, 42, 8, 2, 11, 60]]
KINDS = [
    "all",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "experts.0.gate_proj",
    "experts.2.up_proj",
    "experts.1.down_proj",
]


def make(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from posttrain.lora import LoraConfig, attach_lora, export_adapter, load_peft, save_peft
    from posttrain.models import ModelConfig, build_model, save_pretrained

    config = ModelConfig.tiny(num_hidden_layers=2, torch_dtype="float32")
    ckpt = out / "checkpoint"
    save_pretrained(build_model(config, seed=0), ckpt)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=2, alpha=4.0, b_init="normal", seed=5, export_dtype=torch.float32)
    handle = attach_lora(model, cfg, targets)
    with torch.no_grad():
        for site in handle.sites.values():
            site.lora_B.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    full = export_adapter(handle)
    expected: dict[str, list[list[list[float]]]] = {}
    for kind in KINDS:
        tensors = {
            k: (v if kind == "all" or f".{kind}.lora_" in k else torch.zeros_like(v))
            for k, v in full.items()
        }
        path = save_peft(out / kind, tensors, cfg, moe_convention="per_expert")
        load_peft(handle, path)
        with torch.no_grad():
            expected[kind] = model(input_ids=torch.tensor(IDS)).logits.float().tolist()
    (out / "expected.json").write_text(json.dumps(expected))
    hf = json.loads((ckpt / "config.json").read_text())
    if hf.get("model_type") != "qwen3_moe":  # transformers 4 has no other type for this layout
        dense = [i for i, t in enumerate(hf["mlp_layer_types"]) if t == "dense"]
        for key in ("mlp_layer_types", "layer_types", "rope_parameters", "sliding_window"):
            hf.pop(key, None)
        hf.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
        hf.update(mlp_only_layers=dense, decoder_sparse_step=1, rope_theta=config.rope_theta)
        (ckpt / "config.json").write_text(json.dumps(hf, indent=2))
    print(f"wrote {len(KINDS)} adapters and the expected logits under {out}")


def check(out: Path) -> int:
    import peft
    import transformers
    from transformers import AutoModelForCausalLM

    expected = json.loads((out / "expected.json").read_text())
    ids = torch.tensor(IDS)

    def base_model() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(
            str(out / "checkpoint"), torch_dtype=torch.float32
        ).eval()

    with torch.no_grad():
        base = base_model()(input_ids=ids).logits.float()
    print(
        f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}"
    )
    print(f"{'target':<22} {'max|peft-ours|':>15} {'max|peft-base|':>15}  ok")
    failures = 0
    for kind in KINDS:
        pm = peft.PeftModel.from_pretrained(base_model(), str(out / kind)).eval()
        with torch.no_grad():
            got = pm(input_ids=ids).logits.float()
        to_ours = (got - torch.tensor(expected[kind])).abs().max().item()
        to_base = (got - base).abs().max().item()
        ok = to_ours <= 1e-5 and to_base > 1e-4
        failures += not ok
        print(f"{kind:<22} {to_ours:>15.3e} {to_base:>15.3e}  {'yes' if ok else 'NO'}")
    print("PASS" if not failures else f"FAIL ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(f"usage: {sys.argv[0]} make|check DIR")
    directory = Path(sys.argv[2])
    if sys.argv[1] == "make":
        make(directory)
    else:
        sys.exit(check(directory))
