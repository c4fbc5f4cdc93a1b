"""``posttrain up`` end to end on CPU: two local engines, the stock sgl-router and the session
router; a chat through a session; Ctrl-C; no process it started survives.

The launch package never imports its siblings; this test needs them installed to have
something to start, so it lives in integration_tests, where the whole workspace is.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import httpx
import psutil
import pytest
from stacks import Stack, gone, write_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(400)]
ADAPTER = "policy"


def test_up_serves_a_session_chat_and_stops_everything(tmp_path: Path) -> None:
    model_dir, adapter = write_checkpoint(tmp_path)
    stack = Stack(
        ["--model-path", str(model_dir), "--engines", "2", "--lora", f"{ADAPTER}={adapter}",
         "--engine", "local-engine", "--ready-timeout-s", "150"]
    )  # fmt: skip
    children: list[int] = []
    try:
        stack.wait_ready()
        urls = stack.urls
        assert set(urls) == {"engine-0", "engine-1", "router", "session-router"}
        children = [c.pid for c in psutil.Process(stack.proc.pid).children(recursive=True)]
        assert len(children) >= 4
        assert stack.key_file is not None
        assert stack.key_file.stat().st_mode & 0o777 == 0o600

        base = urls["session-router"]
        auth = {"Authorization": f"Bearer {stack.key}"}
        with httpx.Client(timeout=60.0, headers=auth) as client:
            session = client.post(f"{base}/sessions").json()["session_id"]
            reply = client.post(
                f"{base}/sessions/{session}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["role"] == "assistant"
            record = client.get(f"{base}/sessions/{session}").json()["records"][0]
            assert record["request"]["lora_path"] == ADAPTER  # the adapter reached the engine
            assert record["request"]["extra_key"] == f"{ADAPTER}:v0"  # the startup version
            assert client.delete(f"{base}/sessions/{session}").status_code == 204
            listed = client.get(f"{urls['router']}/workers").json()["workers"]
            workers = {str(w["url"]).split("@", 1)[0].rstrip("/") for w in listed}
            assert {urls["engine-0"], urls["engine-1"]} <= workers, listed  # both behind it
    finally:
        err = stack.stop()
    assert stack.proc.returncode == 0, err[-4000:]
    assert err.count("registered http://127.0.0.1:") == 2
    assert "stopped every process" in err
    assert all(gone(pid) for pid in children), [p for p in children if not gone(p)]
    assert stack.key_file is not None
    assert not stack.key_file.exists()  # removed at stop


def test_two_stacks_side_by_side_with_29000_taken_and_keys_required(tmp_path: Path) -> None:
    model_dir, _ = write_checkpoint(tmp_path)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with contextlib.suppress(OSError):  # taken already is just as good
        squatter.bind(("127.0.0.1", 29000))
        squatter.listen()
    argv = ["--model-path", str(model_dir), "--engines", "1", "--engine", "local-engine",
            "--ready-timeout-s", "150"]  # fmt: skip
    stacks = [Stack(argv), Stack(argv)]
    try:
        for stack in stacks:
            stack.wait_ready()
        first, second = stacks
        assert first.key != second.key
        ports = [url.rsplit(":", 1)[1] for s in stacks for url in s.urls.values()]
        assert len(set(ports)) == len(ports) == 6
        for stack in stacks:
            engine, base = stack.urls["engine-0"], stack.urls["session-router"]
            with httpx.Client(timeout=60.0) as client:
                mine = {"Authorization": f"Bearer {stack.key}"}
                assert client.post(f"{base}/sessions").status_code == 401
                session = client.post(f"{base}/sessions", headers=mine).json()["session_id"]
                reply = client.post(
                    f"{base}/sessions/{session}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    headers=mine,
                )
                assert reply.status_code == 200, reply.text
                # State-changing engine routes need this stack's key (generation, above, not).
                update = {"model_path": str(tmp_path / "nowhere")}
                no_key = client.post(f"{engine}/update_weights_from_disk", json=update)
                assert no_key.status_code == 401, no_key.text
                other = {"Authorization": f"Bearer {(second if stack is first else first).key}"}
                wrong = client.post(
                    f"{engine}/update_weights_from_disk", json=update, headers=other
                )
                assert wrong.status_code == 401
                right = client.post(f"{engine}/update_weights_from_disk", json=update, headers=mine)
                assert right.status_code == 400, right.text  # past the key: the path is refused
    finally:
        errs = [stack.stop() for stack in stacks]
        squatter.close()
    for stack, err in zip(stacks, errs, strict=True):
        assert stack.proc.returncode == 0, err[-4000:]
        assert "--api-key-file " in err  # the key file's path in argv (issue 35), never the key
        assert stack.key not in err  # the key file's path is printed, never the key
        assert "Address already in use" not in err
