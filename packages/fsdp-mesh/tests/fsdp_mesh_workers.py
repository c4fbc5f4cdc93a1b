"""Functions the multi-process tests run on each gloo rank (importable by spawned ranks)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from posttrain.fsdp_mesh import (
    AccumulationError,
    FsdpMesh,
    HsdpConfig,
    MeshBuildError,
    ParityConfig,
    ParityModel,
    accumulate_gradients,
    apply_hsdp,
    build_fsdp_mesh,
    check_mesh,
    clip_grad_norm,
    count_collectives,
    gather_full_param,
    grad_norm,
    iter_full_state_dict,
    latest_step,
    load_checkpoint,
    read_meta,
    run_parity,
    save_checkpoint,
    save_files_checkpoint,
)
from posttrain.interface import MeshSpec

FP32 = HsdpConfig(param_dtype=None, reduce_dtype=None)


def parity_layouts(rank: int, world: int, layouts: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """run_parity for each (replicate, build method) in one process group."""
    out = []
    for r, method in layouts:
        cfg = ParityConfig(replicate=r, shard=world // r, method=method, steps=3)  # type: ignore[arg-type]
        out.append(run_parity(cfg).to_json())
    return out


def _trained(mesh: FsdpMesh, seed: int) -> tuple[ParityModel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = ParityModel(30, 2, 3)
    apply_hsdp(model, mesh, FP32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(100 + step + 10 * dist.get_rank())
        model(torch.randn(4, 30)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full_state(model: ParityModel, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = dict(iter_full_state_dict(model))
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            out[f"optim.{names[id(p)]}.{key}"] = gather_full_param(value)
    return out


def _fresh(mesh: FsdpMesh) -> tuple[ParityModel, torch.optim.Optimizer]:
    torch.manual_seed(777)
    model = ParityModel(30, 2, 3)
    apply_hsdp(model, mesh, FP32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def checkpoint_across_layouts(
    rank: int, world: int, save_r: int, load_rs: list[int], root: str, reference: str | None
) -> dict[str, Any]:
    """Save with replicate=save_r (or load a foreign checkpoint), reload under each load_r."""
    result: dict[str, Any] = {"exact": {}}
    if reference is None:
        mesh = build_fsdp_mesh(MeshSpec(world_size=world, replicate=save_r, shard=world // save_r))
        model, opt = _trained(mesh, seed=5)
        save_checkpoint(
            root, 2, model, mesh, opt, extra={"note": "x"},
            write_files=lambda staged: (staged / f"note_rank{rank}.txt").write_text(str(rank)),
        )  # fmt: skip
        saved = _full_state(model, opt)
        if rank == 0:
            torch.save(saved, Path(root) / "full_reference.pt")
        dist.barrier()
    else:
        saved = torch.load(reference)
    for load_r in load_rs:
        mesh = build_fsdp_mesh(MeshSpec(world_size=world, replicate=load_r, shard=world // load_r))
        model, opt = _fresh(mesh)
        meta = load_checkpoint(root, model, mesh, opt)
        loaded = _full_state(model, opt)
        same_keys = loaded.keys() == saved.keys()
        exact = same_keys and all(torch.equal(loaded[k], saved[k]) for k in saved)
        result["exact"][load_r] = exact
        result["meta"] = (meta.step, meta.world_size, meta.replicate, meta.shard, meta.extra)
    result["files"] = sorted(os.listdir(root))
    result["step_files"] = sorted(os.listdir(Path(root) / "iter_0000002"))
    return result


def files_checkpoint_commit_or_nothing(rank: int, world: int, root: str) -> dict[str, Any]:
    """save_files_checkpoint: step 1 commits; step 2's writer fails, leaving step 1 current."""
    mesh = build_fsdp_mesh(MeshSpec(world_size=world, replicate=1, shard=world))

    def write(staged: Path) -> None:
        (staged / f"part{rank}.bin").write_bytes(bytes([rank]))

    def fail(staged: Path) -> None:
        (staged / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    save_files_checkpoint(root, 1, mesh, write, extra={"k": 1})
    try:
        save_files_checkpoint(root, 2, mesh, fail)
        error = None
    except OSError as exc:
        error = str(exc)
    return {
        "error": error,
        "latest": latest_step(root),
        "meta": (
            read_meta(Path(root) / "iter_0000001").step,
            read_meta(Path(root) / "iter_0000001").extra,
        ),
        "step1": sorted(os.listdir(Path(root) / "iter_0000001")),
        "step2_committed": (Path(root) / "iter_0000002").exists(),
    }


def deferred_vs_eager(rank: int, world: int, replicate: int, micro: int) -> dict[str, Any]:
    """Same data, M micro-batches: per-micro-batch vs deferred replicate all-reduce."""
    mesh = build_fsdp_mesh(
        MeshSpec(world_size=world, replicate=replicate, shard=world // replicate)
    )
    rep = tuple(dist.get_process_group_ranks(mesh.replicate_group))
    shard = tuple(dist.get_process_group_ranks(mesh.shard_group))
    grads: dict[bool, dict[str, torch.Tensor]] = {}
    counts: dict[bool, dict[str, int]] = {}
    for defer in (False, True):
        torch.manual_seed(3)
        model = ParityModel(30, 3, 3)
        apply_hsdp(model, mesh, FP32)
        with count_collectives() as log, accumulate_gradients(model, micro, defer=defer) as acc:
            for m in range(micro):
                with acc.micro_batch():
                    torch.manual_seed(1000 * rank + m)
                    (model(torch.randn(4, 30)).square().mean() / micro).backward()
        grads[defer] = {n: gather_full_param(p.grad) for n, p in model.named_parameters()}
        counts[defer] = {
            "replicate_all_reduce": log.count("allreduce_", group_ranks=rep)
            if replicate > 1
            else 0,
            "replicate_bytes": log.nbytes("allreduce_", group_ranks=rep) if replicate > 1 else 0,
            "shard_reduce_scatter": log.count("_reduce_scatter_base_", group_ranks=shard),
            "groups": 4,
        }
    max_diff = max(float((grads[True][n] - grads[False][n]).abs().max()) for n in grads[True])
    return {"counts": counts, "max_diff": max_diff}


def _message(fn: Any) -> str:
    try:
        fn()
    except (MeshBuildError, AccumulationError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def live_checks(rank: int, world: int) -> dict[str, Any]:
    """Errors and helpers that need a live W=2 gloo group."""
    out: dict[str, Any] = {}
    out["world_mismatch"] = _message(
        lambda: build_fsdp_mesh(MeshSpec(world_size=4, replicate=2, shard=2))
    )
    good = build_fsdp_mesh(MeshSpec(world_size=2, replicate=1, shard=2))
    fallback = build_fsdp_mesh(
        MeshSpec(world_size=2, replicate=2, shard=1), method="init_device_mesh"
    )
    out["fallback"] = fallback.report()
    out["unflatten"] = build_fsdp_mesh(MeshSpec(world_size=2, replicate=2, shard=1)).report()
    # A torch without DeviceMesh._unflatten: "auto" falls back, "unflatten" refuses.
    with patch.object(DeviceMesh, "_unflatten", None):
        out["auto_without_unflatten"] = build_fsdp_mesh(
            MeshSpec(world_size=2, replicate=2)
        ).report()
        out["forced_without_unflatten"] = _message(
            lambda: build_fsdp_mesh(MeshSpec(world_size=2, replicate=2), method="unflatten")
        )
    # A spec that disagrees with the mesh (what a truncating fallback would produce).
    out["grid_mismatch"] = _message(
        lambda: check_mesh(
            FsdpMesh(
                spec=MeshSpec(world_size=2, replicate=2, shard=1),
                world=good.world,
                hsdp=good.hsdp,
                method="unflatten",
            )
        )
    )
    small = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    out["truncated_world"] = _message(
        lambda: check_mesh(
            FsdpMesh(spec=good.spec, world=small, hsdp=good.hsdp, method="init_device_mesh")
        )
    )
    # Accumulation bookkeeping errors.
    torch.manual_seed(0)
    model = ParityModel(8, 1, 2)
    apply_hsdp(model, fallback, FP32)

    def early_exit() -> None:
        with accumulate_gradients(model, 2) as acc, acc.micro_batch():
            model(torch.randn(2, 8)).sum().backward()

    def too_many() -> None:
        with accumulate_gradients(model, 1) as acc:
            for _ in range(2):
                with acc.micro_batch():
                    model(torch.randn(2, 8)).sum().backward()

    def outside() -> None:
        acc = accumulate_gradients(model, 1)
        with acc.micro_batch():
            pass

    out["early_exit"] = _message(early_exit)
    out["too_many"] = _message(too_many)
    out["outside"] = _message(outside)
    model.zero_grad()
    # Clipping with the inf norm and a no-op clip, against an unsharded reference.
    torch.manual_seed(1)
    ref = ParityModel(10, 2, 3)
    sharded = ParityModel(10, 2, 3)
    sharded.load_state_dict(ref.state_dict())
    apply_hsdp(sharded, good, FP32)
    x = torch.randn(2, 4, 10)
    sharded(x[rank]).square().mean().backward()
    ref(x.reshape(8, 10)).square().mean().backward()
    out["inf_norm"] = (
        grad_norm(sharded, float("inf")),
        max(float(p.grad.abs().max()) for p in ref.parameters()),
    )  # type: ignore[union-attr]
    big = clip_grad_norm(sharded, 1e6)
    out["noop_clip"] = (big, float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)))
    out["noop_grads_equal"] = all(
        torch.allclose(gather_full_param(p.grad), q.grad, rtol=1e-6, atol=1e-7)  # type: ignore[arg-type]
        for p, q in zip(sharded.parameters(), ref.parameters(), strict=True)
    )
    full = dict(iter_full_state_dict(sharded, dtype=torch.float64))
    out["export_equal"] = all(torch.equal(full[n], v.double()) for n, v in ref.state_dict().items())
    out["export_dtype"] = str(next(iter(full.values())).dtype)
    return out


def _train_variant(world: int, replicate: int, config: HsdpConfig) -> dict[str, torch.Tensor]:
    mesh = build_fsdp_mesh(MeshSpec(world_size=world, replicate=replicate))
    torch.manual_seed(0)
    model = ParityModel(30, 2, 3)
    apply_hsdp(model, mesh, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        with accumulate_gradients(model, 2) as acc:
            for micro in range(2):
                with acc.micro_batch():
                    torch.manual_seed(100 * step + 10 * dist.get_rank() + micro)
                    (model(torch.randn(4, 30)).float().square().mean() / 2).backward()
        clip_grad_norm(model, 0.05)
        opt.step()
        opt.zero_grad()
    return dict(iter_full_state_dict(model))


def config_variants(rank: int, world: int) -> dict[str, float]:
    """Default bf16/fp32-reduce across layouts, CPU offload, no reshard: max |Δ| of weights."""
    runs = {
        "fp32_r1": _train_variant(world, 1, FP32),
        "bf16_r1": _train_variant(world, 1, HsdpConfig()),
        "bf16_rW": _train_variant(world, world, HsdpConfig()),
        "offload_r1": _train_variant(
            world, 1, HsdpConfig(param_dtype=None, reduce_dtype=None, cpu_offload=True)
        ),
        "keep_rW": _train_variant(
            world,
            world,
            HsdpConfig(param_dtype=None, reduce_dtype=None, reshard_after_forward=False),
        ),
    }

    def diff(a: str, b: str) -> float:
        return max(float((runs[a][n] - runs[b][n]).abs().max()) for n in runs[a])

    return {
        "bf16_r1_vs_rW": diff("bf16_r1", "bf16_rW"),
        "offload_vs_fp32": diff("offload_r1", "fp32_r1"),
        "keep_vs_fp32": diff("keep_rW", "fp32_r1"),
        "bf16_vs_fp32": diff("bf16_r1", "fp32_r1"),
    }


def ignored_params_check(rank: int, world: int) -> dict[str, Any]:
    """``apply_hsdp(ignored_params=...)``: the ignored parameter stays plain and rank-local."""
    from torch.distributed.tensor import DTensor

    mesh = build_fsdp_mesh(MeshSpec(world_size=world, replicate=1))
    torch.manual_seed(0)
    model = ParityModel(30, 2, 3)
    extra = torch.nn.Parameter(torch.ones(30))
    model.register_parameter("extra", extra)
    apply_hsdp(model, mesh, FP32, ignored_params={extra})
    torch.manual_seed(10 + rank)
    (model(torch.randn(4, 30) * model.extra).square().mean()).backward()
    grads = [torch.zeros(30) for _ in range(world)]
    assert extra.grad is not None
    dist.all_gather(grads, extra.grad)
    return {
        "ignored_is_plain": not isinstance(model.extra, DTensor),
        "others_sharded": all(
            isinstance(p, DTensor) for n, p in model.named_parameters() if n != "extra"
        ),
        "ignored_grad_is_local": not torch.equal(grads[0], grads[1]),
    }


def export_in_buckets(rank: int, world: int) -> dict[str, Any]:
    """``iter_full_state_dict``'s bucketed all-gathers against one ``gather_full_param`` per
    entry, on the flat and an HSDP mesh (uneven and empty shards at W=4), gathers counted."""
    out: dict[str, Any] = {}
    for replicate in (1, 2):
        mesh = build_fsdp_mesh(MeshSpec(world_size=world, replicate=replicate))
        torch.manual_seed(3)
        model = ParityModel(30, 2, 3)
        model.register_buffer("steps", torch.arange(4.0))  # plain: passes through
        apply_hsdp(model, mesh, FP32)
        ref = [(n, gather_full_param(v)) for n, v in model.state_dict().items()]
        runs: dict[str, Any] = {}
        # 3600 + 3600 + 360 bytes of fp32 weights: alone, two buckets, one bucket
        for label, nbytes in (("one_each", 1), ("small", 4000), ("default", 64 << 20)):
            with count_collectives() as log:
                got = list(iter_full_state_dict(model, bucket_bytes=nbytes))
            runs[label] = {
                "names_equal": [n for n, _ in got] == [n for n, _ in ref],
                "bytes_equal": all(
                    a.dtype == b.dtype and torch.equal(a, b)
                    for (_, a), (_, b) in zip(got, ref, strict=True)
                ),
                "gathers": log.count(),
            }
        out[f"r{replicate}"] = runs
    try:
        next(iter_full_state_dict(model, bucket_bytes=0))
        out["zero_bucket"] = "accepted"
    except ValueError as exc:
        out["zero_bucket"] = str(exc)
    return out


def _timed(parts: dict[str, Any], seconds: dict[str, float], name: str, fn: Any) -> None:
    t0 = time.perf_counter()
    parts[name] = fn()
    seconds[name] = round(time.perf_counter() - t0, 2)


def w4_suite(rank: int, world: int, root: str) -> dict[str, Any]:
    """Everything the W=4 tests check, in one process group."""
    layouts = [(1, "auto"), (2, "auto"), (4, "auto"), (2, "init_device_mesh")]
    out: dict[str, Any] = {"layouts": layouts, "seconds": {}}
    sec = out["seconds"]
    _timed(out, sec, "parity", lambda: parity_layouts(rank, world, layouts))
    _timed(out, sec, "deferred", lambda: {r: deferred_vs_eager(rank, world, r, 4) for r in (2, 4)})
    _timed(
        out,
        sec,
        "checkpoint",
        lambda: checkpoint_across_layouts(rank, world, 2, [1, 4, 2], root, None),
    )
    _timed(out, sec, "export", lambda: export_in_buckets(rank, world))
    return out


def w2_suite(rank: int, world: int, root: str) -> dict[str, Any]:
    """Everything the W=2 tests check, in one process group (loads the W=4 checkpoint)."""
    layouts = [(1, "auto"), (2, "auto")]
    out: dict[str, Any] = {"layouts": layouts, "seconds": {}}
    sec = out["seconds"]
    ref = str(Path(root) / "full_reference.pt")
    _timed(out, sec, "parity", lambda: parity_layouts(rank, world, layouts))
    _timed(out, sec, "deferred", lambda: {2: deferred_vs_eager(rank, world, 2, 4)})
    _timed(
        out, sec, "checkpoint", lambda: checkpoint_across_layouts(rank, world, 0, [1, 2], root, ref)
    )
    _timed(out, sec, "live", lambda: live_checks(rank, world))
    _timed(out, sec, "variants", lambda: config_variants(rank, world))
    _timed(out, sec, "ignored", lambda: ignored_params_check(rank, world))
    _timed(out, sec, "export", lambda: export_in_buckets(rank, world))
    return out


def torchrun_main(rank: int, world: int, ports: list[int], argvs: list[list[str]]) -> list[Any]:
    """Call the parity command's main() as torchrun would (RANK/WORLD_SIZE set, no group yet)."""
    import contextlib
    import io

    from posttrain.fsdp_mesh import parity

    out: list[Any] = []
    for port, argv in zip(ports, argvs, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                code = parity.main(argv)
            out.append((code, buf.getvalue()))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
    return out
