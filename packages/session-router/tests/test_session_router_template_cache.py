"""The tokenizer's caches: exact by construction, bounded, thread-safe, and visible in /metrics."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.session_router import ChatTokenizer, SessionRouterConfig, create_app
from posttrain.session_router.template import BoundedCache, NotCachedError

PIECES = ["hello", " there", "<|im_start|>", "<|im_end|>", "\n", " 123", "é", "  ", "{}", "tool"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30))
def test_cached_encode_equals_the_tokenizer_on_miss_and_on_hit(
    chat_tok: ChatTokenizer, pieces: list[str]
) -> None:
    text = "".join(pieces)
    expected = chat_tok.tokenizer.encode(text, add_special_tokens=False).ids
    hits = chat_tok.encode_cache.hits
    first = chat_tok.encode(text)
    second = chat_tok.encode(text)
    assert first == expected
    assert second == expected
    assert chat_tok.encode_cache.hits >= hits + 1
    second.append(-1)  # callers get their own list: the cached ids cannot be changed through it
    assert chat_tok.encode(text) == expected


def test_bounded_cache_evicts_least_recently_used_by_count_and_by_weight() -> None:
    cache: BoundedCache[str, str] = BoundedCache(max_entries=3, max_weight=10, weight=len)
    for key in "abc":
        cache.put(key, "xx")
    assert cache.get("a") == "xx"  # a becomes the most recently used
    cache.put("d", "xx")  # over 3 entries: b (least recent) goes
    assert cache.get("b") is None
    assert cache.get("a") == "xx"
    assert len(cache) == 3
    cache.put("e", "xxxxxx")  # weight 2+2+2+6 > 10: evict from the old end until it fits
    assert cache.total_weight <= 10
    assert cache.get("e") == "xxxxxx"
    cache.put("huge", "x" * 11)  # heavier than the whole budget: not stored, nothing evicted
    assert cache.get("huge") is None
    assert cache.get("e") == "xxxxxx"
    cache.put("e", "x")  # replacing a key re-weighs it
    assert cache.total_weight == sum(len(v) for v in cache._items.values())


def test_cache_survives_concurrent_threads(tok_dir: Path) -> None:
    tok = ChatTokenizer.from_dir(tok_dir, encode_cache_tokens=300)  # small: evictions race too
    texts = [f"hello there {i} " * 8 for i in range(40)]
    expected = {t: tok.tokenizer.encode(t, add_special_tokens=False).ids for t in texts}
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        try:
            for k in range(300):
                text = texts[(seed * 7 + k) % len(texts)]
                assert tok.encode(text) == expected[text]
        except BaseException as exc:  # reported below, with the thread's failure
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert tok.encode_cache.total_weight <= 300
    assert tok.encode_cache.total_weight == sum(len(v) for v in tok.encode_cache._items.values())


def test_long_uncached_text_raises_not_cached_and_short_or_cached_text_does_not(
    tok_dir: Path,
) -> None:
    tok = ChatTokenizer.from_dir(tok_dir)
    long_text = "hello there " * 100
    with pytest.raises(NotCachedError):
        tok.encode(long_text, max_uncached_chars=100)
    assert tok.encode("hello", max_uncached_chars=100) == tok.encode("hello")
    ids = tok.encode(long_text)  # now cached: served even under the limit
    assert tok.encode(long_text, max_uncached_chars=100) == ids


def test_anchor_and_tail_caches_are_keyed_by_template_arguments(tok_dir: Path) -> None:
    tok = ChatTokenizer.from_dir(tok_dir)
    appended = [{"role": "user", "content": "and then?"}]
    last = {"role": "assistant", "content": "ok"}
    for kwargs in ({}, {"enable_thinking": False}, {}, {"enable_thinking": False}):
        fresh = ChatTokenizer.from_dir(tok_dir)  # no cache: the reference
        assert tok.render_delta(
            appended, last_assistant=last, template_kwargs=kwargs
        ) == fresh.render_delta(appended, last_assistant=last, template_kwargs=kwargs)
        assert tok.assistant_tail_ids(kwargs) == fresh.assistant_tail_ids(kwargs)
    thinking_off = tok.render_delta(
        appended, last_assistant=last, template_kwargs={"enable_thinking": False}
    )
    assert thinking_off.endswith("</think>\n\n")
    assert not tok.render_delta(appended, last_assistant=last).endswith("</think>\n\n")


def test_metrics_report_tokenize_time_and_cache_hits(tok_dir: Path) -> None:
    cfg = SessionRouterConfig(upstream_url="http://127.0.0.1:1", tokenizer=str(tok_dir))
    app = create_app(cfg)
    tok: ChatTokenizer = app.state.server.tok
    tok.encode("hello there")
    tok.encode("hello there")

    async def main() -> str:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://sr"
        ) as c:
            text = (await c.get("/metrics")).text
        await app.state.server.aclose()
        return text

    text = asyncio.run(main())
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["session_router_encode_cache_hits_total"] >= 1
    assert values["session_router_encode_cache_misses_total"] >= 1
    assert values["session_router_tokenize_seconds_total"] > 0
