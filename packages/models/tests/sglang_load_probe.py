"""Build SGLang's own model class for a checkpoint on CPU and run its ``load_weights`` on it.

Run as a script (``python sglang_load_probe.py <port> <checkpoint dir>...``) by
``test_models_sglang_conformance.py``, in a child process so that SGLang's process-wide state
(its single-rank gloo ``torch.distributed`` world, its runtime context) never reaches the test
process. Prints one ``PROBE <dir> <json>`` line per checkpoint, the object holding:

* ``architecture``: the class SGLang's registry picked for the checkpoint's ``architectures``;
* ``params``: ``{name: shape}`` of the model SGLang builds (its fused names: ``qkv_proj``,
  ``gate_up_proj``, ``experts.w13_weight``, ...);
* ``unwritten``: SGLang parameters still NaN after loading (every one is NaN-filled first);
* ``unused``: checkpoint tensors no SGLang weight loader was called for (MLA: whose values
  SGLang does not hold, under their own name or inside a checked fused parameter);
* ``fused_ok``: spot checks that the fused tensors hold our tensors in SGLang's order.

SGLang's rotary-embedding module imports a GPU kernel (``vllm._custom_ops.rotary_embedding``)
when it is built without CUDA; a stand-in module that raises if called is installed for it.
Nothing here runs a forward, so the kernel is never called. Likewise SGLang's CPU rope factory
builds only DeepSeek's YaRN rope; the MLA attention (``deepseek_v2.py``) of a checkpoint with
the default rope gets the device-independent factory (construction only, no weights in it).

MLA checkpoints (DeepSeek-V3, GLM-4.x-MoE-Lite) are checked on SGLang's own fusions:
``fused_qkv_a_proj_with_mqa = [q_a_proj; kv_a_proj_with_mqa]`` (with a query latent),
``kv_b_proj``, the experts' ``w13``/``w2`` and the shared experts' ``gate_up_proj``.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any


def _install_kernel_stand_in() -> None:
    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("GPU rotary kernel called in a construction-only CPU probe")

    vllm = types.ModuleType("vllm")
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = unavailable  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


def _install_mla_rope_stand_in() -> None:
    import sglang.srt.models.deepseek_v2 as deepseek

    original = deepseek.get_rope_wrapper

    def rope(*args: Any, rope_scaling: Any = None, device: Any = None, **kwargs: Any) -> Any:
        if rope_scaling is None:  # the CPU factory has DeepSeek's YaRN only
            device = None
        return original(*args, rope_scaling=rope_scaling, device=device, **kwargs)

    deepseek.get_rope_wrapper = rope


def _mla_checks(layer: Any, pre: str, holds: Any) -> dict[str, bool]:
    """SGLang's MLA fusions hold our tensors (see the module doc)."""
    attn, a = layer.self_attn, pre + "self_attn."
    checks: dict[str, bool] = {}
    fused = getattr(attn, "fused_qkv_a_proj_with_mqa", None)
    if fused is not None:
        names = (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight")
        checks[pre + "qkv_a"] = holds(fused.weight.data, *names)
    else:
        checks[pre + "kv_a"] = holds(
            attn.kv_a_proj_with_mqa.weight.data, a + "kv_a_proj_with_mqa.weight"
        )
    checks[pre + "kv_b"] = holds(attn.kv_b_proj.weight.data, a + "kv_b_proj.weight")
    shared = getattr(layer.mlp, "shared_experts", None)
    if shared is not None:
        names = (
            pre + "mlp.shared_experts.gate_proj.weight",
            pre + "mlp.shared_experts.up_proj.weight",
        )
        checks[pre + "shared_gate_up"] = holds(shared.gate_up_proj.weight.data, *names)
    return checks


def load_in_name_order(model: Any, tensors: dict[str, Any], current: list[str]) -> None:
    """``model.load_weights`` on ``tensors`` in name order, ``current[0]`` naming the tensor
    being loaded (what a probe's traced weight loaders record); the NVFP4 probe uses it too."""

    def feed() -> Any:
        for name in sorted(tensors):
            current[0] = name
            yield name, tensors[name]

    model.load_weights(feed())


def _init_single_rank(path: str, port: int, **server_args: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(
        ServerArgs(model_path=path, tp_size=1, ep_size=1, pp_size=1, device="cpu", **server_args),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def probe(path: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.utils.hf_transformers_utils import get_config

    hf = get_config(path, trust_remote_code=False)
    cls, arch = ModelRegistry.resolve_model_cls(hf.architectures)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    dtype = next(iter(tensors.values())).dtype
    torch.set_default_dtype(dtype)
    model = cls(hf)
    params = dict(model.named_parameters())
    current: list[str] = [""]
    used: set[str] = set()
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    for p in params.values():
        p.data.fill_(float("nan"))
        loader = getattr(p, "weight_loader", default_weight_loader)

        def traced(*args: Any, _loader: Any = loader, **kwargs: Any) -> Any:
            used.add(current[0])
            return _loader(*args, **kwargs)

        p.weight_loader = traced  # type: ignore[attr-defined]

    load_in_name_order(model, tensors, current)
    unwritten = sorted(n for n, p in params.items() if bool(torch.isnan(p.data.float()).any()))
    checks: dict[str, bool] = {}

    covered: set[str] = set()  # checkpoint tensors found, by value, in a fused parameter

    def holds(param: torch.Tensor, *names: str) -> bool:
        if not all(n in tensors for n in names):
            return False  # the checkpoint lacks what SGLang's layer needs
        ok = torch.equal(param, torch.cat([tensors[n] for n in names]))
        if ok:
            covered.update(names)
        return ok

    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        pre = f"model.layers.{i}."
        if hasattr(layer.self_attn, "kv_b_proj"):
            checks |= _mla_checks(layer, pre, holds)
            bias = None
        else:
            qkv = [pre + f"self_attn.{x}_proj.weight" for x in "qkv"]
            checks[pre + "qkv"] = holds(layer.self_attn.qkv_proj.weight.data, *qkv)
            bias = getattr(layer.self_attn.qkv_proj, "bias", None)
        if bias is not None:  # Qwen2's q/k/v biases, fused in the same order
            names = [pre + f"self_attn.{x}_proj.bias" for x in "qkv"]
            checks[pre + "qkv_bias"] = holds(bias.data, *names)
        if hasattr(mlp, "experts"):
            for e in range(mlp.experts.w13_weight.shape[0]):
                ex = pre + f"mlp.experts.{e}."
                w13, w2 = mlp.experts.w13_weight.data[e], mlp.experts.w2_weight.data[e]
                checks[ex + "w13"] = holds(w13, ex + "gate_proj.weight", ex + "up_proj.weight")
                checks[ex + "w2"] = holds(w2, ex + "down_proj.weight")
        else:
            names = (pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight")
            checks[pre + "gate_up"] = holds(mlp.gate_up_proj.weight.data, *names)
    if any(hasattr(layer.self_attn, "kv_b_proj") for layer in model.model.layers):
        # SGLang's DeepSeek loader fuses q_a/kv_a from a cache and loads on worker threads, so
        # the loader trace cannot name the tensor it got: a tensor counts as used when SGLang
        # holds its values, under its own name or inside a fused parameter checked above
        same = {n for n, t in tensors.items() if n in params and torch.equal(params[n].data, t)}
        used = same | covered
    return {
        "architecture": arch,
        "params": {n: list(p.shape) for n, p in params.items()},
        "unwritten": unwritten,
        "unused": sorted(set(tensors) - used),
        "fused_ok": all(checks.values()),
        "fused_bad": sorted(k for k, ok in checks.items() if not ok),
    }


if __name__ == "__main__":
    port, paths = int(sys.argv[1]), sys.argv[2:]
    _install_kernel_stand_in()
    _install_mla_rope_stand_in()
    _init_single_rank(paths[0], port)  # the server args only need some real checkpoint
    for path in paths:
        print(f"PROBE {path} " + json.dumps(probe(path)), flush=True)
