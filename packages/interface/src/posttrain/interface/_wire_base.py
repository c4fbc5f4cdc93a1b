"""The base class of every wire type and the conversion of pydantic errors into ours.

Wire types are pydantic models so that a payload is validated once, at the
boundary, with the bad field named. Non-finite floats are rejected (JSON
cannot carry them, so an exact round trip could not hold), and
``to_json``/``from_json`` round-trip exactly: ``T.from_json(x.to_json()) == x``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Self

import pydantic

from posttrain.interface._errors import WireFormatError

StrictBool = pydantic.StrictBool
NonNegativeInt = Annotated[int, pydantic.Strict(), pydantic.Field(ge=0)]
PositiveInt = Annotated[int, pydantic.Strict(), pydantic.Field(ge=1)]
NonNegativeFloat = Annotated[float, pydantic.Field(ge=0.0)]
"""Strict scalars: JSON ``true`` is not 1 and ``"5"`` is not a token id."""


_TYPE_TAGS = frozenset({"int", "str", "float", "bool", "none", "list", "dict", "tuple"})


def _is_type_tag(part: str) -> bool:
    """pydantic puts the tried union member ("SamplingParams", "list[int]") into error paths."""
    return "[" in part or "-" in part or part[:1].isupper() or part in _TYPE_TAGS


def _dotted(location: tuple[int | str, ...]) -> str:
    out = ""
    for part in location:
        if isinstance(part, str) and _is_type_tag(part):
            continue
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

    @pydantic.model_validator(mode="after")
    def _extras_are_finite(self) -> Self:
        # allow_inf_nan covers typed fields only; a kept unknown key could still carry inf
        for key, value in (self.model_extra or {}).items():
            where = _first_non_finite(value)
            if where is not None:
                raise ValueError(f"{key}{where}: non-finite number (JSON cannot carry it)")
        return self

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


def _first_non_finite(value: Any, path: str = "") -> str | None:
    """The path (``[2].x``) of the first NaN/Inf inside a JSON-like value, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        items: Any = ((f".{k}", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for suffix, inner in items:
        found = _first_non_finite(inner, path + suffix)
        if found is not None:
            return found
    return None


def _wire_error(model: str, exc: pydantic.ValidationError) -> WireFormatError:
    first = exc.errors()[0]
    field = _dotted(tuple(first["loc"]))
    count = exc.error_count()
    more = f" (and {count - 1} more error(s))" if count > 1 else ""
    return WireFormatError(f"{model}.{field}: {first['msg']}{more}", field=field)
