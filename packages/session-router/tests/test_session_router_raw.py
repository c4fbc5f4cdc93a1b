"""Raw prompts (``/sessions/{id}/v1/completions``): a text or token ids, no chat template, for
base models; the turn is recorded and assembled like a chat turn."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx

from posttrain.formats import decode_samples
from posttrain.session_router import ChatTokenizer, SessionRolloutClient, create_app


def _base_tokenizer_dir(tok_dir: Path, root: Path) -> Path:
    """The test tokenizer without its chat template: a base model's."""
    root.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", root / "tokenizer.json")
    shutil.copy(tok_dir / "generation_config.json", root / "generation_config.json")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_raw_prompts_on_a_base_tokenizer(
    tok_dir: Path, tmp_path: Path, make_engine: Any, router_config: Any
) -> None:
    base = ChatTokenizer.from_dir(_base_tokenizer_dir(tok_dir, tmp_path / "base"))
    seen: list[dict[str, Any]] = []
    engine = make_engine(base)

    async def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, json=engine(body))

    async def main() -> None:
        app = create_app(router_config(), tokenizer=base, transport=httpx.MockTransport(upstream))
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://sr") as c:
                sid = (await c.post("/sessions")).json()["session_id"]
                # chat needs a template: a 400 that names the raw route
                chat = await c.post(
                    f"/sessions/{sid}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}]},
                )
                assert chat.status_code == 400
                assert "no chat template (a base model)" in chat.json()["error"]
                assert "/v1/completions" in chat.json()["error"]
                text = "hello there 12+3="
                r = await c.post(
                    f"/sessions/{sid}/v1/completions",
                    json={"prompt": text, "max_tokens": 16, "logprobs": True, "seed": 5},
                )
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["object"] == "text_completion"
                choice = body["choices"][0]
                assert choice["text"].startswith("reply")
                assert (
                    len(choice["logprobs"]["token_logprobs"]) == body["usage"]["completion_tokens"]
                )
                assert seen[-1]["input_ids"] == base.encode(text)  # as it is: no template
                assert seen[-1]["sampling_params"]["sampling_seed"] == 5
                assert "prompt" not in seen[-1]
                # a second turn continues the session's tokens, given as ids
                acc = (await c.get(f"/sessions/{sid}")).json()["metadata"]["accumulated_token_ids"]
                more = [*acc, *base.encode(" and")]
                r = await c.post(f"/sessions/{sid}/v1/completions", json={"prompt": more})
                assert r.status_code == 200, r.text
                assert seen[-1]["input_ids"] == more
                (sample,) = decode_samples(
                    (await c.post(f"/sessions/{sid}/samples", json={})).content
                ).samples
                assert sample.prompt_ids == base.encode(text)
                assert (
                    sample.tokens
                    == (await c.get(f"/sessions/{sid}")).json()["metadata"]["accumulated_token_ids"]
                )
                # bad prompts: 400 naming the field
                for bad, needle in [
                    ({"prompt": ""}, "prompt: must be a non-empty"),
                    ({"prompt": [1, -1]}, "prompt[1]: must be a token id in [0, "),
                    (
                        {"prompt": [base.tokenizer.get_vocab_size()]},
                        "prompt[0]: must be a token id",
                    ),
                    ({"prompt": {"a": 1}}, "got dict"),
                    ({"prompt": "x", "n": 2}, "n: only 1 choice"),
                    ({"prompt": [1, 2]}, "a raw turn must continue the session's"),
                ]:
                    r = await c.post(f"/sessions/{sid}/v1/completions", json=bad)
                    assert r.status_code == 400, (bad, r.text)
                    assert needle in r.json()["error"], (bad, r.text)
                assert (await c.delete(f"/sessions/{sid}")).status_code == 204
            # the rollout client's raw path: one session per sample, deleted after
            async with SessionRolloutClient("http://sr", transport=transport) as client:
                sample = await client.rollout(
                    [], prompt="2+2=", sampling_params={"max_tokens": 4}, metadata={"k": 1}
                )
                assert sample.prompt_ids == base.encode("2+2=")
                assert sample.response_length == 4
                assert sample.metadata["k"] == 1
                assert app.state.server.sessions == {}
        finally:
            await app.state.server.aclose()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
