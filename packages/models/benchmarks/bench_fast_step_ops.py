"""Kernel launches and host syncs of one fast-numerics training step, counted on the CPU.

The base GPU configuration is launch-bound (issue 37: MFU 5-6 %), so the number of kernels a
step launches, and the host syncs that stall the launch queue, are what the CPU can measure
of its GPU speed. The script runs one step of a random-init decoder in fast numerics --
``forward_token_logprobs`` (the GRPO trainer's chunked logprob path), a mean logprob loss,
backward, ``torch.optim.AdamW`` -- under a ``TorchDispatchMode`` that sees every aten op the
backends run (forward and backward; composite ops arrive decomposed, a kernel's own internal
calls do not), and prints one JSON line per precision:

* ``kernels``: ops that compute (every op but views, ``empty*`` allocations and detaches);
  ``by_phase``: the same for forward, backward and the optimizer step;
* ``host_syncs``: ``_local_scalar_dense`` (``.item()``, ``int()``, ``bool()`` on a tensor),
  plus ops whose output size depends on data (``nonzero``, ``unique*``, ``masked_select``,
  ``repeat_interleave`` without ``output_size``): each is a device-to-host read on CUDA;
* ``top``: the most frequent kernels.

Size: ``ModelConfig.tiny()`` (4 layers, the first dense, then MoE with 4 experts top-2;
``--layers``, ``--hidden`` change it); ``--tokens`` in ``--seq-len`` sequences. The counts
depend on the layer pattern and the number of sequences and experts, not on the widths.
``.tolist()`` on a CPU tensor reads memory without an aten op, so the fp32 per-expert loop's
read of its group sizes (one per MoE layer forward on CUDA) is not in ``host_syncs`` here.
Run from the repo root:

    uv run python packages/models/benchmarks/bench_fast_step_ops.py [--precision fp32 bf16]

The optimizer runs on CPU tensors here (torch's foreach AdamW, whose step counter is read on
the host); on CUDA the trainer uses ``AdamW(fused=True)``: count the optimizer phase apart.
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.models import ModelConfig, Numerics, build_model

_NO_KERNEL = frozenset(
    {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "_to_copy_noop"}
)
_DATA_DEPENDENT = ("nonzero", "unique", "_unique2", "unique_consecutive", "masked_select")


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it by phase (``phase`` is set by the caller)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.kernels: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.syncs: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or name in _DATA_DEPENDENT:
            self.syncs[f"{self.phase}:{name}"] += 1
        elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.syncs[f"{self.phase}:repeat_interleave"] += 1  # sums the repeats on the host
        if not func.is_view and name not in _NO_KERNEL and name != "_local_scalar_dense":
            self.kernels[self.phase][name] += 1
        return func(*args, **kwargs)


def count_step(cfg: ModelConfig, precision: str, tokens: int, seq_len: int) -> dict[str, Any]:
    """One counted step (after an uncounted one) at ``precision``."""
    torch.manual_seed(0)
    model = build_model(cfg, 0, numerics=Numerics.FAST)
    if precision == "bf16":
        model.compute_dtype = torch.bfloat16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    lens = [seq_len] * max(1, tokens // seq_len)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=gen)
    rows = torch.tensor(
        [i for s in range(len(lens)) for i in range(s * seq_len, (s + 1) * seq_len - 1)]
    )
    targets = ids[rows + 1]
    counter = _OpCounter()

    def step() -> None:
        counter.phase = "forward"
        logp, _entropy = model.forward_token_logprobs(ids, lens, rows, targets)
        loss = -logp.mean()
        counter.phase = "backward"
        loss.backward()  # type: ignore[no-untyped-call]
        counter.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with counter:
        step()
    total: collections.Counter[str] = collections.Counter()
    for c in counter.kernels.values():
        total.update(c)
    return {
        "precision": precision,
        "tokens": sum(lens),
        "kernels": sum(total.values()),
        "by_phase": {k: sum(v.values()) for k, v in counter.kernels.items()},
        "host_syncs": sum(counter.syncs.values()),
        "host_sync_ops": dict(counter.syncs),
        "top": {k: dict(v.most_common(12)) for k, v in counter.kernels.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), nargs="+", default=["fp32", "bf16"]
    )
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--grouped-mm", action="store_true",
                        help="bf16 routed experts through torch._grouped_mm (the CUDA path; "
                        "torch runs it on the CPU too) instead of the CPU's per-expert loop")  # fmt: skip
    args = parser.parse_args()
    if args.grouped_mm:
        import posttrain.models._model as model_module

        model_module.use_grouped_mm = lambda x, dtype, inter: dtype == torch.bfloat16
    torch.set_num_threads(1)
    cfg = ModelConfig.tiny(num_hidden_layers=args.layers, hidden_size=args.hidden)
    for precision in args.precision:
        row = count_step(cfg, precision, args.tokens, args.seq_len)
        print(json.dumps({"layers": args.layers, "hidden": args.hidden, **row}), flush=True)


if __name__ == "__main__":
    main()
