"""One GRPO training step on a GPU, beside a plain transformers step in the same process.

A random-init ``posttrain.models`` decoder is sharded with ``fsdp-mesh`` exactly as the GRPO
trainer shards it (``posttrain.grpo.trainer.shard_policy``: one FSDP2 unit per decoder layer
plus the root, fp32 master parameters and reductions, ``precision="bf16"`` casting the compute
copy to bf16; LoRA factors outside FSDP and reduced by ``lora-core``), and ``train_step`` runs
on synthetic samples: the forward, the GRPO objective, backward, gradient reduction, clipping
and one AdamW step.

Sizes: ``--size base`` (hidden 1024, 8 layers, 2 dense + 6 MoE with 8 experts top-2, vocab
32000, about 258M parameters), ``--size 1b`` (a ~0.94B dense Qwen3: hidden 2048, 16 layers,
16 q / 8 kv heads x 128, SwiGLU 6144, vocab 32000), ``--size tiny`` (a CPU dry run).

The reference (world 1, unless ``--no-transformers``): transformers' ``Qwen3MoeForCausalLM``
(``Qwen3ForCausalLM`` for the dense size) built from the same config, eager attention, on the
same token sequences, forward + causal-LM loss + backward + ``torch.optim.AdamW`` step, in fp32
and under bf16 autocast. transformers is imported only then; without it the reference rows say
so and our rows still run.

Reported per row: tokens/s (median over the measured steps), achieved TFLOP/s and MFU from
active-parameter FLOPs (``6 * N_active * tokens`` plus causal attention, ``6 * layers * heads *
head_dim * (L + 1)`` per token; embeddings excluded, the LM head included, for a MoE layer the
router plus ``top_k`` experts) over ``--peak-tflops`` (default: the bf16 dense peak of the
device, 989.4 for H100/H200 SXM), peak memory (``torch.cuda.max_memory_allocated``, largest over
ranks) and, for ours, that the trainer's logprobs equal the reference logprobs fed in as the
rollout's (strict: 0 diff; under bf16 the strict reference holds the bf16 weights an engine
would serve, the trainer's compute copy). The summary line has ours / transformers at each precision.

Needs torch (+CUDA) and the repo's src paths (plus transformers for the reference). From the
repo root:

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python packages/grpo/benchmarks/gpu_train_step.py
    # dry run here:  ... gpu_train_step.py --device cpu --size tiny --reps 1

``--compile`` (``on``, or ``both`` for eager and compiled rows in one run) runs our fast steps
with each decoder layer ``torch.compile``d (the trainer's ``--compile``); compiled rows carry
``compile``, ``first_step_s`` (the step that compiled) and ``compiled_at_end`` (False: the
compile failed and the layers fell back to eager). ``--compile-mode`` passes ``torch.compile``'s
mode (``reduce-overhead``: CUDA graphs; ``max-autotune``, ``max-autotune-no-cudagraphs``; the
trainer's ``--compile-mode``); compiled rows also carry ``compile_mode`` and what dynamo and
inductor counted (``graphs``, ``graph_breaks`` with their reasons, ``cudagraph_skips``,
``cudagraph_partitions``). ``--compile-reference`` adds transformers
rows with each decoder layer compiled. The summary's ``ours_over_transformers_*`` compares
eager with eager, ``ours_compiled_over_transformers_*`` our compiled step with transformers
eager (the issue's comparison) and ``ours_compiled_over_transformers_compiled_*`` compiled
with compiled.

Prints one JSON object per configuration as soon as it is measured (a timeout keeps the rows
already printed), then a summary line.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.trainer import TrainSample, shard_policy, train_step
from posttrain.interface.processes import run_workers
from posttrain.models import COMPILE_MODES, ModelConfig, Numerics, build_model, layers_compiled

SIZES = {
    "tiny": {"vocab_size": 101, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "moe_intermediate_size": 32, "num_experts": 4,
             "num_experts_per_tok": 2, "mlp_only_layers": (0,), "max_position_embeddings": 64},
    "base": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
             "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 64, "moe_intermediate_size": 1024, "num_experts": 8,
             "num_experts_per_tok": 2, "mlp_only_layers": (0, 1), "max_position_embeddings": 512},
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 6144,
           "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128, "moe_intermediate_size": 0, "num_experts": 0,
           "num_experts_per_tok": 1, "family": "qwen3", "max_position_embeddings": 512},
}  # fmt: skip
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}  # dense, SXM


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward multiplies by (embedding lookup excluded, LM head in;
    a MoE layer counts its router and ``top_k`` experts)."""
    h = cfg.hidden_size
    total = cfg.vocab_size * h  # LM head
    for i in range(cfg.num_hidden_layers):
        nh, nkv, hd = cfg.attention_shape(i)
        total += h * (2 * nh * hd + 2 * nkv * hd)
        if cfg.is_moe_layer(i):
            total += (
                h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
            )
        else:
            total += 3 * h * cfg.intermediate_size
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N_active`` plus causal attention (QK and PV, forward
    and twice backward: ``6 * layers * heads * head_dim * (L + 1)``)."""
    attn = sum(
        6 * cfg.attention_shape(i).num_heads * cfg.attention_shape(i).head_dim * (seq_len + 1)
        for i in range(cfg.num_hidden_layers)
    )
    return 6.0 * active_params(cfg) + attn


def default_peak_tflops(device: str) -> float | None:
    """The bf16 dense peak of the CUDA device by name (None when unknown or on CPU)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _token_rows(cfg: ModelConfig, tokens: int, seq_len: int, world: int) -> list[list[int]]:
    """Every rank's sequences of one step (the same for ours and the reference)."""
    gen = torch.Generator().manual_seed(1234)
    n = max(world, tokens // seq_len)
    return [torch.randint(0, cfg.vocab_size, (seq_len,), generator=gen).tolist() for _ in range(n)]


def _samples(cfg: ModelConfig, tokens: int, seq_len: int, rank: int, world: int,
             model: Any) -> list[TrainSample]:  # fmt: skip
    """This rank's share of ``tokens`` tokens in sequences of ``seq_len`` (half prompt)."""
    prompt = seq_len // 2
    mine = _token_rows(cfg, tokens, seq_len, world)[rank::world]
    device = model.embedding.device
    out = []
    with torch.no_grad():  # the "engine" logprobs: the same model, before the step
        for s in mine:
            lp = model.forward_logprobs(torch.tensor(s, device=device), [seq_len])[prompt:]
            out.append(TrainSample(tokens=s, prompt_len=prompt, loss_mask=[1] * (seq_len - prompt),
                                   rollout_logprobs=lp.cpu().tolist(),
                                   advantages=[1.0 if len(out) % 2 else -1.0] * (seq_len - prompt)))  # fmt: skip
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _rates(
    args: argparse.Namespace, mcfg: ModelConfig, tokens: int, seconds: float
) -> dict[str, Any]:
    tflops = train_flops_per_token(mcfg, args.seq_len) * tokens / seconds / 1e12
    return {
        "tokens_per_s": tokens / seconds,
        "step_s_median": seconds,
        "active_params": active_params(mcfg),
        "tflops": tflops,
        "mfu": None if not args.peak_tflops else tflops / args.peak_tflops,
    }


def measure(rank: int, world: int, args: argparse.Namespace, train: str, numerics: str,
            tokens: int, precision: str, compiled: bool = False) -> dict[str, Any]:  # fmt: skip
    device = torch.device(args.device, rank if args.device == "cuda" else 0)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    _fresh_memory(device)
    if compiled:
        torch._dynamo.reset()  # each model's layers compile afresh (the on-disk cache stays)
        torch._dynamo.utils.counters.clear()  # this run's graph breaks and CUDA-graph skips
    mcfg = ModelConfig(**SIZES[args.size])  # type: ignore[arg-type]
    model = build_model(mcfg, seed=0, numerics=Numerics(numerics), device=device)
    params = sum(p.numel() for p in model.parameters())  # before LoRA factors and sharding
    gcfg = GrpoConfig(train=train, replicate=world if args.hsdp else 1,  # type: ignore[arg-type]
                      shard=1 if args.hsdp else world, lr=1e-5, lora_targets=TARGETS,
                      lora_r=16, lora_alpha=32.0, precision=precision,  # type: ignore[arg-type]
                      numerics=numerics, activation_checkpointing=args.activation_checkpointing,  # type: ignore[arg-type]
                      compile=compiled,
                      compile_mode=args.compile_mode if compiled else "default")  # fmt: skip
    # The strict "engine" holds the weights the trainer computes with: under bf16, FSDP's bf16
    # compute copy (a bf16 checkpoint served), so both sides run the same bf16 kernels.
    low = precision == "bf16" and numerics == "strict"
    engine = copy.deepcopy(model) if low else model
    if low:  # parameters only, as FSDP's param_dtype (buffers such as rope tables stay fp32)
        for p in engine.parameters():
            p.data = p.data.to(torch.bfloat16)
    samples = _samples(mcfg, tokens, args.seq_len, rank, world, engine)
    del engine
    policy = shard_policy(model, gcfg, device=device)  # what the GRPO trainer builds, on device
    total = world * len(samples) * (args.seq_len - args.seq_len // 2)
    seconds, diffs, first, recorded = [], [], 0.0, []
    for rep in range(args.reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        before = _cudagraph_recordings()
        metrics = train_step(policy, samples, gcfg, global_batch_size=world * len(samples),
                             global_token_count=total)  # fmt: skip
        _sync(device)
        recorded.append(_cudagraph_recordings() - before)
        if rep == 0:
            diffs.append(metrics["train_rollout_logprob_max_abs_diff"])  # before any update
            first = time.perf_counter() - t0
        else:
            seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if args.device == "cuda" else 0
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    profile = None
    if args.profile and world == 1:
        step = functools.partial(train_step, policy, samples, gcfg,
                                 global_batch_size=len(samples), global_token_count=total)  # fmt: skip
        profile = _profile(step, device)
    still_compiled = layers_compiled(policy.model)
    del policy, model
    step_tokens = world * len(samples) * args.seq_len
    return {
        "impl": "posttrain", "size": args.size, "train": train, "numerics": numerics,
        "precision": precision, "world": world, "hsdp": bool(args.hsdp),
        "activation_checkpointing": bool(args.activation_checkpointing),
        "params": params if rank == 0 else None,
        "tokens_per_step": step_tokens,
        **_rates(args, mcfg, step_tokens, statistics.median(seconds)),
        "peak_memory_gib": max(p or 0 for p in peaks) / 2**30,
        "first_step_max_abs_logprob_diff": diffs[0],
        "step_s_each": [round(x, 4) for x in seconds],  # a step that (re-)records graphs shows
        **({"compile": True, "compile_mode": args.compile_mode,
            "compiled_at_end": still_compiled, "first_step_s": first, **_compile_counters(),
            "cudagraph_recorded_inputs_per_step": recorded}
           if compiled else {}),
        **({"profile": profile} if profile else {}),
    }  # fmt: skip


def _cudagraph_recordings() -> int:
    """Inductor's running count of the non-static inputs of every CUDA graph it recorded: it
    grows while graphs are (re-)recorded and stays put while they replay. A compiled row's
    ``cudagraph_recorded_inputs_per_step`` is its growth per step: in ``reduce-overhead``,
    anything but 0 after the first two steps means graphs are re-recorded every step (a
    parameter's address moved, say FSDP2's re-allocated unsharded parameters), not replayed."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_recorded_non_static_inputs"])


def _compile_counters() -> dict[str, Any]:
    """What dynamo and inductor counted since the run's reset: graphs captured, graph breaks
    (with their reasons, shortened), CUDA-graph skips and partitions (``reduce-overhead``)."""
    counters = torch._dynamo.utils.counters
    breaks = counters["graph_break"]
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": [
            f"{n}x {r.splitlines()[0][:120]}" for r, n in breaks.most_common(3)
        ],
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "cudagraph_partitions": int(counters["inductor"]["cudagraph_partitions"]),
    }


def _profile(step: Any, device: torch.device, top: int = 25) -> dict[str, Any]:
    """One more step under the profiler: its wall time, the device's busy time (the sum of its
    kernels and copies, each counted once: where the GPU waits on the host, busy < wall), the
    ``top`` kernels by device time, the ``top`` host ops by call count (what launches them) and
    the host syncs (``aten::_local_scalar_dense``: ``.item()``/``.tolist()`` on device tensors).
    A CPU run reports host ops by self CPU time as its "kernels"."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    wall = time.perf_counter() - t0
    events = prof.events()
    on_device = [e for e in events if e.device_type == DeviceType.CUDA] if cuda else []
    busy_us = sum(e.time_range.elapsed_us() for e in on_device) if cuda else 0.0
    kernels: dict[str, list[float]] = {}
    for e in on_device:
        kernels.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    if not cuda:
        for e in prof.key_averages():
            kernels[e.key[:90]] = [e.self_cpu_time_total / max(e.count, 1)] * e.count
    ranked = sorted(kernels.items(), key=lambda kv: sum(kv[1]), reverse=True)[:top]
    host = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
    by_calls = sorted(host, key=lambda e: e.count, reverse=True)[:top]
    syncs = sum(e.count for e in host if e.key == "aten::_local_scalar_dense")
    return {
        "wall_ms": round(wall * 1e3, 2),
        "device_busy_ms": round(busy_us / 1e3, 2),
        "device_kernels": len(on_device),
        "host_syncs": syncs,
        "top_kernels": [
            {
                "name": n,
                "ms": round(sum(t) / 1e3, 3),
                "calls": len(t),
                "share_of_busy": round(sum(t) / busy_us, 4) if cuda else None,
            }
            for n, t in ranked
        ],
        "top_host_ops_by_calls": [{"name": e.key[:60], "calls": e.count} for e in by_calls],
    }


def hf_reference(args: argparse.Namespace, precision: str,
                 compiled: bool = False) -> dict[str, Any]:  # fmt: skip
    """One transformers training step (eager attention, causal-LM loss, torch AdamW) of the
    same config on the same sequences; fp32 or under bf16 autocast. ``compiled``: each decoder
    layer ``torch.compile``d (``module.compile()``, the same regions as ours)."""
    row: dict[str, Any] = {"impl": "transformers", "size": args.size, "precision": precision,
                           "world": 1, **({"compile": True} if compiled else {})}  # fmt: skip
    try:
        import transformers
    except ImportError:
        row["skipped"] = ("transformers is not installed in this Python: pip install "
                          "'transformers>=5' (or put it on PYTHONPATH) to get the reference")  # fmt: skip
        return row
    device = torch.device(args.device, 0)
    _fresh_memory(device)
    mcfg = ModelConfig(**SIZES[args.size])  # type: ignore[arg-type]
    hf_dict = mcfg.to_hf_dict() if mcfg.num_experts == 0 else mcfg.to_qwen3_moe_hf_dict()
    hf_dict = {k: v for k, v in hf_dict.items() if k != "architectures"}
    hf_cfg = transformers.AutoConfig.for_model(**hf_dict)
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    hf.float()  # fp32 parameters (autocast makes the bf16 compute copies)
    hf.train()
    if compiled:
        torch._dynamo.reset()
        for layer in hf.model.layers:
            layer.compile()
    row["architecture"] = type(hf).__name__
    row["transformers_version"] = transformers.__version__
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    ids = torch.tensor(_token_rows(mcfg, args.tokens, args.seq_len, 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    seconds = []
    for rep in range(args.reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if rep:
            seconds.append(time.perf_counter() - t0)
        elif compiled:
            row["first_step_s"] = time.perf_counter() - t0
    row["loss"] = float(loss.detach())
    row["tokens_per_step"] = int(ids.numel())
    row.update(_rates(args, mcfg, int(ids.numel()), statistics.median(seconds)))
    row["peak_memory_gib"] = (torch.cuda.max_memory_allocated(device) / 2**30
                              if device.type == "cuda" else 0.0)  # fmt: skip
    del hf, opt, loss
    return row


COMPILE_RUNS = {"off": (False,), "on": (True,), "both": (False, True)}
"""``--compile``: our fast runs eager, compiled, or both (eager first)."""


def _rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    out: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:  # printed as soon as measured: a timeout keeps it
        out.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)

    runs = [("fast", args.tokens)]
    if not args.skip_strict:
        if args.strict_tokens != args.tokens:  # the fast run at the strict batch, for the ratio
            runs.append(("fast", args.strict_tokens))
        runs.append(("strict", args.strict_tokens))
    modes = COMPILE_RUNS[args.compile]
    for i, compiled in enumerate(modes):
        for train in args.train:
            for precision in args.precision:
                for numerics, tokens in runs:
                    if numerics == "strict" and i:  # strict is never compiled: measured once
                        continue
                    emit(measure(rank, world, args, train, numerics, tokens, precision,
                                 compiled and numerics == "fast"))  # fmt: skip
        if i == 0 and world == 1 and not args.hsdp and args.transformers:
            for precision in args.precision:
                emit(hf_reference(args, precision))
            if args.compile_reference:
                for precision in args.precision:
                    emit(hf_reference(args, precision, compiled=True))
    return out


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios at equal batch. Our compiled rows get ``ours_compiled_over_transformers_*``
    (against transformers eager, the issue's comparison) and ``strict_over_fast_compiled_*``;
    a compiled reference adds ``ours_compiled_over_transformers_compiled_*``."""
    ours = [r for r in results if r.get("impl") == "posttrain"]
    strict = {(r["train"], r["precision"], r["world"], r["hsdp"]): r
              for r in ours if r["numerics"] == "strict"}  # fmt: skip
    out: dict[str, Any] = {"summary": "ratios at equal batch, same run"}
    for k, v in strict.items():
        for f in ours:
            if (f["numerics"] == "fast" and (f["train"], f["precision"], f["world"], f["hsdp"]) == k
                    and f["tokens_per_step"] == v["tokens_per_step"]):  # fmt: skip
                fast = "fast_compiled" if f.get("compile") else "fast"
                name = f"strict_over_{fast}_{k[0]}_{k[1]}_w{k[2]}{'_hsdp' if k[3] else ''}"
                out[name] = round(v["tokens_per_s"] / f["tokens_per_s"], 4)
    refs = {(r["precision"], bool(r.get("compile"))): r for r in results
            if r.get("impl") == "transformers" and "tokens_per_s" in r}  # fmt: skip
    for f in ours:
        mine = "ours_compiled" if f.get("compile") else "ours"
        for ref_compiled in (False, True):
            ref = refs.get((f["precision"], ref_compiled))
            if (not ref or f["numerics"] != "fast" or f["world"] != 1 or f["hsdp"]
                    or f["tokens_per_step"] != ref["tokens_per_step"]
                    or (ref_compiled and not f.get("compile"))):  # fmt: skip
                continue
            theirs = "transformers_compiled" if ref_compiled else "transformers"
            key = f"{f['size']}_{f['train']}_{f['precision']}"
            out[f"{mine}_over_{theirs}_{key}"] = round(f["tokens_per_s"] / ref["tokens_per_s"], 4)
            out[f"memory_{mine}_over_{theirs}_{key}"] = (
                round(f["peak_memory_gib"] / ref["peak_memory_gib"], 4)
                if ref["peak_memory_gib"]
                else None
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="base")
    parser.add_argument("--gpus", type=int, nargs="+", default=None,
                        help="world sizes to run (default: 1, and 2 where 2 GPUs exist)")  # fmt: skip
    parser.add_argument("--train", choices=("full", "lora"), nargs="+", default=["full", "lora"])
    parser.add_argument("--precision", choices=("fp32", "bf16"), nargs="+",
                        default=["fp32", "bf16"], help="trainer precision(s) to run")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (fast)")
    parser.add_argument("--strict-tokens", type=int, default=256, help="tokens per step (strict)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-strict", action="store_true")
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                        help="run the transformers reference beside ours (world 1)")  # fmt: skip
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", nargs="?", choices=tuple(COMPILE_RUNS), const="on",
                        default="off", help="torch.compile each decoder layer of our fast runs: "
                        "on (--compile), off, or both (eager rows first)")  # fmt: skip
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile mode of our compiled runs (the trainer's "
                        "--compile-mode): default, reduce-overhead (CUDA graphs), max-autotune, "
                        "max-autotune-no-cudagraphs")  # fmt: skip
    parser.add_argument("--compile-reference", action="store_true",
                        help="also run the transformers reference with each decoder layer "
                        "compiled (the eager reference rows stay)")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step of each run (top kernels by time)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s for MFU (default: the device's bf16 dense peak)")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    args = parser.parse_args()
    if args.compile_mode != "default" and args.compile == "off":
        parser.error(f"--compile-mode {args.compile_mode} needs --compile on or --compile both")
    if args.device == "cpu":
        args.seq_len = min(args.seq_len, SIZES[args.size]["max_position_embeddings"])  # type: ignore[type-var]
    if args.peak_tflops is None:
        args.peak_tflops = default_peak_tflops(args.device)
    available = torch.cuda.device_count() if args.device == "cuda" else 2
    worlds = args.gpus or ([1, 2] if available >= 2 else [1])
    results = []
    for world in worlds:
        if world > available:
            print(json.dumps({"world": world, "skipped": f"only {available} device(s)"}))
            continue
        for hsdp in [False, True] if world > 1 else [False]:
            run_args = replace_ns(args, hsdp=hsdp)
            backend = "nccl" if args.device == "cuda" else "gloo"
            per_rank = run_workers(_rank, world, args=(run_args,), backend=backend,
                                   timeout_s=args.timeout_s, start_method="spawn",
                                   threads_per_rank=None)  # fmt: skip
            results.extend(per_rank[0])  # rank 0 printed each row as it was measured
    print(json.dumps({**_summary(results), "peak_tflops": args.peak_tflops}))
    sys.stdout.flush()
    os._exit(0)  # NCCL teardown can hang on some drivers; every result is printed


def replace_ns(ns: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), **changes})


if __name__ == "__main__":
    main()
