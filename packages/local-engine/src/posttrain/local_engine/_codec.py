"""The tokenizer of a model directory, read with ``tokenizers`` and ``jinja2`` only.

A ``posttrain.models`` checkpoint saved with its tokenizer holds ``tokenizer.json``,
``tokenizer_config.json`` and a chat template (``chat_template.jinja`` or the
``chat_template`` key). Departure from ``transformers.AutoTokenizer``: the same
files are read without importing transformers, which keeps engine start-up (and
so every test that starts an engine process) under a second; the template is
rendered in a sandboxed jinja2 environment, then encoded without adding special
tokens, which is what ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from posttrain.local_engine._errors import CheckpointError

__all__ = ["TokenizerCodec", "load_codec"]


class TokenizerCodec:
    """Encode, decode and chat-template rendering for one tokenizer directory."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], template: str | None) -> None:
        self._tok = tokenizer
        self._config = config
        self._template = (
            None
            if template is None
            else ImmutableSandboxedEnvironment(trim_blocks=False).from_string(template)
        )
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_token_ids: tuple[int, ...] = ()
        eos_id = tokenizer.token_to_id(eos) if isinstance(eos, str) else None
        if eos_id is not None:
            self.eos_token_ids = (int(eos_id),)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def chat_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        if self._template is None:
            raise CheckpointError("the tokenizer has no chat template")
        kwargs = {"add_generation_prompt": True} | template_kwargs
        text = self._template.render(messages=messages, **kwargs)
        return self.encode(text)


def load_codec(model_dir: str | Path) -> TokenizerCodec | None:
    """The directory's tokenizer, or None when it has no ``tokenizer.json``."""
    d = Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        return None
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    config: dict[str, Any] = {}
    if (d / "tokenizer_config.json").is_file():
        config = json.loads((d / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    return TokenizerCodec(tok, config, template if isinstance(template, str) else None)
