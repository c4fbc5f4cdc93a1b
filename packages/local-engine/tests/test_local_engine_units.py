"""Pure pieces: NVFP4 dequantization, the update session, sampling, config.

(The bucket format itself is tested in ``packages/formats``.)
"""

from __future__ import annotations

import pytest
import torch

from posttrain.formats import pack_bucket, unpack_bucket
from posttrain.interface import IncompleteUpdateError, StaleVersionError
from posttrain.local_engine import (
    NVFP4FormatError,
    UpdateSessionError,
    dequantize_nvfp4,
    parse_args,
)
from posttrain.local_engine._nvfp4 import E2M1_VALUES, dequantize_state_dict, read_quant_config
from posttrain.local_engine._sampling import SamplingConfig, pick_token, top_logprobs
from posttrain.local_engine._update import TensorSpec, UpdateSession, check_version_increases


def _nvfp4_reference(values: torch.Tensor, scales: torch.Tensor, s2: float) -> torch.Tensor:
    """Element-wise ModelOpt formula E2M1[c] * (float(s) * s2), written independently."""
    out = torch.empty(values.shape)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            out[i, j] = values[i, j] * (scales[i, j // 16].float() * s2)
    return out


def test_nvfp4_dequantize_unpacks_low_nibble_first() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 32), generator=gen)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = (torch.rand(3, 2, generator=gen) * 10 + 0.1).to(torch.float8_e4m3fn)
    got = dequantize_nvfp4("w", packed, scales, torch.tensor(0.25))
    want = _nvfp4_reference(E2M1_VALUES[codes], scales, 0.25)
    assert torch.equal(got, want)
    # byte 0 = code(x0) | code(x1) << 4: a 0x71 byte decodes to [0.5 (code 1), 6.0 (code 7)]
    one = dequantize_nvfp4(
        "w",
        torch.tensor([[0x71] * 8], dtype=torch.uint8),
        torch.ones(1, 1).to(torch.float8_e4m3fn),
        torch.tensor(1.0),
    )
    assert one[0, :2].tolist() == [0.5, 6.0]


def test_nvfp4_stacked_experts_and_state_dict(tmp_path) -> None:  # type: ignore[no-untyped-def]
    packed = torch.full((2, 4, 8), 0x22, dtype=torch.uint8)  # every code 2 -> 1.0
    scales = torch.ones(2, 4, 1).to(torch.float8_e4m3fn)
    got = dequantize_nvfp4("experts", packed, scales, torch.tensor([2.0, 3.0]))
    assert got[0].unique().tolist() == [2.0]
    assert got[1].unique().tolist() == [3.0]
    (tmp_path / "hf_quant_config.json").write_text(
        '{"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"],'
        ' "kv_cache_quant_algo": "FP8"}}'
    )
    report = read_quant_config(tmp_path)
    assert report is not None
    assert report.exclude_modules == ["lm_head"]
    state = {
        "x.weight": packed[0],
        "x.weight_scale": scales[0],
        "x.weight_scale_2": torch.tensor(2.0),
        "x.input_scale": torch.tensor(1.0),
        "norm.weight": torch.ones(4),
    }
    out = dequantize_state_dict(state, report, {"x.weight": torch.bfloat16})
    assert set(out) == {"x.weight", "norm.weight"}
    assert out["x.weight"].dtype == torch.bfloat16
    assert report.dequantized == ["x.weight"]
    with pytest.raises(NVFP4FormatError, match=r"x\.weight_scale_2"):
        dequantize_state_dict(
            {k: v for k, v in state.items() if k != "x.weight_scale_2"}, report, {}
        )
    with pytest.raises(NVFP4FormatError, match="weight_scale"):
        dequantize_nvfp4(
            "y", packed[0], torch.ones(4, 2).to(torch.float8_e4m3fn), torch.tensor(1.0)
        )


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
