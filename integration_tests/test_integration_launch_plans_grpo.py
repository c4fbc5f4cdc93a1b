"""Every plan launch prints starts a trainer that ``python -m posttrain.grpo`` accepts.

Walks launch's whole catalog: every model, every hardware it is offered on, every node count
and every precision a user may ask for (``posttrain plan --precision``); a combination launch
refuses prints no plan and is skipped. The trainer argv of each plan (after ``-m
posttrain.grpo``, placeholders resolved as a runner would, ``WORLD_SIZE`` as torchrun would
set it) goes through the real trainer command with ``--dry-run``, in process; a few go
through a real ``python -m posttrain.grpo`` subprocess. The golden plan files, which include
user ``--trainer-arg`` tokens, are checked the same way.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.grpo.cli import main as grpo_main
from posttrain.launch import Hardware, LaunchConfig, LaunchConfigError, Plan, Precision, Role
from posttrain.launch.catalog import MODELS, get_model
from posttrain.launch.plan import ProcessSpec, resolve
from posttrain.launch.planner import build_plan
from posttrain.launch.tables import SUPPORTED_NODES

GOLDEN = Path(__file__).parents[1] / "packages" / "launch" / "tests" / "golden"
TRAINER_MODULE = "posttrain.grpo"


def catalog_plans() -> Iterator[tuple[str, Plan]]:
    for model_id in sorted(MODELS):
        for hw in Hardware:
            for nodes in sorted(SUPPORTED_NODES[model_id][hw]):
                for precision in (None, *Precision):
                    cfg = LaunchConfig(
                        model=get_model(model_id), hardware=hw, nodes=nodes, precision=precision
                    )
                    try:
                        plan = build_plan(cfg)
                    except LaunchConfigError:
                        continue  # launch refuses it: no plan is printed
                    name = f"{model_id}/{hw.value}/{nodes}n/{precision or 'default'}"
                    yield name, plan


def trainer_call(spec: ProcessSpec, plan: Plan) -> tuple[list[str], str]:
    """The grpo argv of a trainer process (placeholders resolved) and its WORLD_SIZE."""
    node_ips = {k: f"10.0.0.{k + 1}" for k in range(plan.nodes)}
    argv = [resolve(tok, spec.node, node_ips) for tok in spec.argv]
    at = next(i for i in range(len(argv) - 1) if argv[i : i + 2] == ["-m", TRAINER_MODULE])
    torchrun = argv[:at]
    nnodes = int(torchrun[torchrun.index("--nnodes") + 1])
    per_node = int(torchrun[torchrun.index("--nproc-per-node") + 1])
    return argv[at + 2 :], str(nnodes * per_node)


def dry_run(
    spec: ProcessSpec,
    plan: Plan,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    model_dir: Path | None = None,
) -> None:
    """The trainer's ``--dry-run`` on the plan's argv: flags only, or (``model_dir``) with
    ``--model-path`` pointed at that directory and the model gate applied."""
    argv, world = trainer_call(spec, plan)
    monkeypatch.setenv("WORLD_SIZE", world)
    if model_dir is None:
        check = ["--no-model-check"]  # flags only: no checkpoint here
    else:
        argv[argv.index("--model-path") + 1] = str(model_dir)
        check = []
    code = grpo_main([*argv, "--dry-run", *check])
    _, err = capsys.readouterr()
    assert code == 0, f"{plan.name} {spec.name}: {argv} -> {err.strip()}"


# Catalog models whose real shape a transformers config class gives: the catalog's numbers
# (heads, layers, experts, leading dense layers) over the class's defaults, which are
# GLM-4.7-Flash's (hidden 2048, q/kv latents 768/512, nope/rope/v 192/64/256, ...).
REAL_SHAPE_CONFIGS = {"glm-4.7-flash": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM")}


def write_real_shape_config(model_id: str, directory: Path) -> Path:
    """``directory/config.json`` for catalog model ``model_id`` (see ``REAL_SHAPE_CONFIGS``)."""
    import transformers

    spec = get_model(model_id)
    cls_name, arch = REAL_SHAPE_CONFIGS[model_id]
    moe = spec.num_layers - spec.first_k_dense
    config = getattr(transformers, cls_name)(
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        num_hidden_layers=spec.num_layers,
        n_routed_experts=spec.num_experts,
        first_k_dense_replace=spec.first_k_dense,
        mlp_layer_types=["dense"] * spec.first_k_dense + ["sparse"] * moe,
    )
    config.architectures = [arch]
    config.save_pretrained(str(directory))
    return directory


PLANS = dict(catalog_plans())


def test_the_catalog_is_walked() -> None:
    # Every model on every hardware it is offered on, at least at its smallest node count.
    offered = {(m, h.value) for m in MODELS for h in Hardware if SUPPORTED_NODES[m][h]}
    walked = {tuple(name.split("/")[:2]) for name in PLANS}
    assert walked == offered
    assert any("/nvfp4" in name for name in PLANS)  # a user precision that launch prints


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_catalog_plan_passes_grpo_dry_run(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = PLANS[name]
    trainers = plan.by_role(Role.TRAINER)
    assert trainers
    for spec in trainers:
        dry_run(spec, plan, monkeypatch, capsys)


@pytest.mark.parametrize("name", sorted(n for n in PLANS if n.split("/")[0] in REAL_SHAPE_CONFIGS))
def test_plans_pass_the_model_gate_on_a_real_shape_config(
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The glm-4.7-flash plans name a model the trainer builds: with the model gate on, the
    plan's trainer argv passes ``--dry-run`` on a config of the catalog's shape (before MLA
    was wired into the decoder, the gate refused it; the flags-only walk above passed)."""
    from posttrain.models import load_config

    plan = PLANS[name]
    model_dir = write_real_shape_config(name.split("/")[0], tmp_path / "model")
    config = load_config(model_dir)
    assert config.is_mla
    assert config.num_experts == get_model(name.split("/")[0]).num_experts
    for spec in plan.by_role(Role.TRAINER):
        dry_run(spec, plan, monkeypatch, capsys, model_dir=model_dir)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_every_golden_plan_passes_grpo_dry_run(
    path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = Plan.from_json(path.read_text())
    for spec in plan.by_role(Role.TRAINER):
        if TRAINER_MODULE in spec.argv:
            dry_run(spec, plan, monkeypatch, capsys)


@pytest.mark.parametrize(
    "name", ["posttrain-tiny-moe/cpu/1n/default", "qwen3-235b-a22b/h200/4n/default"]
)
def test_the_real_module_accepts_plans(name: str) -> None:
    plan = PLANS[name]
    for spec in plan.by_role(Role.TRAINER):
        argv, world = trainer_call(spec, plan)
        proc = subprocess.run(
            [sys.executable, "-m", TRAINER_MODULE, *argv, "--dry-run", "--json", "--no-model-check"],
            capture_output=True, text=True, timeout=120, check=False,
            env={"WORLD_SIZE": world, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        backend = "fsdp" if "/cpu/" in name else "megatron"
        assert f'"backend": "{backend}"' in proc.stdout


def test_gpu_catalog_plans_train_on_megatron_without_low_precision_recipes() -> None:
    # GPU plans ask for the megatron backend with their tp/ep/layer flags (the dry runs above
    # take them); no plan carries an fp8/fp4 training recipe (Transformer Engine is not used).
    megatron = 0
    for name, plan in sorted(PLANS.items()):
        for spec in plan.by_role(Role.TRAINER):
            argv, _ = trainer_call(spec, plan)
            assert not any(f in argv for f in ("--fp8-format", "--fp4-format")), name
            megatron += "megatron" in argv
    assert megatron > 10
