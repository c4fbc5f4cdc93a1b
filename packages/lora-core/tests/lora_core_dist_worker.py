"""Rank programs for the gloo tests, run by ``posttrain.interface.testing.run_workers``.

One process group per test module runs every check of a suite (``suite_tp``, ``suite_megatron``)
and returns plain numbers; the test files assert on them. Kept out of pytest collection (no
``test_`` prefix). Also runnable as a script (``python this.py SUITE RANK WORLD PORT OUT``).
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import posttrain.lora.layers as lora_layers
from posttrain.lora import (
    ColumnShardedLinear,
    LoraConfig,
    LoraGroups,
    LoraHandle,
    ReplicaMismatchError,
    RowShardedLinear,
    Target,
    attach_lora,
    export_adapter,
    load_peft,
    lora_grad_norm,
    reduce_lora_grads,
    save_peft,
    verify_replicas,
)
from posttrain.lora.attach import fused_local_parts, fused_local_rows

H, FF, V_PAD, V, T, R = 16, 12, 12, 10, 8, 4
CFG = LoraConfig(r=R, alpha=8.0, b_init="normal", seed=7, export_dtype=torch.float32)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


class Block(nn.Module):
    """Attention-shaped pair (fused interleaved q/k/v column, row out) then a gate/up MLP."""

    def __init__(self, qkv: nn.Module, o: nn.Module, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(torch.tanh(self.qkv(x)))
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Net(nn.Module):
    def __init__(self, blocks: list[Block], head: nn.Module | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x if self.head is None else self.head(x)


def full_linears(seed: int) -> dict[str, nn.Linear]:
    torch.manual_seed(seed)
    mods: dict[str, nn.Linear] = {}
    for i in range(2):
        mods[f"{i}.qkv"] = nn.Linear(H, 2 * H)
        mods[f"{i}.o"] = nn.Linear(2 * H, H)
        mods[f"{i}.gate_up"] = nn.Linear(H, 2 * FF)
        mods[f"{i}.down"] = nn.Linear(FF, H)
    mods["head"] = nn.Linear(H, V_PAD, bias=False)
    return mods


def targets(layers: list[int], local_index: bool, with_head: bool) -> dict[str, Target]:
    out: dict[str, Target] = {}
    for j, i in enumerate(layers):
        k = j if local_index else i
        out[f"blocks.{k}.qkv"] = Target(
            parts=(
                (f"model.layers.{i}.self_attn.q_proj", H),
                (f"model.layers.{i}.self_attn.k_proj", H // 2),
                (f"model.layers.{i}.self_attn.v_proj", H // 2),
            ),
            groups=2,
        )
        out[f"blocks.{k}.o"] = Target(hf_name=f"model.layers.{i}.self_attn.o_proj")
        out[f"blocks.{k}.gate_up"] = Target(
            parts=((f"model.layers.{i}.mlp.gate_proj", FF), (f"model.layers.{i}.mlp.up_proj", FF))
        )
        out[f"blocks.{k}.down"] = Target(hf_name=f"model.layers.{i}.mlp.down_proj")
    if with_head:
        out["head"] = Target(hf_name="lm_head", unpadded_out=V)
    return out


def build_ref(layers: list[int] = [0, 1], with_head: bool = True) -> tuple[Net, LoraHandle]:  # noqa: B006
    full = full_linears(0)
    net = Net(
        [
            Block(full[f"{i}.qkv"], full[f"{i}.o"], full[f"{i}.gate_up"], full[f"{i}.down"])
            for i in layers
        ],
        full["head"] if with_head else None,
    )
    return net, attach_lora(net, CFG, targets(layers, True, with_head))


def build_tp(
    groups: LoraGroups, sp: bool, layers: list[int] | None = None, with_head: bool = True
) -> tuple[Net, LoraHandle]:
    if layers is None:
        layers = [0, 1]
    full = full_linears(0)
    tp = groups.tp

    def col(m: nn.Linear, split: list[int] | None = None) -> ColumnShardedLinear:
        return ColumnShardedLinear.from_full(
            m, tp_group=tp, sequence_parallel=sp, split_sizes=split
        )

    def row(m: nn.Linear) -> RowShardedLinear:
        return RowShardedLinear.from_full(m, tp_group=tp, sequence_parallel=sp)

    blocks = [
        Block(
            col(full[f"{i}.qkv"]),
            row(full[f"{i}.o"]),
            col(full[f"{i}.gate_up"], [FF, FF]),
            row(full[f"{i}.down"]),
        )
        for i in layers
    ]
    net = Net(blocks, col(full["head"]) if with_head else None)
    return net, attach_lora(net, CFG, targets(layers, True, with_head), groups)


def to_local(
    ref: torch.Tensor, site: lora_layers.LoraLinear, factor: str, rank: int, tp: int
) -> torch.Tensor:
    info = site.site
    if factor == "A":
        return ref.chunk(tp, dim=1)[rank] if info.layout == "row" else ref
    if info.layout != "column":
        return ref
    sizes = [s for _, s in info.parts]
    return fused_local_rows(fused_local_parts(ref, sizes, info.groups, 1), info.groups, rank, tp)


def loss_weights() -> torch.Tensor:
    w = torch.randn(T, V_PAD, generator=torch.Generator().manual_seed(5))
    w[:, V:] = 0.0
    return w


def batch(d: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 + d))


def reference_step() -> dict[str, Any]:
    net, handle = build_ref()
    w = loss_weights()
    xs = [batch(d).requires_grad_(True) for d in range(2)]
    outs = [net(x) for x in xs]
    loss = sum((o * w).sum() for o in outs) / 2
    loss.backward()
    return {"net": net, "handle": handle, "xs": xs, "outs": outs}


def tp_dp_mode(rank: int, sp: bool, groups: LoraGroups, ref: dict[str, Any]) -> dict[str, Any]:
    tp_rank, dp_rank, tp = rank % 2, rank // 2, 2
    net, handle = build_tp(groups, sp)
    res: dict[str, Any] = {}
    init_tp = export_adapter(handle)
    init_ref = export_adapter(build_ref()[1])
    res["init_bitwise"] = init_tp.keys() == init_ref.keys() and all(
        torch.equal(init_tp[k], init_ref[k]) for k in init_ref
    )
    x_full = batch(dp_rank).requires_grad_(True)
    x = x_full.chunk(tp)[tp_rank].detach().requires_grad_(True) if sp else x_full
    out = net(x)
    w_loc = loss_weights().chunk(tp, dim=1)[tp_rank]
    (out * w_loc).sum().backward()
    raw = [p.grad.clone() for p in handle.parameters()]
    reduce_lora_grads(handle)
    res["framework"] = framework_style_check(handle, groups, raw)
    ref_out = ref["outs"][dp_rank].chunk(tp, dim=1)[tp_rank]
    res["fwd_rel"] = rel_l2(out.detach(), ref_out.detach())
    ref_dx = ref["xs"][dp_rank].grad * 2  # the reference loss is the DP mean
    if sp:
        ref_dx = ref_dx.chunk(tp)[tp_rank]
    res["dx_rel"] = rel_l2(x.grad, ref_dx)
    errs = {}
    for path, site in handle.sites.items():
        rsite = ref["handle"].sites[path]
        for f in ("A", "B"):
            mine = getattr(site, f"lora_{f}").grad
            theirs = to_local(getattr(rsite, f"lora_{f}").grad, site, f, tp_rank, tp)
            errs[f"{path}.{f}"] = rel_l2(mine, theirs)
    res["grad_rel"] = errs
    res["grad_norm"] = lora_grad_norm(handle)
    ref_sq = sum(float(p.grad.double().pow(2).sum()) for p in ref["handle"].parameters())
    res["ref_grad_norm"] = ref_sq**0.5
    # replicated factors (and their grads) must be bitwise equal on all 4 ranks
    mismatched = []
    for name, p in handle.named_parameters():
        for label, t in (("value", p.detach()), ("grad", p.grad)):
            peers = [torch.empty_like(t) for _ in range(4)]
            dist.all_gather(peers, t.contiguous())
            group = (
                range(4)
                if p.lora_tag.shard_axis is None
                else [r for r in range(4) if r % 2 == tp_rank]
            )
            if not all(torch.equal(peers[r], t) for r in group):
                mismatched.append(f"{name}.{label}")
    res["replica_mismatch"] = mismatched
    try:
        verify_replicas(handle)
        verify_replicas(handle, grads=True)
        res["verify_replicas"] = "ok"
    except ReplicaMismatchError as exc:
        res["verify_replicas"] = str(exc)
    return res


def framework_style_check(
    handle: LoraHandle, groups: LoraGroups, raw: list[torch.Tensor]
) -> dict[str, Any]:
    """Reduce and norm the way Megatron does, reading only the Megatron attributes we set.

    finalize_model_grads SUMs ``sequence_parallel`` params over TP, DDP averages over DP, then
    ``reduce_lora_grads(after_dp_finish=True)`` must add nothing; the grad norm counts a param
    on every TP rank if ``tensor_model_parallel`` else only on TP rank 0 (the duplicate filter).
    """
    ours = [p.grad.clone() for p in handle.parameters()]
    tp_rank = dist.get_rank(groups.tp)
    for p, g in zip(handle.parameters(), raw, strict=True):
        p.grad = g.clone()
        if p.sequence_parallel:
            dist.all_reduce(p.grad, group=groups.tp)
        if p.allreduce:
            dist.all_reduce(p.grad, group=groups.dp)
            p.grad /= dist.get_world_size(groups.dp)
    reduce_lora_grads(handle, after_dp_finish=True, overlap_grad_reduce=True)
    same = all(
        torch.allclose(p.grad, o, rtol=1e-6, atol=0)
        for p, o in zip(handle.parameters(), ours, strict=True)
    )
    sq = torch.zeros((), dtype=torch.float64)
    for p in handle.parameters():
        if p.tensor_model_parallel or tp_rank == 0:
            sq += p.grad.double().pow(2).sum()
    dist.all_reduce(sq, group=groups.tp)
    for p, o in zip(handle.parameters(), ours, strict=True):
        p.grad = o
    return {"grads_match": same, "megatron_norm": float(sq.sqrt())}


class _GatherNoReduce(torch.autograd.Function):
    """All-gather forward, but backward keeps only this rank's slice (no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(h) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, h.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(n)[r].contiguous(), None


def negative_control(
    rank: int, groups: LoraGroups, ref: dict[str, Any], sp: bool
) -> dict[str, Any]:
    """Drop the rank-r reduction of the column branch: must break grads and replicas.

    Without SP: the identity-forward / all-reduce-backward op becomes a plain identity. With SP:
    the all-gather keeps its forward but loses its reduce-scatter backward.
    """
    name = "gather_from_seq" if sp else "copy_to_group"
    saved = getattr(lora_layers, name)
    broken = _GatherNoReduce.apply if sp else (lambda h, group: h)
    setattr(lora_layers, name, broken)
    try:
        res = tp_dp_mode(rank, sp, groups, ref)
    finally:
        setattr(lora_layers, name, saved)
    return {
        "verify_replicas": res["verify_replicas"],
        "dx_rel": res["dx_rel"],
        "max_grad_rel": max(res["grad_rel"].values()),
        "replica_mismatch": res["replica_mismatch"],
    }


def perturbed_ref_adapter() -> tuple[LoraHandle, dict[str, torch.Tensor]]:
    _, handle = build_ref()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for site in handle.sites.values():
            site.lora_A.add_(torch.randn(site.lora_A.shape, generator=gen))
            b = torch.randn(site.lora_B.shape, generator=gen)
            if site.site.unpadded_out:
                b[site.site.unpadded_out :] = 0
            site.lora_B.add_(b)
    return handle, export_adapter(handle)


def import_export(rank: int, groups: LoraGroups) -> dict[str, Any]:
    res: dict[str, Any] = {}
    _ref_handle, ref_adapter = perturbed_ref_adapter()
    with tempfile.TemporaryDirectory() as tmp:
        save_peft(Path(tmp) / "ref", ref_adapter, CFG)
        _, tp_handle = build_tp(groups, sp=False)
        load_peft(tp_handle, Path(tmp) / "ref")
        tp_adapter = export_adapter(tp_handle)
        res["tp1_to_tp2_bitwise"] = tp_adapter.keys() == ref_adapter.keys() and all(
            torch.equal(tp_adapter[k], ref_adapter[k]) for k in ref_adapter
        )
        res["lm_head_rows"] = list(tp_adapter["base_model.model.lm_head.lora_B.weight"].shape)
        save_peft(Path(tmp) / "tp", tp_adapter, CFG)
        _, back = build_ref()
        load_peft(back, Path(tmp) / "tp")
        back_adapter = export_adapter(back)
        res["tp2_to_tp1_bitwise"] = all(
            torch.equal(back_adapter[k], ref_adapter[k]) for k in ref_adapter
        )
        res["bf16_export_dtypes"] = sorted(
            {str(t.dtype) for t in export_adapter(tp_handle, dtype=torch.bfloat16).values()}
        )
    return res


def pipeline_export(rank: int, tp_group: Any, pp_group: Any) -> dict[str, Any]:
    """PP=2 x TP=2: stage s holds layer s (and the head on the last stage)."""
    stage = rank // 2
    groups = LoraGroups(tp=tp_group, pp=pp_group)
    _ref_handle, ref_adapter = perturbed_ref_adapter()
    with tempfile.TemporaryDirectory() as tmp:
        save_peft(Path(tmp) / "ref", ref_adapter, CFG)
        _, handle = build_tp(groups, sp=True, layers=[stage], with_head=stage == 1)
        loaded = load_peft(handle, Path(tmp) / "ref")
        full = export_adapter(handle)
    return {
        "pp_bitwise": full.keys() == ref_adapter.keys()
        and all(torch.equal(full[k], ref_adapter[k]) for k in ref_adapter),
        "pp_sorted": list(full) == sorted(full),
        "stage_loaded": len(loaded),
    }


def suite_tp(rank: int, world: int) -> dict[str, Any]:
    assert world == 4
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = LoraGroups(tp=tp_groups[rank // 2], dp=dp_groups[rank % 2])
    ref = reference_step()
    return {
        "nosp": tp_dp_mode(rank, False, groups, ref),
        "sp": tp_dp_mode(rank, True, groups, ref),
        "negative": negative_control(rank, groups, ref, sp=False),
        "negative_sp": negative_control(rank, groups, ref, sp=True),
        "io": import_export(rank, groups),
        "pp": pipeline_export(rank, tp_groups[rank // 2], dp_groups[rank % 2]),
        "ep": suite_ep(
            rank,
            LoraGroups(ep=tp_groups[rank // 2], expert_dp=dp_groups[rank % 2], dp=dist.group.WORLD),
        ),
    }


def suite_megatron(rank: int, world: int) -> dict[str, Any]:
    """The TP=2 x DP=world/2 checks through megatron-core's real parallel linears.

    megatron-core's sequence-parallel all-gather takes its buffer from a global memory buffer
    allocated on ``torch.cuda.current_device()``; on a CPU machine we patch that function to
    return ``"cpu"`` (the only patch; no CUDA is touched otherwise).
    """
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    import torch._dynamo as dynamo

    dynamo.config.disable = True  # megatron-core calls torch.compile at import: skip it
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    ndp = world // 2  # TP=2 x DP=world/2
    tp_groups = [dist.new_group([2 * d, 2 * d + 1]) for d in range(ndp)]
    dp_groups = (
        [dist.new_group(list(range(t, world, 2))) for t in range(2)] if ndp > 1 else [None, None]
    )
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
    tp_rank, dp_rank, tp = rank % 2, rank // 2, 2

    def full() -> dict[str, nn.Linear]:
        torch.manual_seed(1)
        return {
            f"{i}.{n}": nn.Linear(*dims)
            for i in range(2)
            for n, dims in (("fc1", (H, 2 * FF)), ("fc2", (2 * FF, H)))
        }

    class MBlock(nn.Module):
        def __init__(self, fc1: nn.Module, fc2: nn.Module, megatron: bool) -> None:
            super().__init__()
            self.fc1, self.fc2, self.megatron = fc1, fc2, megatron

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            h = F.gelu(h[0] if self.megatron else h)
            y = self.fc2(h)
            return x + (y[0] if self.megatron else y)

    def tgt() -> dict[str, Target]:
        return {
            f"{i}.{n}": Target(hf_name=f"model.layers.{i}.mlp.{hf}")
            for i in range(2)
            for n, hf in (("fc1", "up_proj"), ("fc2", "down_proj"))
        }

    cfg = LoraConfig(r=R, alpha=8.0, b_init="normal", seed=9, export_dtype=torch.float32)
    ref_mods = full()
    ref = nn.ModuleDict(
        {str(i): MBlock(ref_mods[f"{i}.fc1"], ref_mods[f"{i}.fc2"], False) for i in range(2)}
    )
    ref_handle = attach_lora(ref, cfg, tgt())
    xs = [
        torch.randn(T, 1, H, generator=torch.Generator().manual_seed(200 + d)).requires_grad_(True)
        for d in range(ndp)
    ]
    w = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(3))
    ref_outs = []
    for x in xs:
        h = x
        for i in range(2):
            h = ref[str(i)](h)
        ref_outs.append(h)
    (sum((o * w).sum() for o in ref_outs) / ndp).backward()

    results: dict[str, Any] = {}
    for sp in (False, True):
        mcfg = ModelParallelConfig(
            tensor_model_parallel_size=2,
            sequence_parallel=sp,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )
        mods = full()
        blocks = nn.ModuleDict()
        for i in range(2):
            fc1 = ColumnParallelLinear(
                H,
                2 * FF,
                config=mcfg,
                init_method=nn.init.zeros_,
                bias=True,
                gather_output=False,
                tp_group=tp_group,
            )
            fc2 = RowParallelLinear(
                2 * FF,
                H,
                config=mcfg,
                init_method=nn.init.zeros_,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
                tp_group=tp_group,
            )
            with torch.no_grad():
                fc1.weight.copy_(mods[f"{i}.fc1"].weight.chunk(tp)[tp_rank])
                fc1.bias.copy_(mods[f"{i}.fc1"].bias.chunk(tp)[tp_rank])
                fc2.weight.copy_(mods[f"{i}.fc2"].weight.chunk(tp, dim=1)[tp_rank])
                fc2.bias.copy_(mods[f"{i}.fc2"].bias)
            blocks[str(i)] = MBlock(fc1, fc2, True)
        groups = LoraGroups(tp=tp_group, dp=dp_group)
        handle = attach_lora(blocks, cfg, tgt(), groups)
        init_same = all(
            torch.equal(a, b)
            for a, b in zip(
                export_adapter(handle).values(),
                export_adapter(
                    attach_lora(
                        nn.ModuleDict(
                            {
                                str(i): MBlock(full()[f"{i}.fc1"], full()[f"{i}.fc2"], False)
                                for i in range(2)
                            }
                        ),
                        cfg,
                        tgt(),
                    )
                ).values(),
                strict=True,
            )
        )
        x_full = xs[dp_rank].detach().clone()
        x = (x_full.chunk(tp)[tp_rank] if sp else x_full).clone().requires_grad_(True)
        h = x
        for i in range(2):
            h = blocks[str(i)](h)
        # non-SP: the output is replicated and every TP rank computes the same full loss
        w_loc = w.chunk(tp)[tp_rank] if sp else w
        (h * w_loc).sum().backward()
        reduce_lora_grads(handle)
        ref_out = ref_outs[dp_rank].chunk(tp)[tp_rank] if sp else ref_outs[dp_rank]
        ref_dx = xs[dp_rank].grad * ndp
        ref_dx = ref_dx.chunk(tp)[tp_rank] if sp else ref_dx
        errs = {}
        for path, site in handle.sites.items():
            rsite = ref_handle.sites[path]
            for f in ("A", "B"):
                errs[f"{path}.{f}"] = rel_l2(
                    getattr(site, f"lora_{f}").grad,
                    to_local(getattr(rsite, f"lora_{f}").grad, site, f, tp_rank, tp),
                )
        ref_norm = sum(float(p.grad.double().pow(2).sum()) for p in ref_handle.parameters()) ** 0.5
        tags = {
            n: (p.tensor_model_parallel, p.partition_dim, p.sequence_parallel)
            for n, p in handle.named_parameters()
            if n.startswith("0.")
        }
        results["sp" if sp else "nosp"] = {
            "init_bitwise": init_same,
            "fwd_rel": rel_l2(h.detach(), ref_out.detach()),
            "dx_rel": rel_l2(x.grad, ref_dx),
            "grad_rel": errs,
            "grad_norm": lora_grad_norm(handle),
            "ref_grad_norm": ref_norm,
            "tags": tags,
        }
    return results


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        out_splits, in_splits = ctx.splits
        gi = g.new_empty(sum(in_splits), *g.shape[1:])
        dist.all_to_all_single(gi, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gi, None, None, None


N_EXP, EP = 4, 2


def moe(
    x: torch.Tensor, expert: torch.Tensor, fc1: nn.Module, fc2: nn.Module, ep_group: Any
) -> torch.Tensor:
    """Top-1 hard routing; a hand-written all-to-all dispatcher when ``ep_group`` is given."""
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    n_loc = N_EXP // ep
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=N_EXP)
    xs = x[order]
    if ep == 1:
        h = F.gelu(fc1(xs, counts.tolist()))
        ys = fc2(h, counts.tolist())
    else:
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=ep_group)  # [src, local expert]
        send_splits = counts.view(ep, n_loc).sum(1).tolist()
        recv_splits = recv.view(ep, n_loc).sum(1).tolist()
        got = _AllToAll.apply(xs, recv_splits, send_splits, ep_group)
        blocks = recv.view(ep, n_loc)
        idx = torch.arange(got.shape[0])
        pieces = list(torch.split(idx, blocks.reshape(-1).tolist()))  # (src, e) blocks
        perm = torch.cat([pieces[s * n_loc + e] for e in range(n_loc) for s in range(ep)])
        tpe = blocks.sum(0).tolist()
        h = F.gelu(fc1(got[perm], tpe))
        y_local = fc2(h, tpe)
        back = torch.empty_like(y_local)
        back = back.index_copy(0, perm, y_local)
        ys = _AllToAll.apply(back, send_splits, recv_splits, ep_group)
    out = torch.empty_like(ys).index_copy(0, order, ys)
    return x + out


def moe_targets(shared: bool) -> dict[str, Target]:
    if shared:
        return {
            "fc1": Target(hf_name="model.layers.0.mlp.experts.w1", shared="A"),
            "fc2": Target(hf_name="model.layers.0.mlp.experts.w2", shared="B"),
        }
    return {
        "fc1": Target(hf_name="model.layers.0.mlp.experts.{expert}.up_proj"),
        "fc2": Target(hf_name="model.layers.0.mlp.experts.{expert}.down_proj"),
    }


def build_moe(
    ep_group: Any, ep_rank: int, shared: bool, groups: LoraGroups | None
) -> tuple[nn.ModuleDict, LoraHandle]:
    from posttrain.lora.experts import ExpertLinear

    torch.manual_seed(4)
    w1, w2 = torch.randn(N_EXP, FF, H) * 0.3, torch.randn(N_EXP, H, FF) * 0.3
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    fc1 = ExpertLinear(N_EXP, H, FF, ep_group=ep_group)
    fc2 = ExpertLinear(N_EXP, FF, H, ep_group=ep_group)
    with torch.no_grad():
        fc1.weight.copy_(w1.chunk(ep)[ep_rank])
        fc2.weight.copy_(w2.chunk(ep)[ep_rank])
    mods = nn.ModuleDict({"fc1": fc1, "fc2": fc2})
    cfg = LoraConfig(r=R, alpha=8.0, b_init="normal", seed=5, export_dtype=torch.float32)
    return mods, attach_lora(mods, cfg, moe_targets(shared), groups)


def moe_batch(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + d)
    return torch.randn(T, H, generator=gen), torch.randint(0, N_EXP, (T,), generator=gen)


def ep_mode(rank: int, shared: bool, groups: LoraGroups) -> dict[str, Any]:
    """EP=2 x expert-DP=2 in a world of 4 (dense DP=4), vs one process holding every expert."""
    ep_rank = rank % 2
    ref_mods, ref_handle = build_moe(None, 0, shared, None)
    w = torch.randn(T, H, generator=torch.Generator().manual_seed(8))
    xs = []
    ref_loss = 0.0
    for d in range(4):
        x, e = moe_batch(d)
        x.requires_grad_(True)
        xs.append(x)
        ref_loss = ref_loss + (moe(x, e, ref_mods["fc1"], ref_mods["fc2"], None) * w).sum() / 4
    ref_loss.backward()  # type: ignore[union-attr]
    mods, handle = build_moe(groups.ep, ep_rank, shared, groups)
    init_same = all(
        torch.equal(a, b)
        for a, b in zip(
            export_adapter(handle).values(),
            export_adapter(build_moe(None, 0, shared, None)[1]).values(),
            strict=True,
        )
    )
    x, e = moe_batch(rank)
    x.requires_grad_(True)
    out = moe(x, e, mods["fc1"], mods["fc2"], groups.ep)
    ref_out = moe(xs[rank].detach(), e, ref_mods["fc1"], ref_mods["fc2"], None)
    (out * w).sum().backward()
    reduce_lora_grads(handle)
    errs = {}
    for path, site in handle.sites.items():
        rsite = ref_handle.sites[path]
        for f in ("A", "B"):
            ref_g = getattr(rsite, f"lora_{f}").grad
            if site.shared != f:
                ref_g = ref_g.chunk(2)[ep_rank]
            errs[f"{path}.{f}"] = rel_l2(getattr(site, f"lora_{f}").grad, ref_g)
    ref_norm = sum(float(p.grad.double().pow(2).sum()) for p in ref_handle.parameters()) ** 0.5
    _, ref_adapter = perturbed_moe_adapter(shared)
    with tempfile.TemporaryDirectory() as tmp:
        save_peft(Path(tmp) / "a", ref_adapter, handle.config)
        load_peft(handle, Path(tmp) / "a")
    round_trip = export_adapter(handle)
    return {
        "init_bitwise": init_same,
        "fwd_rel": rel_l2(out.detach(), ref_out.detach()),
        "dx_rel": rel_l2(x.grad, xs[rank].grad * 4),
        "grad_rel": errs,
        "grad_norm": lora_grad_norm(handle),
        "ref_grad_norm": ref_norm,
        "import_export_bitwise": round_trip.keys() == ref_adapter.keys()
        and all(torch.equal(round_trip[k], ref_adapter[k]) for k in ref_adapter),
        "keys": {
            k: list(v.shape) for k, v in ref_adapter.items() if ".0." in k or "w1" in k or "w2" in k
        },
    }


def perturbed_moe_adapter(shared: bool) -> tuple[LoraHandle, dict[str, torch.Tensor]]:
    _, handle = build_moe(None, 0, shared, None)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in handle.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    return handle, export_adapter(handle)


def suite_ep(rank: int, groups: LoraGroups) -> dict[str, Any]:
    return {"per_expert": ep_mode(rank, False, groups), "shared_outer": ep_mode(rank, True, groups)}


SUITES = {"tp": suite_tp, "megatron": suite_megatron}


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    suite, rank, world, port, out = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=90),
    )
    try:
        result = SUITES[suite](rank, world)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
