"""The local stack plan: engine choice, ordering, validation."""

import importlib.util
from pathlib import Path

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
from posttrain.launch.keys import key_dir, new_api_key, remove_key_file, write_key_file
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
    # local engines seed sample j of an n request sampling_seed + j: a group is one /generate
    assert "--parallel-sampling" in session.argv


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
    # SGLang gives every parallel sample the request's one seed: one /generate per sample
    assert "--parallel-sampling" not in plan.process("session-router").argv


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


def _value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_port_is_free_or_given_and_the_metrics_port_binds_loopback() -> None:
    free = build_local_stack(LocalStackConfig(model_path="/m", engines=1))
    router = free.process("router").argv
    assert _value(router, "--prometheus-host") == "127.0.0.1"
    assert _value(router, "--prometheus-port") not in ("29000", "0")
    given = build_local_stack(
        LocalStackConfig(model_path="/m", engines=1, router_port=31100, router_metrics_port=31300)
    )
    assert _value(given.process("router").argv, "--prometheus-port") == "31300"
    assert _value(given.process("router").argv, "--port") == "31100"


def test_the_key_goes_to_local_engines_and_the_session_router_only() -> None:
    """Issue 35, finding 7: by file (or environment), never in argv."""
    plan = build_local_stack(
        LocalStackConfig(model_path="/m", engines=2, api_key="k3y", api_key_file="/k/s.key")
    )
    for engine in plan.by_role(Role.ENGINE):
        assert _value(engine.argv, "--api-key-file") == "/k/s.key"
    assert _value(plan.process("session-router").argv, "--api-key-file") == "/k/s.key"
    assert all("k3y" not in tok for p in plan.processes for tok in p.argv)
    assert all("--api-key" not in p.argv for p in plan.processes)
    assert "--api-key-file" not in plan.process("router").argv  # keys.py: the router takes none
    by_env = build_local_stack(LocalStackConfig(model_path="/m", engines=1, api_key="k3y"))
    assert all("k3y" not in tok for p in by_env.processes for tok in p.argv)
    assert by_env.process("session-router").env["POSTTRAIN_API_KEY"] == "k3y"
    assert by_env.by_role(Role.ENGINE)[0].env["POSTTRAIN_API_KEY"] == "k3y"
    sglang = build_local_stack(
        LocalStackConfig(model_path="/m", engines=1, engine_kind=EngineKind.SGLANG, api_key="k")
    )
    assert "--api-key" not in sglang.by_role(Role.ENGINE)[0].argv
    unkeyed = build_local_stack(LocalStackConfig(model_path="/m", engines=1))
    assert all("--api-key" not in p.argv for p in unkeyed.processes)


def test_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    key = new_api_key()
    assert len(key) == 64
    assert not key.startswith("-")
    path = write_key_file(key, "stack-1", tmp_path)
    assert path.read_text().strip() == key
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(LaunchConfigError, match="already exists"):
        write_key_file(new_api_key(), "stack-1", tmp_path)
    remove_key_file(path)
    remove_key_file(path)  # twice is fine
    assert not path.exists()


def test_key_dir_is_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = key_dir()
    assert folder == tmp_path / "posttrain"
    assert folder.stat().st_mode & 0o077 == 0
    folder.chmod(0o755)
    with pytest.raises(LaunchConfigError, match="open to other users"):
        key_dir()
