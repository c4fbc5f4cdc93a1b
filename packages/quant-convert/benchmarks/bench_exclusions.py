"""Exclusion-list length on a Qwen3-30B-A3B-shaped checkpoint (48 layers, 128 experts, last 8
layers BF16; tiny shapes, names are what count): compact and explicit styles against the
earlier tooling's rule (miles #2043), re-derived here from the same names, which gives 499.
Every list is also checked exact under the SGLang-rule mirror.

    uv run python packages/quant-convert/benchmarks/bench_exclusions.py
"""

from __future__ import annotations

import json
import re
import time

from posttrain.quant_convert import QuantPolicy, plan_exclusions
from posttrain.quant_convert.exclusions import verify_exclusions
from posttrain.quant_convert.selection import select_tensors
from posttrain.quant_convert.sglang_rules import build_modules
from posttrain.quant_convert.testing import qwen3_moe_tensor_infos


def earlier_tooling(
    names: list[str], quantized: frozenset[str], layers: int, end: int
) -> list[str]:
    """The #2043 rule: layer prefixes, every kept module, containers of BF16 layers, augments."""
    bf16 = [f"model.layers.{i}." for i in range(layers - end, layers)]
    out = set(bf16)
    for n in names:
        if not n.endswith(".weight") or n in quantized:
            continue
        m = n.removesuffix(".weight")
        if ".experts." not in m:
            out.add(m)
        elif any(m.startswith(d) for d in bf16):
            out.add(m.split(".experts.")[0] + ".experts")
        else:
            out.add(m)
    for m in list(out):
        if re.search(r"\.(q|k|v)_proj$", m):
            out.add(re.sub(r"\.(q|k|v)_proj$", ".qkv_proj", m))
        c = re.match(r"(.*\.mlp\.experts)\.\d+\.(gate|up|down)_proj$", m)
        if c:
            out.add(c.group(1))
    return sorted(out)


def main() -> None:
    tensors = qwen3_moe_tensor_infos(48, 128)
    quantized = select_tensors(tensors, QuantPolicy(num_layers_at_end_in_bf16=8), 48)
    result: dict[str, object] = {"date": time.strftime("%Y-%m-%d"), "tensors": len(tensors)}
    modules = build_modules(tensors)
    wanted = {m.name: not any(w in quantized for w in m.weights) for m in modules}
    old = earlier_tooling([t.name for t in tensors], quantized, 48, 8)
    verify_exclusions(modules, wanted, old)
    result["earlier_tooling"] = len(old)
    for style in ("compact", "explicit"):
        t0 = time.perf_counter()
        plan = plan_exclusions(tensors, quantized, style)  # type: ignore[arg-type]
        result[style] = len(plan.entries)
        result[f"{style}_seconds"] = round(time.perf_counter() - t0, 2)
        if style == "compact":
            result["compact_entries"] = list(plan.entries)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
