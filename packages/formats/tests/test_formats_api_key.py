"""``resolve_api_key``: the one reader of a component's key, by file or environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.formats import FormatsConfigError, resolve_api_key


def test_file_then_environment_then_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POSTTRAIN_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("POSTTRAIN_API_KEY", " env-key \n")
    assert resolve_api_key(None) == "env-key"
    key = tmp_path / "key"
    key.write_text("file-key\n")
    assert resolve_api_key(key) == "file-key"


@pytest.mark.parametrize("content", ["", "two tokens", None])
def test_a_bad_key_file_is_named_by_its_flag_and_never_echoed(
    tmp_path: Path, content: str | None
) -> None:
    key = tmp_path / "key"
    if content is not None:
        key.write_text(content)
    with pytest.raises(FormatsConfigError, match=r"--api-key-file .*key") as info:
        resolve_api_key(key)
    assert "two" not in str(info.value)  # the contents are never echoed
