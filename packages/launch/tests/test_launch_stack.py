"""The local stack plan: engine choice, ordering, validation."""

import importlib.util

import pytest

from posttrain.launch import (
    Detection,
    EngineKind,
    Hardware,
    LaunchConfigError,
    LocalStackConfig,
    Role,
    build_local_stack,
)
from posttrain.launch.stack import default_engine_kind

GPU = Detection(tool="nvidia-smi", gpu_names=("NVIDIA H200",), hardware=Hardware.H200)
CPU = Detection(tool=None, gpu_names=(), hardware=Hardware.CPU)


@pytest.mark.parametrize(
    ("sglang", "seen", "expected"),
    [(True, GPU, EngineKind.SGLANG), (True, CPU, EngineKind.LOCAL), (False, GPU, EngineKind.LOCAL)],
)
def test_default_engine_kind(
    monkeypatch: pytest.MonkeyPatch, sglang: bool, seen: Detection, expected: EngineKind
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        if name == "sglang":
            return object() if sglang else None
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert default_engine_kind(seen) is expected


def test_stack_order_router_empty_until_session_router_probed() -> None:
    plan = build_local_stack(LocalStackConfig(model_path="/m", engines=3))
    router = plan.process("router")
    session = plan.process("session-router")
    assert router.stage == 0
    assert "--worker-urls" not in router.argv
    assert session.stage == 1
    assert [r.after_stage for r in plan.registrations] == [1, 1, 1]
    engine_ports = {p.argv[p.argv.index("--port") + 1] for p in plan.by_role(Role.ENGINE)}
    assert {r.worker.rsplit(":", 1)[1] for r in plan.registrations} == engine_ports
    assert router.argv[router.argv.index("--host") + 1] == "127.0.0.1"


def test_sglang_stack_uses_sglang_spelling() -> None:
    plan = build_local_stack(
        LocalStackConfig(
            model_path="/m", engines=1, engine_kind=EngineKind.SGLANG, loras=(("a", "/x"),)
        )
    )
    engine = plan.by_role(Role.ENGINE)[0]
    argv = engine.argv
    assert engine.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert argv[:3] == ("python", "-m", "sglang.launch_server")
    assert argv[argv.index("--lora-paths") + 1] == "a=/x"
    assert "--enable-lora" in argv


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (LocalStackConfig(model_path="/m", engines=0), "engines=0"),
        (LocalStackConfig(model_path="/m", engines=2, engine_ports=(1,)), "1 ports for engines=2"),
        (LocalStackConfig(model_path="/m", loras=(("a", "/x"), ("a", "/y"))), "repeat"),
    ],
)
def test_stack_validation(cfg: LocalStackConfig, message: str) -> None:
    with pytest.raises(LaunchConfigError, match=message):
        build_local_stack(cfg)
