"""The tokenizer of a model directory, read with ``tokenizers`` and ``jinja2`` only.

A ``posttrain.models`` checkpoint saved with its tokenizer holds ``tokenizer.json``,
``tokenizer_config.json`` and a chat template (``chat_template.jinja`` or the
``chat_template`` key). Departure from ``transformers.AutoTokenizer``: the same
files are read without importing transformers, which keeps engine start-up (and
so every test that starts an engine process) under a second; the template is
rendered in a sandboxed jinja2 environment, then encoded without adding special
tokens, which is what ``apply_chat_template(tokenize=True)`` does.

``max_chars_per_token`` bounds how many characters of input one token can stand for, read
from the tokenizer itself, so that a text too long for the context is refused from its
length before it is tokenized (tokenizing megabytes takes seconds). The bound is only
claimed where it is sound: a BPE model (no fused unknown tokens), whose pre-tokenizer never
drops characters and whose normalizer is none, NFC or NFKC; for byte-level BPE the longest
vocabulary string bounds the input characters a token covers, and canonical composition
shrinks a text by at most 4 characters to 1. Any other tokenizer gets ``None`` (no shortcut:
the text is tokenized, off the event loop, then checked).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from posttrain.interface import WireFormatError
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
        self.max_chars_per_token = max_chars_per_token(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def chat_text(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        """The prompt text the chat template renders; a template failure is a 400."""
        if self._template is None:
            raise CheckpointError("the tokenizer has no chat template")
        kwargs = {"add_generation_prompt": True} | template_kwargs
        try:
            return self._template.render(messages=messages, **kwargs)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise WireFormatError(
                f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                field="messages",
            ) from None


_KEEPS_EVERY_CHAR = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})
_COMPOSITION_SHRINK = {None: 1, "NFC": 4, "NFKC": 4}


def _pre_tokenizer_keeps_chars(spec: Any) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps_chars(p) for p in spec.get("pretokenizers", []))
    if spec.get("type") == "Split" and str(spec.get("behavior")) == "Removed":
        return False
    return spec.get("type") in _KEEPS_EVERY_CHAR


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """How many input characters one token can cover at most; None when it cannot be bounded."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    norm_type = None if normalizer is None else normalizer.get("type")
    if (
        model.get("type") != "BPE"
        or model.get("fuse_unk")
        or norm_type not in _COMPOSITION_SHRINK
        or not _pre_tokenizer_keeps_chars(spec.get("pre_tokenizer"))
    ):
        return None
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * _COMPOSITION_SHRINK[norm_type]


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
