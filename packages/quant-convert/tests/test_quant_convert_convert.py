"""Converter on synthetic multi-shard MoE checkpoints: output contract, resume, errors, CLI."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from posttrain.formats import read_nvfp4_quant_config
from posttrain.interface import NVFP4Precision
from posttrain.quant_convert import (
    CheckpointError,
    ConvertOptions,
    QuantConvertError,
    QuantPolicy,
    ResumeError,
    TensorInfo,
    convert_checkpoint,
    plan_conversion,
    quantize_nvfp4_pair,
)
from posttrain.quant_convert.cli import build_parser, main
from posttrain.quant_convert.nvfp4 import quantize_nvfp4
from posttrain.quant_convert.sglang_rules import build_modules, is_excluded
from posttrain.quant_convert.testing import SyntheticSpec, write_synthetic_checkpoint

SPEC = SyntheticSpec(layers=4, experts=3, shards=3, dense_layers=(0,), shared_experts=True)
OPTS = ConvertOptions(policy=QuantPolicy(num_layers_at_end_in_bf16=1))


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "src", SPEC)


def _load(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = h.get_tensor(k)
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def check_loader_contract(dst: Path) -> None:
    """What SGLang's modelopt_fp4 loader needs, checked on the written files."""
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    hq = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert cfg["ignore"] == hq["exclude_modules"]
    assert (cfg["quant_algo"], cfg["quant_method"], cfg["group_size"]) == ("NVFP4", "modelopt", 16)
    assert hq["quant_algo"] == "NVFP4"
    assert hq["group_size"] == 16
    declared = read_nvfp4_quant_config(dst)  # the formats reader engines use reads it back
    assert declared is not None
    assert list(declared.exclude_modules) == cfg["ignore"]
    tensors = _load(dst)
    infos = [
        TensorInfo(n, "BF16", tuple(t.shape))
        for n, t in tensors.items()
        if not n.endswith(("_scale", "_scale_2"))
    ]
    for m in build_modules(infos):
        excluded = is_excluded(m, cfg["ignore"])
        for w in m.weights:
            base = w.removesuffix(".weight")
            if excluded:
                assert tensors[w].dtype == torch.bfloat16, w
                assert base + ".weight_scale" not in tensors
            else:
                n, k2 = tensors[w].shape
                assert tensors[w].dtype == torch.uint8
                assert tensors[base + ".weight_scale"].dtype == torch.float8_e4m3fn
                assert tensors[base + ".weight_scale"].shape == (n, k2 * 2 // 16)
                assert tensors[base + ".weight_scale_2"].shape == ()
        if m.kind == "fused_moe" and not excluded:
            for w in m.weights:
                if w.endswith("gate_proj.weight"):
                    up = w.replace("gate_proj", "up_proj")
                    s_g = tensors[w.removesuffix(".weight") + ".weight_scale_2"]
                    s_u = tensors[up.removesuffix(".weight") + ".weight_scale_2"]
                    assert torch.equal(s_g, s_u), w  # SGLang's w13_weight_scale_2 columns equal
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert set(index["weight_map"]) == set(tensors)


def test_convert_matches_reference_and_loader_contract(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = convert_checkpoint(src, dst, options=OPTS)
    check_loader_contract(dst)
    source, out = _load(src), _load(dst)
    quantized = report.plan.quantized
    assert quantized
    assert all(".layers.3." not in n and "shared" not in n for n in quantized)
    for name, t in source.items():
        if name not in quantized:
            assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name
    cross = 0
    for name in quantized:
        if name.endswith("gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            cross += report.plan.tensor_file[name] != report.plan.tensor_file[up]
            qg, qu = quantize_nvfp4_pair(source[name], source[up])
            for q, n in ((qg, name), (qu, up)):
                assert torch.equal(out[n], q.packed)
                assert torch.equal(
                    out[n.removesuffix("weight") + "weight_scale"].view(torch.uint8),
                    q.scale.view(torch.uint8),
                )
                assert torch.equal(out[n.removesuffix("weight") + "weight_scale_2"], q.scale_2)
                assert out[n.removesuffix("weight") + "input_scale"].item() == 1.0
        elif name.endswith("down_proj.weight"):
            assert torch.equal(out[name], quantize_nvfp4(source[name]).packed)
    assert cross >= 1  # the synthetic cuts shards between a gate and its up
    assert report.bytes_in >= report.plan.source_bytes
    assert report.bytes_in <= 1.1 * report.plan.source_bytes
    manifest = json.loads((dst / "quant_convert_manifest.json").read_text())
    for f, sha in manifest["shards"].items():
        assert hashlib.sha256((dst / f).read_bytes()).hexdigest() == sha
    assert manifest["options"]["num_layers_at_end_in_bf16"] == 1
    assert set(manifest["inputs"]) == {s.file for s in report.plan.shards}
    assert (dst / "extra" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert not (dst / ".quant-convert").exists()
    assert not list(dst.rglob("*.tmp"))


def test_vlm_prefix_and_explicit_style_no_input_scale(tmp_path: Path) -> None:
    spec = SyntheticSpec(layers=3, experts=2, shards=2, prefix="model.language_model.")
    src = write_synthetic_checkpoint(tmp_path / "vlm", spec)
    opts = ConvertOptions(
        policy=QuantPolicy(num_layers_at_start_in_bf16=1),
        precision=NVFP4Precision(input_scale=None, kv_cache_quant_algo=None),
        exclusion_style="explicit",
    )
    report = convert_checkpoint(src, tmp_path / "out", options=opts, workers=2)
    check_loader_contract(tmp_path / "out")
    assert all(".layers.0." not in n for n in report.plan.quantized)
    assert len(report.plan.quantized) == 2 * 2 * 3
    out = _load(tmp_path / "out")
    assert not any(n.endswith("input_scale") for n in out)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "kv_cache_scheme" not in cfg["quantization_config"]
    hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["kv_cache_quant_algo"] is None
    assert "model.language_model.layers.0.mlp.experts" in hq["quantization"]["exclude_modules"]


_KILLER = """
import os, signal, sys
from posttrain.quant_convert import convert_checkpoint, ConvertOptions, QuantPolicy
def progress(e):  # past half of the bytes: inside the second shard, after the first is done
    if not e.shard_done and e.bytes_done > e.bytes_total // 2:
        os.kill(os.getpid(), signal.SIGKILL)
convert_checkpoint(sys.argv[1], sys.argv[2],
    options=ConvertOptions(policy=QuantPolicy(num_layers_at_end_in_bf16=1)), progress=progress)
"""


@pytest.mark.multiproc
def test_kill_and_resume_is_byte_identical(src: Path, tmp_path: Path) -> None:
    # killed inside the second shard: the first is recorded, the second's *.tmp is discarded
    reference = tmp_path / "ref"
    convert_checkpoint(src, reference, options=OPTS)
    dst = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(src), str(dst)], timeout=120, check=False
    )
    assert proc.returncode == -9
    assert not (dst / "quant_convert_manifest.json").exists()  # never looks complete
    state = json.loads((dst / ".quant-convert" / "state.json").read_text())
    assert 1 <= len(state["shards"]) < 3
    report = convert_checkpoint(src, dst, options=OPTS)
    assert set(report.shards_resumed) == set(state["shards"])
    assert _files(dst) == _files(reference)


def test_resume_refuses_changed_options_until_overwrite(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert_checkpoint(src, dst, options=OPTS)
    again = convert_checkpoint(src, dst, options=OPTS)  # complete: everything resumes
    assert again.shards_written == ()
    other = ConvertOptions(policy=QuantPolicy(num_layers_at_end_in_bf16=2))
    with pytest.raises(ResumeError, match="other inputs or options"):
        convert_checkpoint(src, dst, options=other)
    with pytest.raises(ResumeError, match="--no-resume needs --overwrite"):
        convert_checkpoint(src, dst, options=OPTS, resume=False)
    report = convert_checkpoint(src, dst, options=other, overwrite=True)
    assert len(report.shards_written) == 3
    check_loader_contract(dst)


def test_resume_redoes_a_corrupted_shard(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert_checkpoint(src, dst, options=OPTS)
    reference = _files(dst)
    shard = next(iter(sorted(dst.glob("*.safetensors"))))
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    report = convert_checkpoint(src, dst, options=OPTS)
    assert report.shards_written == (shard.name,)
    assert _files(dst) == reference


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_error_cases(src: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is the model dir"):
        convert_checkpoint(src, src)
    with pytest.raises(CheckpointError, match="nested"):
        convert_checkpoint(src, src / "nvfp4")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_checkpoint(src, foreign)

    quantized = _copy(src, tmp_path / "q")
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="already quantized"):
        plan_conversion(quantized)

    scaled = tmp_path / "scaled"
    scaled.mkdir()
    (scaled / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    save_file(
        {"a.weight": torch.zeros(2, 16), "a.weight_scale": torch.zeros(2)},
        str(scaled / "m.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"a\.weight_scale"):
        plan_conversion(scaled)

    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    (bins / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"only \*\.bin"):
        plan_conversion(bins)

    noconf = tmp_path / "noconf"
    noconf.mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        plan_conversion(noconf)
    (noconf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        plan_conversion(noconf)

    partial = ConvertOptions(policy=QuantPolicy(keep_patterns=("layers.1.mlp.experts.0.",)))
    with pytest.raises(CheckpointError, match="partial FusedMoE"):
        plan_conversion(src, partial)

    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    save_file(
        {"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(4, 16, dtype=torch.bfloat16),
         "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(16, 16, dtype=torch.bfloat16)},
        str(lonely / "m.safetensors"),
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="without its up partner"):
        plan_conversion(lonely)


def test_cli_dry_run_summary_and_unknown_flag(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "cli"
    args = [
        "nvfp4",
        "--model-dir",
        str(src),
        "--save-dir",
        str(dst),
        "--num-layers-at-end-in-bf16",
        "1",
    ]
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "exclusion list (compact" in out
    assert "model.layers.3.mlp.experts" in out
    assert not dst.exists()
    assert (
        main(
            [
                *args,
                "--no-progress",
                "--extra-high-precision-layers-hf",
                "layers.1.mlp.",
                "re:layers\\.2\\.mlp\\.",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tensors quantized: 0," in out
    assert "exclusion entries:" in out
    assert "bytes in:" in out
    with pytest.raises(SystemExit) as info:
        main([*args, "--frobnicate"])
    assert info.value.code == 2
    assert main(["nvfp4", "--model-dir", str(src), "--save-dir", str(src)]) == 2
    assert "is the model dir" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*args, "--device", "0"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_console_script_points_at_main() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "quant-convert"]
    assert ep.load() is main


def test_three_d_experts_are_opt_in(tmp_path: Path) -> None:
    src = tmp_path / "fused"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4, 32, 48, generator=g) * 0.02).to(torch.bfloat16)
    save_file({"model.layers.0.mlp.experts.down_proj.weight": w}, str(src / "model.safetensors"))
    assert plan_conversion(src).quantized == frozenset()
    opts = ConvertOptions(policy=QuantPolicy(quantize_3d_experts=True))
    report = convert_checkpoint(src, tmp_path / "out", options=opts)
    assert report.tensors_quantized == 1
    out = _load(tmp_path / "out")
    base = "model.layers.0.mlp.experts.down_proj."
    assert out[base + "weight"].shape == (4, 32, 24)
    assert out[base + "weight_scale"].shape == (4, 32, 3)
    assert out[base + "weight_scale_2"].shape == (4,)
    for e in range(4):
        q = quantize_nvfp4(w[e])
        assert torch.equal(out[base + "weight"][e], q.packed)
        assert out[base + "weight_scale_2"][e] == q.scale_2


def test_a_failure_before_any_shard_finishes_leaves_nothing_behind(tmp_path: Path) -> None:
    src = tmp_path / "nan"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    gate = torch.zeros(16, 16, dtype=torch.bfloat16)
    gate[3, 5] = float("nan")
    save_file(
        {"model.layers.0.mlp.experts.0.gate_proj.weight": gate,
         "model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(16, 16, dtype=torch.bfloat16),
         "model.layers.0.mlp.experts.0.down_proj.weight": torch.ones(16, 16, dtype=torch.bfloat16)},
        str(src / "m.safetensors"),
    )  # fmt: skip
    fresh = tmp_path / "fresh"
    with pytest.raises(QuantConvertError, match="gate_proj"):
        convert_checkpoint(src, fresh)
    assert not fresh.exists()  # it created the directory, so it removes it
    given = tmp_path / "given"
    given.mkdir()
    with pytest.raises(QuantConvertError):
        convert_checkpoint(src, given)
    assert list(given.iterdir()) == []  # no .quant-convert/state.json left in a dir it was given


def test_help_names_every_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    nvfp4 = sub.choices["nvfp4"]
    for action in nvfp4._actions:
        assert action.help, action.option_strings
    with pytest.raises(SystemExit):
        main(["nvfp4", "--help"])
    out = capsys.readouterr().out
    assert "(default: te-multiplier)" in out
    assert "(default: 0)" in out
    assert "Numpy" not in out
    assert "miles" not in out  # the user-facing description, not the module docstring
