"""Where SGLang itself imports, its own matcher must decide every module as our mirror does.

Runs where ``sglang`` imports: CI runs it in the side environment ``.ci/sglang-conformance``
builds (a pinned sglang with ``--no-deps`` plus the light packages it imports), where it must
pass; the workspace's own suite skips it.
"""

from __future__ import annotations

import warnings

import pytest

from posttrain.quant_convert import QuantPolicy, plan_exclusions
from posttrain.quant_convert.selection import select_tensors
from posttrain.quant_convert.sglang_rules import FUSED_LINEARS, build_modules, is_excluded
from posttrain.quant_convert.testing import qwen3_moe_tensor_infos

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    modelopt_quant = pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant")
    sglang_utils = pytest.importorskip("sglang.srt.layers.quantization.utils")


@pytest.mark.parametrize("style", ["compact", "explicit"])
@pytest.mark.parametrize("end", [0, 2])
def test_sglang_decides_like_the_mirror(style: str, end: int) -> None:
    tensors = qwen3_moe_tensor_infos(6, 4, dense=frozenset({0}), shared=True)
    quantized = select_tensors(tensors, QuantPolicy(num_layers_at_end_in_bf16=end), 6)
    entries = list(plan_exclusions(tensors, quantized, style).entries)  # type: ignore[arg-type]
    cfg = modelopt_quant.ModelOptFp4Config.from_config(
        {"quant_algo": "NVFP4", "quant_method": "modelopt", "group_size": 16, "ignore": entries,
         "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
    )  # fmt: skip
    mapping = {k: list(v) for k, v in FUSED_LINEARS.items()}
    for m in build_modules(tensors):
        if m.kind == "fused_moe":
            theirs = cfg.is_layer_excluded(m.name)
        else:
            theirs = sglang_utils.is_layer_skipped(
                m.name, entries, mapping
            ) or cfg.is_layer_excluded(m.name)
        assert bool(theirs) == is_excluded(m, entries), m.name
