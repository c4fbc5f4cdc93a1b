"""The NVFP4 quant config: what the writer declares, the reader reads back, from either file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.formats import NVFP4FormatError, NVFP4QuantConfig, nvfp4_config_sections
from posttrain.formats import read_nvfp4_quant_config as read

_NAMES = st.lists(st.from_regex(r"model\.layers\.[0-9]{1,2}\.[a-z_]{1,12}", fullmatch=True))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(exclude=_NAMES, kv=st.sampled_from(["FP8", None]), which=st.sampled_from(["config", "hf"]))
def test_sections_round_trip_through_either_file(
    tmp_path: Path, exclude: list[str], kv: str | None, which: str
) -> None:
    written = NVFP4QuantConfig(exclude_modules=tuple(exclude), kv_cache_quant_algo=kv)
    section, hf = nvfp4_config_sections(written)
    for name in ("config.json", "hf_quant_config.json"):
        (tmp_path / name).unlink(missing_ok=True)
    if which == "config":
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": section}))
    else:
        (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf))
    back = read(tmp_path)
    assert back is not None
    assert (back.exclude_modules, back.kv_cache_quant_algo, back.group_size) == (
        written.exclude_modules,
        kv,
        16,
    )
    assert back.source.endswith("config.json" if which == "config" else "hf_quant_config.json")


def test_sections_keep_the_source_entries_and_fill_config_groups() -> None:
    section, hf = nvfp4_config_sections(
        NVFP4QuantConfig(exclude_modules=("lm_head",), kv_cache_quant_algo=None),
        config_section={"kv_cache_scheme": {"num_bits": 8}, "config_groups": {"g": {}}, "x": 1},
        hf_quant_config={"producer": {"name": "someone"}},
    )
    assert section["x"] == 1
    assert "kv_cache_scheme" not in section
    assert section["config_groups"]["g"]["weights"]["num_bits"] == 4
    assert section["config_groups"]["g"]["targets"] == ["Linear"]
    assert (section["quant_method"], section["ignore"]) == ("modelopt", ["lm_head"])
    assert hf["producer"] == {"name": "someone"}
    assert hf["quantization"]["kv_cache_quant_algo"] is None


def test_no_declaration_reads_as_none(tmp_path: Path) -> None:
    assert read(tmp_path) is None
    (tmp_path / "config.json").write_text('{"quantization_config": {}}')
    assert read(tmp_path) is None


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("[1, 2]", "a JSON list, not an object"),
        ("{not json", "not valid JSON"),
        ('{"quantization_config": [1]}', "quantization_config is a list"),
        ('{"quantization_config": {"quant_algo": "FP8"}}', "quant_algo 'FP8' is not supported"),
        ('{"quantization_config": {"quant_algo": "NVFP4", "group_size": 32}}', "group_size 32"),
        ('{"quantization_config": {"quant_algo": "NVFP4", "ignore": "lm_head"}}', "ignore must"),
        ('{"quantization_config": {"quant_algo": "NVFP4", "ignore": [1]}}', "not a string"),
    ],
)
def test_malformed_declarations_name_the_file(tmp_path: Path, config: str, match: str) -> None:
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(NVFP4FormatError, match=match) as info:
        read(tmp_path)
    assert "config.json" in str(info.value)


def test_the_source_sections_are_left_as_they_were() -> None:
    import copy

    from posttrain.formats import NVFP4QuantConfig, nvfp4_config_sections

    source = {"config_groups": {"g0": {"weights": {"num_bits": 8}}, "g1": None}}
    before = copy.deepcopy(source)
    qc, _ = nvfp4_config_sections(NVFP4QuantConfig(), config_section=source)
    assert source == before
    g0 = qc["config_groups"]["g0"]
    assert g0["targets"] == ["Linear"]
    assert g0["weights"] == {"num_bits": 8, "group_size": 16}
    assert g0["input_activations"]["group_size"] == 16
    assert qc["config_groups"]["g1"] is None
