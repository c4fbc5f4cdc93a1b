"""Issue 35 against a real engine (HTTP on 127.0.0.1): media a client cannot use to hang the
engine or learn about its disk, weights that are finite but extreme, logprobs JSON can carry.

Findings covered: 2 (a file-path read that never ends: paths off unless
``--allowed-media-dir``, only regular files there, a bounded media pool), 4 (an escaped media
key cannot put decoding on the loop; the sentinel count is checked before any decode), 5 (no
file facts in errors), 6 (a 3e38 weight is refused; a non-finite logprob is ``null``), 8 (a
``.npy`` header's shape is bounded before allocation).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.interface import WireFormatError
from posttrain.interface.testing import AppServer
from posttrain.local_engine import EngineConfig, build_app
from posttrain.local_engine._errors import OverloadedError
from posttrain.local_engine._media import MediaPool
from posttrain.models import MediaFiles, encode_png_base64
from posttrain.models.__main__ import init_checkpoint

GEN = {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(
        tmp_path_factory.mktemp("mm") / "ck", arch="multimodal-tiny", max_positions=64, seed=2
    )


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    pixels = torch.randint(
        0, 256, (8, 8, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    (d / "ok.png").write_bytes(base64.b64decode(encode_png_base64(pixels)))
    outside = d.parent / "outside.png"
    outside.write_bytes((d / "ok.png").read_bytes())
    (d / "link.png").symlink_to(outside)
    os.mkfifo(d / "pipe.png")
    return d


@pytest.fixture(scope="module")
def closed(mm_dir: Path) -> Any:
    """An engine with file-path media off (the default)."""
    with AppServer(build_app(EngineConfig(model_path=str(mm_dir))), timeout_s=60) as s:
        yield s


@pytest.fixture(scope="module")
def opened(mm_dir: Path, media_dir: Path) -> Any:
    cfg = EngineConfig(model_path=str(mm_dir), allowed_media_dir=str(media_dir), media_workers=1)
    with AppServer(build_app(cfg), timeout_s=60) as s:
        yield s


def _gen(url: str, image: Any, text: str = "see <|image|>", **extra: Any) -> httpx.Response:
    body = {"text": text, "image_data": image, "sampling_params": GEN, **extra}
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def test_without_allowed_dir_paths_are_refused_alike_and_the_engine_keeps_serving(
    closed: Any, media_dir: Path
) -> None:
    refs = ["/proc/kmsg", str(media_dir / "ok.png"), "/no/such.png", str(media_dir / "pipe.png")]
    with ThreadPoolExecutor(8) as pool:  # more than the default thread pool's spare threads
        replies = list(pool.map(lambda ref: _gen(closed.url, ref), refs * 4))
    messages = set()
    for r in replies:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "image_data"
        messages.add(err["message"])
    assert len(messages) == 1, messages  # nothing tells a present file from a missing one
    assert "not allowed" in next(iter(messages))
    assert httpx.get(f"{closed.url}/health", timeout=10).status_code == 200
    big = {"input_ids": [5, 6], "rid": "x" * 40_000, "sampling_params": GEN}  # parsed off-loop
    assert httpx.post(f"{closed.url}/generate", json=big, timeout=60).status_code == 200


def test_inside_the_allowed_dir_only_regular_files_are_read(opened: Any, media_dir: Path) -> None:
    inline = base64.b64encode((media_dir / "ok.png").read_bytes()).decode()
    by_path = _gen(opened.url, str(media_dir / "ok.png"), return_logprob=True)
    by_value = _gen(opened.url, inline, return_logprob=True)
    assert by_path.status_code == 200, by_path.text
    assert by_path.json()["output_ids"] == by_value.json()["output_ids"]
    for ref in ("link.png", str(media_dir / "pipe.png"), "../outside.png", "/proc/kmsg"):
        r = _gen(opened.url, ref)
        assert r.status_code == 400, r.text
        assert "not allowed" in r.json()["error"]["message"]


def test_an_escaped_media_key_with_many_references_is_refused_before_any_decode(
    opened: Any, media_dir: Path
) -> None:
    """Finding 4: ``image\\u005fdata`` is the same key once parsed; 200 references for a
    prompt with one sentinel are refused from the count, before a single file is read."""
    refs = json.dumps([str(media_dir / "ok.png")] * 200)
    key = '"image\\u005fdata"'  # image_data, JSON-escaped
    raw = '{"text": "see <|image|>", ' + key + ": " + refs + ', "sampling_params": '
    raw += json.dumps(GEN) + "}"
    r = httpx.post(f"{opened.url}/generate", content=raw.encode(),
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == "image_data"
    assert "1 image sentinel token(s) but 200 image item(s)" in err["message"]
    assert "nothing was decoded" in err["message"]


def test_a_npy_with_a_huge_declared_shape_is_a_400_naming_audio_data(closed: Any) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "|u1", "fortran_order": False, "shape": (10**12, 8)}
    )
    npy = base64.b64encode(buf.getvalue() + bytes(16)).decode()
    body = {"text": "hear <|audio|>", "audio_data": npy, "sampling_params": GEN}
    r = httpx.post(f"{closed.url}/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "audio_data"
    assert "declares shape [1000000000000, 8]" in r.json()["error"]["message"]


def test_the_media_pool_is_bounded_and_has_a_deadline() -> None:
    """Stuck media work fills only the media pool: past capacity a 503 at once, past the
    deadline a 400 naming the field; the pool recovers when the work ends."""
    import asyncio

    pool = MediaPool(MediaFiles.engine(None), workers=1, timeout_s=0.2)
    release = threading.Event()

    async def scenario() -> list[str]:
        outcomes: list[str] = []
        jobs = [asyncio.ensure_future(pool.run(release.wait, field="image_data")) for _ in range(5)]
        await asyncio.sleep(0)
        try:
            await pool.run(lambda: None, field="image_data")
        except OverloadedError as exc:
            outcomes.append(f"503 {exc}")
        for job in jobs:
            try:
                await job
            except WireFormatError as exc:
                outcomes.append(f"400 {exc}")
        release.set()
        for _ in range(100):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.02)
        outcomes.append(str(await pool.run(lambda: 7, field="image_data")))
        return outcomes

    got = asyncio.run(scenario())
    assert got[0].startswith("503 image_data: media decoding is at capacity")
    assert all(o.startswith("400 image_data: media decoding took longer") for o in got[1:6])
    assert got[-1] == "7"
    pool.shutdown()


def _extreme_ckpt(src: Path, dst: Path, value: float, *, whole: bool = False) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    victim = sorted(k for k in tensors if k.endswith("q_proj.weight"))[0]
    tensors[victim] = tensors[victim].clone()
    if whole:
        tensors[victim].fill_(value)
    else:
        tensors[victim].view(-1)[0] = value
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_finite_but_extreme_weight_is_refused_and_the_old_weights_serve(
    closed: Any, mm_dir: Path, tmp_path: Path
) -> None:
    bad = _extreme_ckpt(mm_dir, tmp_path / "extreme", 3e38)
    before = httpx.get(f"{closed.url}/weights_checksum", timeout=30).json()
    r = httpx.post(f"{closed.url}/update_weights_from_disk", json={"model_path": str(bad)},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert "magnitude 3e+38" in r.json()["error"]["message"]
    assert httpx.get(f"{closed.url}/weights_checksum", timeout=30).json() == before


def test_non_finite_logprobs_are_null_never_a_500(
    mm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the bound lifted ($POSTTRAIN_MAX_ABS_WEIGHT=inf) a 3e38 weight gets in and the
    logprobs overflow: the reply still is JSON, with null where a logprob is not finite."""
    monkeypatch.setenv("POSTTRAIN_MAX_ABS_WEIGHT", "inf")
    bad = _extreme_ckpt(mm_dir, tmp_path / "extreme", 3e38, whole=True)
    with AppServer(build_app(EngineConfig(model_path=str(bad))), timeout_s=60) as s:
        body = {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": GEN}  # fmt: skip
        r = httpx.post(f"{s.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        lps = [e[0] for e in r.json()["meta_info"]["input_token_logprobs"]]
        assert None in lps[1:]


def test_a_non_json_config_is_a_checkpoint_error_not_an_nvfp4_one(
    closed: Any, mm_dir: Path, tmp_path: Path
) -> None:
    """The minor finding: ``/update_weights_from_disk`` named NVFP4 for a plain checkpoint."""
    bad = tmp_path / "ck"
    shutil.copytree(mm_dir, bad)
    (bad / "config.json").write_text("{not json")
    r = httpx.post(f"{closed.url}/update_weights_from_disk", json={"model_path": str(bad)},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "CheckpointError", err
    assert "config.json: not valid JSON" in err["message"]
