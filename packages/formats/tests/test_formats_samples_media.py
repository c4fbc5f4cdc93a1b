"""samples/2: media references ride with each sample; text-only payloads stay samples/1."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from posttrain.formats import (
    MEDIA_SAMPLES_FORMAT,
    SAMPLES_FORMAT,
    SamplesFormatError,
    decode_samples,
    encode_samples,
)
from posttrain.interface import MediaKind, MediaRef, Sample

PNG_B64 = "data:image/png;base64,iVBORw0KGgo="


def _sample(media: list[MediaRef] | None = None) -> Sample:
    return Sample(prompt_ids=[1, 2, 9], response_ids=[5], rollout_logprobs=[-0.5], loss_mask=[1],
                  media=media or [])  # fmt: skip


def _meta(data: bytes) -> dict[str, object]:
    return json.loads(st_load(data)["_samples_meta"].tobytes())  # type: ignore[no-any-return]


def _rewrite(data: bytes, meta: dict[str, object]) -> bytes:
    tensors = dict(st_load(data))
    import numpy as np

    tensors["_samples_meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8).copy()
    return bytes(st_save(tensors))


def test_media_round_trip_in_order_as_samples_2() -> None:
    media = [MediaRef(kind=MediaKind.IMAGE, ref=PNG_B64),
             MediaRef(kind=MediaKind.AUDIO, ref="/data/clip.npy"),
             MediaRef(kind=MediaKind.IMAGE, ref="/data/second.png")]  # fmt: skip
    batch = [_sample(media), _sample()]
    data = encode_samples(batch)
    assert _meta(data)["format"] == MEDIA_SAMPLES_FORMAT
    decoded = decode_samples(data).samples
    assert decoded == batch
    assert decoded[0].media[0].ref == PNG_B64  # the string exactly as the engine got it


def test_text_only_payload_is_samples_1_byte_for_byte_and_still_reads() -> None:
    data = encode_samples([_sample()])
    meta = _meta(data)
    assert meta["format"] == SAMPLES_FORMAT
    assert "media" not in meta["samples"][0]  # type: ignore[index]
    assert decode_samples(data).samples == [_sample()]


def test_base_keeps_its_media_when_the_wire_has_none() -> None:
    base = _sample([MediaRef(kind="image", ref="/x.png")])  # type: ignore[arg-type]
    out = decode_samples(encode_samples([_sample()]), base=base).samples[0]
    assert out.media == base.media


@pytest.mark.parametrize(
    ("media", "message"),
    [
        ([{"kind": "video", "ref": "x"}], r"samples\[0\]\.media\[0\]: media kind must be one of"),
        ([{"kind": "image", "ref": ""}], r"samples\[0\]\.media\[0\]: image reference must be"),
        ([{"kind": "image"}], r"samples\[0\]\.media\[0\]: expected an object with exactly"),
        ({"kind": "image", "ref": "x"}, r"samples\[0\]\.media: must be a list"),
    ],
)
def test_bad_media_entries_are_named(media: object, message: str) -> None:
    data = encode_samples([_sample([MediaRef(kind=MediaKind.IMAGE, ref="a.png")])])
    meta = _meta(data)
    meta["samples"][0]["media"] = media  # type: ignore[index]
    with pytest.raises(SamplesFormatError, match=message):
        decode_samples(_rewrite(data, meta))


def test_a_samples_1_payload_cannot_carry_media() -> None:
    data = encode_samples([_sample([MediaRef(kind=MediaKind.IMAGE, ref="a.png")])])
    meta = _meta(data)
    meta["format"] = SAMPLES_FORMAT
    with pytest.raises(SamplesFormatError, match="only a 'posttrain-samples/2' payload"):
        decode_samples(_rewrite(data, meta))
    meta["format"] = "posttrain-samples/3"
    with pytest.raises(SamplesFormatError, match="got 'posttrain-samples/3'"):
        decode_samples(_rewrite(data, meta))
