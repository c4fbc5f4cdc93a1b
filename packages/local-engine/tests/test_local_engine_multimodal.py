"""Images and audio over real HTTP (127.0.0.1), memory release/resume, and issue 25's trap 3.

The engine serves a ``multimodal-tiny`` checkpoint (``python -m posttrain.models init --arch
multimodal-tiny``); its logprobs on prompts with ``image_data`` / ``audio_data`` equal the
trainer's packed forward bit for bit.

Trap 3 (dead tower-sync gate), the engine's half: after an offload/onload cycle the engine's
towers are stale until a sync sends them again. Sent (``with_towers``), its ``tower_sha256`` and
image-prompt logprobs equal the trainer's; not sent (what a dead gate does), it refuses to
generate and names the stale tower tensors. The gate itself is grpo's ``towers_due`` (keyed on
``has_towers``), tested against this engine in
``integration_tests/test_integration_grpo_tower_sync.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from posttrain.formats import EngineClient, push_distributed, tensors_sha256
from posttrain.interface.testing import AppServer
from posttrain.local_engine import EngineConfig, build_app
from posttrain.local_engine._engine import Engine
from posttrain.models import (
    DecoderModel,
    MediaBatch,
    build_tokenizer,
    decode_media,
    encode_npy_base64,
    encode_png_base64,
    encode_wav_base64,
    expand_media_tokens,
    has_towers,
    load_pretrained,
    tower_parameter_names,
)
from posttrain.models.__main__ import init_checkpoint

TOK = build_tokenizer(multimodal=True)
GEN = {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 2, "temperature": 1.0}


def _png(h: int, w: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return encode_png_base64(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=gen))


def _wav(samples: int) -> str:
    t = torch.arange(samples, dtype=torch.float32) / 16000.0
    return encode_wav_base64(0.4 * torch.sin(2 * torch.pi * 300.0 * t))


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(
        tmp_path_factory.mktemp("mm") / "ck", arch="multimodal-tiny", max_positions=64, seed=2
    )


@pytest.fixture(scope="module")
def server(mm_dir: Path) -> Any:
    with AppServer(build_app(EngineConfig(model_path=str(mm_dir))), timeout_s=60) as s:
        yield s


def _trainer_logprobs(
    model: DecoderModel, texts: list[str], images: list[list[str]], audio: list[list[str]],
    replies: list[dict[str, Any]],
) -> tuple[list[float], list[float]]:  # fmt: skip
    """(served, trainer) logprobs of every prompt and output token after the first, packed."""
    seqs, batches, served = [], [], []
    for text, imgs, auds, reply in zip(texts, images, audio, replies, strict=True):
        items = decode_media(model.config, images=imgs, audio=auds)
        ids, batch = expand_media_tokens(TOK.encode(text), items, model.config)
        meta = reply["meta_info"]
        assert meta["prompt_tokens"] == len(ids)  # placeholders are counted, as in SGLang
        seqs.append(ids + reply["output_ids"])
        batches.append(batch if len(batch) else None)
        served += [e[0] for e in meta["input_token_logprobs"][1:]]
        served += [e[0] for e in meta["output_token_logprobs"]]
    lengths = [len(s) for s in seqs]
    flat = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        lp = model.forward_logprobs(flat, lengths, media=MediaBatch.pack(batches, lengths))
    starts = {sum(lengths[:j]) for j in range(len(seqs))}
    return served, [float(x) for t, x in enumerate(lp.tolist()) if t not in starts]


def test_generate_with_images_and_audio_equals_the_trainer(server: Any, mm_dir: Path) -> None:
    texts = ["look <|image|> then <|audio|> and <|image|>:", "just text", "<|audio|>?"]
    images = [[_png(8, 8, 1), _png(4, 12, 2)], [], []]
    npy = encode_npy_base64(torch.randint(0, 256, (3, 8), dtype=torch.uint8))
    audio = [[_wav(1200)], [], [npy]]
    body = {"text": texts, "image_data": [images[0], None, []], "audio_data": [audio[0], None, npy],
            "return_logprob": True, "logprob_start_len": 0, "sampling_params": GEN}  # fmt: skip
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    served, trainer = _trainer_logprobs(load_pretrained(mm_dir), texts, images, audio, r.json())
    assert served == trainer  # bit for bit, the three prompts packed into one training forward
    info = httpx.get(f"{server.url}/model_info").json()
    assert info["has_image_understanding"] is True
    assert info["has_audio_understanding"] is True


def test_chat_with_image_data_equals_the_trainer(server: Any, mm_dir: Path) -> None:
    img = _png(8, 4, 5)
    msgs = [{"role": "user", "content": "what is in <|image|>?"}]
    body = {"messages": msgs, "image_data": img, "max_tokens": 5, "seed": 3, "logprobs": True,
            "return_meta_info": True}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    meta = r.json()["choices"][0]["meta_info"]
    text = TOK.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    model = load_pretrained(mm_dir)
    ids, batch = expand_media_tokens(
        TOK.encode(text), decode_media(model.config, images=[img]), model.config
    )
    out = [e[1] for e in meta["output_token_logprobs"]]
    with torch.no_grad():
        lp = model.forward_logprobs(torch.tensor(ids + out), [len(ids) + len(out)], media=batch)
    assert [e[0] for e in meta["output_token_logprobs"]] == lp[len(ids) :].tolist()
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"text": "a <|image|>", "image_data": "@@not base64@@"}, "image_data", "valid base64"),
        ({"text": "a <|image|> <|image|>", "image_data": [_png(4, 4, 0)]}, "image_data",
         "2 image sentinel"),
        ({"text": "a", "image_data": [_png(4, 4, 0)]}, "image_data", "0 image sentinel"),
        ({"text": "a <|image|>", "image_data": _png(6, 4, 0)}, "image_data", "patch size 4"),
        ({"text": "a <|audio|>", "audio_data": _png(4, 4, 0)}, "audio_data", "neither a WAV"),
        ({"text": "a <|audio|>", "audio_data": _wav(100)}, "audio_data", "fewer than one frame"),
        ({"text": ["a", "b"], "image_data": [_png(4, 4, 0)]}, "image_data", "one per prompt"),
        ({"text": "a <|audio|>", "audio_data": [""]}, "audio_data", "non-empty"),
    ],
)  # fmt: skip
def test_bad_media_is_a_400_naming_the_field(
    server: Any, body: dict[str, Any], field: str, message: str
) -> None:
    r = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == field
    assert message in err["message"]


def test_text_only_model_refuses_media(ckpt_dir: Path) -> None:
    with AppServer(build_app(EngineConfig(model_path=str(ckpt_dir))), timeout_s=60) as s:
        r = httpx.post(f"{s.url}/generate", json={"text": "a", "image_data": _png(4, 4, 0)})
        chat = httpx.post(
            f"{s.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a"}], "audio_data": [_wav(800)]},
        )
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "image_data"
    assert "no vision tower" in r.json()["error"]["message"]
    assert chat.status_code == 400
    assert chat.json()["error"]["field"] == "audio_data"


# ---------------------------------------------------------------------------- memory, trap 3


def test_release_frees_the_weights_and_resume_needs_every_tensor_again(mm_dir: Path) -> None:
    model = load_pretrained(mm_dir)
    engine = Engine(model)
    before = sum(p.numel() for p in model.parameters())
    assert engine.release_memory(None) == ["kv_cache", "weights"]
    assert sum(p.untyped_storage().nbytes() for p in model.parameters()) == 0  # freed for real
    assert engine.resume_memory(["kv_cache"]) == ["weights"]
    assert engine.resume_memory(None) == []
    assert sum(p.numel() for p in model.parameters()) == before
    assert len(engine.stale_tensors) == len(engine.param_specs())
    with pytest.raises(Exception, match="not been re-sent"):
        engine.check_available()


def _resync(model: DecoderModel, url: str, version: int, *, with_towers: bool) -> None:
    """A full sync after an engine onload: the trained decoder weights, and the frozen towers
    when ``with_towers``."""
    hf = model.hf_state_dict()
    towers = set(tower_parameter_names(model))
    assert towers
    assert has_towers(model)
    send = {n: t for n, t in hf.items() if with_towers or n not in towers}
    with EngineClient(url, timeout_s=60) as client:
        push_distributed([client], list(send.items()), weight_version=version, timeout_s=60)


def _check_engine_equals_trainer(url: str, model: DecoderModel) -> None:
    hf = model.hf_state_dict()
    towers = tensors_sha256({n: hf[n] for n in tower_parameter_names(model)})
    checksum = httpx.get(f"{url}/weights_checksum", timeout=30).json()
    assert checksum["tower_sha256"] == towers, "engine tower weights differ from the trainer's"
    text, img = "count <|image|>:", _png(8, 8, 7)
    body = {"text": text, "image_data": [img], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": GEN}  # fmt: skip
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    served, trainer = _trainer_logprobs(model, [text], [[img]], [[]], [r.json()])
    assert served == trainer


@pytest.mark.parametrize("with_towers", [True, False], ids=["towers-resent", "towers-not-resent"])
def test_trap3_an_engine_serves_again_only_once_its_towers_are_resent(
    mm_dir: Path, with_towers: bool
) -> None:
    trainer = load_pretrained(mm_dir)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # a few "training steps": the decoder moved, the frozen towers not
        for p in trainer.parameters():
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    with AppServer(build_app(EngineConfig(model_path=str(mm_dir))), timeout_s=60) as s:
        _resync(trainer, s.url, 1, with_towers=True)  # the first sync sends everything
        _check_engine_equals_trainer(s.url, trainer)
        with EngineClient(s.url, timeout_s=60) as client:  # the trainer's offload cycle
            released = client.post("/release_memory_occupation", {"tags": None})
            assert released["released"] == ["kv_cache", "weights"]
            assert httpx.post(f"{s.url}/generate", json={"text": "a"}).status_code == 503
            assert httpx.get(f"{s.url}/weights_checksum").status_code == 503
            assert client.post("/resume_memory_occupation", {"tags": None})["stale_tensors"] > 0
        _resync(trainer, s.url, 2, with_towers=with_towers)
        if with_towers:
            _check_engine_equals_trainer(s.url, trainer)
            assert httpx.get(f"{s.url}/server_info").json()["weights_serviceable"] is True
        else:
            with pytest.raises(AssertionError, match="tower weights differ"):
                _check_engine_equals_trainer(s.url, trainer)
            r = httpx.post(f"{s.url}/generate", json={"text": "a"})
            assert r.status_code == 503  # never serves stale towers: it names them
            assert "model.audio_tower" in r.json()["error"]["message"]


def test_memory_routes_refuse_bad_tags(server: Any) -> None:
    r = httpx.post(f"{server.url}/release_memory_occupation", json={"tags": ["gpu"]})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "tags"
    r = httpx.post(f"{server.url}/release_memory_occupation", json={"tag": ["weights"]})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "tag"
    r = httpx.post(f"{server.url}/resume_memory_occupation")  # no body = all; nothing released
    assert r.status_code == 200
    assert r.json()["released"] == []
    assert r.json()["stale_tensors"] == 0


def test_a_release_between_an_update_and_its_install_refuses_the_install(mm_dir: Path) -> None:
    """The distributed route stages an update, then installs it between batches: a release in
    that gap leaves nothing to write into, so the install is refused by name (not a crash),
    and the engine keeps its version."""
    from posttrain.local_engine._errors import UpdateSessionError

    model = load_pretrained(mm_dir)
    engine = Engine(model)
    name, tensor = next(iter(model.hf_state_dict().items()))
    update = engine.new_update()
    update.add({name: tensor.detach().clone()})
    engine.release_memory(["weights"])
    with pytest.raises(UpdateSessionError, match="the weights were released before"):
        engine.commit_staged(update, 1, dict(update.staged))
    assert engine.weight_version != 1
