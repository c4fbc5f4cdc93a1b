"""Pure pieces: the NVFP4 checkpoint reader, the update session, sampling, config.

(The bucket format itself is tested in ``packages/formats``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import posttrain.formats as formats
from posttrain.interface import IncompleteUpdateError, StaleVersionError
from posttrain.local_engine import (
    CheckpointError,
    NonFiniteWeightsError,
    NVFP4FormatError,
    parse_args,
)
from posttrain.local_engine._loader import read_checkpoint
from posttrain.local_engine._sampling import (
    SamplingConfig,
    pick_token,
    pick_tokens,
    top_logprobs,
)
from posttrain.local_engine._update import StagedUpdate, TensorSpec, check_version_increases


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
    (tmp_path / "config.json").write_text("{}")  # a checkpoint has one (its model's config)
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


def _staged() -> StagedUpdate:
    specs = {"a": TensorSpec(torch.bfloat16, (2,)), "b": TensorSpec(torch.float32, (3,))}
    return StagedUpdate(specs=specs)


def test_staged_update_checks_every_bucket_and_a_fault_fails_it_whole() -> None:
    s = _staged()
    s.add({"a": torch.ones(2, dtype=torch.bfloat16)})
    s.add({"b": torch.ones(3)})
    assert (s.buckets, sorted(s.staged), s.failed) == (2, ["a", "b"], None)
    for bucket, match in [
        ({"zz": torch.ones(2)}, "'zz' is not a weight"),
        ({"a": torch.ones(2)}, "float32"),  # wrong dtype: no implicit cast
        ({"a": torch.ones(3, dtype=torch.bfloat16)}, r"\[3\]"),
        ({"b": torch.tensor([1.0, float("inf"), 0.0])}, "Inf"),
    ]:
        s = _staged()
        s.add({"a": torch.ones(2, dtype=torch.bfloat16)} if "a" not in bucket else {})
        with pytest.raises((IncompleteUpdateError, NonFiniteWeightsError), match=match):
            s.add(bucket)
        assert s.failed is not None
        assert s.staged == {}  # nothing of a failed update is kept
        with pytest.raises(IncompleteUpdateError, match="already refused"):
            s.add({"b": torch.ones(3)})  # its later buckets are dropped too
    s = _staged()
    s.add({"a": torch.ones(2, dtype=torch.bfloat16)})
    with pytest.raises(IncompleteUpdateError, match="twice"):
        s.add({"a": torch.ones(2, dtype=torch.bfloat16)})


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


@pytest.mark.parametrize("vocab", [5, 101, 4099])
def test_pick_tokens_equals_pick_token_row_by_row(vocab: int) -> None:
    """A decode step's tokens chosen together are each row's own ``pick_token`` draw, whatever
    the rows' configs and whichever rows share the call (the generators advance alike too)."""
    gen = torch.Generator().manual_seed(vocab)
    configs = [SamplingConfig(), SamplingConfig(temperature=0.7), SamplingConfig(top_k=3),
               SamplingConfig(top_p=0.8), SamplingConfig(temperature=0.0),
               SamplingConfig(min_p=0.1)]  # fmt: skip
    for step in range(20):
        rows = [
            torch.log_softmax(torch.randn(vocab, generator=gen) * (1 + k % 4), dim=-1)
            for k in range(48)
        ]
        cfgs = [configs[(k * 7 + step) % len(configs)] if k % 3 else SamplingConfig()
                for k in range(48)]  # fmt: skip
        seeds = [step * 1000 + k for k in range(48)]
        alone = [pick_token(r, c, torch.Generator().manual_seed(s))
                 for r, c, s in zip(rows, cfgs, seeds, strict=True)]  # fmt: skip
        together = [torch.Generator().manual_seed(s) for s in seeds]
        assert pick_tokens(rows, cfgs, together) == alone
        few = [torch.Generator().manual_seed(s) for s in seeds[:2]]
        assert pick_tokens(rows[:2], cfgs[:2], few) == alone[:2]  # its batch mates do not matter
        after = [torch.rand((), generator=g).item() for g in together]
        again = [torch.Generator().manual_seed(s) for s in seeds]
        for r, c, g in zip(rows, cfgs, again, strict=True):
            pick_token(r, c, g)
        assert after == [torch.rand((), generator=g).item() for g in again]


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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-threads", "0"], "--num-threads 0 must be positive"),
        (["--max-request-bytes", "-1"], "--max-request-bytes -1 must be positive"),
        (["--max-loaded-loras", "0"], "--max-loaded-loras 0 must be positive"),
        (["--media-timeout-s", "nan"], "--media-timeout-s nan must be finite and > 0"),
        (["--update-group-timeout", "inf"], "--update-group-timeout inf must be finite and > 0"),
    ],
)
def test_cli_refuses_non_positive_and_non_finite_limits_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--model-path", "m", *flags])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


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
    from posttrain.local_engine import AdapterError, NonFiniteWeightsError
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
    # a 400 before anything is served; NaN/Inf is the engine's NonFiniteWeightsError
    expected = NonFiniteWeightsError if "NaN" in match else AdapterError
    with pytest.raises(expected, match=match) as info:
        adapter_from_tensors("poisoned", config, tensors, {module: (8, 6)})
    assert "adapter 'poisoned'" in str(info.value)


def test_off_loop_parsing_is_decided_by_body_size_alone() -> None:
    """Issue 35: never by a key found in the raw bytes (``image\\u005fdata`` escapes it); a
    request naming media goes to the media pool after parsing (test_local_engine_hostile_media)."""
    import asyncio
    import threading

    from posttrain.local_engine._http import INLINE_BODY_BYTES, off_loop_if_large

    async def thread_of(raw: bytes) -> int:
        return await off_loop_if_large(raw, threading.get_ident)

    loop_thread = threading.get_ident()
    for raw in (b'{"text": "hi"}', b'{"text": "hi", "image_data": "/tmp/x.png"}'):
        assert asyncio.run(thread_of(raw)) == loop_thread
    big = b'{"text": "%s"}' % (b"a" * INLINE_BODY_BYTES)
    assert asyncio.run(thread_of(big)) != loop_thread


def test_the_api_key_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, finding 7: ``--api-key-file`` / $POSTTRAIN_API_KEY, so argv holds no key."""
    from posttrain.local_engine._config import parse_args

    key = tmp_path / "k"
    key.write_text("s3cret\n")
    assert parse_args(["--model-path", "/m", "--api-key-file", str(key)]).api_key == "s3cret"
    monkeypatch.setenv("POSTTRAIN_API_KEY", "from-env")
    assert parse_args(["--model-path", "/m"]).api_key == "from-env"
    (tmp_path / "two").write_text("a b")
    for bad in (str(tmp_path / "two"), str(tmp_path / "missing")):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "/m", "--api-key-file", bad])


def test_scheduler_stream_admits_between_steps_and_yields_to_exclusive_calls() -> None:
    """``run_stream``: items queued while a batch runs join it (within max_batch and the
    adapter limit), each result is delivered when its item finishes, and a waiting
    ``call_exclusive`` stops admission so it runs between batches."""
    import asyncio
    import threading
    from collections.abc import Callable, Sequence

    from posttrain.local_engine._scheduler import BatchScheduler

    log: list[str] = []
    step = threading.Event()

    def stream(
        first: Sequence[tuple[object, str | None]],
        admit: Callable[[int], Sequence[tuple[object, str | None]]],
        finish: Callable[[object, str], None],
        rows: int,
    ) -> None:
        running = list(first)
        log.append(f"start {[x for _, x in running]}")
        while running:
            step.wait(timeout=10)  # one "decode step" per release by the test
            step.clear()
            h, x = running.pop(0)
            finish(h, f"done:{x}")
            joined = list(admit(rows - len(running)))
            log.append(f"joined {[x for _, x in joined]}")
            running += joined

    async def scenario() -> list[str]:
        sched: BatchScheduler[str | None, str] = BatchScheduler(
            lambda items: [], batch_key=lambda x: x, abort_result=lambda x: "aborted",
            max_batch=3, max_keys=1, run_stream=stream,
        )  # fmt: skip
        sched.start()
        first = asyncio.ensure_future(sched.submit(["a", "a"]))
        while not log:
            await asyncio.sleep(0.01)
        later = asyncio.ensure_future(sched.submit(["b", None, "a"]))
        await asyncio.sleep(0.05)
        step.set()  # a finishes; None and a join (b waits: one adapter per batch)
        while len(log) < 2:
            await asyncio.sleep(0.01)
        exclusive = asyncio.ensure_future(sched.call_exclusive(lambda: log.append("swap")))
        await asyncio.sleep(0.05)
        for _ in range(8):  # drain: nothing joins while the swap waits
            step.set()
            await asyncio.sleep(0.05)
        out = await asyncio.wait_for(first, 10)
        await asyncio.wait_for(exclusive, 10)
        for _ in range(4):  # b's own batch, after the swap
            step.set()
            await asyncio.sleep(0.05)
        out += await asyncio.wait_for(later, 10)
        await sched.stop()
        return out

    out = asyncio.run(scenario())
    assert out == ["done:a", "done:a", "done:b", "done:None", "done:a"]
    assert log[:2] == ["start ['a', 'a']", "joined [None, 'a']"]
    assert "joined ['b']" not in log
    swap = log.index("swap")
    assert all(not e.startswith("joined ['") for e in log[2:swap])  # nothing joined meanwhile
    assert log[swap + 1] == "start ['b']"


def test_default_batch_size_is_bounded_by_kv_memory() -> None:
    from posttrain.local_engine import EngineConfig
    from posttrain.local_engine._config import DEFAULT_MAX_RUNNING, kv_budget_bytes
    from posttrain.models import KVCache, ModelConfig

    cfg = EngineConfig(model_path="m")
    recipe_row = KVCache.row_bytes(ModelConfig.tiny(max_position_embeddings=64))
    assert recipe_row == 32 * 1024
    assert cfg.running_limit(recipe_row) == DEFAULT_MAX_RUNNING == 128
    budget = kv_budget_bytes()
    assert 0 < budget <= 2 * 2**30
    assert cfg.running_limit(budget // 5) == 5  # 5 rows fit the budget, a 6th would not
    assert cfg.running_limit(budget * 3) == 1  # never below one
    assert EngineConfig(model_path="m", max_running_requests=8).running_limit(budget) == 8
    from posttrain.interface import ConfigError

    with pytest.raises(ConfigError, match="max-running-requests"):
        EngineConfig(model_path="m", max_running_requests=0)
