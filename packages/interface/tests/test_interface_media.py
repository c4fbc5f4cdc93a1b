"""Media references: validated on construction, and the SGLang request fields both ways."""

from __future__ import annotations

import pytest

from posttrain.interface import (
    ConfigError,
    MediaKind,
    MediaRef,
    Sample,
    media_from_request,
    media_request_fields,
)


def test_request_fields_round_trip_per_kind_in_order() -> None:
    media = [MediaRef(kind=MediaKind.IMAGE, ref="a.png"),
             MediaRef(kind=MediaKind.AUDIO, ref="UklGRg=="),
             MediaRef(kind=MediaKind.IMAGE, ref="b.png")]  # fmt: skip
    fields = media_request_fields(media)
    assert fields == {"image_data": ["a.png", "b.png"], "audio_data": ["UklGRg=="]}
    assert media_from_request(fields) == [media[0], media[2], media[1]]
    assert media_from_request({"image_data": "one.png"}) == [MediaRef(kind="image", ref="one.png")]  # type: ignore[arg-type]
    assert media_request_fields([]) == {}
    assert media_from_request({"text": "hi"}) == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"image_data": 3}, "image_data: must be a string or a list of strings, got int"),
        ({"audio_data": ["a", ""]}, r"audio_data\[1\]: must be a non-empty string"),
        ({"image_data": [None]}, r"image_data\[0\]: must be a non-empty string, got None"),
    ],
)
def test_bad_request_fields_are_named(body: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        media_from_request(body)


def test_sample_media_from_dicts_and_back() -> None:
    s = Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0], loss_mask=[1],
               media=[{"kind": "audio", "ref": "/clips/0.npy"}])  # type: ignore[list-item]  # fmt: skip
    assert s.media == [MediaRef(kind=MediaKind.AUDIO, ref="/clips/0.npy")]
    assert Sample.from_dict(s.to_dict()) == s
    old = {k: v for k, v in s.to_dict().items() if k != "media"}  # a dict from before media
    assert Sample.from_dict(old).media == []
    with pytest.raises(ConfigError, match=r"media\[0\]: media kind must be one of image, audio"):
        Sample(prompt_ids=[1], response_ids=[], rollout_logprobs=[], loss_mask=[],
               media=[{"kind": "video", "ref": "x"}])  # type: ignore[list-item]  # fmt: skip
