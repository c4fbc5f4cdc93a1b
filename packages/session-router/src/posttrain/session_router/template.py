"""A local tokenizer plus its chat template, loaded from a model directory without transformers.

The session server renders the chat template itself and sends token ids to ``/generate``, so it
never needs the router to understand chat requests. It reads what ``save_pretrained`` of a
transformers fast tokenizer writes (``tokenizer.json``, ``tokenizer_config.json`` and optionally
``chat_template.jinja`` / ``generation_config.json``) with the ``tokenizers`` library and renders
the template in a jinja2 sandbox configured the way transformers configures it (trim_blocks,
lstrip_blocks, loop controls, ``tojson`` without ASCII escaping, ``raise_exception``).

Departure from the obvious: later turns are never rendered from the full history. ``render_delta``
renders only the appended messages behind a fixed dummy system+assistant pair and takes the text
after that pair, so earlier tokens (the engine's own output) are never re-tokenized.

Tokenizing is the one cost of a turn that grows with its text (about 1 us per token with a
byte-level BPE, 10 ms for an 8,192-token first turn), so ``encode`` keeps a bounded LRU of the
texts it tokenized (keyed by the exact text, so a hit is exact by construction). In GRPO every
prompt starts a group of sessions with the same first turn, so all but the first of a group hit
it. The anchor renders of ``render_delta`` and the assistant tail depend only on the template
arguments and are cached the same way.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

import orjson
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from posttrain.interface import ConfigError
from posttrain.session_router._errors import BadChatRequestError
from posttrain.session_router.config import DEFAULT_ENCODE_CACHE_TOKENS

_SENTINEL = "\u2063posttrain-assistant-content\u2063"
_DUMMY_SYSTEM = {"role": "system", "content": "posttrain dummy system"}


K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """A least-recently-used map bounded by entry count and by the summed ``weight`` of its values."""

    def __init__(self, *, max_entries: int, max_weight: int, weight: Callable[[V], int]) -> None:
        self._lock = threading.Lock()  # turns are prepared on the event loop and in threads
        self.max_entries = max_entries
        self.max_weight = max_weight
        self._weight = weight
        self._items: OrderedDict[K, V] = OrderedDict()
        self.total_weight = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: K, value: V) -> None:
        w = self._weight(value)
        if w > self.max_weight or self.max_entries < 1:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.total_weight -= self._weight(old)
            self._items[key] = value
            self.total_weight += w
            while len(self._items) > self.max_entries or self.total_weight > self.max_weight:
                _, evicted = self._items.popitem(last=False)
                self.total_weight -= self._weight(evicted)


class NotCachedError(Exception):
    """``encode(..., max_uncached_chars=N)`` met a longer text it has not tokenized before.

    Control flow only (never leaves the package): the caller then tokenizes off the event loop.
    """


def _args_key(*parts: Any) -> bytes:
    """A cache key for JSON-shaped template arguments (sorted keys, so equal dicts agree)."""
    return orjson.dumps(parts, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _special_token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ChatTokenizer:
    """A ``tokenizers`` tokenizer with a jinja chat template and the model's stop token ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        *,
        special_tokens: Mapping[str, str] | None = None,
        stop_token_ids: Sequence[int] = (),
        source: str = "<memory>",
        encode_cache_tokens: int = DEFAULT_ENCODE_CACHE_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        # text -> ids, bounded by the number of cached token ids.
        self.encode_cache: BoundedCache[str, tuple[int, ...]] = BoundedCache(
            max_entries=1 << 16, max_weight=encode_cache_tokens, weight=len
        )
        self.tokenize_seconds = 0.0  # wall time spent tokenizing texts that were not cached
        self._tokenize_lock = threading.Lock()  # encode runs on the event loop and in threads
        self._render_cache: BoundedCache[bytes, str] = BoundedCache(
            max_entries=1024, max_weight=16 * 1024 * 1024, weight=len
        )
        self._tail_cache: BoundedCache[bytes, tuple[int, ...]] = BoundedCache(
            max_entries=1024, max_weight=1 << 20, weight=len
        )
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now(UTC).strftime(fmt)
        # None: a base model's tokenizer; only raw prompts (/v1/completions) can be served.
        self._template: Any = None
        if chat_template is not None:
            try:
                self._template = env.from_string(chat_template)
            except TemplateError as exc:
                raise ConfigError(f"chat template of {source} does not compile: {exc}") from exc
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)

    @classmethod
    def from_dir(
        cls, path: str | Path, *, encode_cache_tokens: int = DEFAULT_ENCODE_CACHE_TOKENS
    ) -> ChatTokenizer:
        """Load ``tokenizer.json`` and the chat template from a model or tokenizer directory."""
        root = Path(path)
        if root.is_file():
            root = root.parent
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"tokenizer: {tok_file} does not exist")
        tokenizer = Tokenizer.from_file(str(tok_file))
        config: dict[str, Any] = {}
        config_file = root / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        template = _read_chat_template(root, config)
        special = {
            key: text
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _special_token_text(config.get(key))) is not None
        }
        stop_ids: set[int] = set()
        if (
            "eos_token" in special
            and (eos := tokenizer.token_to_id(special["eos_token"])) is not None
        ):
            stop_ids.add(eos)
        gen_file = root / "generation_config.json"
        if gen_file.is_file():
            eos_cfg = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
            if isinstance(eos_cfg, int):
                stop_ids.add(eos_cfg)
            elif isinstance(eos_cfg, list):
                stop_ids.update(int(i) for i in eos_cfg)
        return cls(
            tokenizer,
            template,
            special_tokens=special,
            stop_token_ids=sorted(stop_ids),
            source=str(root),
            encode_cache_tokens=encode_cache_tokens,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render messages with the chat template; any template failure is a 400 naming the source."""
        if self._template is None:
            raise BadChatRequestError(
                f"the tokenizer of {self.source} has no chat template (a base model): send raw "
                "prompts to /sessions/{id}/v1/completions instead of chat messages"
            )
        context: dict[str, Any] = dict(self.special_tokens)
        context.update(template_kwargs or {})
        context.update(
            messages=[dict(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return str(self._template.render(**context))
        except TemplateError as exc:
            raise BadChatRequestError(
                f"chat template of {self.source} rejected the messages: {exc}"
            ) from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template indexes message fields without checking them (``content + '...'`` on a
            # value it did not expect): the request's shape, not the server, is at fault.
            raise BadChatRequestError(
                f"chat template of {self.source} cannot render the messages: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def encode(self, text: str, *, max_uncached_chars: int | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised, none are added.

        Served from the LRU when this exact text was tokenized before. With
        ``max_uncached_chars``, a longer text that is not cached raises ``NotCachedError``
        instead of being tokenized (so an event loop can hand it to a thread).
        """
        ids = self.encode_cache.get(text)
        if ids is None:
            if max_uncached_chars is not None and len(text) > max_uncached_chars:
                raise NotCachedError(len(text))
            started = time.perf_counter()
            # The batch entry point skips offset tracking (~20% faster); the ids are the same.
            ids = tuple(self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)
            with self._tokenize_lock:
                self.tokenize_seconds += time.perf_counter() - started
            self.encode_cache.put(text, ids)
        return list(ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of one token (used for OpenAI ``logprobs.content[].token``)."""
        return str(self.tokenizer.id_to_token(token_id) or "")

    def assistant_tail_ids(self, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Tokens the template renders right after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        key = _args_key(template_kwargs)
        cached = self._tail_cache.get(key)
        if cached is not None:
            return list(cached)
        text = self.render(
            [_DUMMY_SYSTEM, {"role": "assistant", "content": _SENTINEL}],
            add_generation_prompt=False,
            template_kwargs=template_kwargs,
        )
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ConfigError(f"chat template of {self.source} does not render assistant content")
        ids = self.encode(text[at + len(_SENTINEL) :])
        self._tail_cache.put(key, tuple(ids))
        return ids

    def render_delta(
        self,
        appended: Sequence[Mapping[str, Any]],
        *,
        last_assistant: Mapping[str, Any],
        tools: Sequence[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Text the template adds for ``appended`` messages after an assistant turn, with the generation prompt."""
        anchor = [
            _DUMMY_SYSTEM,
            {
                "role": "assistant",
                "content": _SENTINEL,
                **(
                    {"tool_calls": last_assistant["tool_calls"]}
                    if last_assistant.get("tool_calls")
                    else {}
                ),
            },
        ]
        key = _args_key(anchor[1].get("tool_calls"), tools, template_kwargs)
        base = self._render_cache.get(key)
        if base is None:
            base = self.render(
                anchor, add_generation_prompt=False, tools=tools, template_kwargs=template_kwargs
            )
            self._render_cache.put(key, base)
        full = self.render(
            [*anchor, *appended],
            add_generation_prompt=True,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        if not full.startswith(base):
            raise BadChatRequestError(
                f"chat template of {self.source} does not render appended messages as a suffix of "
                "the history; this template cannot be used token-in/token-out"
            )
        return full[len(base) :]


def _read_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """The chat template of ``root``; None when it has none (a base model's tokenizer)."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ConfigError(
            f"tokenizer: the chat template in {root}'s tokenizer_config.json is a "
            f"{type(template).__name__}, not a string (or a list with a 'default' entry)"
        )
    return template
