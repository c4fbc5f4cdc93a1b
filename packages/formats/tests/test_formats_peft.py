"""PEFT adapters: write -> read is the identity, and every malformed adapter is refused by name."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.formats import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    PEFT_TENSOR_DTYPES,
    PeftConfigError,
    PeftFormatError,
    PeftTensorError,
    build_peft_adapter,
    parse_peft_config,
    parse_peft_key,
    peft_config_from_spec,
    peft_key,
    peft_modules,
    read_peft_adapter,
    write_peft_adapter,
    write_safetensors,
)
from posttrain.interface import LoraSpec

_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")


@st.composite
def specs(draw: st.DrawFn) -> LoraSpec:
    targets = draw(st.lists(st.sampled_from(_LEAVES), min_size=1, max_size=5, unique=True))
    return LoraSpec(
        r=draw(st.integers(1, 6)),
        alpha=draw(st.floats(1e-3, 1e3, allow_nan=False)),
        target_modules=tuple(targets),
        dropout=draw(st.sampled_from([0.0, 0.05, 0.5])),
        use_rslora=draw(st.booleans()),
    )


def _tensors(spec: LoraSpec, layers: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        for i, leaf in enumerate(spec.target_modules):
            module = f"model.layers.{layer}.self_attn.{leaf}"
            fan_in, fan_out = 8 + i, 4 + 2 * i
            out[peft_key(module, "A")] = torch.randn(spec.r, fan_in, generator=gen).to(dtype)
            out[peft_key(module, "B")] = torch.randn(fan_out, spec.r, generator=gen).to(dtype)
    return out


@_SETTINGS
@given(spec=specs(), layers=st.integers(1, 3), dtype=st.sampled_from(PEFT_TENSOR_DTYPES))
def test_write_then_read_is_the_identity(
    tmp_path: Path, spec: LoraSpec, layers: int, dtype: torch.dtype
) -> None:
    tensors = _tensors(spec, layers, dtype, seed=layers)
    write_peft_adapter(tmp_path / "a", tensors, spec, base_model_name_or_path="tiny")
    back = read_peft_adapter(tmp_path / "a")
    assert back.spec == spec
    assert back.config["base_model_name_or_path"] == "tiny"
    assert back.tensors.keys() == tensors.keys()
    for key, t in tensors.items():  # bit for bit, in the dtype written
        assert back.tensors[key].dtype == dtype
        assert torch.equal(back.tensors[key].view(torch.uint8), t.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(spec=specs(), base=st.text(max_size=20))
def test_config_and_spec_round_trip(spec: LoraSpec, base: str) -> None:
    config = peft_config_from_spec(spec, base_model_name_or_path=base)
    assert parse_peft_config(json.loads(json.dumps(config))) == spec
    assert config["peft_type"] == "LORA"
    assert config["bias"] == "none"


def test_all_linear_is_written_as_peft_spells_it() -> None:
    spec = LoraSpec(r=2, alpha=4.0, target_modules=("all-linear",))
    config = peft_config_from_spec(spec)
    assert config["target_modules"] == "all-linear"
    assert parse_peft_config(config) == spec
    assert parse_peft_config({**config, "target_modules": ["ALL-LINEAR"]}) == spec
    with pytest.raises(PeftConfigError, match="must stand alone"):
        peft_config_from_spec(LoraSpec(r=2, alpha=4.0, target_modules=("all-linear", "q_proj")))


def test_export_dtype_casts_and_default_keys_normalise(tmp_path: Path) -> None:
    spec = LoraSpec(r=2, alpha=4.0, target_modules=("q_proj",))
    tensors = {
        "base_model.model.m.q_proj.lora_A.default.weight": torch.randn(2, 8),
        "base_model.model.m.q_proj.lora_B.default.weight": torch.randn(4, 2),
    }
    write_peft_adapter(tmp_path / "a", tensors, spec, dtype=torch.bfloat16)
    back = read_peft_adapter(tmp_path / "a").tensors
    assert list(back) == [peft_key("m.q_proj", "A"), peft_key("m.q_proj", "B")]
    assert {t.dtype for t in back.values()} == {torch.bfloat16}
    assert parse_peft_key(next(iter(tensors))) == ("m.q_proj", "A")
    with pytest.raises(PeftTensorError, match="export dtype"):
        write_peft_adapter(tmp_path / "b", tensors, spec, dtype=torch.int8)


def test_shared_outer_expert_factors_are_3d() -> None:
    config = peft_config_from_spec(LoraSpec(r=2, alpha=2.0, target_modules=("w1", "w2")))
    e = "model.layers.0.mlp.experts"
    adapter = build_peft_adapter(
        config,
        {
            peft_key(f"{e}.w1", "A"): torch.zeros(1, 2, 8),  # shared A, one per expert B
            peft_key(f"{e}.w1", "B"): torch.zeros(4, 6, 2),
            peft_key(f"{e}.w2", "A"): torch.zeros(4, 2, 6),
            peft_key(f"{e}.w2", "B"): torch.zeros(1, 8, 2),
        },
    )
    assert list(adapter.modules) == [f"{e}.w1", f"{e}.w2"]
    with pytest.raises(PeftTensorError, match="different expert counts"):
        peft_modules(
            {peft_key("x", "A"): torch.zeros(3, 2, 8), peft_key("x", "B"): torch.zeros(4, 6, 2)}
        )


# ---- the reader refuses each malformed adapter, naming the file and the key or field ---------

_SPEC = LoraSpec(r=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
_CONFIG = peft_config_from_spec(_SPEC)
_QA, _QB = peft_key("model.layers.0.q_proj", "A"), peft_key("model.layers.0.q_proj", "B")
_VA, _VB = peft_key("model.layers.0.v_proj", "A"), peft_key("model.layers.0.v_proj", "B")


def _good() -> dict[str, torch.Tensor]:
    return {
        _QA: torch.ones(2, 8),
        _QB: torch.ones(6, 2),
        _VA: torch.ones(2, 8),
        _VB: torch.ones(4, 2),
    }


def _adapter_dir(root: Path, tensors: dict[str, torch.Tensor], config: object = _CONFIG) -> Path:
    root.mkdir()
    with open(root / ADAPTER_WEIGHTS_FILE, "wb") as f:
        write_safetensors(f, tensors)  # no checks: the file holds whatever the test put in
    (root / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {_QA: torch.ones(2, 8, dtype=torch.int64)},
            PeftTensorError,
            r"q_proj\.lora_A\.weight has dtype int64",
        ),
        (
            {_VB: torch.ones(4, 2, dtype=torch.bool)},
            PeftTensorError,
            r"v_proj\.lora_B\.weight has dtype bool",
        ),
        (
            {_QA: torch.tensor([[float("nan")] * 8] * 2)},
            PeftTensorError,
            r"q_proj\.lora_A\.weight contains NaN",
        ),
        (
            {_QB: torch.full((6, 2), float("-inf"))},
            PeftTensorError,
            r"q_proj\.lora_B\.weight contains Inf",
        ),
        (
            {_QA: torch.ones(3, 8), _QB: torch.ones(6, 3)},
            PeftTensorError,
            r"has rank 3 .* says r=2",
        ),
        ({_QA: torch.ones(2, 8), _QB: torch.ones(6, 3)}, PeftTensorError, "disagree on the rank"),
        ({_QA: torch.ones(16)}, PeftTensorError, r"q_proj\.lora_A\.weight has shape \[16\]"),
        ({_QB: None}, PeftTensorError, r"q_proj\.lora_A\.weight without its pair lora_B"),
        (
            {"base_model.model.m.lora_embedding_A": torch.ones(2, 2)},
            PeftTensorError,
            "not a PEFT LoRA key",
        ),
        (
            {"model.layers.0.q_proj.lora_A.weight": torch.ones(2, 8)},
            PeftTensorError,
            "not a PEFT LoRA key",
        ),
        (
            {
                peft_key("model.layers.0.o_proj", "A"): torch.ones(2, 8),
                peft_key("model.layers.0.o_proj", "B"): torch.ones(8, 2),
            },
            PeftConfigError,
            r"target_modules \['q_proj', 'v_proj'\] do not select 'model.layers.0.o_proj'",
        ),
    ],
)
def test_bad_tensors_are_refused(tmp_path: Path, change: dict, error: type, match: str) -> None:
    tensors = _good()
    for key, value in change.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    d = _adapter_dir(tmp_path / "a", tensors)
    with pytest.raises(error, match=match) as info:
        read_peft_adapter(d)
    where = ADAPTER_CONFIG_FILE if error is PeftConfigError else ADAPTER_WEIGHTS_FILE
    assert str(d / where) in str(info.value)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ([_CONFIG], "a JSON list, not an object"),
        ("LORA", "a JSON str, not an object"),
        ({k: v for k, v in _CONFIG.items() if k != "r"}, "missing field.*r"),
        (
            {k: v for k, v in _CONFIG.items() if k not in ("peft_type", "target_modules")},
            "peft_type, target_modules",
        ),
        ({**_CONFIG, "r": 0}, "r must be a positive integer, got 0"),
        ({**_CONFIG, "r": -2}, "r must be a positive integer, got -2"),
        ({**_CONFIG, "r": 2.0}, "r must be a positive integer, got 2.0"),
        ({**_CONFIG, "r": True}, "r must be a positive integer, got True"),
        ({**_CONFIG, "lora_alpha": "8"}, "lora_alpha must be a number"),
        ({**_CONFIG, "lora_alpha": 0}, "lora_alpha must be > 0"),
        ({**_CONFIG, "lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
        ({**_CONFIG, "use_rslora": "yes"}, "use_rslora must be true or false"),
        ({**_CONFIG, "peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
        ({**_CONFIG, "bias": "all"}, "bias 'all' is unsupported"),
        ({**_CONFIG, "use_dora": True}, "use_dora=True is unsupported"),
        ({**_CONFIG, "fan_in_fan_out": True}, "fan_in_fan_out=True is unsupported"),
        ({**_CONFIG, "rank_pattern": {"q_proj": 4}}, "rank_pattern is unsupported"),
        ({**_CONFIG, "modules_to_save": ["lm_head"]}, "modules_to_save is unsupported"),
        ({**_CONFIG, "target_modules": ".*proj"}, "is a regex string"),
        ({**_CONFIG, "target_modules": []}, "non-empty list of names"),
        ({**_CONFIG, "target_modules": ["q_proj", 3]}, "holds a non-name"),
    ],
)
def test_bad_configs_are_refused(tmp_path: Path, config: object, match: str) -> None:
    d = _adapter_dir(tmp_path / "a", _good(), config)
    with pytest.raises(PeftConfigError, match=match) as info:
        read_peft_adapter(d)
    assert str(d / ADAPTER_CONFIG_FILE) in str(info.value)


def test_nan_alpha_in_json_is_refused(tmp_path: Path) -> None:
    d = _adapter_dir(tmp_path / "a", _good())
    (d / ADAPTER_CONFIG_FILE).write_text(
        json.dumps(_CONFIG).replace('"lora_alpha": 4.0', '"lora_alpha": NaN')
    )
    with pytest.raises(PeftConfigError, match="lora_alpha must be finite"):
        read_peft_adapter(d)


@pytest.mark.parametrize(
    ("mangle", "error", "match"),
    [
        (lambda raw: raw[: len(raw) // 2], PeftTensorError, "not a readable safetensors file"),
        (lambda raw: b"\xff" * 8 + raw[8:], PeftTensorError, "not a readable safetensors file"),
        (lambda raw: b"", PeftTensorError, "not a readable safetensors file"),
    ],
)
def test_corrupt_safetensors_is_refused(tmp_path: Path, mangle, error: type, match: str) -> None:  # type: ignore[no-untyped-def]
    d = _adapter_dir(tmp_path / "a", _good())
    weights = d / ADAPTER_WEIGHTS_FILE
    weights.write_bytes(mangle(weights.read_bytes()))
    with pytest.raises(error, match=match) as info:
        read_peft_adapter(d)
    assert str(weights) in str(info.value)


def test_missing_and_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(PeftConfigError, match=r"adapter_config\.json: cannot read"):
        read_peft_adapter(tmp_path / "nowhere")
    with pytest.raises(PeftConfigError, match="not a usable path"):
        read_peft_adapter(str(tmp_path / "nul\x00byte"))
    d = _adapter_dir(tmp_path / "a", _good())
    (d / ADAPTER_WEIGHTS_FILE).unlink()
    with pytest.raises(PeftTensorError, match=r"adapter_model\.safetensors: no such file"):
        read_peft_adapter(d)
    (d / ADAPTER_CONFIG_FILE).write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(PeftConfigError, match="not valid JSON"):
        read_peft_adapter(d)
    (d / ADAPTER_CONFIG_FILE).write_bytes(b" " * (2 << 20))
    with pytest.raises(PeftConfigError, match="larger than"):
        read_peft_adapter(d)


def test_writer_refuses_what_the_reader_refuses_and_keeps_the_old(tmp_path: Path) -> None:
    target = tmp_path / "a"
    write_peft_adapter(target, _good(), _SPEC)
    before = (target / ADAPTER_WEIGHTS_FILE).read_bytes()
    bad = {**_good(), _QA: torch.full((2, 8), float("nan"))}
    with pytest.raises(PeftTensorError, match="contains NaN"):
        write_peft_adapter(target, bad, _SPEC)
    overflow = {**_good(), _QA: torch.full((2, 8), 1e6)}  # finite in fp32, Inf in fp16
    with pytest.raises(PeftTensorError, match="contains Inf"):
        write_peft_adapter(target, overflow, _SPEC, dtype=torch.float16)
    with pytest.raises(PeftConfigError, match="do not select"):
        write_peft_adapter(target, _good(), LoraSpec(r=2, alpha=4.0, target_modules=("q_proj",)))
    assert (target / ADAPTER_WEIGHTS_FILE).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_a_target_without_tensors_is_allowed() -> None:
    # PEFT keeps names that matched nothing in the base model; they select no tensor here either
    config = {**_CONFIG, "target_modules": ["q_proj", "v_proj", "c_attn"]}
    assert build_peft_adapter(config, _good()).spec.target_modules == ("q_proj", "v_proj", "c_attn")


# ---- fuzz: untrusted config objects and safetensors bytes -------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELD_VALUES = st.one_of(
    _JSON, st.sampled_from(["LORA", "lora", "all-linear", "none", ["q_proj"], 2, 4.0, -1, 0])
)


@settings(max_examples=300, deadline=None)
@given(
    base=st.one_of(_JSON, st.just(dict(_CONFIG))),
    edits=st.dictionaries(
        st.sampled_from([*sorted(_CONFIG), "use_dora", "rank_pattern"]), _FIELD_VALUES, max_size=4
    ),
)
def test_fuzz_config_parser_returns_a_spec_or_a_named_error(base: object, edits: dict) -> None:
    config = {**base, **edits} if isinstance(base, dict) else base
    try:
        spec = parse_peft_config(config, where="fuzz.json")
    except PeftConfigError as e:
        message = str(e)
        spec = None
    if spec is None:
        assert message.startswith("fuzz.json: ")
        return
    assert isinstance(config, dict)
    assert spec.r == config["r"]
    assert spec.alpha == config["lora_alpha"]
    assert parse_peft_config(peft_config_from_spec(spec)) == spec


def _valid_bytes() -> bytes:
    buf = io.BytesIO()
    write_safetensors(buf, _good())
    return buf.getvalue()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), mode=st.sampled_from(["random", "flip", "cut", "header"]))
def test_fuzz_safetensors_reading(tmp_path: Path, data: st.DataObject, mode: str) -> None:
    raw = bytearray(_valid_bytes())
    if mode == "random":
        raw = bytearray(data.draw(st.binary(max_size=256)))
    elif mode == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif mode == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    else:  # a header length that lies
        raw[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    d = tmp_path / "a"
    d.mkdir(exist_ok=True)
    (d / ADAPTER_WEIGHTS_FILE).write_bytes(bytes(raw))
    (d / ADAPTER_CONFIG_FILE).write_text(json.dumps(_CONFIG))
    try:
        adapter = read_peft_adapter(d)
    except PeftFormatError as e:
        message = str(e)
        adapter = None
    if adapter is None:
        assert str(d) in message
        return
    for a, b in adapter.modules.values():  # whatever was accepted passed every check
        assert a.dtype in PEFT_TENSOR_DTYPES
        assert bool(torch.isfinite(a).all())
        assert a.shape[-2] == b.shape[-1] == 2
