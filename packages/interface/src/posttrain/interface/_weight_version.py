"""The one weight-version type: a non-negative ``int``, or ``None`` before any versioned update.

``Sample.weight_version``, every weight update and what the engines
report (``/model_info``, ``/server_info``, ``meta_info`` of ``/generate``) all use it.

Why an int and not SGLang's string: a version is compared and subtracted, never just shown.
An engine refuses an update whose version does not increase (``StaleVersionError``), and a
string compares wrongly ("10" < "9"); a trainer measures staleness as its version minus the
sample's (off-policy filters, TIS); JSON carries an int exactly. ``None`` means "no versioned
update installed yet", which SGLang spells ``"default"``.

The conversion happens once, at the boundary: ``parse_weight_version`` reads what an engine
sends (an int, a decimal string such as SGLang's ``"3"``, ``"default"``, or null), and the
``WireWeightVersion`` fields of the SGLang wire models use it; a request SGLang reads
(``UpdateWeightsFromDiskRequest``) sends the version as the decimal string SGLang expects.
"""

from __future__ import annotations

from typing import Annotated

import pydantic

from posttrain.interface._errors import WireFormatError

SGLANG_UNVERSIONED = "default"
"""What SGLang reports as the weight version until one is set (``ServerArgs.weight_version``)."""


def is_weight_version(value: object) -> bool:
    """True for what a weight version is in posttrain's own types: an int >= 0, never a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_weight_version(value: object, *, field: str = "weight_version") -> int | None:
    """An engine's weight version as ours: ``3``, ``"3"`` -> 3; null or ``"default"`` -> None.

    Anything else (a negative number, a bool, a float, ``"v3"``) is a ``WireFormatError``
    naming ``field``.
    """
    if value is None:
        return None
    if is_weight_version(value):
        assert isinstance(value, int)
        return value
    if isinstance(value, str):
        text = value.strip()
        if text == SGLANG_UNVERSIONED:
            return None
        if text.isascii() and text.isdigit():
            return int(text)
    raise WireFormatError(
        f"{field}: {value!r} is not a weight version (a non-negative integer, a decimal "
        f"string, {SGLANG_UNVERSIONED!r} or null)",
        field=field,
    )


def _to_sglang(value: int | None) -> str | None:
    return None if value is None else str(value)


WireWeightVersion = Annotated[int | None, pydantic.BeforeValidator(parse_weight_version)]
"""A weight version read from an engine reply (accepts SGLang's strings)."""

SGLangWeightVersion = Annotated[
    int | None,
    pydantic.BeforeValidator(parse_weight_version),
    pydantic.PlainSerializer(_to_sglang, when_used="json"),
]
"""A weight version in a request SGLang reads: an int here, a decimal string on the wire."""
