"""``posttrain demo`` options (the run end to end is in integration_tests)."""

from __future__ import annotations

import pytest

from posttrain.launch.demo import DemoConfig, DemoError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"turns": 0}, "--turns"), ({"turns": 4}, "--turns"), ({"max_tokens": 0}, "--max-tokens"),
     ({"engines": 0}, "--engines")],
)  # fmt: skip
def test_config_errors_name_the_flag(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(DemoError, match=message):
        DemoConfig(**kwargs)  # type: ignore[arg-type]
