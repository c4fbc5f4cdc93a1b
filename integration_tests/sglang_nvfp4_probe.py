"""Build SGLang's model class for an NVFP4 checkpoint with its own ``ModelOptFp4Config`` on CPU
and run its ``load_weights`` on the tensors of ``update.safetensors`` (a weight update's names,
dtypes and shapes). Run as ``python sglang_nvfp4_probe.py <port> <checkpoint dir>`` by
``test_integration_sglang_conformance.py``, in a child process (SGLang's process-wide state).

Prints one ``PROBE <json>`` line: ``unwritten`` (SGLang parameters no loader was called for;
the swizzled block scales are derived after loading, so they are not counted; ``input_scale``
is: an update carries the served checkpoint's), ``unused`` (update tensors no loader took)
and ``mismatched`` (a loader refused a tensor: its error). The MoE layers are built with the
marlin runner backend, the one SGLang offers for NVFP4 below Blackwell; nothing runs a forward.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "models", "tests"))

import sglang_load_probe as base


def probe(path: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.utils.hf_transformers_utils import get_config

    initialize_moe_config()
    hf = get_config(path, trust_remote_code=False)
    cls, arch = ModelRegistry.resolve_model_cls(hf.architectures)
    quant = ModelOptFp4Config.from_config(hf.quantization_config)
    quant.packed_modules_mapping = getattr(cls, "packed_modules_mapping", {})
    torch.set_default_dtype(torch.bfloat16)
    model = cls(hf, quant_config=quant)
    tensors = load_file(os.path.join(path, "update.safetensors"))
    params = dict(model.named_parameters())
    current = [""]
    used: set[str] = set()
    written: set[str] = set()
    errors: list[str] = []
    for pname, p in params.items():
        loader = getattr(p, "weight_loader", default_weight_loader)

        def traced(*args: Any, _loader: Any = loader, _p: str = pname, **kwargs: Any) -> Any:
            used.add(current[0])
            written.add(_p)
            try:
                return _loader(*args, **kwargs)
            except Exception as exc:
                errors.append(f"{current[0]} -> {_p}: {type(exc).__name__}: {exc}")
                raise

        try:
            p.weight_loader = traced  # type: ignore[attr-defined]
        except AttributeError:  # SGLang's parameter classes keep it behind a property
            p._weight_loader = traced  # type: ignore[attr-defined]

    base.load_in_name_order(model, tensors, current)
    derived = ("_blockscale_swizzled",)
    return {
        "architecture": arch,
        "unwritten": sorted(n for n in params if n not in written and not n.endswith(derived)),
        "unused": sorted(set(tensors) - used),
        "mismatched": errors,
    }


if __name__ == "__main__":
    port, path = int(sys.argv[1]), sys.argv[2]
    base._install_kernel_stand_in()
    base._init_single_rank(path, port, moe_runner_backend="marlin")
    print("PROBE " + json.dumps(probe(path)), flush=True)
