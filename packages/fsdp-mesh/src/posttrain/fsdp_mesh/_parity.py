"""The gradient-parity worker: check a cluster's HSDP layout against single-process training.

``run_parity(config)`` runs inside an initialised process group of W = replicate x shard ranks.
It trains a small bias-free MLP (``dim`` defaults to 30, so shards are uneven for s = 4 and the
3-row head leaves a rank with an empty shard) for ``steps`` AdamW steps of ``micro_batches``
micro-batches each, with the deferred replicate all-reduce and clipping, next to an unsharded
fp32 reference that every rank computes locally on *all* ranks' data. Checks, collected rather
than raised mid-way (so no rank leaves a collective early):

1. reference: every full gradient, the clipped norm and every parameter after each step equal
   the reference within ``rtol``/``atol`` (default 2e-5 / 2e-6, fp32 summation-order noise);
2. cross-rank: full gradients and parameters are bit-identical on all ranks;
3. round trip: after a DCP save, a freshly built model and optimizer load the weights and AdamW
   state bit-exactly;
4. traffic: one replicate all-reduce per FSDP group per optimizer step (none when r = 1),
   counted on the first step (the counter routes every op through Python, so the later steps
   run uncounted and are the ones timed in ``step_seconds``).

The command (``python -m posttrain.fsdp_mesh.parity``) lives in ``_parity_cli.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.fsdp_mesh._accumulate import accumulate_gradients
from posttrain.fsdp_mesh._checkpoint import load_checkpoint, save_checkpoint
from posttrain.fsdp_mesh._clip import clip_grad_norm
from posttrain.fsdp_mesh._comm_count import CollectiveLog, count_collectives
from posttrain.fsdp_mesh._errors import MeshConfigError, ParityError
from posttrain.fsdp_mesh._gather import gather_full_param
from posttrain.fsdp_mesh._hsdp import HsdpConfig, apply_hsdp, fsdp_modules
from posttrain.fsdp_mesh._mesh import BuildMethod, FsdpMesh, build_fsdp_mesh
from posttrain.interface import MeshSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ParityConfig:
    """Layout, model size, training schedule and tolerances of one parity run."""

    replicate: int
    shard: int
    device_type: str = "cpu"
    method: BuildMethod = "auto"
    dim: int = 30
    layers: int = 3
    out_dim: int = 3
    batch: int = 4
    micro_batches: int = 2
    steps: int = 3
    lr: float = 1e-2
    weight_decay: float = 0.1
    max_norm: float = 0.05
    seed: int = 1234
    rtol: float = 2e-5
    atol: float = 2e-6
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "replicate",
            "shard",
            "dim",
            "layers",
            "out_dim",
            "batch",
            "micro_batches",
            "steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MeshConfigError(f"{name} must be a positive int, got {value!r}")
        for name in ("lr", "max_norm", "rtol", "atol"):
            if not getattr(self, name) > 0:
                raise MeshConfigError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class ParityReport:
    """What one rank measured; ``failures`` is empty when every check passed."""

    rank: int
    world_size: int
    replicate: int
    shard: int
    method: str
    max_grad_err: float = 0.0
    max_param_err: float = 0.0
    max_norm_rel_err: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    replicate_all_reduces: int = 0
    local_rows: dict[str, int] = field(default_factory=dict)
    fsdp_groups: int = 0
    step_seconds: list[float] = field(default_factory=list)
    checkpoint_exact: bool = False
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        out["median_step_s"] = statistics.median(self.step_seconds) if self.step_seconds else None
        return out

    def raise_for_failures(self) -> None:
        if self.failures:
            raise ParityError(f"rank {self.rank}: " + "; ".join(self.failures))


class ParityModel(nn.Module):
    """``layers`` bias-free Linear(dim)+ReLU blocks and a bias-free Linear(dim, out_dim) head."""

    def __init__(self, dim: int, layers: int, out_dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim, bias=False), nn.ReLU()) for _ in range(layers)
        )
        self.head = nn.Linear(dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def micro_batch_input(cfg: ParityConfig, step: int, rank: int, micro: int) -> torch.Tensor:
    """The deterministic input of (step, rank, micro-batch), the same on every process."""
    gen = torch.Generator().manual_seed(9000 + 100_000 * step + 1000 * rank + micro)
    return torch.randn(cfg.batch, cfg.dim, generator=gen)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _full(tensor: torch.Tensor | None) -> torch.Tensor:
    if tensor is None:
        raise ParityError("a parameter has no gradient after backward")
    return gather_full_param(tensor, device="cpu")


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0


class _Checker:
    def __init__(self, cfg: ParityConfig, mesh: FsdpMesh, report: ParityReport) -> None:
        self.cfg, self.mesh, self.report = cfg, mesh, report

    def close(self, what: str, name: str, got: torch.Tensor, want: torch.Tensor) -> float:
        err = _max_err(got, want)
        if not torch.allclose(got, want, rtol=self.cfg.rtol, atol=self.cfg.atol):
            self.report.failures.append(
                f"{what} {name}: max|Δ| {err:.3e} vs reference exceeds "
                f"rtol={self.cfg.rtol} atol={self.cfg.atol}"
            )
        return err

    def identical_across_ranks(self, what: str, tensors: dict[str, torch.Tensor]) -> None:
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors.values()])
        bits = flat.view(torch.int32).to(self.mesh.spec.device_type)
        gathered = [torch.empty_like(bits) for _ in range(self.mesh.dp_size)]
        dist.all_gather(gathered, bits, group=self.mesh.dp_group)
        for peer, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                self.report.failures.append(f"{what}: rank {peer} differs bitwise from rank 0")


def _full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{names[id(p)]}.{key}"] = gather_full_param(value)
    return out


def _check_traffic(
    cfg: ParityConfig, mesh: FsdpMesh, report: ParityReport, log: CollectiveLog
) -> None:
    rep_ranks = tuple(dist.get_process_group_ranks(mesh.replicate_group))
    ars = log.count("allreduce_", group_ranks=rep_ranks) if cfg.replicate > 1 else 0
    report.replicate_all_reduces = ars
    want = report.fsdp_groups if cfg.replicate > 1 else 0
    if log.count() == 0 and mesh.dp_size > 1:
        # The dispatch-mode counter saw nothing at all (not even the shard traffic): counting does
        # not work on this build/device, which says nothing about the all-reduces.
        report.notes.append("the collective counter saw no calls; check 4 skipped")
    elif ars != want:
        report.failures.append(
            f"{ars} replicate all-reduces in one optimizer step, expected {want} "
            "(one per FSDP group)"
        )


def run_parity(config: ParityConfig) -> ParityReport:
    """Run the parity checks on this rank (collective on all W ranks); see the module docstring."""
    cfg = config
    world = dist.get_world_size()
    spec = MeshSpec(
        world_size=world, replicate=cfg.replicate, shard=cfg.shard, device_type=cfg.device_type
    )
    mesh = build_fsdp_mesh(spec, method=cfg.method)
    rank = dist.get_rank()
    report = ParityReport(
        rank=rank, world_size=world, replicate=cfg.replicate, shard=cfg.shard, method=mesh.method
    )
    check = _Checker(cfg, mesh, report)
    device = torch.device(cfg.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        # The reference is fp32; TF32 matmuls would make it, not the sharding, the error source.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    torch.manual_seed(cfg.seed)
    reference = ParityModel(cfg.dim, cfg.layers, cfg.out_dim).to(device)
    model = ParityModel(cfg.dim, cfg.layers, cfg.out_dim).to(device)
    model.load_state_dict(reference.state_dict())
    hsdp = HsdpConfig(param_dtype=None, reduce_dtype=None)
    apply_hsdp(model, mesh, hsdp)
    report.fsdp_groups = len(fsdp_modules(model))
    report.local_rows = {
        n: int(p.to_local().shape[0]) if isinstance(p, DTensor) else int(p.shape[0])
        for n, p in model.named_parameters()
    }

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    opt, ref_opt = adamw(model), adamw(reference)
    ref_params = dict(reference.named_parameters())
    m_count = cfg.micro_batches
    for step in range(cfg.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        counter = count_collectives()
        with contextlib.ExitStack() as stack:
            if step == 0:
                stack.enter_context(counter)
            with accumulate_gradients(model, m_count) as acc:
                for micro in range(m_count):
                    with acc.micro_batch():
                        x = micro_batch_input(cfg, step, rank, micro).to(device)
                        (_loss(model(x)) / m_count).backward()  # type: ignore[no-untyped-call]
        norm = clip_grad_norm(model, cfg.max_norm)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step == 0:
            _check_traffic(cfg, mesh, report, counter.log)
        else:
            report.step_seconds.append(time.perf_counter() - t0)

        # Reference: the same global batch on one process, loss averaged over W x M.
        ref_loss = torch.stack(
            [
                _loss(reference(micro_batch_input(cfg, step, q, micro).to(device)))
                for q in range(world)
                for micro in range(m_count)
            ]
        ).sum()
        (ref_loss / (world * m_count)).backward()  # type: ignore[no-untyped-call]
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.max_norm))
        ref_opt.step()

        # Both sides' gradients are compared after clipping, each by its own coefficient.
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        for n, g in grads.items():
            want = ref_params[n].grad
            if want is None:
                raise ParityError(f"reference parameter {n} has no gradient")
            err = check.close(f"step {step} grad", n, g, want.cpu())
            report.max_grad_err = max(report.max_grad_err, err)
        check.identical_across_ranks(f"step {step} gradients", grads)
        rel = abs(norm - ref_norm) / max(ref_norm, 1e-12)
        report.grad_norms.append(norm)
        report.max_norm_rel_err = max(report.max_norm_rel_err, rel)
        if rel > 1e-5:
            report.failures.append(f"step {step}: grad norm {norm:.8g} vs reference {ref_norm:.8g}")
        opt.zero_grad()
        ref_opt.zero_grad()

        params = {n: gather_full_param(p) for n, p in model.named_parameters()}
        for n, p in params.items():
            err = check.close(f"step {step} param", n, p, ref_params[n].detach().cpu())
            report.max_param_err = max(report.max_param_err, err)
        check.identical_across_ranks(f"step {step} parameters", params)

    _round_trip(cfg, mesh, model, opt, hsdp, report, device)
    return report


def _round_trip(
    cfg: ParityConfig,
    mesh: FsdpMesh,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    hsdp: HsdpConfig,
    report: ParityReport,
    device: torch.device,
) -> None:
    """Save, rebuild from a different seed, load: weights and AdamW state must be bit-exact."""
    created = None
    root = cfg.checkpoint_dir
    if root is None:
        box: list[str | None] = [
            tempfile.mkdtemp(prefix="posttrain-parity-") if report.rank == 0 else None
        ]
        dist.broadcast_object_list(box, src=0, group=mesh.dp_group)
        root = created = box[0]
    assert root is not None
    try:
        save_checkpoint(root, cfg.steps, model, mesh, optimizer, extra={"parity": True})
        saved = {n: gather_full_param(p) for n, p in model.named_parameters()}
        saved_opt = _full_optimizer_state(model, optimizer)
        torch.manual_seed(cfg.seed + 1)
        fresh = ParityModel(cfg.dim, cfg.layers, cfg.out_dim).to(device)
        apply_hsdp(fresh, mesh, hsdp)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        meta = load_checkpoint(root, fresh, mesh, fresh_opt)
        loaded = {n: gather_full_param(p) for n, p in fresh.named_parameters()}
        loaded_opt = _full_optimizer_state(fresh, fresh_opt)
        exact = meta.step == cfg.steps and loaded.keys() == saved.keys()
        exact = exact and loaded_opt.keys() == saved_opt.keys()
        for what, got, want in (("param", loaded, saved), ("optimizer", loaded_opt, saved_opt)):
            for n in sorted(set(got) & set(want)):
                if not torch.equal(got[n], want[n]):
                    exact = False
                    report.failures.append(f"round trip {what} {n}: not bit-exact after load")
        if not exact and not any("round trip" in f for f in report.failures):
            report.failures.append(
                f"round trip: keys or step differ (step {meta.step}, "
                f"params {sorted(loaded)} vs {sorted(saved)})"
            )
        report.checkpoint_exact = exact
    finally:
        dist.barrier(group=mesh.dp_group)
        if created is not None and report.rank == 0:
            shutil.rmtree(created, ignore_errors=True)
