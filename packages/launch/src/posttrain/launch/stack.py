"""The local stack ``posttrain up`` starts: N engines, the stock sgl-router, a session router.

Everything binds 127.0.0.1, and every port is either given or chosen free: the engines', the
router's, the router's Prometheus metrics port (sgl-router's default, 29000, would make a second
stack on the machine fail with "Address already in use") and the session router's. With
``api_key`` set, the local engines and the session router require it (see ``keys.py`` for who
gets the key and why the router does not). The engine is ``posttrain.local_engine`` on a CPU machine and
``sglang.launch_server`` where sglang is importable and a GPU is present. The sibling packages
are *started as processes* (``python -m ...``), never imported: launch composes them without
depending on them.

LoRA: every engine loads every ``--lora NAME=PATH`` at startup; the session router injects
``lora_path`` and ``extra_key`` (version 0: the startup adapter) for the one adapter (rollouts without it would silently be base-model,
off-policy samples). Several adapters with sessions are rejected, as the design note says.
``lora_adapter`` names an adapter a trainer pushes later (engines start with LoRA on and no
adapter loaded; the session router injects that name). ``teacher_model_path`` adds one more
engine, not behind the router: the teacher on-policy distillation scores against.

Faults: an engine that dies mid-rollout is failed over by sgl-router itself. A request whose
worker refuses or drops the connection is retried (``--retry-max-retries ROUTER_RETRIES``,
backoff from ``ROUTER_RETRY_BACKOFF_MS``, doubling). Under the manual policy a session's routing
key sticks to its worker, so a retry goes to the *same* dead engine until that worker is no
longer available; only then is the key given to a live engine. The stack makes that the
health check's call (every ``ROUTER_HEALTH_INTERVAL_S``, out after ``ROUTER_HEALTH_FAILURES``
failed probe), with retries spanning longer than that, and turns sgl-router's circuit breaker
off (``--disable-circuit-breaker``): the breaker counted client errors (400s) as engine
failures, so a few bad requests took every engine out for a minute (issue 35). A session's turn is committed
once, by the session router, when a reply arrives, so a retried request never makes a second
sample. ``turn_timeout_s`` (``posttrain grpo
--turn-timeout``) becomes the session router's ``--upstream-timeout-s``: a frozen engine's turn
ends at that deadline (the trainer marks its sample aborted). Both are exercised in
``integration_tests/test_integration_engine_faults.py``.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from posttrain.interface.processes import free_ports
from posttrain.launch._errors import LaunchConfigError
from posttrain.launch.args import Args
from posttrain.launch.hardware import Detection, detect_hardware
from posttrain.launch.plan import PYTHON, Plan, ProcessSpec, Readiness, Registration, Role
from posttrain.launch.planner import ENGINE_MODULES, ROUTER_MODULE, SESSION_ROUTER_MODULE
from posttrain.launch.tables import EngineKind

LOCAL_HOST = "127.0.0.1"
TEACHER = "teacher"
"""The name of the teacher engine's process (and URL key): the one engine not behind the router."""
ROUTER_RETRIES = 5
"""sgl-router's ``--retry-max-retries``: attempts per request."""
ROUTER_HEALTH_INTERVAL_S = 1
"""sgl-router's ``--health-check-interval-secs``: how often each engine's /health is probed."""
ROUTER_HEALTH_FAILURES = 1
"""sgl-router's ``--health-failure-threshold``: failed probes before an engine is out."""
ROUTER_RETRY_BACKOFF_MS = 500
"""sgl-router's ``--retry-initial-backoff-ms`` (doubling, capped at 4 s): the retries of a
request on a dead engine span ~7.5 s, longer than the health check takes to mark it
unhealthy, so the request fails over within its own retries.

sgl-router's circuit breaker is off (``--disable-circuit-breaker``): it counted client errors
(a 400 for a bad request) as engine failures, so three bad requests took an engine out of the
router for a minute (issue 35). Failover is the health check's job: a dead engine stops
answering ``/health``; a client's bad request does not change that."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalStackConfig:
    model_path: str
    engines: int = 2
    loras: tuple[tuple[str, str], ...] = ()
    lora_adapter: str | None = None
    teacher_model_path: str | None = None
    tokenizer_path: str | None = None  # default: model_path
    engine_kind: EngineKind = EngineKind.LOCAL
    engine_ports: tuple[int, ...] = ()  # empty: pick free ports
    router_port: int = 0  # 0: pick a free port
    session_router_port: int = 0
    router_metrics_port: int = 0  # 0: pick a free port
    api_key: str | None = None  # None: no component requires a key
    # Where the engines and the session router read the key (--api-key-file); None with a key:
    # $POSTTRAIN_API_KEY in their environment. Never argv (ps would show it).
    api_key_file: str | None = None
    ready_timeout_s: float = 300.0
    turn_timeout_s: float | None = None  # the session router's --upstream-timeout-s; None: its own
    engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    session_router_args: tuple[str, ...] = ()


def default_engine_kind(detection: Detection | None = None) -> EngineKind:
    """SGLang when it is importable and a GPU answers; the embedded local engine otherwise."""
    if importlib.util.find_spec("sglang") is None:
        return EngineKind.LOCAL
    seen = detection if detection is not None else detect_hardware()
    return EngineKind.SGLANG if seen.gpu_count > 0 else EngineKind.LOCAL


def policy_engine_names(plan: Plan) -> list[str]:
    """The engines behind the router (every engine process but the teacher), in start order."""
    return [p.name for p in plan.processes if p.role is Role.ENGINE and p.name != TEACHER]


def _key_env(cfg: LocalStackConfig) -> dict[str, str]:
    """The key through the environment when there is no key file (never through argv)."""
    if not cfg.api_key or cfg.api_key_file:
        return {}
    from posttrain.formats import API_KEY_ENV  # the "local" extra: what a local stack runs

    return {API_KEY_ENV: cfg.api_key}


def build_local_stack(cfg: LocalStackConfig) -> Plan:
    """Engines and sgl-router (stage 0), session router (stage 1), then engine registration.

    The router starts empty so the session router's passthrough probe (an echo worker it
    registers for the probe) is the only worker it can be routed to; engines join after.
    """
    _check_stack_config(cfg)
    # Every port the stack may need (engines, router, session router, metrics, teacher), chosen
    # together so that no two are the same; the ones given on the command line go unused.
    spare = iter(free_ports(cfg.engines + 4))
    ports = cfg.engine_ports or tuple(next(spare) for _ in range(cfg.engines))
    router_port = cfg.router_port or next(spare)
    session_port = cfg.session_router_port or next(spare)
    served = cfg.lora_adapter or (cfg.loras[0][0] if cfg.loras else None)
    metrics_port = cfg.router_metrics_port or next(spare)
    processes: list[ProcessSpec] = []
    engines = [(f"engine-{i}", port, cfg.model_path) for i, port in enumerate(ports)]
    if cfg.teacher_model_path is not None:
        engines.append((TEACHER, next(spare), cfg.teacher_model_path))
    for i, (name, port, model_path) in enumerate(engines):
        processes.append(_engine_process(cfg, i, name, port, model_path))
    processes.append(_router_process(cfg, router_port, metrics_port))
    processes.append(_session_router_process(cfg, router_port, session_port, served))
    return Plan(
        name=f"local-stack-{cfg.engines}x{cfg.engine_kind.value}",
        hardware="local",
        nodes=1,
        processes=tuple(processes),
        registrations=tuple(
            Registration(
                router=f"http://{LOCAL_HOST}:{router_port}",
                worker=f"http://{LOCAL_HOST}:{p}",
                after_stage=1,
                timeout_s=cfg.ready_timeout_s,
            )
            for p in ports
        ),
        notes=(f"model {cfg.model_path}", f"engines: {cfg.engines} x {cfg.engine_kind.value}"),
    )


def _check_stack_config(cfg: LocalStackConfig) -> None:
    """Refuse a stack configuration that cannot run, naming the field."""
    if cfg.engines < 1:
        raise LaunchConfigError(f"engines={cfg.engines} must be >= 1")
    if not 0 < cfg.ready_timeout_s < math.inf:
        raise LaunchConfigError(
            f"--ready-timeout-s {cfg.ready_timeout_s} must be a finite number of seconds > 0"
        )
    if cfg.turn_timeout_s is not None and not 0 < cfg.turn_timeout_s < math.inf:
        raise LaunchConfigError(f"turn_timeout_s={cfg.turn_timeout_s} must be finite and > 0")
    if cfg.engine_ports and len(cfg.engine_ports) != cfg.engines:
        raise LaunchConfigError(
            f"engine_ports has {len(cfg.engine_ports)} ports for engines={cfg.engines}"
        )
    names = [name for name, _ in cfg.loras]
    if len(set(names)) != len(names):
        raise LaunchConfigError(f"lora names {names} repeat")
    if cfg.lora_adapter is not None and cfg.loras and cfg.loras[0][0] != cfg.lora_adapter:
        raise LaunchConfigError(
            f"lora_adapter {cfg.lora_adapter!r} differs from the --lora adapter {cfg.loras[0][0]!r}"
        )
    if len(cfg.loras) > 1:
        raise LaunchConfigError(
            f"lora: {len(cfg.loras)} adapters ({', '.join(names)}) given, but the session "
            "router injects exactly one adapter per rollout; pass one --lora"
        )


def _engine_process(
    cfg: LocalStackConfig, i: int, name: str, port: int, model_path: str
) -> ProcessSpec:
    """Engine ``i`` (or the teacher) on ``port``, serving ``model_path``."""
    args = Args()
    src = f"local stack ({cfg.engine_kind.value})"
    args.set("--model-path", model_path, source=src)
    args.set("--host", LOCAL_HOST, source=src)
    args.set("--port", port, source=src)
    keyed = bool(cfg.api_key or cfg.api_key_file) and cfg.engine_kind is EngineKind.LOCAL
    if keyed and cfg.api_key_file:
        args.set("--api-key-file", cfg.api_key_file, source="local stack (per-stack key)")
    if name != TEACHER and (cfg.loras or cfg.lora_adapter):
        # Both engines take SGLang's spelling; --lora-paths is one nargs="+" flag
        # (repeating it would keep only the last occurrence).
        args.set("--enable-lora", source=src + " (--lora)")
        if cfg.loras:
            pairs = [f"{n}={path}" for n, path in cfg.loras]
            args.set("--lora-paths", *pairs, source=src + " (--lora)")
    args.extend_user(cfg.engine_args)
    return ProcessSpec(
        name=name,
        role=Role.ENGINE,
        argv=(PYTHON, "-m", ENGINE_MODULES[cfg.engine_kind], *args.argv()),
        # One GPU per SGLang engine (engine i on GPU i); the CPU engine needs none.
        env={"CUDA_VISIBLE_DEVICES": str(i)}
        if cfg.engine_kind is EngineKind.SGLANG
        else _key_env(cfg)
        if keyed
        else {},
        stage=0,
        readiness=Readiness(
            url=f"http://{LOCAL_HOST}:{port}/health", timeout_s=cfg.ready_timeout_s
        ),
        explain=tuple(args.explain()),
    )


def _router_process(cfg: LocalStackConfig, router_port: int, metrics_port: int) -> ProcessSpec:
    """sgl-router on ``router_port``: sessions stick to an engine, a dead engine fails over."""
    router = Args()
    router.set("--host", LOCAL_HOST, source="local stack")
    router.set("--port", router_port, source="local stack")
    router.set("--policy", "manual", source="local stack (sessions on)")
    router.set("--assignment-mode", "min_load", source="local stack (sessions on)")
    router.set("--prometheus-host", LOCAL_HOST, source="local stack")
    router.set("--prometheus-port", metrics_port, source="local stack (a free port, not 29000)")
    router.set("--log-level", "warn", source="local stack")
    router.set(
        "--health-check-interval-secs", ROUTER_HEALTH_INTERVAL_S,
        source="local stack (a dead engine is out within a second)",
    )  # fmt: skip
    router.set("--health-failure-threshold", ROUTER_HEALTH_FAILURES, source="local stack")
    router.set(
        "--retry-max-retries", ROUTER_RETRIES,
        source="local stack (a dead engine's requests fail over to the others)",
    )  # fmt: skip
    router.set(
        "--retry-initial-backoff-ms", ROUTER_RETRY_BACKOFF_MS,
        source="local stack (retries outlast the health check: a sticky request fails over)",
    )  # fmt: skip
    router.set("--retry-backoff-multiplier", 2, source="local stack")
    router.set("--retry-max-backoff-ms", 4000, source="local stack")
    router.set(
        "--disable-circuit-breaker",
        source="local stack (client 4xx must not take an engine out; the health check fails over)",
    )  # fmt: skip
    router.extend_user(cfg.router_args)
    return ProcessSpec(
        name="router",
        role=Role.ROUTER,
        argv=(PYTHON, "-m", ROUTER_MODULE, *router.argv()),
        stage=0,
        readiness=Readiness(
            url=f"http://{LOCAL_HOST}:{router_port}/health", timeout_s=cfg.ready_timeout_s
        ),
        explain=tuple(router.explain()),
    )


def _session_router_process(
    cfg: LocalStackConfig, router_port: int, session_port: int, served: str | None
) -> ProcessSpec:
    """The session router on ``session_port`` in front of sgl-router, injecting ``served``."""
    session = Args()
    session.set("--upstream", f"http://{LOCAL_HOST}:{router_port}", source="local stack")
    session.set("--tokenizer", cfg.tokenizer_path or cfg.model_path, source="local stack")
    session.set("--host", LOCAL_HOST, source="local stack")
    session.set("--port", session_port, source="local stack")
    if cfg.api_key_file:
        session.set("--api-key-file", cfg.api_key_file, source="local stack (per-stack key)")
    if served is not None:
        session.set("--lora-adapter", served, source="local stack (--lora)")
    if cfg.turn_timeout_s is not None:
        session.set(
            "--upstream-timeout-s", cfg.turn_timeout_s,
            source="local stack (--turn-timeout: a frozen engine's turn ends here)",
        )  # fmt: skip
    if cfg.engine_kind is EngineKind.LOCAL:
        session.set(
            "--parallel-sampling",
            source="local stack (local engines seed sample j of an n-request sampling_seed + j: "
            "a group is one /generate)",
        )  # fmt: skip
    if cfg.loras:
        # The engines load the adapter at startup: version 0 of it (its extra_key "<name>:v0").
        session.set("--lora-weight-version", 0, source="local stack (--lora)")
    session.extend_user(cfg.session_router_args)
    return ProcessSpec(
        name="session-router",
        role=Role.SESSION_ROUTER,
        argv=(PYTHON, "-m", SESSION_ROUTER_MODULE, *session.argv()),
        env=_key_env(cfg),
        stage=1,
        readiness=Readiness(
            url=f"http://{LOCAL_HOST}:{session_port}/health", timeout_s=cfg.ready_timeout_s
        ),
        explain=tuple(session.explain()),
    )
