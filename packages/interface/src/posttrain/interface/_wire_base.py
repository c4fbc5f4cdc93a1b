"""The base class of every wire type and the conversion of pydantic errors into ours.

Wire types are pydantic models so that a payload is validated once, at the
boundary, with the bad field named. Non-finite floats are rejected (JSON
cannot carry them, so an exact round trip could not hold), and
``to_json``/``from_json`` round-trip exactly: ``T.from_json(x.to_json()) == x``.
"""

from __future__ import annotations

from typing import Any, Self

import pydantic

from posttrain.interface._errors import WireFormatError


def _dotted(location: tuple[int | str, ...]) -> str:
    out = ""
    for part in location:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "<root>"


class WireModel(pydantic.BaseModel):
    """A validated JSON payload; unknown keys are rejected unless a subclass allows them."""

    model_config = pydantic.ConfigDict(
        extra="forbid", allow_inf_nan=False, frozen=False, validate_assignment=True
    )

    @classmethod
    def parse(cls, data: Any) -> Self:
        """Validate a decoded JSON object; raises ``WireFormatError`` naming the first bad field."""
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            raise _wire_error(cls.__name__, exc) from None

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        """Decode and validate JSON text; raises ``WireFormatError`` naming the first bad field."""
        try:
            return cls.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            raise _wire_error(cls.__name__, exc) from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict that is sent: fields left unset are omitted."""
        return self.model_dump(mode="json", exclude_unset=True)

    def to_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)


def _wire_error(model: str, exc: pydantic.ValidationError) -> WireFormatError:
    first = exc.errors()[0]
    field = _dotted(tuple(first["loc"]))
    count = exc.error_count()
    more = f" (and {count - 1} more error(s))" if count > 1 else ""
    return WireFormatError(f"{model}.{field}: {first['msg']}{more}", field=field)
