"""Pure pieces: buckets, the NVFP4 checkpoint reader, the update session, sampling, config."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posttrain.formats as formats
from posttrain.interface import IncompleteUpdateError, StaleVersionError, WireFormatError
from posttrain.local_engine import (
    CheckpointError,
    NVFP4FormatError,
    UpdateSessionError,
    pack_bucket,
    parse_args,
    unpack_bucket,
)
from posttrain.local_engine._loader import read_checkpoint
from posttrain.local_engine._sampling import SamplingConfig, pick_token, top_logprobs
from posttrain.local_engine._update import TensorSpec, UpdateSession, check_version_increases

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([1, 64, 256]),
)
def test_bucket_round_trip_mixed_dtypes(
    spec: list[tuple[torch.dtype, list[int]]], align: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        (f"t{i}", (torch.randn(shape, generator=gen) * 50).to(dt))
        for i, (dt, shape) in enumerate(spec)
    ]
    manifest, buf = pack_bucket(tensors, update_id="u", weight_version=1, alignment=align)
    assert all(e.offset % align == 0 for e in manifest.tensors)
    assert manifest.sha256 == hashlib.sha256(buf.numpy().tobytes()).hexdigest()
    out = unpack_bucket(manifest, buf)
    for name, t in tensors:
        assert out[name].dtype == t.dtype
        assert torch.equal(out[name], t)


def test_bucket_sha256_and_bounds_are_checked() -> None:
    manifest, buf = pack_bucket([("a", torch.ones(4))], update_id="u", weight_version=1)
    bad = buf.clone()
    bad[0] ^= 1
    with pytest.raises(WireFormatError, match="sha256") as e:
        unpack_bucket(manifest, bad)
    assert e.value.field == "manifest.sha256"
    with pytest.raises(WireFormatError, match="total_bytes"):
        unpack_bucket(manifest, buf[:8])


def test_bucket_into_reused_slot_zeroes_gaps() -> None:
    slot = torch.full((4096,), 0xFF, dtype=torch.uint8)
    tensors = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(2))]
    m1, _ = pack_bucket(tensors, update_id="u", weight_version=1, out=slot)
    m2, _ = pack_bucket(tensors, update_id="u", weight_version=1)
    assert m1.sha256 == m2.sha256


def test_nvfp4_checkpoint_reads_dequantized_with_a_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    state = {
        "x.weight": torch.full((4, 8), 0x22, dtype=torch.uint8),  # every code 2 -> 1.0
        "x.weight_scale": torch.ones(4, 1).to(torch.float8_e4m3fn),
        "x.weight_scale_2": torch.tensor(2.0),
        "x.input_scale": torch.tensor(1.0),
        "norm.weight": torch.ones(4),
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "hf_quant_config.json").write_text(
        '{"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"],'
        ' "kv_cache_quant_algo": "FP8"}}'
    )
    tensors, report = read_checkpoint(tmp_path, {"x.weight": torch.bfloat16})
    assert set(tensors) == {"x.weight", "norm.weight"}
    assert tensors["x.weight"].dtype == torch.bfloat16
    assert tensors["x.weight"].unique().tolist() == [2.0]
    assert report is not None
    assert (report.exclude_modules, report.dequantized) == (["lm_head"], ["x.weight"])
    assert report.to_json()["kv_cache_quant_algo"] == "FP8"
    del state["x.weight_scale_2"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(NVFP4FormatError, match=r"x\.weight_scale_2") as info:
        read_checkpoint(tmp_path, {})
    # one error, in both trees: the engine's (a CheckpointError -> 400) and the format's
    assert isinstance(info.value, CheckpointError)
    assert isinstance(info.value, formats.NVFP4FormatError)


def _session(**kw: object) -> UpdateSession:
    expected = {
        "a": TensorSpec(torch.bfloat16, (2,)),
        "b": TensorSpec(torch.float32, (3,)),
    }
    return UpdateSession(update_id="u", weight_version=2, kind="base", expected=expected, **kw)  # type: ignore[arg-type]


def _bucket(items: list[tuple[str, torch.Tensor]], index: int, last: bool):  # type: ignore[no-untyped-def]
    m, buf = pack_bucket(items, update_id="u", weight_version=2, bucket_index=index, is_last=last)
    return m, unpack_bucket(m, buf)


def test_session_complete_and_faults() -> None:
    s = _session()
    s.add_bucket(*_bucket([("a", torch.ones(2, dtype=torch.bfloat16))], 0, False))
    s.add_bucket(*_bucket([("b", torch.ones(3))], 1, True))
    assert s.finish().success
    # missing
    s = _session()
    s.add_bucket(*_bucket([("a", torch.ones(2, dtype=torch.bfloat16))], 0, True))
    r = s.finish()
    assert not r.success
    assert r.missing == ["b"]
    # unknown
    s = _session()
    with pytest.raises(IncompleteUpdateError, match="'zz' is not expected"):
        s.add_bucket(*_bucket([("zz", torch.ones(2))], 0, True))
    assert s.finish().unexpected == ["zz"]
    # duplicate across buckets
    s = _session()
    s.add_bucket(*_bucket([("a", torch.ones(2, dtype=torch.bfloat16))], 0, False))
    with pytest.raises(IncompleteUpdateError, match="twice"):
        s.add_bucket(*_bucket([("a", torch.ones(2, dtype=torch.bfloat16))], 1, True))
    assert s.finish().duplicates == ["a"]
    # wrong dtype: no implicit cast
    s = _session()
    with pytest.raises(IncompleteUpdateError, match="float32"):
        s.add_bucket(*_bucket([("a", torch.ones(2))], 0, True))
    assert not s.finish().success
    # out-of-order bucket
    s = _session()
    with pytest.raises(UpdateSessionError, match="expected bucket 0"):
        s.add_bucket(*_bucket([("a", torch.ones(2, dtype=torch.bfloat16))], 1, True))


def test_versions_must_increase() -> None:
    check_version_increases(None, 0)
    check_version_increases(3, 4)
    with pytest.raises(StaleVersionError, match="does not increase"):
        check_version_increases(3, 3)


def test_sampling_is_seeded_and_respects_top_k_top_p() -> None:
    lp = torch.log_softmax(torch.tensor([3.0, 2.9, 0.0, -1.0, -5.0]), dim=-1)
    draws = [
        pick_token(lp, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(s))
        for s in range(200)
    ]
    again = [
        pick_token(lp, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(s))
        for s in range(200)
    ]
    assert draws == again
    assert len(set(draws)) >= 3
    topk = {
        pick_token(lp, SamplingConfig(top_k=2), torch.Generator().manual_seed(s))
        for s in range(100)
    }
    assert topk == {0, 1}
    topp = {
        pick_token(lp, SamplingConfig(top_p=0.5), torch.Generator().manual_seed(s))
        for s in range(100)
    }
    assert topp == {0}
    assert pick_token(lp, SamplingConfig(temperature=0.0), torch.Generator()) == 0
    tied = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert top_logprobs(tied, 2) == [(1.0, 1), (1.0, 2)]


def test_cli_flags_use_sglang_names() -> None:
    cfg = parse_args(
        [
            "--model-path", "m", "--port", "1234", "--enable-lora", "--max-loras-per-batch", "2",
            "--lora-paths", "a=/x", "b=/y", "--api-key", "k", "--random-seed", "7",
            "--numerics", "fast",
        ]
    )  # fmt: skip
    assert cfg.lora_paths == {"a": "/x", "b": "/y"}
    assert cfg.api_key == "k"
    assert (cfg.port, cfg.random_seed, cfg.numerics, cfg.host) == (1234, 7, "fast", "127.0.0.1")
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--lora-paths", "a=/x"])  # needs --enable-lora


def test_scheduler_batches_within_adapter_limit_and_bounds_queue() -> None:
    import asyncio

    from posttrain.local_engine import OverloadedError
    from posttrain.local_engine._scheduler import BatchScheduler

    batches: list[list[str | None]] = []

    def run(items: list[str | None]) -> list[str]:
        batches.append(list(items))
        return [f"done:{x}" for x in items]

    async def scenario() -> list[str]:
        sched: BatchScheduler[str | None, str] = BatchScheduler(
            run, batch_key=lambda x: x, abort_result=lambda x: "aborted",
            max_queue=6, max_batch=4, max_keys=2,
        )  # fmt: skip
        sched.start()
        sched.pause(abort_queued=False)
        task = asyncio.ensure_future(sched.submit(["a", None, "b", "c", None, "a"]))
        await asyncio.sleep(0.01)
        with pytest.raises(OverloadedError, match="queue full"):
            await sched.submit(["d"])
        sched.resume()
        out = await asyncio.wait_for(task, timeout=10)
        await sched.stop()
        return out

    out = asyncio.run(scenario())
    assert out == ["done:a", "done:None", "done:b", "done:c", "done:None", "done:a"]
    # first batch: a, None, b (two adapters), then c is held back; None and a still fit
    assert batches[0] == ["a", None, "b", None]
    assert all(len({x for x in b if x is not None}) <= 2 for b in batches)
    assert sorted(x or "" for b in batches for x in b) == sorted(["a", "", "b", "c", "", "a"])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.full((2, 8), float("nan")), r"lora_A\.weight contains NaN"),
        (torch.ones(2, 8, dtype=torch.int64), r"lora_A\.weight has dtype int64"),
        (torch.ones(3, 8), r"has rank 3 .* says r=2"),
    ],
)
def test_adapters_from_tensors_are_checked_by_the_formats_reader(
    bad: torch.Tensor, match: str
) -> None:
    from posttrain.local_engine import AdapterError
    from posttrain.local_engine._lora import adapter_from_tensors

    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    module = "model.layers.0.self_attn.q_proj"
    good = {
        formats.peft_key(module, "A"): torch.ones(2, 8),
        formats.peft_key(module, "B"): torch.ones(6, 2),
    }
    served = adapter_from_tensors("ok", config, good, {module: (8, 6)})
    assert served.scaling == 2.0
    bad_b = torch.ones(6, 3) if bad.shape[0] == 3 else good[formats.peft_key(module, "B")]
    tensors = {formats.peft_key(module, "A"): bad, formats.peft_key(module, "B"): bad_b}
    with pytest.raises(AdapterError, match=match) as info:  # a 400 before anything is served
        adapter_from_tensors("poisoned", config, tensors, {module: (8, 6)})
    assert "adapter 'poisoned'" in str(info.value)
