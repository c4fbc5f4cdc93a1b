"""Media through the session router: ``image_data``/``audio_data`` reach the engine on every
token-in/token-out turn (through the real sgl-router on 127.0.0.1) and come back on the
session's sample (samples/2), so a trainer can rebuild the exact multimodal input."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest
from safetensors.numpy import load as st_load

from posttrain.formats import MEDIA_SAMPLES_FORMAT, decode_samples
from posttrain.interface import MediaKind, MediaRef, media_request_fields
from posttrain.session_router import (
    ChatTokenizer,
    LoopbackWorker,
    RouterHandle,
    SampleAssemblyError,
    SessionRolloutClient,
    SessionRouterConfig,
    TurnRecord,
    UpstreamReplyError,
    create_app,
    default_probe_body,
    parse_generate_reply,
)
from posttrain.session_router.samples import merge_turns, trim_turns

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]

IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="
AUDIO = "/clips/tone.npy"
SECOND_IMAGE = "/images/second.png"
PLACEHOLDERS = 3  # what the engine says each media item expands to in prompt_tokens


def media_engine(tok: ChatTokenizer, make_engine: Any) -> Any:
    """The scripted engine, counting each media item's placeholder run in ``prompt_tokens`` as
    a multimodal engine does."""
    engine = make_engine(tok)

    def generate(body: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = engine(body)
        items = len(body.get("image_data") or []) + len(body.get("audio_data") or [])
        reply["meta_info"]["prompt_tokens"] += PLACEHOLDERS * items
        return reply

    return generate


def test_sgl_router_passes_the_media_fields_through(router: RouterHandle) -> None:
    body = default_probe_body()
    body.update(image_data=[IMAGE, SECOND_IMAGE], audio_data=[AUDIO])
    router.probe_passthrough(body)  # raises RouterIncompatible naming a dropped field


def test_two_turns_forward_media_and_the_sample_carries_it(
    router: RouterHandle, tok_dir: Any, chat_tok: ChatTokenizer, make_engine: Any, app_client: Any
) -> None:
    cfg = SessionRouterConfig(upstream_url=router.url, tokenizer=str(tok_dir))
    with LoopbackWorker(generate=media_engine(chat_tok, make_engine)) as worker:
        router.add_worker(worker.url)

        async def scenario() -> None:
            async with app_client(cfg, tokenizer=chat_tok) as c:
                sid = (await c.post("/sessions")).json()["session_id"]
                url = f"/sessions/{sid}/v1/chat/completions"
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "what is in it?"}]
                r1 = await c.post(url, json={"messages": msgs, "image_data": IMAGE,
                                             "audio_data": [AUDIO]})  # fmt: skip
                assert r1.status_code == 200, r1.text
                msgs += [r1.json()["choices"][0]["message"], {"role": "user", "content": "and?"}]
                r2 = await c.post(url, json={"messages": msgs, "image_data": [IMAGE, SECOND_IMAGE],
                                             "audio_data": [AUDIO]})  # fmt: skip
                assert r2.status_code == 200, r2.text
                info = (await c.get(f"/sessions/{sid}")).json()
                assert info["records"][1]["request"]["image_data"] == [IMAGE, SECOND_IMAGE]
                data = (await c.post(f"/sessions/{sid}/samples", json={})).content
                decoded = decode_samples(data)
                (sample,) = decoded.samples
                assert sample.tokens == info["metadata"]["accumulated_token_ids"]
                assert sample.media == [
                    MediaRef(kind=MediaKind.IMAGE, ref=IMAGE),
                    MediaRef(kind=MediaKind.IMAGE, ref=SECOND_IMAGE),
                    MediaRef(kind=MediaKind.AUDIO, ref=AUDIO),
                ]
                meta = json.loads(st_load(data)["_samples_meta"].tobytes())
                assert meta["format"] == MEDIA_SAMPLES_FORMAT

        try:
            asyncio.run(asyncio.wait_for(scenario(), timeout=40))
        finally:
            router.remove_worker(worker.url)
    bodies = [body for _, body in worker.generate_requests]
    assert [b["image_data"] for b in bodies] == [[IMAGE], [IMAGE, SECOND_IMAGE]]
    assert [b["audio_data"] for b in bodies] == [[AUDIO], [AUDIO]]
    assert all(isinstance(b["input_ids"], list) for b in bodies)  # still token-in


def test_rollout_client_sends_media_and_gets_it_back(
    router: RouterHandle, tok_dir: Any, chat_tok: ChatTokenizer, make_engine: Any, app_client: Any
) -> None:
    cfg = SessionRouterConfig(upstream_url=router.url, tokenizer=str(tok_dir))
    media = [MediaRef(kind=MediaKind.AUDIO, ref=AUDIO), MediaRef(kind=MediaKind.IMAGE, ref=IMAGE)]
    with LoopbackWorker(generate=media_engine(chat_tok, make_engine)) as worker:
        router.add_worker(worker.url)

        async def scenario() -> None:
            app = create_app(cfg, tokenizer=chat_tok)
            try:
                transport = httpx.ASGITransport(app=app)
                async with SessionRolloutClient("http://sr", transport=transport) as client:
                    group = await client.rollout_group(
                        [{"role": "user", "content": "count"}], 2, group_index=0,
                        sampling_params={"max_tokens": 4}, media=media,
                    )  # fmt: skip
                    text_only = await client.rollout([{"role": "user", "content": "hi"}])
            finally:
                await app.state.server.aclose()
            for sample in group:  # images first, then audio: the request fields' order
                assert sample.media == [media[1], media[0]]
            assert text_only.media == []

        try:
            asyncio.run(asyncio.wait_for(scenario(), timeout=40))
        finally:
            router.remove_worker(worker.url)
    assert worker.generate_requests[0][1]["audio_data"] == [AUDIO]
    assert "image_data" not in worker.generate_requests[-1][1]  # the text-only rollout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"image_data": 7}, "image_data: must be a string or a list of strings, got int"),
        ({"audio_data": ["ok", ""]}, r"audio_data\[1\]: must be a non-empty string"),
    ],
)
def test_bad_media_fields_are_a_400_naming_the_field(
    run_app: Any, extra: dict[str, Any], message: str
) -> None:
    seen: list[httpx.Request] = []

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        r = await c.post(f"/sessions/{sid}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "x"}], **extra})  # fmt: skip
        assert r.status_code == 400
        assert re.search(message, r.text), r.text

    run_app(scenario, seen=seen)
    assert seen == []  # nothing went upstream


def _record(prompt: list[int], output: list[int], media: list[MediaRef]) -> TurnRecord:
    return TurnRecord(
        timestamp=0.0, request_timestamp=0.0, method="POST", path="/generate",
        request={"input_ids": prompt, **media_request_fields(media)},
        response={"meta_info": {}}, status_code=200, prompt_ids=prompt, output_ids=output,
        output_logprobs=[-0.5] * len(output), finish_reason="stop",
    )  # fmt: skip


def test_a_later_turn_that_drops_an_earlier_image_is_refused() -> None:
    first = [MediaRef(kind=MediaKind.IMAGE, ref=IMAGE)]
    other = [MediaRef(kind=MediaKind.IMAGE, ref=SECOND_IMAGE)]
    records = [_record([1, 2], [3], first), _record([1, 2, 3, 4], [5], other)]
    turns = trim_turns(records, [1, 2, 3, 4, 5], max_trim_tokens=1)
    with pytest.raises(SampleAssemblyError, match=r"turns\[1\]: the previous turns' image_data"):
        merge_turns(turns)
    kept = [_record([1, 2], [3], first), _record([1, 2, 3, 4], [5], first + other)]
    merged, used = merge_turns(trim_turns(kept, [1, 2, 3, 4, 5], max_trim_tokens=1))
    assert used == 2
    assert merged is not None
    assert merged.media == first + other


def test_expanded_prompt_tokens_are_accepted_only_with_media() -> None:
    reply = {"text": "a", "output_ids": [5], "meta_info": {
        "prompt_tokens": 9, "completion_tokens": 1, "output_token_logprobs": [[-0.1, 5, None]]}}  # fmt: skip
    assert parse_generate_reply(reply, prompt_len=3, url="u", with_media=True).output_ids == [5]
    with pytest.raises(UpstreamReplyError, match="prompt_tokens=9 but 3 input_ids"):
        parse_generate_reply(reply, prompt_len=3, url="u")
