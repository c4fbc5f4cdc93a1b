"""Rules and validation: the GLM-4.7-Flash and Qwen3-MoE hardware rules, TP, precision,
unsupported (hardware, nodes) pairs, user arguments last, and the attention-backend escape hatch."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.launch import (
    MODELS,
    Hardware,
    LaunchConfig,
    LaunchConfigError,
    Plan,
    Precision,
    Role,
    UnsupportedHardwareError,
    build_plan,
    get_model,
)
from posttrain.launch.hardware import Generation
from posttrain.launch.tables import ROLLOUT_TP, SUPPORTED_NODES

RAGGED = "--flashinfer-mla-disable-ragged"


def plan_for(model: str, hw: Hardware, **kw: object) -> Plan:
    return build_plan(LaunchConfig(model=get_model(model), hardware=hw, **kw))  # type: ignore[arg-type]


def engine_argv(plan: Plan) -> list[str]:
    return list(plan.by_role(Role.ENGINE)[0].argv)


def flag_value(argv: list[str], flag: str) -> str | None:
    """argparse semantics: the last occurrence wins."""
    found = None
    for i, tok in enumerate(argv):
        if tok == flag:
            found = argv[i + 1] if i + 1 < len(argv) else ""
        elif tok.startswith(flag + "="):
            found = tok.split("=", 1)[1]
    return found


BLACKWELL = [h for h in Hardware if h.generation is Generation.BLACKWELL]


@pytest.mark.parametrize("hw", BLACKWELL)
def test_glm_flash_blackwell_tp2_and_paged_mla_prefill(hw: Hardware) -> None:
    argv = engine_argv(plan_for("glm-4.7-flash", hw))
    assert flag_value(argv, "--tp-size") == "2"
    assert RAGGED in argv
    assert "--attention-backend" not in argv  # default backend: SGLang's own choice


def test_glm_flash_h200_tp1_without_the_fix() -> None:
    argv = engine_argv(plan_for("glm-4.7-flash", Hardware.H200))
    assert flag_value(argv, "--tp-size") == "1"
    assert RAGGED not in argv


@pytest.mark.parametrize("backend", ["default", "flashinfer"])
def test_glm_flash_b200_fix_applies_to_default_and_flashinfer(backend: str) -> None:
    argv = engine_argv(plan_for("glm-4.7-flash", Hardware.B200, attention_backend=backend))
    assert RAGGED in argv
    assert flag_value(argv, "--attention-backend") == (None if backend == "default" else backend)


@pytest.mark.parametrize("backend", ["fa3", "trtllm_mla", "triton", "some_future_backend"])
@pytest.mark.parametrize("hw", [Hardware.B200, Hardware.H200, Hardware.MI300X])
@pytest.mark.parametrize("model", ["glm-4.7-flash", "qwen3-30b-a3b"])
def test_escape_hatch_passes_through_untouched(model: str, hw: Hardware, backend: str) -> None:
    plan = plan_for(model, hw, attention_backend=backend)
    for engine in plan.by_role(Role.ENGINE):
        argv = list(engine.argv)
        assert argv.count("--attention-backend") == 1
        assert flag_value(argv, "--attention-backend") == backend
        assert RAGGED not in argv
        assert any("escape hatch" in line for line in engine.explain)


def test_qwen3_moe_blackwell_trtllm_mha_and_mxfp8_deferred_to_bf16() -> None:
    plan = plan_for("qwen3-30b-a3b", Hardware.B200)
    assert flag_value(engine_argv(plan), "--attention-backend") == "trtllm_mha"
    trainer = plan.by_role(Role.TRAINER)[0]
    assert flag_value(list(trainer.argv), "--backend") == "megatron"
    assert "--fp8-recipe" not in trainer.argv
    assert "--bf16" in trainer.argv
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" not in trainer.env
    assert any("the mxfp8 recipe needs Transformer Engine" in x for x in trainer.explain)


def test_qwen3_moe_hopper_megatron_tp_sp_ep() -> None:
    plan = plan_for("qwen3-30b-a3b", Hardware.H100)
    assert flag_value(engine_argv(plan), "--attention-backend") is None
    trainer = plan.by_role(Role.TRAINER)[0]
    argv = list(trainer.argv)
    assert flag_value(argv, "--backend") == "megatron"
    tp = int(flag_value(argv, "--tensor-model-parallel-size") or 0)
    ep = int(flag_value(argv, "--expert-model-parallel-size") or 0)
    ranks = int(flag_value(argv, "--nnodes") or 0) * int(flag_value(argv, "--nproc-per-node") or 0)
    assert tp >= 1
    assert ep >= 1
    assert ranks % (tp * ep) == 0
    assert ("--sequence-parallel" in argv) == (tp > 1)
    assert flag_value(argv, "--num-experts") == "128"
    assert any("the fp8-blockwise recipe needs Transformer Engine" in x for x in trainer.explain)
    assert trainer.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


@pytest.mark.parametrize("precision", [Precision.FP8_BLOCKWISE, Precision.MXFP8])
def test_explicit_fp8_is_refused_without_transformer_engine(precision: Precision) -> None:
    with pytest.raises(
        LaunchConfigError, match=rf"precision={precision.value}.*Transformer Engine"
    ):
        plan_for("qwen3-30b-a3b", Hardware.B200, precision=precision)


def test_gpu_plans_train_on_megatron_and_cpu_plans_on_fsdp() -> None:
    """GPU plans train on megatron, MLA models (glm-4.7-flash) included, with MLA's LoRA
    targets; CPU plans train on FSDP."""
    from posttrain.launch.catalog import Attention, get_model

    for model_id, row in SUPPORTED_NODES.items():
        mla = get_model(model_id).attention is Attention.MLA
        for hw, node_counts in row.items():
            for nodes in sorted(node_counts):
                for trainer in plan_for(model_id, hw, nodes=nodes).by_role(Role.TRAINER):
                    argv = list(trainer.argv)
                    ranks = int(flag_value(argv, "--nnodes") or 0) * int(
                        flag_value(argv, "--nproc-per-node") or 0
                    )
                    assert "--fp8-recipe" not in argv
                    assert "--fp4-recipe" not in argv
                    if mla:
                        assert flag_value(argv, "--lora-targets") == (
                            "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"
                        )
                    if hw is Hardware.CPU:
                        assert flag_value(argv, "--backend") == "fsdp"
                        replicate = int(flag_value(argv, "--replicate") or 0)
                        shard = int(flag_value(argv, "--shard") or 0)
                        assert replicate * shard == ranks, (model_id, hw, nodes)
                        assert "--tensor-model-parallel-size" not in argv
                        continue
                    assert flag_value(argv, "--backend") == "megatron", (model_id, hw)
                    assert "--replicate" not in argv
                    assert "--shard" not in argv
                    tp = int(flag_value(argv, "--tensor-model-parallel-size") or 0)
                    ep = int(flag_value(argv, "--expert-model-parallel-size") or 1)
                    assert tp >= 1, (model_id, hw, nodes)
                    assert ranks % (tp * ep) == 0, (model_id, hw, nodes)


@pytest.mark.parametrize("precision", [Precision.MXFP8, Precision.NVFP4])
@pytest.mark.parametrize("hw", [h for h in Hardware if not h.is_blackwell])
def test_fp4_and_mxfp8_only_on_blackwell(precision: Precision, hw: Hardware) -> None:
    model = "posttrain-tiny-moe" if hw is Hardware.CPU else "qwen3-30b-a3b"
    with pytest.raises(LaunchConfigError, match=f"precision={precision.value}.*{hw.value}"):
        plan_for(model, hw, precision=precision)


def test_nvfp4_on_blackwell_quantizes_rollout() -> None:
    plan = plan_for("qwen3-30b-a3b", Hardware.GB200, precision=Precision.NVFP4)
    assert flag_value(engine_argv(plan), "--quantization") == "modelopt_fp4"
    trainer = list(plan.by_role(Role.TRAINER)[0].argv)
    assert flag_value(trainer, "--rollout-quant") == "nvfp4"  # bf16 training, NVFP4 sync
    assert flag_value(trainer, "--backend") == "megatron"
    assert "--fp4-recipe" not in trainer


@pytest.mark.parametrize(
    ("model", "hw", "nodes"),
    [("glm-4.7-flash", Hardware.CPU, 1), ("glm-4.7-flash", Hardware.H200, 3),
     ("qwen3-235b-a22b", Hardware.H100, 1), ("posttrain-tiny-moe", Hardware.CPU, 2)],
)  # fmt: skip
def test_unknown_hardware_nodes_pair_names_both(model: str, hw: Hardware, nodes: int) -> None:
    with pytest.raises(UnsupportedHardwareError) as info:
        plan_for(model, hw, nodes=nodes)
    assert f"({hw.value}, {nodes} node(s))" in str(info.value)
    assert (info.value.hardware, info.value.nodes) == (hw.value, nodes)


def test_rollout_tp_must_divide_heads() -> None:
    with pytest.raises(LaunchConfigError, match="rollout_tp=3 does not divide the 20"):
        plan_for("glm-4.7-flash", Hardware.H200, rollout_tp=3)
    with pytest.raises(LaunchConfigError, match="exceeds the 4 GPUs per node"):
        plan_for("glm-4.7-flash", Hardware.GB200, rollout_tp=5)


def test_table_tps_divide_heads_everywhere() -> None:
    for model_id, row in ROLLOUT_TP.items():
        heads = MODELS[model_id].num_attention_heads
        for hw, tp in row.items():
            if SUPPORTED_NODES[model_id][hw]:
                assert tp is not None, (model_id, hw)
                assert heads % tp == 0, (model_id, hw)


def test_every_supported_pair_builds_a_consistent_plan() -> None:
    for model_id, row in SUPPORTED_NODES.items():
        spec = MODELS[model_id]
        for hw, node_counts in row.items():
            for nodes in sorted(node_counts):
                plan = plan_for(model_id, hw, nodes=nodes)
                engines = plan.by_role(Role.ENGINE)
                trainers = plan.by_role(Role.TRAINER)
                assert engines
                assert trainers
                assert plan.by_role(Role.ROUTER)
                for e in engines:
                    tp = flag_value(list(e.argv), "--tp-size")
                    assert tp is None or spec.num_attention_heads % int(tp) == 0
                gpus = sum(p.gpus for p in plan.processes)
                assert gpus == hw.gpus_per_node * nodes, (model_id, hw, nodes)
                assert len(plan.registrations) == len(engines)
                assert {r.after_stage for r in plan.registrations} == {1}


def test_moe_layer_freq_is_one_argv_token() -> None:
    from posttrain.launch.catalog import get_model

    plan = plan_for("qwen3-30b-a3b", Hardware.H200)  # glm-4.7-flash (MLA) trains on FSDP
    argv = list(plan.by_role(Role.TRAINER)[0].argv)
    assert flag_value(argv, "--moe-layer-freq") == "[1]*48"
    assert get_model("glm-4.7-flash").moe_layer_freq == "[0]*1+[1]*46"


tokens = st.lists(
    st.one_of(
        st.sampled_from(["--tp-size", "--attention-backend", "--port", "--lr", "--x=1"]),
        st.text(alphabet="abc019*[]+=.-_ ", min_size=1, max_size=8),
    ),
    max_size=6,
)


@settings(max_examples=25, deadline=None)
@given(
    model=st.sampled_from(sorted(MODELS)),
    engine=tokens,
    trainer=tokens,
    router=tokens,
    session=tokens,
)
def test_user_arguments_always_come_last(
    model: str, engine: list[str], trainer: list[str], router: list[str], session: list[str]
) -> None:
    hw = Hardware.CPU if model == "posttrain-tiny-moe" else Hardware.B200
    nodes = min(SUPPORTED_NODES[model][hw])
    plan = plan_for(
        model, hw, nodes=nodes, engine_args=tuple(engine), trainer_args=tuple(trainer),
        router_args=tuple(router), session_router_args=tuple(session),
    )  # fmt: skip
    for role, user in (
        (Role.ENGINE, engine), (Role.TRAINER, trainer), (Role.ROUTER, router),
        (Role.SESSION_ROUTER, session),
    ):  # fmt: skip
        for proc in plan.by_role(role):
            assert list(proc.argv[len(proc.argv) - len(user) :]) == user


def test_user_override_wins_and_is_explained() -> None:
    plan = plan_for("glm-4.7-flash", Hardware.B200, engine_args=("--tp-size", "4"))
    engine = plan.by_role(Role.ENGINE)[0]
    assert flag_value(list(engine.argv), "--tp-size") == "4"  # last occurrence wins
    assert any("--tp-size 2" in line and "[overridden by user]" in line for line in engine.explain)
    assert any(line.startswith("--tp-size: user overrides") for line in engine.explain)
    assert "overridden by user" in plan.explain()


def test_cpu_plan_uses_local_engine_and_fsdp() -> None:
    plan = plan_for("posttrain-tiny-moe", Hardware.CPU)
    assert engine_argv(plan)[:3] == ["python", "-m", "posttrain.local_engine"]
    trainer = list(plan.by_role(Role.TRAINER)[0].argv)
    assert flag_value(trainer, "--backend") == "fsdp"
    assert not plan.by_role(Role.TRAINER)[0].env


@pytest.mark.parametrize(
    "spelling", [("--attention-backend", "trtllm_mla"), ("--attention-backend=trtllm_mla",)]
)
def test_backend_given_in_engine_args_also_switches_rules_off(spelling: tuple[str, ...]) -> None:
    for model in ("glm-4.7-flash", "qwen3-30b-a3b"):
        argv = engine_argv(plan_for(model, Hardware.B200, engine_args=spelling))
        assert RAGGED not in argv
        assert flag_value(argv, "--attention-backend") == "trtllm_mla"
        assert sum(t.startswith("--attention-backend") for t in argv) == 1  # the user's, untouched


def test_plans_pass_train_and_the_weight_sync_mode_and_lora_engines_enable_lora() -> None:
    lora = plan_for("qwen3-8b", Hardware.H100)
    trainer = list(lora.by_role(Role.TRAINER)[0].argv)
    assert flag_value(trainer, "--train") == "lora"
    assert flag_value(trainer, "--weight-sync-backend") == "nccl"
    assert flag_value(trainer, "--lora-sync") == "tensors"
    engine = engine_argv(lora)
    assert "--enable-lora" in engine
    assert flag_value(engine, "--max-lora-rank") == "8"
    i = engine.index("--lora-target-modules")
    assert engine[i + 1 : i + 5] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert "--enable-lora" in lora.explain()
    # the user's trainer LoRA settings reach the engines
    mine = plan_for("qwen3-8b", Hardware.H100, trainer_args=("--lora-r", "32", "--lora-targets",
                                                           "q_proj,o_proj"))  # fmt: skip
    engine = engine_argv(mine)
    assert flag_value(engine, "--max-lora-rank") == "32"
    i = engine.index("--lora-target-modules")
    assert engine[i + 1 : i + 3] == ["q_proj", "o_proj"]
    full = plan_for("qwen3-8b", Hardware.H100, train="full")
    assert flag_value(list(full.by_role(Role.TRAINER)[0].argv), "--train") == "full"
    assert flag_value(list(full.by_role(Role.TRAINER)[0].argv), "--weight-sync") == "distributed"
    assert "--enable-lora" not in engine_argv(full)
    assert "--weight-sync tensor (CUDA IPC) needs engines colocated" in full.explain()
    with pytest.raises(LaunchConfigError, match="train"):
        plan_for("qwen3-8b", Hardware.H100, train="qlora")
    # colocated engines' CUDA IPC sync: refused, as no plan puts engines on the trainer's GPUs
    for spelling in (("--weight-sync", "tensor"), ("--weight-sync=tensor",)):
        with pytest.raises(LaunchConfigError, match=r"--weight-sync tensor: .*never colocate"):
            plan_for("qwen3-8b", Hardware.H100, train="full", trainer_args=spelling)
