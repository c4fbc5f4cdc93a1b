"""``posttrain grpo``'s pieces that need no processes: options, the stack it asks for, the argv."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from posttrain.launch import LaunchConfigError
from posttrain.launch.cli import app
from posttrain.launch.grpo import (
    ADAPTER,
    GrpoRecipeConfig,
    data_flags,
    local_topology,
    trainer_argv,
    usable_cores,
)
from posttrain.launch.plan import Plan
from posttrain.launch.stack import LocalStackConfig, build_local_stack, policy_engine_names

RECIPE = {
    "policy": "/c/policy",
    "teacher": "/c/teacher",
    "policy_nvfp4": "/c/policy-nvfp4",
    "recipe": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 4,
               "temperature": 1.0, "lr": 5e-3, "full_lr": 1e-3, "lora_r": 8, "lora_alpha": 16.0,
               "lora_targets": ["q_proj", "v_proj"], "max_grad_norm": 1.0, "steps": 30,
               "opd_top_k": 0, "opd_kl_coef": 0.5, "tis": "tis"},
}  # fmt: skip
URLS = {"engine-0": "http://e0", "engine-1": "http://e1", "session-router": "http://sr",
        "teacher": "http://t"}  # fmt: skip


def _flag(argv: list[str], name: str) -> str:
    """The value of the last occurrence of ``name`` (the trainer's rule: the last one wins)."""
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


def test_default_argv_is_the_lora_recipe() -> None:
    argv = trainer_argv(GrpoRecipeConfig(), RECIPE, URLS, ["engine-0", "engine-1"])
    assert argv[:3] == [sys.executable, "-m", "posttrain.grpo"]  # this interpreter, not PATH's
    assert argv.count("--lr") == 1
    assert _flag(argv, "--lr") == "0.005"  # the LoRA lr
    assert _flag(argv, "--model-path") == "/c/policy"
    assert _flag(argv, "--rollout-url") == "http://sr"
    assert _flag(argv, "--engine-urls") == "http://e0,http://e1"
    assert _flag(argv, "--train") == "lora"
    assert _flag(argv, "--lora-name") == ADAPTER
    assert _flag(argv, "--lora-targets") == "q_proj,v_proj"
    assert _flag(argv, "--steps") == "30"
    assert (_flag(argv, "--replicate"), _flag(argv, "--shard")) == ("1", "2")
    assert "--opd" not in argv
    assert "--rollout-quant" not in argv
    assert "--engine-model-path" not in argv  # the engines serve --model-path itself
    assert "--api-key-file" not in argv


def test_the_key_reaches_the_trainer_as_a_file_and_every_keyed_component() -> None:
    argv = trainer_argv(GrpoRecipeConfig(), RECIPE, URLS, ["engine-0"], Path("/k/grpo.key"))
    assert _flag(argv, "--api-key-file") == "/k/grpo.key"
    assert not any("secret" in tok for tok in argv)
    plan = build_local_stack(
        LocalStackConfig(
            model_path="/m",
            lora_adapter=ADAPTER,
            teacher_model_path="/t",
            api_key="secret",
            api_key_file="/k/grpo.key",
        )
    )
    procs = {p.name: p.argv for p in plan.processes}
    for name in ("engine-0", "engine-1", "teacher", "session-router"):
        assert procs[name][procs[name].index("--api-key-file") + 1] == "/k/grpo.key", name
        assert not any("secret" in tok for tok in procs[name]), name
    assert "--api-key-file" not in procs["router"]  # sgl-router takes none (keys.py says why)


def test_modes_and_user_flags_last() -> None:
    cfg = GrpoRecipeConfig(train="full", opd=True, rollout_quant="nvfp4", steps=3, seed=2,
                           resume=Path("/r"), trainer_args=("--lr", "7e-4"))  # fmt: skip
    argv = trainer_argv(cfg, RECIPE, URLS, ["engine-0", "engine-1"])
    assert _flag(argv, "--steps") == "3"
    assert _flag(argv, "--seed") == "2"
    assert _flag(argv, "--teacher-url") == "http://t"
    assert _flag(argv, "--rollout-quant") == "nvfp4"
    assert _flag(argv, "--tis") == "tis"
    assert _flag(argv, "--model-path") == "/c/policy"  # the trainer's bf16 policy
    assert _flag(argv, "--engine-model-path") == "/c/policy-nvfp4"  # what the engines reload
    assert _flag(argv, "--resume") == "/r"
    assert argv[-2:] == ["--lr", "7e-4"]  # the user's flag, last: it wins
    recipes = argv[:-2]
    assert recipes.count("--lr") == 1  # the recipe's lr once, full mode's own
    assert _flag(recipes, "--lr") == "0.001"
    given = trainer_argv(GrpoRecipeConfig(opd=True, teacher_url="http://mine"), RECIPE, URLS, [])
    assert _flag(given, "--teacher-url") == "http://mine"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train": "qlora"}, "--train must be lora or full"),
        ({"rollout_quant": "fp8"}, "--rollout-quant must be none or nvfp4"),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"teacher_url": "ftp://x"}, "--teacher must be an http"),
    ],
)
def test_bad_options_are_named(changes: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchConfigError, match=message):
        GrpoRecipeConfig(**changes)  # type: ignore[arg-type]


def test_stack_serves_a_pushed_adapter_and_a_teacher_outside_the_router() -> None:
    plan = build_local_stack(
        LocalStackConfig(
            model_path="/c/nv",
            tokenizer_path="/c/policy",
            engines=2,
            lora_adapter=ADAPTER,
            teacher_model_path="/c/teacher",
        )
    )
    procs = {p.name: p for p in plan.processes}
    assert set(procs) == {"engine-0", "engine-1", "teacher", "router", "session-router"}
    assert policy_engine_names(plan) == ["engine-0", "engine-1"]  # the trainer's engines
    for name in ("engine-0", "engine-1"):
        argv = procs[name].argv
        assert "--enable-lora" in argv
        assert "--lora-paths" not in argv  # the trainer pushes the adapter
        assert argv[argv.index("--model-path") + 1] == "/c/nv"
    assert "--enable-lora" not in procs["teacher"].argv
    session = procs["session-router"].argv
    assert session[session.index("--lora-adapter") + 1] == ADAPTER
    assert session[session.index("--tokenizer") + 1] == "/c/policy"
    workers = {r.worker for r in plan.registrations}
    assert len(workers) == 2  # the teacher is not behind the router
    teacher_port = procs["teacher"].argv[procs["teacher"].argv.index("--port") + 1]
    assert not any(teacher_port in w for w in workers)
    router = procs["router"].argv
    assert "--prometheus-port" in router
    with pytest.raises(LaunchConfigError, match="differs from the --lora adapter"):
        build_local_stack(LocalStackConfig(model_path="/m", lora_adapter="a", loras=(("b", "/p"),)))


@pytest.mark.parametrize(
    ("cores", "engines", "trainer", "expected"),
    [
        (1, None, (), (1, 1)),
        (2, None, (), (1, 1)),  # 2 cores: one engine, one rank (docs/benchmarks/grpo.md)
        (3, None, (), (1, 1)),
        (4, None, (), (2, 2)),
        (64, None, (), (2, 2)),
        (2, 3, (), (3, 1)),  # --engines wins
        (2, None, ("--replicate", "2", "--shard", "1"), (1, 2)),  # the trainer's mesh flags win
        (2, None, ("--shard=1", "--shard", "3"), (1, 3)),  # the last one, as the trainer reads
    ],
)
def test_topology_follows_the_cores_unless_flags_say(
    cores: int, engines: int | None, trainer: tuple[str, ...], expected: tuple[int, int]
) -> None:
    topology = local_topology(cores, engines, trainer)
    assert (topology.engines, topology.trainer_ranks) == expected
    described = topology.describe()
    assert described.startswith(f"{expected[0]} engine")
    assert f"{expected[1]} trainer rank" in described


def test_usable_cores_are_the_affinity_capped_by_a_cgroup_quota(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0))  # no quota file
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0))
    cpu_max.write_text("50000 100000\n")  # half a core: still one
    assert usable_cores(cpu_max) == 1
    cpu_max.write_text(f"{150000 * 64} 100000\n")  # a quota above the affinity changes nothing
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0))
    cpu_max.write_text("garbage\n")
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0))


def test_the_topology_reaches_the_stack_the_trainer_and_the_printed_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a 2-core machine the run starts one engine and trains on one rank and says so;
    ``--engines 2`` starts two."""
    planned: list[tuple[int, list[str]]] = []
    monkeypatch.setattr("posttrain.launch.grpo.prepare_recipe", lambda *a, **k: RECIPE)
    monkeypatch.setattr("posttrain.launch.grpo._trainer_preflight", lambda *a: "")
    monkeypatch.setattr("posttrain.launch.grpo.usable_cores", lambda: 2)

    def run(
        cfg: GrpoRecipeConfig, recipe: dict[str, Any], plan: Plan, *rest: Any, **kw: Any
    ) -> int:
        names = policy_engine_names(plan)
        planned.append((len(names), trainer_argv(cfg, recipe, URLS, [], trainer_ranks=rest[-1])))
        return 0

    monkeypatch.setattr("posttrain.launch.grpo._run_stack_and_trainer", run)
    for flags, engines in (((), 1), (("--engines", "2"), 2)):
        result = CliRunner().invoke(app, ["grpo", "--out", str(tmp_path / "out"), *flags])
        assert result.exit_code == 0, result.output
        assert planned[-1][0] == engines
        assert _flag(planned[-1][1], "--shard") == "1"
        said = " ".join(result.output.split())
        assert f"starting {engines} engine" in said, said
        assert "1 trainer rank, for 2 cores" in said, said


def test_grpo_help_lists_the_recipe_options() -> None:
    result = CliRunner().invoke(app, ["grpo", "--help"])
    assert result.exit_code == 0
    for flag in ("--train", "--opd", "--teacher", "--rollout-quant", "--steps", "--seed",
                 "--resume", "--out", "--turn-timeout"):  # fmt: skip
        assert flag in result.output


def test_turn_timeout_reaches_the_trainer_and_the_session_router() -> None:
    cfg = GrpoRecipeConfig(turn_timeout_s=7.5)
    argv = trainer_argv(cfg, RECIPE, URLS, ["engine-0", "engine-1"])
    assert _flag(argv, "--turn-timeout-s") == "7.5"
    assert "--turn-timeout-s" not in trainer_argv(GrpoRecipeConfig(), RECIPE, URLS, [])
    plan = build_local_stack(LocalStackConfig(model_path="/m", turn_timeout_s=7.5))
    procs = {p.name: p.argv for p in plan.processes}
    assert _flag(list(procs["session-router"]), "--upstream-timeout-s") == "7.5"
    # sgl-router retries a dead engine's requests on the others (the engine-fault tests).
    assert _flag(list(procs["router"]), "--retry-max-retries") == "5"
    assert "--disable-circuit-breaker" in procs["router"]  # client 4xx never take an engine out
    assert "--cb-failure-threshold" not in procs["router"]
    plain = build_local_stack(LocalStackConfig(model_path="/m"))
    session = next(p.argv for p in plain.processes if p.name == "session-router")
    assert "--upstream-timeout-s" not in session  # the session router's own default
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(LaunchConfigError, match="--turn-timeout must be a finite"):
            GrpoRecipeConfig(turn_timeout_s=bad)
        with pytest.raises(LaunchConfigError, match="turn_timeout_s="):
            build_local_stack(LocalStackConfig(model_path="/m", turn_timeout_s=bad))


def test_data_and_reward_flags_reach_the_trainer() -> None:
    flags = data_flags(
        prompt_data=Path("d.jsonl"), input_key="question", label_key="answer",
        apply_chat_template=False, reward=["math:0.9", "length:0.1"], eval_data=["e.jsonl"],
        eval_every=2, metadata_key=None,
    )  # fmt: skip
    argv = trainer_argv(GrpoRecipeConfig(data_args=flags), RECIPE, URLS, ["engine-0"])
    tail = argv[argv.index("--prompt-data") :]
    assert tail == [
        "--prompt-data", "d.jsonl", "--input-key", "question", "--label-key", "answer",
        "--no-apply-chat-template", "--reward", "math:0.9", "--reward", "length:0.1",
        "--eval-data", "e.jsonl", "--eval-every", "2",
    ]  # fmt: skip


def test_bad_data_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One trainer --dry-run checks the inputs, after the recipe's prepare step; its error line
    is the command's, and nothing starts after it."""
    missing = tmp_path / "missing.jsonl"
    out = tmp_path / "out"
    started: list[object] = []
    monkeypatch.setattr("posttrain.launch.grpo.prepare_recipe", lambda *a, **k: RECIPE)
    monkeypatch.setattr(
        "posttrain.launch.grpo._run_stack_and_trainer", lambda *a, **k: started.append(a) or 0
    )
    result = CliRunner().invoke(
        app, ["grpo", "--prompt-data", str(missing), "--reward", "math", "--out", str(out)]
    )
    assert result.exit_code == 2
    # the recipe's stand-in policy (/c/policy) is refused too, on its own line before
    assert "error: --model-path: model path '/c/policy'" in result.output
    assert result.output.rstrip().endswith(f"--prompt-data {missing}: no such file or directory")
    assert "exited with code" not in result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not started


def test_dry_run_prints_the_checked_config_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--dry-run`` is the launcher's own flag (not passed through to a trainer that would run
    after the stack started): the recipe step and the trainer's checks, then exit 0."""
    started: list[object] = []
    checked: list[list[str]] = []
    monkeypatch.setattr("posttrain.launch.grpo.prepare_recipe", lambda *a, **k: RECIPE)

    def preflight(cfg: GrpoRecipeConfig, *a: object) -> str:
        checked.append(list(cfg.trainer_args))
        return "the trainer's config\n"

    monkeypatch.setattr("posttrain.launch.grpo._trainer_preflight", preflight)
    monkeypatch.setattr(
        "posttrain.launch.grpo._run_stack_and_trainer", lambda *a, **k: started.append(a) or 0
    )
    result = CliRunner().invoke(app, ["grpo", "--dry-run", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert checked == [[]]  # consumed by posttrain grpo, not forwarded to the trainer
    assert "the trainer's config\nposttrain grpo --dry-run: every check passed" in result.stdout
    assert not started
    assert "--dry-run" in CliRunner().invoke(app, ["grpo", "--help"]).output


def test_lora_targets_for_mla_name_mla_projections(tmp_path: Path) -> None:
    """DeepSeek-V3 / GLM-4.x-Lite have no k_proj/v_proj: the recipe's attention targets become
    MLA's own projections (q_a/q_b with a q latent, else q_proj; kv_a/kv_b; o_proj)."""
    from posttrain.launch.grpo import lora_targets_for

    recipe = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    glm = {"kv_lora_rank": 16, "q_lora_rank": 16, "n_routed_experts": 4,
           "mlp_layer_types": ["dense", "sparse"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(glm))
    assert lora_targets_for(tmp_path, recipe) == [
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
        "gate_proj", "up_proj", "down_proj",
    ]  # fmt: skip
    ds = {"kv_lora_rank": 16, "q_lora_rank": None, "n_routed_experts": 4,
          "first_k_dense_replace": 0}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(ds))
    assert lora_targets_for(tmp_path, recipe) == [
        "q_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    ]


def test_an_unknown_task_is_the_recipe_steps_own_line(tmp_path: Path) -> None:
    from posttrain.launch._errors import RecipeError
    from posttrain.launch.grpo import prepare_recipe

    (tmp_path / "config.json").write_text("{}")  # --model-path: the settings-only step
    cfg = GrpoRecipeConfig(task="boxes", model_path=tmp_path)
    logged: list[str] = []
    with pytest.raises(RecipeError) as raised:
        prepare_recipe(cfg, lambda name, line: logged.append(line))
    assert str(raised.value) == (
        "the recipe's prepare step refused: task='boxes' has no embedded recipe "
        "(one of addition, shapes)"
    )
    assert logged[-1] == "error: task='boxes' has no embedded recipe (one of addition, shapes)"


def test_nvfp4_with_a_model_path_names_the_commands_that_do_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(LaunchConfigError) as raised:
        GrpoRecipeConfig(model_path=tmp_path, rollout_quant="nvfp4")
    message = str(raised.value)
    assert f"`quant-convert nvfp4 --model-dir {tmp_path} --save-dir OUT`" in message
    assert f"--model-path {tmp_path} --engine-model-path OUT`" in message
