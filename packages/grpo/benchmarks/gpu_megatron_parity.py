"""The megatron backend on N ranks (NCCL on GPUs, or gloo on CPU): parity, step time, memory.

For each layout that fits the world (``--layouts``, default ``tp1,tp2,tp2sp,ep2,tp2ep2``; a
layout whose sizes do not divide the world, or the model's heads, is skipped and listed with
why), every rank builds the
``posttrain.models`` decoder as ``posttrain.grpo.megatron`` splits it (``TensorParallelDecoder``:
megatron-core parallel linears with the model's kernels, ``ExpertParallelMoe`` for EP), loads
the weights of one random-init model, and compares with that model run whole on each rank's
device (the single-process reference):

* ``logprob_max_abs_diff``: the layout's per-token logprobs vs the reference's;
* ``loss_rel``, ``grad_rel_max``: the loss ``sum(logprob * w)`` (fixed weights ``w``) and every
  gradient, gathered to full HF-named tensors after the backend's explicit reduction (TP sums
  of partial grads, DP mean, the EP rule), relative L2 vs the reference, worst tensor named;
* ``export_bitwise``: the gathered HF weights equal the reference's bit for bit.

Then ``--steps`` timed training steps (forward, backward, gradient reduction, AdamW) per
layout: ``step_s_median`` and ``peak_mem_bytes`` (``torch.cuda.max_memory_allocated``, the
largest over ranks; 0 on CPU), next to the same step of the reference model alone on one rank
(``reference``) for the ratio. Every rank gets the same batch (the data-parallel ranks
duplicate it), so the DP mean must give the reference's gradient exactly up to sum order.

Run from the repo root (one JSON object on stdout from rank 0)::

    uv run torchrun --nproc-per-node 2 packages/grpo/benchmarks/gpu_megatron_parity.py
    uv run torchrun --nproc-per-node 2 packages/grpo/benchmarks/gpu_megatron_parity.py \\
        --backend gloo --size tiny --steps 2          # the CPU check of this script
    uv run torchrun --nproc-per-node 1 packages/grpo/benchmarks/gpu_megatron_parity.py

``--size small`` (default on CUDA) is a 4-layer decoder (hidden 512, 8 heads / 4 KV heads,
1 dense + 3 MoE layers of 8 experts top-2); ``--numerics fast`` times torch's BLAS kernels
instead of the strict (batch-invariant) ones. ``--family deepseek_v3`` makes the same sizes a
DeepSeek-V3 (MLA: q/kv latents, 8 heads of nope 64 + rope 32, values 64 at ``small``; the MoE
layers DeepSeek-style: 2 expert groups, top-2 of one, a shared expert, fp32 router)::

    uv run torchrun --nproc-per-node 2 packages/grpo/benchmarks/gpu_megatron_parity.py \
        --family deepseek_v3 --layouts tp1,tp2,tp2sp,ep2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "moe_intermediate_size": 32, "num_experts": 4,
             "num_experts_per_tok": 2, "mlp_only_layers": (0,), "max_position_embeddings": 64},
    "small": {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 64, "moe_intermediate_size": 512, "num_experts": 8,
              "num_experts_per_tok": 2, "mlp_only_layers": (0,), "max_position_embeddings": 256},
}  # fmt: skip
MLA_SIZES: dict[str, dict[str, Any]] = {  # --family deepseek_v3 on top of SIZES
    "tiny": {"num_key_value_heads": 4, "head_dim": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
             "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12, "n_group": 2,
             "topk_group": 1},
    "small": {"num_key_value_heads": 8, "head_dim": 32, "q_lora_rank": 256, "kv_lora_rank": 128,
              "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "n_group": 2,
              "topk_group": 1},
}  # fmt: skip
LAYOUTS = {
    "tp1": (1, 1, False), "tp2": (2, 1, False), "tp2sp": (2, 1, True), "ep2": (1, 2, False),
    "tp2ep2": (2, 2, False), "tp2ep2sp": (2, 2, True), "tp4": (4, 1, False),
}  # fmt: skip


def _batch(cfg: Any, tokens: int, device: torch.device) -> tuple[torch.Tensor, list[int], Any]:
    gen = torch.Generator().manual_seed(7)
    seq = min(cfg.max_position_embeddings, max(8, tokens // 4))
    lengths = [seq] * max(1, tokens // seq)
    ids = torch.randint(4, cfg.vocab_size, (sum(lengths),), generator=gen)
    weights = torch.randn(sum(lengths), generator=gen)
    return ids.to(device), lengths, weights.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / den if den else float(a.double().norm())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def _time_steps(step: Any, steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps + 1):  # the first one warms up
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def run_layout(name: str, ref: Any, args: argparse.Namespace, device: torch.device,
               batch: tuple[torch.Tensor, list[int], torch.Tensor],
               ref_grads: dict[str, torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    from posttrain.grpo.megatron.grads import grad_norm, reduce_gradients
    from posttrain.grpo.megatron.groups import build_parallel_groups
    from posttrain.grpo.megatron.model import TensorParallelDecoder
    from posttrain.models import Numerics, to_hf_state_dict

    tp, ep, sp = LAYOUTS[name]
    groups = build_parallel_groups(tp, ep)
    model = TensorParallelDecoder(ref.config, groups, sequence_parallel=sp,
                                  numerics=Numerics(args.numerics), device=device).to(device)  # fmt: skip
    model.load_hf_state_dict({k: v.to(device) for k, v in ref.hf_state_dict().items()})
    ids, lengths, w = batch
    lp = model.forward_logprobs(ids, lengths)
    loss = (lp * w).sum()
    loss.backward()  # every DP rank has the whole batch: the DP mean is its gradient
    params = [p for p in model.parameters() if p.requires_grad]
    reduce_gradients(model, params)
    norm = grad_norm(model, params)
    grads = to_hf_state_dict(model.full_state_dict(grads=True, device=device), model.full_config)
    with torch.no_grad():
        ref_lp = ref.forward_logprobs(ids, lengths)
    worst = {k: _rel(grads[k].float(), g.float()) for k, g in ref_grads.items()}
    top = max(worst, key=lambda k: worst[k])
    exported = model.hf_state_dict(device=device)
    ref_sd = ref.hf_state_dict()
    bitwise = exported.keys() == ref_sd.keys() and all(
        torch.equal(exported[k], v) for k, v in ref_sd.items()
    )
    ref_loss = float((ref_lp * w).sum())
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    model.zero_grad(set_to_none=True)

    def step() -> None:
        (model.forward_logprobs(ids, lengths) * w).sum().backward()
        reduce_gradients(model, params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = _time_steps(step, args.steps, device)
    peak = torch.tensor([_peak(device)], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "layout": name, "tp": tp, "ep": ep, "sequence_parallel": sp, "dp": groups.dp_size,
        "logprob_max_abs_diff": float((lp.detach() - ref_lp).abs().max()),
        "loss_rel": abs(float(loss) - ref_loss) / max(abs(ref_loss), 1e-30),
        "grad_norm": norm, "grad_rel_max": worst[top], "grad_rel_worst_tensor": top,
        "export_bitwise": bool(bitwise), "step_s_median": seconds,
        "peak_mem_bytes": int(peak.item()),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_backend = "nccl" if torch.cuda.is_available() else "gloo"
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=default_backend)
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--layouts", default="tp1,tp2,tp2sp,ep2,tp2ep2")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--numerics", choices=("strict", "fast"), default="strict")
    parser.add_argument("--family", choices=("qwen3_moe", "deepseek_v3"), default="qwen3_moe")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # a plain `python` run: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))  # fmt: skip
    dist.init_process_group(args.backend, timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import posttrain.grpo.megatron.layers  # noqa: F401 (megatron-core)
    from posttrain.grpo import GrpoConfigError
    from posttrain.grpo.megatron.model import check_tensor_parallel_config
    from posttrain.models import ModelConfig, Numerics, build_model, to_hf_state_dict

    size = args.size or ("small" if device.type == "cuda" else "tiny")
    if args.family == "deepseek_v3":
        mla = {**SIZES[size], **MLA_SIZES[size]}
        cfg = ModelConfig.mla_tiny("deepseek_v3", **mla, initializer_range=0.05)
    else:
        cfg = ModelConfig.tiny(**SIZES[size], initializer_range=0.05)
    ref = build_model(cfg, seed=11, numerics=Numerics(args.numerics)).to(device)
    batch = _batch(cfg, args.tokens, device)
    ids, lengths, w = batch
    (ref.forward_logprobs(ids, lengths) * w).sum().backward()
    ref_grads = to_hf_state_dict(
        {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
         for n, p in ref.named_parameters()}, cfg,
    )  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-6)

    def ref_step() -> None:
        (ref.forward_logprobs(ids, lengths) * w).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    ref_model_sd = {k: v.clone() for k, v in ref.hf_state_dict().items()}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ref_seconds = _time_steps(ref_step, args.steps, device)
    reference = {"step_s_median": ref_seconds, "peak_mem_bytes": _peak(device)}
    ref.load_hf_state_dict(ref_model_sd)  # undo the timed updates: layouts start from these
    ref.zero_grad(set_to_none=True)
    results, skipped = [], []
    for name in [n.strip() for n in args.layouts.split(",") if n.strip()]:
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
        tp, ep, _ = LAYOUTS[name]
        if world % tp or world % ep or cfg.num_experts % ep:
            skipped.append(f"{name}: tp {tp} / ep {ep} do not split {world} ranks, "
                           f"{cfg.num_experts} experts")  # fmt: skip
            continue
        try:
            check_tensor_parallel_config(cfg, tp)
        except GrpoConfigError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        results.append(run_layout(name, ref, args, device, batch, ref_grads))
    if rank == 0:
        print(json.dumps({
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": args.backend, "world_size": world, "size": size, "family": args.family,
            "numerics": args.numerics, "tokens": sum(lengths),
            "parameters": sum(p.numel() for p in ref.parameters()),
            "reference": reference, "layouts": results, "skipped": skipped,
        }, indent=2))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
