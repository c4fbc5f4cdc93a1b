"""Every enum value has an entry in every table (no KeyError can wait for launch day)."""

from posttrain.launch import MODELS, EngineKind, Hardware, ModelFamily, Precision
from posttrain.launch.hardware import Generation
from posttrain.launch.tables import (
    BACKEND_PRECISIONS,
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_PRECISION,
    ENGINE_KIND,
    PRECISION_GENERATIONS,
    ROLLOUT_TP,
    SUPPORTED_NODES,
    TRAINER_BACKEND,
    TRAINER_TP,
    VISIBLE_DEVICES_VAR,
    TrainerBackend,
)


def test_model_tables_cover_every_model_and_hardware() -> None:
    for table in (ROLLOUT_TP, SUPPORTED_NODES):
        assert set(table) == set(MODELS)
        for row in table.values():
            assert set(row) == set(Hardware)
    assert set(TRAINER_TP) == set(MODELS)


def test_family_tables_cover_every_family_and_generation() -> None:
    for table in (DEFAULT_PRECISION, DEFAULT_ATTENTION_BACKEND):
        assert set(table) == set(ModelFamily)
        for row in table.values():
            assert set(row) == set(Generation)
    for gen_table in (ENGINE_KIND, TRAINER_BACKEND, VISIBLE_DEVICES_VAR):
        assert set(gen_table) == set(Generation)
    assert set(PRECISION_GENERATIONS) == set(Precision)
    assert set(BACKEND_PRECISIONS) == set(TrainerBackend)
    assert all(Precision.BF16 in allowed for allowed in BACKEND_PRECISIONS.values())
    assert set(ENGINE_KIND.values()) == set(EngineKind)


def test_defaults_are_allowed_where_they_are_defaults() -> None:
    for row in DEFAULT_PRECISION.values():
        for gen, precision in row.items():
            assert gen in PRECISION_GENERATIONS[precision]


def test_supported_nodes_agree_with_rollout_tp() -> None:
    for model_id in MODELS:
        for hw in Hardware:
            offered = bool(SUPPORTED_NODES[model_id][hw])
            assert offered == (ROLLOUT_TP[model_id][hw] is not None), (model_id, hw)
