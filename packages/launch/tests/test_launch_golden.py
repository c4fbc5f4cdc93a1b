"""Golden plans: one JSON file per (model, hardware) plus a few variants.

Regenerate after an intended change with
``POSTTRAIN_REGEN_GOLDEN=1 uv run pytest packages/launch -k test_plan_matches_golden`` and review the diff.
"""

import os
from pathlib import Path

import pytest

from posttrain.launch import (
    MODELS,
    EngineKind,
    Hardware,
    LaunchConfig,
    LocalStackConfig,
    Plan,
    build_local_stack,
    build_plan,
    get_model,
)
from posttrain.launch.tables import SUPPORTED_NODES

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("POSTTRAIN_REGEN_GOLDEN") == "1"


def golden_cases() -> dict[str, Plan]:
    cases: dict[str, Plan] = {}
    for model_id in MODELS:
        for hw in Hardware:
            nodes = SUPPORTED_NODES[model_id][hw]
            if nodes:
                cfg = LaunchConfig(model=get_model(model_id), hardware=hw, nodes=min(nodes))
                cases[f"{model_id}__{hw.value}"] = build_plan(cfg)
    cases["glm-4.7-flash__b200__attention-fa3"] = build_plan(
        LaunchConfig(
            model=get_model("glm-4.7-flash"), hardware=Hardware.B200, attention_backend="fa3"
        )
    )
    cases["qwen3-235b-a22b__h200__4n"] = build_plan(
        LaunchConfig(model=get_model("qwen3-235b-a22b"), hardware=Hardware.H200, nodes=4)
    )
    cases["qwen3-30b-a3b__b200__user-args"] = build_plan(
        LaunchConfig(
            model=get_model("qwen3-30b-a3b"),
            hardware=Hardware.B200,
            model_path="/ckpt/qwen3-30b-a3b",
            engine_args=("--attention-backend", "fa4", "--mem-fraction-static", "0.7"),
            trainer_args=("--lr", "1e-6"),
        )
    )
    cases["local-stack__2-engines__lora"] = build_local_stack(
        LocalStackConfig(
            model_path="/ckpt/tiny",
            engines=2,
            loras=(("policy", "/ckpt/adapter"),),
            engine_kind=EngineKind.LOCAL,
            engine_ports=(31000, 31001),
            router_port=31100,
            session_router_port=31200,
            router_metrics_port=31300,
        )
    )
    return cases


CASES = golden_cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_matches_golden(name: str) -> None:
    path = GOLDEN / f"{name}.json"
    text = CASES[name].to_json()
    if REGEN:
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}; regenerate with POSTTRAIN_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"plan {name} differs from {path.name}"
    assert Plan.from_json(text) == CASES[name]  # round trip


def test_no_stale_golden_files() -> None:
    on_disk = {p.stem for p in GOLDEN.glob("*.json")}
    assert on_disk == set(CASES)


def test_every_model_and_gpu_hardware_has_a_golden() -> None:
    for model_id in MODELS:
        for hw in Hardware:
            if SUPPORTED_NODES[model_id][hw]:
                assert f"{model_id}__{hw.value}" in CASES
