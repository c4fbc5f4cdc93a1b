"""Turn a ``LaunchConfig`` into a ``Plan``: place engines, router, session routers, trainer.

Placement: engines fill GPUs from node 0 upward, ``rollout_tp`` GPUs each; the trainer takes
the rest (the other half of a single node, or the remaining whole nodes). Trainer ranks start
through torchrun with c10d rendezvous on the first trainer node: one torchrun agent per
trainer node, ``--nproc-per-node`` ranks each. Router and session routers run on node 0.

Stages: engines and the router (0; the router starts with no workers), session routers (1;
each probes field passthrough through the still-empty router), then the engines are
registered with the router, then the trainer (2).
"""

from __future__ import annotations

from posttrain.launch.args import Args
from posttrain.launch.plan import PYTHON, Plan, ProcessSpec, Readiness, Registration, Role
from posttrain.launch.rules import LaunchConfig, Resolved, apply_rules, resolve_config
from posttrain.launch.tables import VISIBLE_DEVICES_VAR, EngineKind, TrainerBackend

ENGINE_READY_S = 1800.0  # loading a large checkpoint from network storage takes minutes
ROUTER_READY_S = 120.0
SESSION_READY_S = 120.0

ENGINE_MODULES: dict[EngineKind, str] = {
    EngineKind.SGLANG: "sglang.launch_server",
    EngineKind.LOCAL: "posttrain.local_engine",
}
ROUTER_MODULE = "posttrain.launch.sgl_router"
SESSION_ROUTER_MODULE = "posttrain.session_router"


def _env_lines(env: dict[str, tuple[str, str]]) -> list[str]:
    return [f"env {k}={v}  <- {src}" for k, (v, src) in sorted(env.items())]


def _copy_with(args: Args, *extra: tuple[str, object]) -> Args:
    """A copy of ``args`` with per-process flags set (still before the user's tokens)."""
    out = args.copy()
    for name, value in extra:
        out.set(name, value, source="placement")
    return out


def build_plan(cfg: LaunchConfig) -> Plan:
    """Validate ``cfg``, run the rules, place every process. Deterministic (golden-tested)."""
    r = resolve_config(cfg)
    role_args, fired = apply_rules(r)
    hw = cfg.hardware
    gpn = hw.gpus_per_node
    visible = VISIBLE_DEVICES_VAR[hw.generation]
    processes: list[ProcessSpec] = []

    n_engines = r.rollout_gpus // r.rollout_tp if gpn else 1
    worker_urls: list[str] = []
    per_node_index: dict[int, int] = {}
    for i in range(n_engines):
        first_gpu = i * r.rollout_tp
        node = first_gpu // gpn if gpn else 0
        k = per_node_index.get(node, 0)
        per_node_index[node] = k + 1
        port = cfg.engine_port + k
        args = _copy_with(role_args.engine, ("--port", port))
        env = {name: value for name, (value, _) in role_args.engine_env.items()}
        explain = [*args.explain(), *_env_lines(role_args.engine_env)]
        if visible and gpn:
            local = range(first_gpu % gpn, first_gpu % gpn + r.rollout_tp)
            env[visible] = ",".join(str(g) for g in local)
            explain.append(f"env {visible}={env[visible]}  <- placement")
        url = f"http://{{node_ip:{node}}}:{port}"
        worker_urls.append(url)
        processes.append(
            ProcessSpec(
                name=f"engine-{i}",
                role=Role.ENGINE,
                argv=(PYTHON, "-m", ENGINE_MODULES[r.engine_kind], *args.argv()),
                env=env,
                node=node,
                gpus=r.rollout_tp if gpn else 0,
                stage=0,
                readiness=Readiness(
                    url=f"http://{{node_ip}}:{port}/health", timeout_s=ENGINE_READY_S
                ),
                explain=tuple(explain),
            )
        )

    router = _copy_with(role_args.router)
    processes.append(
        ProcessSpec(
            name="router",
            role=Role.ROUTER,
            argv=(PYTHON, "-m", ROUTER_MODULE, *router.argv()),
            node=0,
            stage=0,
            readiness=Readiness(
                url=f"http://{{node_ip}}:{cfg.router_port}/health", timeout_s=ROUTER_READY_S
            ),
            explain=tuple(router.explain()),
        )
    )
    router_url = f"http://{{node_ip:0}}:{cfg.router_port}"
    registrations = tuple(
        Registration(router=router_url, worker=url, after_stage=1) for url in worker_urls
    )

    for i in range(cfg.session_routers):
        port = cfg.session_router_port + i
        args = _copy_with(role_args.session_router, ("--port", port))
        processes.append(
            ProcessSpec(
                name=f"session-router-{i}",
                role=Role.SESSION_ROUTER,
                argv=(PYTHON, "-m", SESSION_ROUTER_MODULE, *args.argv()),
                node=0,
                stage=2,
                readiness=Readiness(
                    url=f"http://{{node_ip}}:{port}/health", timeout_s=SESSION_READY_S
                ),
                explain=tuple(args.explain()),
            )
        )

    # The trainer pushes every weight update to each engine directly (never through the router).
    trainer = _copy_with(role_args.trainer, ("--engine-urls", ",".join(worker_urls)))
    processes.extend(_trainer_processes(r, trainer, role_args.trainer_env))
    notes = [f"rules fired: {', '.join(fired)}"]
    parallel = (
        f"hsdp {r.trainer_replicate} x {r.trainer_shard}"
        if r.trainer_backend is TrainerBackend.FSDP
        else f"tp {r.trainer_tp}, ep {r.trainer_ep}"
    )
    notes.append(
        f"rollout: {n_engines} engine(s) x tp {r.rollout_tp}; trainer: "
        f"{r.trainer_gpus or 1} rank(s), {r.trainer_backend.value} {parallel}, "
        f"{r.precision.value}"
    )
    return Plan(
        name=f"{cfg.model.id}-{hw.value}-{cfg.nodes}n",
        hardware=hw.value,
        nodes=cfg.nodes,
        processes=tuple(processes),
        registrations=registrations,
        notes=tuple(notes),
    )


def torchrun_argv(
    *, nnodes: int, nproc_per_node: int, rendezvous: str, run_id: str, entry: tuple[str, ...]
) -> list[str]:
    """torchrun with c10d rendezvous: every agent gets the same argv; ranks come from the store.

    No ``--node-rank``: c10d assigns agent ranks on arrival, so one argv serves every node.
    ``--max-restarts 0``: a failed rank fails the job instead of silently restarting.
    ``--local-addr {node_ip}``: ranks meet at the address the runner knows for this node,
    not whatever the host name resolves to.
    """
    return [
        PYTHON, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", rendezvous,
        "--rdzv-id", run_id,
        "--max-restarts", "0",
        "--local-addr", "{node_ip}",
        *entry,
    ]  # fmt: skip


def _trainer_processes(
    r: Resolved, trainer: Args, trainer_env: dict[str, tuple[str, str]]
) -> list[ProcessSpec]:
    cfg, hw = r.cfg, r.cfg.hardware
    gpn = hw.gpus_per_node
    visible = VISIBLE_DEVICES_VAR[hw.generation]
    if gpn == 0:
        nodes, per_node, first_node, local_first = [0], 1, 0, 0
    elif cfg.nodes == 1:
        nodes, per_node, first_node, local_first = [0], r.trainer_gpus, 0, r.rollout_gpus
    else:
        first_node = r.rollout_gpus // gpn
        nodes, per_node, local_first = list(range(first_node, cfg.nodes)), gpn, 0
    out = []
    for rank_node, node in enumerate(nodes):
        torchrun = torchrun_argv(
            nnodes=len(nodes),
            nproc_per_node=per_node,
            rendezvous=f"{{node_ip:{first_node}}}:{cfg.rendezvous_port}",
            run_id=f"{cfg.model.id}-{hw.value}-{cfg.nodes}n",
            entry=("-m", cfg.trainer_module),
        )
        env = {k: v for k, (v, _) in trainer_env.items()}
        explain = [
            f"torchrun c10d rendezvous at node {first_node}: {len(nodes)} agent(s) x {per_node}",
            *trainer.explain(),
            *_env_lines(trainer_env),
        ]
        if visible and gpn:
            env[visible] = ",".join(str(g) for g in range(local_first, local_first + per_node))
            explain.append(f"env {visible}={env[visible]}  <- placement")
        out.append(
            ProcessSpec(
                name=f"trainer-{rank_node}",
                role=Role.TRAINER,
                argv=(*torchrun, *trainer.argv()),
                env=env,
                node=node,
                gpus=per_node if gpn else 0,
                stage=2,
                readiness=None,
                explain=tuple(explain),
            )
        )
    return out
