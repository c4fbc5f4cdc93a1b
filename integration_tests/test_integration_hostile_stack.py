"""Issue 35 on a real ``posttrain up`` stack (two local engines, the real sgl-router binary, the
session router, all on 127.0.0.1): what a hostile local process or a careless client did to it.

* Finding 7: no process of the stack has the API key in its argv (what ``ps`` shows).
* Finding 3: 20 client errors in a row (a negative temperature, a context overflow, a bad
  image), through sgl-router and through a session, never take an engine out: the next good
  request is served (with sgl-router's breaker on, three 400s per engine gave 502s for ~60 s).
* Finding 2: file-path media through the router is refused, the same words for a present and
  a missing file.
* The load figures: 200 concurrent ``/generate`` through sgl-router and 50 concurrent sessions
  through the session router, every one answered 200.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from stacks import Stack, write_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(400)]
GEN = {"max_new_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir, _ = write_checkpoint(tmp_path_factory.mktemp("hostile"))
    s = Stack(["--model-path", str(model_dir), "--engines", "2", "--engine", "local-engine",
               "--ready-timeout-s", "150"])  # fmt: skip
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_no_process_of_the_stack_has_the_key_in_its_argv(stack: Stack) -> None:
    children = psutil.Process(stack.proc.pid).children(recursive=True)
    assert len(children) >= 4
    for child in children:
        assert stack.key not in " ".join(child.cmdline()), child.name()


def _bad_bodies(model_dir_hint: str) -> list[dict[str, Any]]:
    return [
        {"text": "hi", "sampling_params": {"temperature": -5, "max_new_tokens": 2}},
        {"input_ids": [5] * 600, "sampling_params": GEN},  # over the 512-token context
        {"text": "hi", "image_data": model_dir_hint, "sampling_params": GEN},
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
    ]


def test_client_errors_never_take_an_engine_out(stack: Stack, tmp_path: Path) -> None:
    router, base = stack.urls["router"], stack.urls["session-router"]
    auth = {"Authorization": f"Bearer {stack.key}"}
    bodies = _bad_bodies(str(tmp_path / "nothing.png"))
    with httpx.Client(timeout=60.0) as client:
        for i in range(20):
            r = client.post(f"{router}/generate", json=bodies[i % len(bodies)])
            assert 400 <= r.status_code < 500, (i, r.status_code, r.text)
        good = client.post(f"{router}/generate", json={"text": "hello", "sampling_params": GEN})
        assert good.status_code == 200, good.text
        session = client.post(f"{base}/sessions", headers=auth).json()["session_id"]
        turn = f"{base}/sessions/{session}/v1/chat/completions"
        for _ in range(20):
            bad = {"messages": [{"role": "user", "content": "hi"}], "temperature": -5,
                   "max_tokens": 2}  # fmt: skip
            r = client.post(turn, json=bad, headers=auth)
            assert 400 <= r.status_code < 500, r.text
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = client.post(turn, json=ok, headers=auth)
        assert r.status_code == 200, r.text


def test_file_path_media_is_refused_alike_through_the_router(stack: Stack) -> None:
    replies = set()
    with httpx.Client(timeout=60.0) as client:
        for ref in ("/proc/kmsg", "/etc/hostname", "/no/such/file.png", str(stack.key_file)):
            body = {"text": "hi", "image_data": ref, "sampling_params": GEN}
            r = client.post(f"{stack.urls['router']}/generate", json=body)
            assert r.status_code == 400, r.text
            replies.add(r.text)
        assert client.get(f"{stack.urls['engine-0']}/health").status_code == 200
    assert len(replies) == 1, replies


def test_load_200_generates_and_50_sessions_all_answered(stack: Stack) -> None:
    router, base = stack.urls["router"], stack.urls["session-router"]
    auth = {"Authorization": f"Bearer {stack.key}"}

    async def run() -> tuple[list[int], list[int]]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=180.0, limits=limits) as client:

            async def generate(i: int) -> int:
                body = {"text": f"count {i}", "sampling_params": GEN}
                return (await client.post(f"{router}/generate", json=body)).status_code

            async def session(i: int) -> int:
                made = await client.post(f"{base}/sessions", headers=auth)
                sid = made.json()["session_id"]
                msg = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2}
                r = await client.post(f"{base}/sessions/{sid}/v1/chat/completions", json=msg,
                                      headers=auth)  # fmt: skip
                return r.status_code

            gens = await asyncio.gather(*(generate(i) for i in range(200)))
            sessions = await asyncio.gather(*(session(i) for i in range(50)))
            return list(gens), list(sessions)

    gens, sessions = asyncio.run(asyncio.wait_for(run(), timeout=300))
    assert gens == [200] * 200
    assert sessions == [200] * 50
