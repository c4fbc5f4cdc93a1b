"""Hostile and broken inputs (issue #18): non-finite weights and adapters, refused updates that
must leave the engine serving, bad checkpoints, JSON for every error, huge texts, and fuzzed
request bodies. Each refusal is a 4xx with a stable ``error.type``; the weights checksum and
version show nothing changed, and generation still answers."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from posttrain.formats import adapter_push_body
from posttrain.interface import GenerateRequest, PosttrainError
from posttrain.local_engine import EngineConfig, create_app
from posttrain.local_engine._codec import load_codec
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import Engine
from posttrain.local_engine._loader import load_model, read_checkpoint
from posttrain.local_engine._requests import drop_neutral_sglang_keys, tasks_from_generate

PEFT_CONFIG = {
    "peft_type": "LORA",
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["q_proj", "v_proj"],
    "lora_dropout": 0.0,
    "bias": "none",
}
PROMPT = [5, 17, 33, 9]


def _gen(c: Any, lora: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "sampling_seed": 3, "ignore_eos": True},
        "return_logprob": True,
    }
    if lora is not None:
        body["lora_path"] = lora
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    lps = [e[0] for e in r.json()["meta_info"]["output_token_logprobs"]]
    assert all(math.isfinite(lp) for lp in lps)
    return dict(r.json())


def _state(c: Any) -> tuple[str, int | None]:
    """What the engine serves: (weights sha256, weight version)."""
    info = c.get("/weights_checksum").json()
    return info["sha256"], info["weight_version"]


def _assert_refused(r: Any, status: int, kind: str, *needles: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == kind, err
    for needle in needles:
        assert needle in err["message"], err


def _assert_serving(c: Any, before: tuple[str, str]) -> None:
    assert _state(c) == before
    assert c.get("/health_generate").status_code == 200
    assert c.get("/server_info").json()["weights_serviceable"] is True
    _gen(c)


def _write_ckpt(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _adapter_tensors(engine_targets: Any, *, poison: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    out: dict[str, torch.Tensor] = {}
    for module, (d_in, d_out) in sorted(engine_targets.items()):
        if module.endswith(("q_proj", "v_proj")):
            out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(2, d_in, generator=gen)
            out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(d_out, 2, generator=gen)
    if poison:
        last = sorted(out)[-1]
        out[last][0, 0] = float("nan")
    return out


# ---- 2. non-finite weights and adapters are refused before anything is swapped ------------


def test_all_nan_checkpoint_from_disk_is_refused(engine, ckpt_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tensors = {k: torch.full_like(v, math.nan) for k, v in load_file(ckpt_dir / "model.safetensors").items()}  # fmt: skip
    bad = _write_ckpt(ckpt_dir, tmp_path / "nan", tensors)
    with engine() as c:
        before = _state(c)
        r = c.post(
            "/update_weights_from_disk", json={"model_path": str(bad), "weight_version": "2"}
        )
        _assert_refused(r, 400, "NonFiniteWeightsError", "non-finite")
        _assert_serving(c, before)


def test_a_nan_checkpoint_does_not_start(ckpt_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(ckpt_dir / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = math.nan
    bad = _write_ckpt(ckpt_dir, tmp_path / "nan-boot", tensors)
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: NonFiniteWeightsError")
    assert name in proc.stderr


def test_health_generate_is_503_when_weights_produce_nan(ckpt_dir: Path) -> None:
    with _app(ckpt_dir) as (c, model):
        assert c.get("/health_generate").status_code == 200
        # A fault no route lets in (every install path checks first): memory corrupted under
        # the engine, simulated by writing NaN into the served weights directly.
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(math.nan)
        _assert_refused(c.get("/health_generate"), 503, "UnavailableError", "not finite")


# ---- 3. refused updates leave the engine serving; every error is JSON ---------------------


def _bad_checkpoints(ckpt_dir: Path, root: Path) -> dict[str, tuple[Path, str]]:
    tensors = load_file(ckpt_dir / "model.safetensors")
    name = sorted(tensors)[0]
    wrong = dict(tensors)
    wrong[name] = torch.zeros(3, 5, dtype=tensors[name].dtype)
    out = {
        "nonexistent": (root / "nope", "CheckpointError"),
        "wrong shape": (_write_ckpt(ckpt_dir, root / "wrong", wrong), "IncompleteUpdateError"),
        "a file, not a dir": (ckpt_dir / "config.json", "CheckpointError"),
    }
    data = (ckpt_dir / "model.safetensors").read_bytes()
    for label, blob in [
        ("truncated", data[: len(data) // 2]),
        ("garbage", os.urandom(4096)),
        ("huge header length", (1 << 40).to_bytes(8, "little") + b"{}"),
        ("empty", b""),
    ]:
        d = root / label.replace(" ", "-")
        d.mkdir()
        shutil.copy(ckpt_dir / "config.json", d / "config.json")
        (d / "model.safetensors").write_bytes(blob)
        out[label] = (d, "CheckpointError")
    d = root / "bad-index"
    d.mkdir()
    shutil.copy(ckpt_dir / "config.json", d / "config.json")
    (d / "model.safetensors.index.json").write_text("[1, 2")
    out["malformed index"] = (d, "CheckpointError")
    return out


def test_refused_disk_updates_keep_the_engine_serving(
    engine, ckpt_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    cases = _bad_checkpoints(ckpt_dir, tmp_path)
    with engine() as c:
        before = _state(c)
        for label, (path, kind) in cases.items():
            r = c.post("/update_weights_from_disk", json={"model_path": str(path)})
            assert r.status_code == 400, (label, r.text)
            assert r.json()["error"]["type"] == kind, (label, r.json())
            _assert_serving(c, before)
        # a good checkpoint still loads afterwards
        r = c.post(
            "/update_weights_from_disk", json={"model_path": str(ckpt_dir), "weight_version": "4"}
        )
        assert r.status_code == 200, r.text
        assert _state(c) == (before[0], 4)


def test_read_checkpoint_names_the_directory(ckpt_dir: Path, tmp_path: Path) -> None:
    for path, kind in _bad_checkpoints(ckpt_dir, tmp_path).values():
        if kind != "CheckpointError":
            continue  # a readable checkpoint of the wrong shape is the engine's to refuse
        with pytest.raises(PosttrainError, match=str(path.name)):
            read_checkpoint(path, {})


def test_an_unexpected_exception_is_a_json_500_and_the_engine_serves_on(ckpt_dir: Path) -> None:
    def broken_loader(path: str) -> dict[str, torch.Tensor]:
        raise RuntimeError(f"a bug while reading {path}")

    with _app(ckpt_dir, load_checkpoint=broken_loader) as (c, _):
        before = _state(c)
        r = c.post("/update_weights_from_disk", json={"model_path": str(ckpt_dir)})
        _assert_refused(r, 500, "InternalServerError", "RuntimeError")
        _assert_serving(c, before)


# ---- 4. long work never blocks the event loop; long texts are refused before tokenizing ---


class _CountingCodec:
    """The real tokenizer, counting the texts it tokenizes; ``gate`` holds ``encode`` until set."""

    def __init__(self, inner: Any, gate: threading.Event | None = None) -> None:
        self.inner = inner
        self.gate = gate
        self.entered = threading.Event()
        self.encoded: list[int] = []
        self.max_chars_per_token = inner.max_chars_per_token

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=30)
        return list(self.inner.encode(text))

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))

    def chat_text(self, messages: Any, **kw: Any) -> str:
        return str(self.inner.chat_text(messages, **kw))


class _app:  # noqa: N801 - a context manager used like a function
    """An engine app over ``ckpt_dir`` built by hand, so a test can swap its codec or loader."""

    def __init__(self, ckpt_dir: Path, *, codec: Any = None, load_checkpoint: Any = None) -> None:
        from starlette.testclient import TestClient

        model, _ = load_model(ckpt_dir)
        self.model = model
        real = load_codec(ckpt_dir)
        engine = Engine(model, eos_token_ids=real.eos_token_ids if real else ())
        specs = {k: s.dtype for k, s in engine.param_specs().items()}
        ctx = ServerContext(
            config=EngineConfig(model_path=str(ckpt_dir)),
            engine=engine,
            codec=codec or real,
            load_checkpoint=load_checkpoint or (lambda p: read_checkpoint(p, specs)[0]),
        )
        self.app = create_app(ctx)
        self.client = TestClient(self.app)

    def __enter__(self) -> tuple[Any, Any]:
        return self.client.__enter__(), self.model

    def __exit__(self, *exc: object) -> None:
        self.client.__exit__(*exc)


@pytest.mark.parametrize("megabytes", [4, 10])
def test_a_huge_text_is_refused_before_tokenizing(ckpt_dir: Path, megabytes: int) -> None:
    codec = _CountingCodec(load_codec(ckpt_dir))
    text = "hello world " * (megabytes * (1 << 20) // 12)
    with _app(ckpt_dir, codec=codec) as (c, _):
        r = c.post("/generate", json={"text": text})
        _assert_refused(r, 400, "WireFormatError", "refused before tokenizing")
        assert r.json()["error"]["field"] == "text"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
        _assert_refused(r, 400, "WireFormatError", "refused before tokenizing")
        batch = c.post("/generate", json={"text": ["hi", text]})
        _assert_refused(batch, 400, "WireFormatError", "text[1]")
        assert codec.encoded == []  # nothing was tokenized
        assert c.post("/generate", json={"text": "hi"}).status_code == 200


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_health_answers_while_a_prompt_is_being_tokenized(ckpt_dir: Path, route: str) -> None:
    """The tokenizer is held mid-``encode``; ``/health`` must answer meanwhile (it could not
    while tokenizing ran on the event loop: then this test's health call never returns)."""
    gate = threading.Event()
    codec = _CountingCodec(load_codec(ckpt_dir), gate)
    # past INLINE_BODY_BYTES, so the request takes the path a large prompt takes
    pad = {"rid": "x" * (70 * 1024)}
    if route == "/generate":
        body: dict[str, Any] = {"text": "a" * 20, **pad}
    else:
        body = {"messages": [{"role": "user", "content": "b" * 20}], **pad}
    result: dict[str, Any] = {}
    with _app(ckpt_dir, codec=codec) as (c, _):  # one event loop; requests from two threads
        sender = threading.Thread(target=lambda: result.update(big=c.post(route, json=body)))
        sender.start()
        try:
            assert codec.entered.wait(timeout=30), "the prompt never reached the tokenizer"
            prober = threading.Thread(target=lambda: result.update(health=c.get("/health")))
            prober.start()
            prober.join(timeout=20)
            assert not prober.is_alive(), "/health did not answer while a prompt was tokenized"
            assert result["health"].status_code == 200
            assert sender.is_alive()  # the big request was still in flight meanwhile
        finally:
            gate.set()
            sender.join(timeout=60)
    assert result["big"].status_code == 200, result["big"].text


# ---- fuzzing the request parsers (untrusted bytes) ----------------------------------------

_scalars = st.none() | st.booleans() | st.integers(-3, 300) | st.floats() | st.text(max_size=6)
# JSON of bounded depth: scalars, then lists and objects of JSON (hypothesis shrinks to scalars)
_json: st.SearchStrategy[Any] = st.deferred(
    lambda: (
        _scalars
        | st.lists(_json, max_size=3)
        | st.dictionaries(st.text(max_size=8), _json, max_size=3)
    )
)
_keys = st.sampled_from(
    ["text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
     "top_logprobs_num", "token_ids_logprob", "lora_path", "rid", "stream", "model",
     "max_new_tokens", "temperature", "stop", "return_text_in_logprobs"]
)  # fmt: skip
_generate_bodies = st.dictionaries(_keys, _json, max_size=6) | _json


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_generate_bodies, raw=st.binary(max_size=48))
def test_fuzz_generate_parsing_gives_tasks_or_a_named_error(
    body: Any, raw: bytes, ckpt_dir: Path
) -> None:
    from posttrain.local_engine._http import decode_json

    codec = _fuzz_codec(ckpt_dir)
    for blob in (json.dumps(body).encode(), raw):
        try:
            req = GenerateRequest.parse(drop_neutral_sglang_keys(decode_json(blob)))
            tasks, options = tasks_from_generate(
                req, codec=codec, next_seed=lambda: 0, max_context=48
            )
        except PosttrainError:
            continue
        assert len(tasks) == len(options) == req.batch_size


_CODECS: dict[Path, Any] = {}


def _fuzz_codec(ckpt_dir: Path) -> Any:
    if ckpt_dir not in _CODECS:
        _CODECS[ckpt_dir] = load_codec(ckpt_dir)
    return _CODECS[ckpt_dir]


@pytest.fixture(scope="module")
def served_engine(ckpt_dir: Path) -> Iterator[Any]:
    with _app(ckpt_dir) as (c, _):
        yield c


# ---- --help ---------------------------------------------------------------------------------


def test_help_gives_every_option_a_text_and_its_default() -> None:
    from posttrain.local_engine._config import build_parser

    parser = build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []
    text = " ".join(parser.format_help().split())
    shown = {"--port": "30000", "--host": "127.0.0.1", "--max-running-requests": "8"}
    assert all(f"{flag} " in text and f"(default: {v})" in text for flag, v in shown.items())
    assert "state-changing" in text


def test_nan_adapters_are_refused_on_every_path(engine, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    good = _adapter_tensors(reference.lora_targets())
    bad = _adapter_tensors(reference.lora_targets(), poison=True)
    good_dir, bad_dir = tmp_path / "good", tmp_path / "bad"
    for d, t in ((good_dir, good), (bad_dir, bad)):
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(PEFT_CONFIG))
        save_file(t, str(d / "adapter_model.safetensors"))
    with engine(enable_lora=True, lora_paths={"a": str(good_dir)}) as c:
        before_base = _state(c)
        served = _gen(c, "a")["output_ids"]
        # by path
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(bad_dir)})
        _assert_refused(r, 400, "NonFiniteWeightsError", "adapter 'a'", "lora_B")
        # from tensors, in SGLang's body (serialized_named_tensors)
        body = adapter_push_body("a", PEFT_CONFIG, bad).to_dict()
        r = c.post("/load_lora_adapter_from_tensors", json=body)
        _assert_refused(r, 400, "NonFiniteWeightsError")
        # an adapter whose scaling is not finite: its config is refused, naming lora_alpha
        inf_cfg = {**PEFT_CONFIG, "lora_alpha": "inf"}
        r = c.post(
            "/load_lora_adapter_from_tensors", json=adapter_push_body("a", inf_cfg, good).to_dict()
        )
        _assert_refused(r, 400, "AdapterError", "lora_alpha")
        # a corrupt weights file and a config that is a JSON list: named, not a 500
        broken = tmp_path / "broken"
        shutil.copytree(good_dir, broken)
        (broken / "adapter_model.safetensors").write_bytes(b"\x10" * 64)
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(broken)})
        _assert_refused(r, 400, "AdapterError", "safetensors")
        shutil.copy(good_dir / "adapter_model.safetensors", broken / "adapter_model.safetensors")
        (broken / "adapter_config.json").write_text("[1, 2]")
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(broken)})
        _assert_refused(r, 400, "AdapterError")
        # the adapter that was loaded still serves, unchanged; so does the base
        assert _gen(c, "a")["output_ids"] == served
        _assert_serving(c, before_base)
        assert c.get("/v1/models").json()["data"][1]["root"] == str(good_dir)


def test_every_error_is_json_with_a_type(engine) -> None:  # type: ignore[no-untyped-def]
    with engine() as c:
        _assert_refused(c.get("/no_such_route"), 404, "NotFound")
        _assert_refused(c.get("/generate"), 405, "MethodNotAllowed")
        _assert_refused(c.post("/generate", content=b"{not json"), 400, "WireFormatError")
        _assert_refused(c.post("/generate", content=b"[" * 100_000), 400, "WireFormatError")
        _assert_refused(c.post("/generate", json=[1, 2]), 400, "WireFormatError")
        bucket = {"names": ["x"], "dtypes": ["bfloat16"], "shapes": [[2]]}
        r = c.post("/update_weights_from_distributed", json={**bucket, "shapes": [["two"]]})
        _assert_refused(r, 400, "WireFormatError")
        r = c.post("/update_weights_from_distributed", json=bucket)  # no group joined
        _assert_refused(r, 400, "UpdateSessionError", "not joined")
        init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                "world_size": 2, "backend": "nccl"}  # fmt: skip
        _assert_refused(
            c.post("/init_weights_update_group", json=init), 400, "UpdateSessionError", "gloo"
        )


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(body=_generate_bodies, route=st.sampled_from(["/generate", "/v1/chat/completions", "/update_weights_from_disk", "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weight_version", "/update_weights_from_tensor", "/load_lora_adapter_from_tensors", "/pause_generation"]))  # fmt: skip
def test_fuzz_every_route_answers_json(body: Any, route: str, served_engine: Any) -> None:
    r = served_engine.post(route, content=json.dumps(body).encode())
    assert r.status_code in (200, 400, 409, 413, 503), (route, body, r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["type"]
    served_engine.post("/continue_generation")  # a fuzzed pause must not starve later examples
