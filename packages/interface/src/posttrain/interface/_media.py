"""Media references: which image or audio item a sample's prompt carried, as the engine got it.

A multimodal prompt holds one sentinel token per media item; the engine receives the items in
SGLang's request fields ``image_data`` and ``audio_data`` (each a list, in the order of the
sentinels of that kind). A sample keeps the same references, so a trainer rebuilds the exact
input the engine saw: ``MediaRef(kind, ref)`` where ``ref`` is the entry exactly as it was sent
(base64, optionally as a ``data:`` URL, or a file path on the machines that read it). The bytes
are not copied into the sample a second time, and not re-encoded: a re-encoded image can decode
to different pixels than the engine's.

``media_request_fields`` and ``media_from_request`` convert between a sample's ordered media
list and the two request fields. The kinds keep their own order; items of different kinds
never share a sentinel, so interleaving across kinds needs no record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from posttrain.interface._errors import ConfigError


class MediaKind(StrEnum):
    """The kind of a media item, named by the request field that carries it."""

    IMAGE = "image"
    AUDIO = "audio"

    @property
    def request_field(self) -> str:
        """SGLang's ``/generate`` field for this kind: ``image_data`` or ``audio_data``."""
        return f"{self.value}_data"


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaRef:
    """One media item of a prompt: its kind and the reference string the engine got."""

    kind: MediaKind
    ref: str

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", MediaKind(self.kind))
        except ValueError:
            allowed = ", ".join(k.value for k in MediaKind)
            raise ConfigError(f"media kind must be one of {allowed}, got {self.kind!r}") from None
        if not isinstance(self.ref, str) or not self.ref:
            raise ConfigError(f"{self.kind.value} reference must be a non-empty string")

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "ref": self.ref}

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "media") -> MediaRef:
        if isinstance(data, MediaRef):
            return data
        if not isinstance(data, Mapping) or set(data) != {"kind", "ref"}:
            raise ConfigError(
                f"{where}: expected an object with exactly kind and ref, got {data!r}"
            )
        try:
            return cls(kind=data["kind"], ref=data["ref"])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def media_request_fields(media: Sequence[MediaRef]) -> dict[str, list[str]]:
    """The ``image_data`` / ``audio_data`` fields that send ``media`` (only kinds present)."""
    out: dict[str, list[str]] = {}
    for item in media:
        out.setdefault(item.kind.request_field, []).append(item.ref)
    return out


def media_from_request(body: Mapping[str, Any]) -> list[MediaRef]:
    """The media a request body sends in ``image_data`` / ``audio_data`` (a string or a list
    of strings each); images first, then audio, each in request order."""
    out: list[MediaRef] = []
    for kind in MediaKind:
        name = kind.request_field
        value = body.get(name)
        if value is None:
            continue
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(
                f"{name}: must be a string or a list of strings, got {type(value).__name__}"
            )
        for i, ref in enumerate(items):
            if not isinstance(ref, str) or not ref:
                raise ConfigError(f"{name}[{i}]: must be a non-empty string, got {ref!r}")
            out.append(MediaRef(kind=kind, ref=ref))
    return out
