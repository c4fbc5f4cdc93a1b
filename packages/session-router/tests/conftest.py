"""Fixtures for session-router tests: a tiny locally-trained chat tokenizer, a scripted engine, and
the ASGI app in this process (``app_client``: a client of it, no socket; ``run_app``: a scenario
against it with a mocked upstream), shared by the app, hardening and router tests; and a real
sgl-router per test module (``router``, stopped by its pid afterwards).

The tokenizer is a byte-level BPE trained in memory with the ``tokenizers`` library (no
downloads) and saved the way ``save_pretrained`` saves one (``tokenizer.json`` plus
``tokenizer_config.json`` with a ChatML template), so ``ChatTokenizer.from_dir`` loads it through
the same path it uses for a model directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from posttrain.interface.testing import free_port
from posttrain.session_router import (
    ChatTokenizer,
    RouterHandle,
    RouterSpec,
    SessionRouterConfig,
    create_app,
    start_router,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CORPUS = [
    "hello there, how are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "user assistant system tool call result weather in Paris is sunny",
    "def f(x): return x * 2  # python code with symbols {}[]()<>!?",
] * 20

Upstream = Callable[[httpx.Request], Awaitable[httpx.Response]]
Scenario = Callable[[httpx.AsyncClient], Awaitable[None]]


def build_tokenizer_dir(root: Path) -> Path:
    """Train and save the tiny chat tokenizer under ``root``; returns the directory."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        )
    )
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return root


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="session")
def chat_tok(tok_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tok_dir)


def scripted_engine(
    tok: ChatTokenizer, *, stop: str = "<|im_end|>", weight_version: str = "7"
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A deterministic stand-in for an SGLang ``/generate``: replies ``reply <n> <k>`` + stop token.

    ``n`` is the prompt length and ``k`` a call counter, so every turn's tokens differ; logprobs
    are a pure function of (prompt length, position), so tests can recompute them.
    """
    stop_id = tok.tokenizer.token_to_id(stop)
    calls = {"n": 0}

    def generate(body: dict[str, Any]) -> dict[str, Any]:
        calls["n"] += 1
        prompt = body["input_ids"]
        max_new = body.get("sampling_params", {}).get("max_new_tokens")
        text = f"reply {len(prompt)} {calls['n']}"
        ids = [*tok.encode(text), stop_id]
        finish: dict[str, Any] = {"type": "stop", "matched": stop_id}
        if max_new is not None and len(ids) > max_new:
            ids = ids[:max_new]
            finish = {"type": "length", "length": max_new}
        logprobs = [expected_logprob(len(prompt), i) for i in range(len(ids))]
        return {
            "text": tok.decode(ids),
            "output_ids": ids,
            "meta_info": {
                "id": f"req-{calls['n']}",
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(logprobs, ids, strict=True)
                ],
                "finish_reason": finish,
                "weight_version": weight_version,
            },
        }

    return generate


def expected_logprob(prompt_len: int, position: int) -> float:
    return -0.01 * ((prompt_len + 3 * position) % 97) - 0.001


@pytest.fixture(scope="session")
def make_engine() -> Callable[..., Callable[[dict[str, Any]], dict[str, Any]]]:
    """``make_engine(tok, stop=..., weight_version=...)`` -> a scripted ``/generate`` function."""
    return scripted_engine


@pytest.fixture(scope="session")
def router_config(tok_dir: Path) -> Callable[..., SessionRouterConfig]:
    """``router_config(**kw)`` -> a config on the tiny tokenizer, its upstream a placeholder URL."""

    def build(**kw: Any) -> SessionRouterConfig:
        return SessionRouterConfig(upstream_url="http://router.test", tokenizer=str(tok_dir), **kw)

    return build


def engine_upstream_for(
    engine: Callable[[dict[str, Any]], dict[str, Any]], seen: list[httpx.Request]
) -> Upstream:
    """An upstream that records each request in ``seen`` and answers ``/generate`` with ``engine``."""

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.url.path == "/generate"
        return httpx.Response(
            200, json=engine(json.loads(request.content)), headers={"server": "upstream"}
        )

    return handle


@contextlib.asynccontextmanager
async def in_process_client(
    cfg: SessionRouterConfig,
    *,
    tokenizer: ChatTokenizer | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    timeout_s: float = 30.0,
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the session server's ASGI app in this process (no socket; ``http://sr``).

    ``transport`` goes behind the app's upstream client (default: the real pooled one, to
    ``cfg.upstream_url``); the server is closed on exit.
    """
    app = create_app(cfg, tokenizer=tokenizer, transport=transport)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://sr", timeout=timeout_s
        ) as client:
            yield client
    finally:
        await app.state.server.aclose()


@pytest.fixture(scope="session")
def app_client() -> Callable[..., contextlib.AbstractAsyncContextManager[httpx.AsyncClient]]:
    """``async with app_client(cfg, tokenizer=..., transport=...) as c``: see ``in_process_client``."""
    return in_process_client


@pytest.fixture(scope="session")
def run_app(tok_dir: Path, chat_tok: ChatTokenizer) -> Callable[..., None]:
    """``run_app(scenario, *, upstream=None, seen=None, tokenizer=None, **config)``.

    Runs ``scenario(client)`` against the app on the tiny tokenizer (or ``tokenizer``), its
    config ``SessionRouterConfig(**config)`` and its upstream an ``httpx.MockTransport`` of
    ``upstream`` (default: the scripted engine on ``/generate``, recording requests in ``seen``).
    """

    def run(
        scenario: Scenario,
        *,
        upstream: Upstream | None = None,
        seen: list[httpx.Request] | None = None,
        tokenizer: ChatTokenizer | None = None,
        **config: Any,
    ) -> None:
        if upstream is None:
            upstream = engine_upstream_for(scripted_engine(chat_tok), [] if seen is None else seen)
        cfg = SessionRouterConfig(
            upstream_url="http://router.test", tokenizer=str(tok_dir), **config
        )

        async def main() -> None:
            async with in_process_client(
                cfg, tokenizer=tokenizer or chat_tok, transport=httpx.MockTransport(upstream)
            ) as client:
                await scenario(client)

        asyncio.run(asyncio.wait_for(main(), timeout=30))

    return run


@pytest.fixture(scope="module")
def router() -> Iterator[RouterHandle]:
    """A real sgl-router (the ``sglang-router`` wheel's binary) on 127.0.0.1 for one module."""
    handle = start_router(RouterSpec(port=free_port()), ready_timeout_s=30)
    try:
        yield handle
    finally:
        handle.stop()
    assert handle.process is not None
    assert handle.process.poll() is not None  # stopped, not left behind
