"""The multimodal provider: frozen vision/audio towers, media sentinels, strict parity, trap 2.

Issue 25, trap 2 (``no_grad`` scope): the tower outputs are written into the embedding output;
if ``no_grad`` covers that write as well as the tower forwards, the embedding output is
detached and the text embedding gets zero gradient on every multimodal batch.
``_embed_with_scope`` reintroduces the old scope as ``no_grad_scope="towers+scatter"`` and
the test shows that variant fails the check the model passes.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.models import (
    MULTIMODAL_VOCAB_SIZE,
    DecoderModel,
    MediaBatch,
    MediaError,
    MediaFiles,
    MediaItem,
    MediaKind,
    MissingTensorError,
    ModelConfig,
    ModelConfigError,
    ModelInputError,
    UnknownTensorError,
    build_model,
    build_tokenizer,
    decode_audio,
    decode_image,
    decode_media,
    decode_media_refs,
    encode_npy_base64,
    encode_png_base64,
    encode_wav_base64,
    expand_media_tokens,
    has_towers,
    load_pretrained,
    mel_bins,
    tower_parameter_names,
)
from posttrain.models.__main__ import main as init_main

IMG, AUD = 101, 102


@pytest.fixture(scope="module")
def mm() -> DecoderModel:
    return build_model(ModelConfig.multimodal_tiny(), seed=3)


def _image(h: int, w: int, seed: int) -> MediaItem:
    gen = torch.Generator().manual_seed(seed)
    return MediaItem(
        MediaKind.IMAGE, torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=gen)
    )


def _audio(frames: int, seed: int) -> MediaItem:
    gen = torch.Generator().manual_seed(seed)
    return MediaItem(
        MediaKind.AUDIO, torch.randint(0, 256, (frames, 8), dtype=torch.uint8, generator=gen)
    )


# ---------------------------------------------------------------------------- config, weights


def test_towers_are_off_by_default_and_configs_round_trip() -> None:
    tiny = ModelConfig.tiny()
    assert not tiny.has_towers
    assert not any("tower" in k or ("token_id" in k and "image" in k) for k in tiny.to_hf_dict())
    cfg = ModelConfig.multimodal_tiny()
    data = cfg.to_hf_dict()
    assert data["architectures"] == ["PosttrainMultimodalForCausalLM"]
    assert ModelConfig.from_hf_dict(data) == cfg
    assert not has_towers(build_model(tiny))
    assert tower_parameter_names(build_model(tiny)) == []


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"vision_patch_size": 0}, "image_token_id"),
        ({"image_token_id": None}, "image_token_id"),
        ({"vision_hidden_size": 0}, "vision_hidden_size"),
        ({"audio_intermediate_size": 0}, "audio_intermediate_size"),
        ({"image_token_id": 200}, "image_token_id"),
        ({"audio_token_id": IMG}, "image_token_id"),
        ({"audio_token_id": 3}, "audio_token_id"),  # also the eos id
        ({"vision_patch_size": -1}, "vision_patch_size"),
    ],
)
def test_bad_tower_fields_are_named(changes: dict[str, object], named: str) -> None:
    with pytest.raises(ModelConfigError, match=named):
        ModelConfig.multimodal_tiny(**changes)


def test_towers_frozen_eval_and_loaded_strictly(mm: DecoderModel, tmp_path: Path) -> None:
    names = tower_parameter_names(mm)
    assert len(names) == 14
    assert has_towers(mm)
    assert all(n.startswith(("model.vision_tower.", "model.audio_tower.")) for n in names)
    frozen = {n for n, p in mm.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in mm.named_parameters() if "_tower." in n}
    mm.train()
    assert mm.training
    assert not mm.vision_tower.training
    assert not mm.audio_tower.training
    mm.eval()
    assert not any(
        n.startswith(("model.vision_tower", "model.audio_tower")) for n in mm.lora_targets()
    )
    mm.save_pretrained(tmp_path / "ck", tokenizer=build_tokenizer(multimodal=True))
    back = load_pretrained(tmp_path / "ck")
    for (n, a), (_, b) in zip(mm.named_parameters(), back.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    tensors = load_file(str(tmp_path / "ck" / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.vision_tower.projector.weight"]
    save_file(missing, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(MissingTensorError, match=r"vision_tower\.proj"):
        load_pretrained(tmp_path / "ck")
    text_only = build_model(ModelConfig.tiny(vocab_size=103))
    with pytest.raises(UnknownTensorError, match=r"model\.audio_tower\.frame_embed\.weight"):
        text_only.load_hf_state_dict(tensors)


def test_init_cli_writes_a_multimodal_checkpoint(tmp_path: Path) -> None:
    assert init_main(["init", "--arch", "multimodal-tiny", str(tmp_path / "mm")]) == 0
    model = load_pretrained(tmp_path / "mm")
    assert model.config.has_vision_tower
    assert model.config.has_audio_tower
    assert model.config.vocab_size == MULTIMODAL_VOCAB_SIZE
    tok = build_tokenizer(multimodal=True)
    assert tok.encode("a<|image|>b<|audio|>") == [71, IMG, 72, AUD]
    assert build_tokenizer().encode("a") == [71]  # the text-only tokenizer is unchanged


# ---------------------------------------------------------------------------- sentinels


def test_expand_matches_each_kind_in_order() -> None:
    cfg = ModelConfig.multimodal_tiny()
    a, b, s = _image(8, 4, 0), _image(4, 4, 1), _audio(3, 2)
    ids, batch = expand_media_tokens([5, IMG, 6, AUD, IMG, 7], [a, s, b], cfg)
    assert ids == [5, *[IMG] * 2, 6, *[AUD] * 3, *[IMG] * 1, 7]
    assert [(sp.item, sp.start, sp.length) for sp in batch] == [(a, 1, 2), (s, 4, 3), (b, 7, 1)]
    packed = MediaBatch.pack([None, batch], [4, len(ids)])
    assert [sp.start for sp in packed] == [5, 8, 11]
    with pytest.raises(MediaError, match=r"1 image sentinel.*2 image item"):
        expand_media_tokens([IMG, AUD], [a, b, s], cfg)
    with pytest.raises(MediaError, match="0 audio sentinel"):
        expand_media_tokens([IMG], [a, s], cfg)
    with pytest.raises(MediaError, match="patch size 4"):
        expand_media_tokens([IMG], [_image(6, 4, 0)], cfg)
    with pytest.raises(MediaError, match="no vision tower"):
        expand_media_tokens([5], [a], ModelConfig.tiny())
    with pytest.raises(MediaError, match="sorted and disjoint"):
        MediaBatch((batch.spans[1], batch.spans[0]))


def test_media_positions_are_checked(mm: DecoderModel) -> None:
    ids, batch = expand_media_tokens([5, IMG, 6], [_image(4, 8, 0)], mm.config)
    with pytest.raises(ModelInputError, match="not the placeholder id"):
        mm.forward_logprobs(torch.tensor([5, 6, 6, 6]), [4], media=batch)
    with pytest.raises(ModelInputError, match="sequence of 2"):
        mm.forward_logprobs(torch.tensor(ids[:2]), [2], media=batch)


# ---------------------------------------------------------------------------- parity


def test_packed_forward_equals_prefill_and_decode_bit_for_bit(mm: DecoderModel) -> None:
    cfg = mm.config
    prompts = [
        ([2, 40, IMG, 41, AUD, 42], [_image(8, 8, 1), _audio(5, 2)]),
        ([2, 50, 51], []),
        ([2, AUD, IMG, IMG, 60], [_image(4, 12, 3), _audio(2, 4), _image(8, 4, 5)]),
    ]
    responses = [[70, 71, 72, 73], [74, 75], [76, 77, 78]]
    expanded = [expand_media_tokens(p, m, cfg) for p, m in prompts]
    seqs = [ids + r for (ids, _), r in zip(expanded, responses, strict=True)]
    lengths = [len(s) for s in seqs]
    media = MediaBatch.pack([b if len(b) else None for _, b in expanded], lengths)
    packed = mm.forward_logprobs(torch.tensor([t for s in seqs for t in s]), lengths, media=media)
    alone = [
        mm.forward_logprobs(torch.tensor(s), [len(s)], media=b)
        for s, (_, b) in zip(seqs, expanded, strict=True)
    ]
    assert torch.equal(packed, torch.cat(alone))  # packing changes no bit
    cache = mm.new_kv_cache(3)
    steps = mm.extend(
        cache, [0, 1, 2], [ids for ids, _ in expanded], media=[b for _, b in expanded]
    )
    served: list[list[float]] = []
    rows = {j: steps[j].logprobs for j in range(3)}
    out = [
        [float(rows[j][k - 1, ids[k]]) for k in range(1, len(ids))]
        for j, (ids, _) in enumerate(expanded)
    ]
    last = {j: rows[j][-1] for j in range(3)}
    for step in range(max(len(r) for r in responses)):
        live = [j for j in range(3) if step < len(responses[j])]
        for j in live:
            out[j].append(float(last[j][responses[j][step]]))
        nxt = mm.decode_step(cache, live, [responses[j][step] for j in live]).logprobs
        last = {j: nxt[i] for i, j in enumerate(live)}
    served = out
    want = [a[1:].tolist() for a in alone]
    assert served == want  # prefill + batched decode == training forward, bit for bit
    # the towers matter: another image changes the logprobs after it
    other, b2 = expand_media_tokens(prompts[0][0], [_image(8, 8, 9), prompts[0][1][1]], cfg)
    moved = mm.forward_logprobs(torch.tensor(other + responses[0]), [lengths[0]], media=b2)
    assert not torch.equal(moved, alone[0])


def test_prefill_single_row_matches(mm: DecoderModel) -> None:
    ids, batch = expand_media_tokens([2, IMG, 9], [_image(4, 4, 7)], mm.config)
    cache = mm.new_kv_cache(1)
    step = mm.prefill(cache, 0, ids, media=batch)
    lp = mm.forward_logprobs(torch.tensor(ids), [len(ids)], media=batch)
    assert [float(step.logprobs[k - 1, ids[k]]) for k in range(1, len(ids))] == lp[1:].tolist()


# ---------------------------------------------------------------------------- trap 2


def _embed_with_scope(
    model: DecoderModel,
    ids: torch.Tensor,
    media: MediaBatch,
    no_grad_scope: Literal["towers", "towers+scatter", "none"],
) -> torch.Tensor:
    """The embedding step with a chosen ``no_grad`` scope: ``towers`` (the model's), the old
    ``towers+scatter`` (trap 2), or ``none`` (no grad-mode trick: a mask blend as reference)."""
    h = model.embedding[ids].float()
    pos = torch.tensor(media.positions())
    if no_grad_scope == "none":
        rows = model.media_embeddings(media)  # frozen towers: nothing needs grad anyway
        mask = torch.zeros(ids.shape[0], 1)
        mask[pos] = 1.0
        full = torch.zeros_like(h.detach())
        full[pos] = rows
        return h * (1.0 - mask) + full * mask
    if no_grad_scope == "towers":
        return model.embed_inputs(ids, media)
    with torch.no_grad():  # the old scope: the tower forwards AND the write into the output
        rows = model.media_embeddings(media)
        out = h.clone()
        out[pos] = rows
    return out


def _embedding_grad(
    model: DecoderModel, ids: torch.Tensor, media: MediaBatch, scope: str
) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    embeds = _embed_with_scope(model, ids, media, scope)  # type: ignore[arg-type]
    lp = model.forward_logprobs(ids, [ids.shape[0]], inputs_embeds=embeds)
    lp.sum().backward()
    grad = model.embedding.grad
    return torch.zeros_like(model.embedding) if grad is None else grad.clone()


def _check_embedding_grad(
    model: DecoderModel, ids: torch.Tensor, media: MediaBatch, scope: str
) -> None:
    got = _embedding_grad(model, ids, media, scope)
    ref = _embedding_grad(model, ids, media, "none")
    text_rows = sorted({int(t) for t in ids if int(t) not in (IMG, AUD)})
    assert bool(got[text_rows].abs().sum() > 0), "text embedding rows got zero gradient"
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_trap2_text_embedding_gradient_is_live_on_a_multimodal_batch() -> None:
    model = build_model(ModelConfig.multimodal_tiny(), seed=4)
    ids_list, media = expand_media_tokens(
        [2, 30, IMG, 31, AUD, 32, 33], [_image(8, 4, 1), _audio(3, 2)], model.config
    )
    ids = torch.tensor(ids_list)
    # the model's own path (forward_logprobs(media=...)) equals the explicit "towers" scope
    model.zero_grad(set_to_none=True)
    model.forward_logprobs(ids, [len(ids_list)], media=media).sum().backward()
    assert model.embedding.grad is not None
    assert torch.equal(model.embedding.grad, _embedding_grad(model, ids, media, "towers"))
    assert all(p.grad is None for p in model.vision_tower.parameters())  # frozen: no grad
    _check_embedding_grad(model, ids, media, "towers")
    with pytest.raises(AssertionError, match="zero gradient"):  # the old no_grad scope
        _check_embedding_grad(model, ids, media, "towers+scatter")


# ---------------------------------------------------------------------------- decoding


def test_image_references_decode_to_the_same_pixels(tmp_path: Path) -> None:
    item = _image(6, 10, 3)
    b64 = encode_png_base64(item.data)
    path = tmp_path / "x.png"
    path.write_bytes(base64.b64decode(b64))
    for ref in (b64, f"data:image/png;base64,{b64}", str(path)):
        assert torch.equal(decode_image(ref).data, item.data)
    with pytest.raises(MediaError, match=r"image_data: .*valid base64"):
        decode_image("no such file.png")
    with pytest.raises(MediaError, match="not a readable image"):
        decode_image(base64.b64encode(b"hello world!").decode())


def test_bad_image_files_are_media_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decompression bomb, a broken PNG and an oversized file: each a ``MediaError`` (an
    engine's 400), never an exception that escapes as a 500."""
    from PIL import Image

    png = base64.b64decode(encode_png_base64(_image(6, 10, 3).data))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # 60 pixels > 2x the limit: a bomb
    with pytest.raises(MediaError, match="not a readable image"):
        decode_image(base64.b64encode(png).decode())
    monkeypatch.undo()
    broken = png[:-20] + b"\x00" * 8 + png[-12:]  # the IDAT chunk's bytes cut short
    with pytest.raises(MediaError, match="not a readable image"):
        decode_image(base64.b64encode(broken).decode())
    path = tmp_path / "big.png"
    path.write_bytes(png)
    small = MediaFiles(any_path=True, max_bytes=len(png) - 1)
    with pytest.raises(MediaError, match=rf"image_data: .*big.png.* is {len(png)} bytes"):
        decode_image(str(path), files=small)


def test_audio_references_decode_to_mel_bins(tmp_path: Path) -> None:
    t = torch.arange(400 + 160 * 6, dtype=torch.float32) / 16000.0
    samples = 0.5 * torch.sin(2 * torch.pi * 440.0 * t)
    item = decode_audio(encode_wav_base64(samples), num_mel_bins=8)
    assert item.data.shape == (7, 8)
    assert item.data.dtype == torch.uint8
    pcm = torch.round(samples.clamp(-1, 1) * 32767).to(torch.int16).float() / 32768.0
    assert torch.equal(item.data, mel_bins(pcm, num_mel_bins=8))
    assert int(item.data.max()) > int(item.data.min())  # a tone is not flat across bins
    npy = encode_npy_base64(item.data)
    assert torch.equal(decode_audio(npy, num_mel_bins=8).data, item.data)
    (tmp_path / "m.npy").write_bytes(base64.b64decode(npy))
    assert torch.equal(decode_audio(str(tmp_path / "m.npy"), num_mel_bins=8).data, item.data)
    with pytest.raises(MediaError, match="holds 8 mel bins per frame, the audio tower takes 6"):
        decode_audio(npy, num_mel_bins=6)
    with pytest.raises(MediaError, match="fewer than one frame"):
        decode_audio(encode_wav_base64(samples[:100]), num_mel_bins=8)
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 8), dtype=np.float32))
    floats = base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(MediaError, match="uint8"):
        decode_audio(floats, num_mel_bins=8)
    with pytest.raises(MediaError, match="neither a WAV"):
        decode_audio(encode_png_base64(_image(4, 4, 0).data), num_mel_bins=8)


def test_decode_media_names_the_field_and_refuses_missing_towers() -> None:
    cfg = ModelConfig.multimodal_tiny()
    png = encode_png_base64(_image(4, 4, 0).data)
    items = decode_media(cfg, images=[png], audio=[encode_npy_base64(_audio(2, 1).data)])
    assert [i.kind for i in items] == [MediaKind.IMAGE, MediaKind.AUDIO]
    from posttrain.interface import MediaKind as RefKind
    from posttrain.interface import MediaRef

    audio = encode_npy_base64(_audio(2, 1).data)  # refs in any order: images first, as sent
    refs = [MediaRef(kind=RefKind.AUDIO, ref=audio), MediaRef(kind=RefKind.IMAGE, ref=png)]
    again = decode_media_refs(cfg, refs)
    assert [i.kind for i in again] == [MediaKind.IMAGE, MediaKind.AUDIO]
    assert all(torch.equal(a.data, b.data) for a, b in zip(items, again, strict=True))
    with pytest.raises(MediaError, match=r"image_data\[0\]: the model has no vision tower") as info:
        decode_media(ModelConfig.tiny(), images=[png])
    assert info.value.kind == "image"
    with pytest.raises(MediaError, match=r"image_data\[1\]") as info:
        decode_media(cfg, images=[png, "!!"])
    with pytest.raises(MediaError, match=r"image_data\[0\]: .*patch size"):
        decode_media(cfg, images=[encode_png_base64(_image(5, 4, 0).data)])
    big = encode_png_base64(torch.zeros(64, 64, 3, dtype=torch.uint8))  # 256 patches > 64
    with pytest.raises(MediaError, match=r"image_data\[0\]: a 64x64 image has more pixels"):
        decode_media(cfg, images=[big])
    long = encode_npy_base64(torch.zeros(65, 8, dtype=torch.uint8))
    with pytest.raises(MediaError, match=r"audio_data\[0\]: 65 mel frames"):
        decode_media(cfg, audio=[long])
