"""/generate, chat and info routes: SGLang shapes, strict parity, scoring forms, faults."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.interface import GenerateResponse


def _lp(entries: list[list[Any]]) -> list[float | None]:
    return [e[0] for e in entries]


def test_info_routes_have_sglang_shapes(engine, ckpt_dir) -> None:  # type: ignore[no-untyped-def]
    with engine() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200
        for path in ("/model_info", "/get_model_info"):
            info = c.get(path).json()
            assert info["model_path"] == str(ckpt_dir)
            assert info["is_generation"] is True
            assert info["weight_version"] is None  # an int once an update installs one
        for path in ("/server_info", "/get_server_info"):
            s = c.get(path).json()
            assert s["numerics"] == "strict"
            assert s["quantization"] is None
            assert s["internal_states"][0]["weight_version"] is None
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == str(ckpt_dir)
        assert c.post("/flush_cache").status_code == 200


def test_generate_logprobs_equal_training_forward(engine, reference, trainer_lp) -> None:  # type: ignore[no-untyped-def]
    prompt = [5, 17, 33, 9, 71, 2]
    with engine() as c:
        r = c.post(
            "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 11},
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 3,
            },
        )
    assert r.status_code == 200, r.text
    body = GenerateResponse.parse(r.json()).model_dump()
    meta = r.json()["meta_info"]
    out = r.json()["output_ids"]
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(out)
    assert len(meta["input_token_logprobs"]) == len(prompt)
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt
    assert [e[1] for e in meta["output_token_logprobs"]] == out
    want = trainer_lp(reference, prompt + out)
    got = _lp(meta["input_token_logprobs"])[1:] + _lp(meta["output_token_logprobs"])
    assert got == want[1:]  # bit for bit
    # top-k rows are descending and include the sampled token's logprob when it is top-1
    for row in meta["output_top_logprobs"]:
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
    assert body["meta_info"]["weight_version"] is None


def test_batched_and_text_forms_match_single(engine) -> None:  # type: ignore[no-untyped-def]
    sp = {"max_new_tokens": 5, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "sampling_seed": 3}
    with engine(max_running_requests=4) as c:
        single = [
            c.post(
                "/generate", json={"input_ids": p, "sampling_params": sp, "return_logprob": True}
            ).json()
            for p in ([4, 5, 6], [7, 8, 9, 10, 11])
        ]
        batch = c.post(
            "/generate",
            json={
                "input_ids": [[4, 5, 6], [7, 8, 9, 10, 11]],
                "sampling_params": sp,
                "return_logprob": True,
            },
        ).json()
        text = c.post(
            "/generate", json={"text": ["hi", "yo"], "sampling_params": {"max_new_tokens": 2}}
        )
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in single]
    assert [b["meta_info"]["output_token_logprobs"] for b in batch] == [
        s["meta_info"]["output_token_logprobs"] for s in single
    ]
    assert text.status_code == 200
    assert len(text.json()) == 2
    assert all(isinstance(t["text"], str) for t in text.json())


@settings(max_examples=10, deadline=None)
@given(
    prompt=st.lists(st.integers(4, 100), min_size=3, max_size=10),
    ids=st.lists(st.integers(0, 127), min_size=1, max_size=4, unique=True),
    data=st.data(),
)
def test_flat_and_per_position_scoring_agree(engine, prompt, ids, data) -> None:  # type: ignore[no-untyped-def]
    rows = [sorted(data.draw(st.sets(st.sampled_from(ids), max_size=len(ids)))) for _ in prompt]
    base = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    with engine() as c:
        flat = c.post("/generate", json=base | {"token_ids_logprob": sorted(ids)}).json()[
            "meta_info"
        ]
        per = c.post("/generate", json=base | {"token_ids_logprob_positions": rows}).json()[
            "meta_info"
        ]
    assert per["input_token_logprobs"] == flat["input_token_logprobs"]
    for i, row in enumerate(rows):
        if i == 0 or not row:
            assert per["input_token_ids_logprobs"][i] is None
            continue
        flat_row = {e[1]: e[0] for e in flat["input_token_ids_logprobs"][i]}
        assert [[e[0], e[1]] for e in per["input_token_ids_logprobs"][i]] == [
            [flat_row[t], t] for t in row
        ]


def test_text_in_logprobs_and_text_prompt_scoring(engine) -> None:  # type: ignore[no-untyped-def]
    with engine() as c:
        r = c.post(
            "/generate",
            json={
                "text": "abc",
                "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True,
                "logprob_start_len": 0,
                "return_text_in_logprobs": True,
            },
        ).json()
        bad = c.post(
            "/generate",
            json={
                "text": "abc",
                "token_ids_logprob_positions": [[1]],
                "sampling_params": {"max_new_tokens": 0},
            },
        )
    assert [e[2] for e in r["meta_info"]["input_token_logprobs"]] == ["a", "b", "c"]
    assert bad.status_code == 400
    assert bad.json()["error"]["field"] == "token_ids_logprob_positions"


def test_stop_token_ids_and_stop_strings(engine) -> None:  # type: ignore[no-untyped-def]
    with engine() as c:
        free = c.post(
            "/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
            },
        ).json()
        first = free["output_ids"][0]
        stopped = c.post(
            "/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {
                    "max_new_tokens": 10,
                    "temperature": 0,
                    "stop_token_ids": [first],
                },
            },
        ).json()
        assert stopped["output_ids"] == [first]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
        assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        text = free["text"]
        stop = text[1:3] if len(text) >= 3 else text
        cut = c.post(
            "/generate",
            json={
                "input_ids": [5, 6, 7],
                "sampling_params": {
                    "max_new_tokens": 10,
                    "temperature": 0,
                    "stop": stop,
                    "ignore_eos": True,
                },
            },
        ).json()
        assert cut["meta_info"]["finish_reason"]["matched"] == stop
        assert stop not in cut["text"]


def test_chat_completion_with_logprobs_and_meta_info(engine) -> None:  # type: ignore[no-untyped-def]
    with engine() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 2,
                "return_meta_info": True,
                "seed": 1,
            },
        )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant"
    lps = [x["logprob"] for x in choice["logprobs"]["content"]]
    assert lps == [e[0] for e in choice["meta_info"]["output_token_logprobs"]]
    assert all(len(x["top_logprobs"]) == 2 for x in choice["logprobs"]["content"])
    assert r.json()["usage"]["completion_tokens"] == len(lps)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": [1, 2], "text": "x"}, "<root>"),
        ({"input_ids": [1, 500]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
        (
            {"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}},
            "sampling_params.repetition_penalty",
        ),
        ({"input_ids": [1, 2], "lora_path": "nope"}, None),
        ({"input_ids": [1, 2], "token_ids_logprob_positions": [[1]]}, "<root>"),
        ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
        ({"input_ids": [1, 2], "stream": True}, "stream"),
        ({"input_ids": list(range(60))}, "input_ids"),
        ({"input_ids": [[1, 2], [3]], "rid": ["a"]}, "rid"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(engine, body, field) -> None:  # type: ignore[no-untyped-def]
    with engine() as c:
        r = c.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if field is not None:  # pydantic may add a union tag in the middle of the path
        first, last = field.split(".")[0], field.split(".")[-1]
        assert err["field"].startswith(first), err
        assert err["field"].endswith(last), err
    else:
        assert "nope" in err["message"]


def test_malformed_json_and_oversize_bodies(engine) -> None:  # type: ignore[no-untyped-def]
    with engine(max_request_bytes=2048) as c:
        bad = c.post(
            "/generate", content=b'{"input_ids": [1,', headers={"content-type": "application/json"}
        )
        big = c.post("/generate", json={"input_ids": [1] * 2000})
    assert bad.status_code == 400
    assert bad.json()["error"]["field"] == "body"
    assert big.status_code == 413


def test_overload_answers_503_and_pause_continue(engine) -> None:  # type: ignore[no-untyped-def]
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}}
    with engine(max_queued_requests=2) as c:
        # a batch that can never fit the queue is oversize (413), not overload
        assert c.post("/generate", json={"input_ids": [[4, 5]] * 3}).status_code == 413
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        results: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(c.post("/generate", json=body).status_code)
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while c.get("/server_info").json()["internal_states"][0]["queued_requests"] < 2:
            assert time.monotonic() < deadline, "requests never queued"
            time.sleep(0.02)
        over = c.post("/generate", json=body)
        assert over.status_code == 503
        assert "queue full" in over.json()["error"]["message"]
        assert c.post("/continue_generation").status_code == 200
        for t in threads:
            t.join(timeout=10)
        assert results == [200, 200]
        # abort mode finishes queued requests with finish_reason abort
        c.post("/pause_generation", json={"mode": "abort"})
        c.post("/continue_generation")
        assert (
            c.post("/generate", json=body).json()["meta_info"]["finish_reason"]["type"] == "length"
        )


def test_bearer_token_guards_state_changing_routes(engine) -> None:  # type: ignore[no-untyped-def]
    with engine(api_key="sekrit") as c:
        assert (
            c.post(
                "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1}}
            ).status_code
            == 200
        )
        for path in (
            "/pause_generation",
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
            "/update_weight_version",
            "/update_weights_from_tensor",
            "/update_weights_from_disk",
            "/flush_cache",
        ):
            assert c.post(path, json={}).status_code == 401, path
        r = c.post("/flush_cache", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
        assert c.post("/flush_cache", headers={"Authorization": "Bearer wrong"}).status_code == 401


_DENSE: dict[str, Any] = {"num_experts": 0, "mlp_only_layers": ()}
_FAMILY_LAYOUTS: dict[str, dict[str, Any]] = {
    "qwen3_moe_all_moe": {"mlp_only_layers": ()},
    "qwen3_yarn": {**_DENSE, "family": "qwen3", "rope_scaling": "yarn"},
    "qwen2": {**_DENSE, "family": "qwen2", "qk_norm": False, "qkv_bias": True},
    "llama3": {**_DENSE, "family": "llama", "qk_norm": False, "rope_scaling": "llama3"},
    "mistral": {
        **_DENSE,
        "family": "mistral",
        "qk_norm": False,
        "sliding_window_layers": (0, 1, 2, 3),
        "sliding_window_size": 3,
    },
}


@pytest.mark.parametrize(
    "layout", ["mellum", "qwen3_moe_mlp_only_layers", *sorted(_FAMILY_LAYOUTS)]
)
def test_serves_every_checkpoint_layout(engine, tmp_path, trainer_lp, layout: str) -> None:  # type: ignore[no-untyped-def]
    """Dense+MoE (mellum), all-MoE (qwen3_moe), pre-mellum qwen3_moe + mlp_only_layers dirs,
    and each dense family (Qwen3 + YaRN, Qwen2 with q/k/v bias, Llama 3 rope, Mistral window)."""
    import json

    from posttrain.models import ModelConfig, RopeScaling, build_model, load_pretrained

    changes = dict(_FAMILY_LAYOUTS.get(layout, {}))
    rope = changes.pop("rope_scaling", None)
    if rope is not None:
        changes["rope_scaling"] = RopeScaling(
            rope_type=rope, factor=4.0, original_max_position_embeddings=8
        )
    cfg = ModelConfig.tiny(torch_dtype="bfloat16", max_position_embeddings=48, **changes)
    build_model(cfg, seed=3).save_pretrained(tmp_path)
    if layout == "qwen3_moe_mlp_only_layers":
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_qwen3_moe_hf_dict()))
    written = json.loads((tmp_path / "config.json").read_text())
    prompt = [5, 17, 33, 9]
    with engine(model_path=str(tmp_path)) as c:
        info = c.get("/model_info").json()
        r = c.post(
            "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 2},
                "return_logprob": True,
            },
        )
    assert info["model_type"] == written["model_type"]
    assert info["architectures"] == written["architectures"]
    assert r.status_code == 200, r.text
    out = r.json()["output_ids"]
    lps = [e[0] for e in r.json()["meta_info"]["output_token_logprobs"]]
    expected = trainer_lp(load_pretrained(tmp_path), prompt + out)[len(prompt) :]
    assert lps == expected


def test_context_length_sets_the_kv_capacity(engine) -> None:  # type: ignore[no-untyped-def]
    """``--context-length`` (SGLang's flag) is the KV capacity, not max_position_embeddings."""
    prompt = list(range(4, 22))  # 18 tokens
    with engine(context_length=20) as c:
        info = c.get("/server_info").json()
        r = c.post(
            "/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 10}},
        )
        too_long = c.post(
            "/generate",
            json={"input_ids": list(range(4, 25)), "sampling_params": {"max_new_tokens": 1}},
        )
    assert info["context_length"] == 20
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] <= 2
    assert too_long.status_code == 400, too_long.text
    assert "20" in too_long.text


def _gen(c: Any, body: dict[str, Any]) -> Any:
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _sample(item: dict[str, Any]) -> tuple[Any, ...]:
    m = item["meta_info"]
    return (item["output_ids"], m["output_token_logprobs"], m["input_token_logprobs"])


def test_parallel_samples_equal_single_requests_at_any_batch_size(engine) -> None:  # type: ignore[no-untyped-def]
    """``sampling_params.n``: SGLang's list reply, prompt-major, sample j seeded seed + j and
    named rid_j; one shared prefill, the same tokens and logprobs as n single requests decoded
    alone (batch size 1) and inside batches of 64."""
    prompts = [[4, 5, 6, 7], [9, 8, 7]]
    sp = {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 7, "n": 4}
    base = {"sampling_params": sp, "return_logprob": True, "logprob_start_len": 0}
    with engine(max_running_requests=1) as c:
        alone = [
            _sample(_gen(c, base | {"input_ids": p, "sampling_params": sp | {"n": 1,
                                                                           "sampling_seed": 7 + j}}))
            for p in prompts
            for j in range(4)
        ]  # fmt: skip
    with engine() as c:
        assert c.get("/server_info").json()["max_running_requests"] == 128  # the new default
        one = _gen(c, base | {"input_ids": prompts[0], "rid": "g"})
        assert isinstance(one, list)
        assert [x["meta_info"]["id"] for x in one] == ["g_0", "g_1", "g_2", "g_3"]
        both = _gen(c, base | {"input_ids": prompts})
        # 16 copies of the batch in one request: 128 samples, the engine's whole default batch
        wide = _gen(c, base | {"input_ids": prompts * 16})
    assert [_sample(x) for x in one] == alone[:4]
    assert [_sample(x) for x in both] == alone  # prompt-major: prompt 0's samples first
    assert [_sample(x) for x in wide] == alone * 16
    assert len({tuple(s[0]) for s in alone[:4]}) > 1  # the seeds differ, so do the samples


def test_parallel_sampling_refusals(engine) -> None:  # type: ignore[no-untyped-def]
    with engine(max_queued_requests=8) as c:
        mixed = c.post(
            "/generate",
            json={"input_ids": [[4, 5], [6, 7]],
                  "sampling_params": [{"n": 2}, {"n": 3}]},
        )  # fmt: skip
        too_many = c.post(
            "/generate", json={"input_ids": [[4, 5], [6, 7]], "sampling_params": {"n": 5}}
        )
        chat = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2}
        )
        zero = c.post("/generate", json={"input_ids": [4, 5], "sampling_params": {"n": 0}})
    assert mixed.status_code == 400
    assert "same n" in mixed.text
    assert too_many.status_code == 413
    assert "sampling_params.n" in too_many.text
    assert chat.status_code == 400
    assert "sampling_params.n" in chat.text
    assert zero.status_code == 400
    assert "n" in zero.text


def test_tasks_joining_a_running_batch_decode_as_alone(reference) -> None:  # type: ignore[no-untyped-def]
    """Continuous batching: tasks admitted between decode steps (into rows freed by finished
    tasks, some sharing a prompt) give the tokens and logprobs they give decoded alone."""
    from posttrain.local_engine._engine import Engine, GenResult, GenTask
    from posttrain.local_engine._sampling import SamplingConfig

    engine = Engine(reference, eos_token_ids=[3])

    def task(i: int) -> GenTask:
        return GenTask(
            input_ids=[4 + i % 3, 9, 11 + i % 3],
            max_new_tokens=2 + i % 4,
            sampling=SamplingConfig(temperature=0.9),
            seed=100 + i,
            ignore_eos=True,
            return_logprob=True,
            logprob_start_len=0,
        )

    alone = [engine.run_batch([task(i)])[0] for i in range(10)]
    waves = [[0, 1, 2], [3, 4], [], [5, 6, 7, 8], [9]]  # queued at successive step boundaries
    queue: list[int] = []
    got: dict[object, GenResult] = {}
    asked: list[int] = []

    def admit(free: int) -> list[tuple[object, GenTask]]:
        asked.append(free)
        queue.extend(waves[len(asked)] if len(asked) < len(waves) else [])
        taken, queue[:] = queue[:free], queue[free:]
        return [(i, task(i)) for i in taken]

    engine.run_stream([(i, task(i)) for i in waves[0]], admit, got.__setitem__, rows=5)

    def key(r: GenResult) -> tuple[Any, ...]:
        return (r.output_ids, r.output_token_logprobs, r.input_token_logprobs, r.finish_reason)

    assert [key(got[i]) for i in range(10)] == [key(r) for r in alone]
    assert min(asked) < 5  # some tasks joined while others were running


def test_a_task_that_cannot_start_fails_alone(reference) -> None:  # type: ignore[no-untyped-def]
    from posttrain.local_engine import AdapterError
    from posttrain.local_engine._engine import Engine, GenTask
    from posttrain.local_engine._sampling import SamplingConfig

    engine = Engine(reference)
    good = GenTask(input_ids=[4, 5], max_new_tokens=2, sampling=SamplingConfig(), seed=1)
    gone = GenTask(input_ids=[4, 5], max_new_tokens=2, sampling=SamplingConfig(), seed=1,
                   lora_name="unloaded")  # fmt: skip
    got: dict[object, object] = {}
    engine.run_stream([("good", good), ("gone", gone)], lambda free: [], got.__setitem__, rows=2)
    assert isinstance(got["gone"], AdapterError)
    assert got["good"].output_ids == engine.run_batch([good])[0].output_ids  # type: ignore[attr-defined]


def test_concurrent_requests_equal_the_same_requests_alone(engine) -> None:  # type: ignore[no-untyped-def]
    """Requests sent together go through the scheduler's continuous batch (joining it as they
    arrive); each reply equals the reply to the same request sent alone."""
    from concurrent.futures import ThreadPoolExecutor

    def body(i: int) -> dict[str, Any]:
        sp = {"max_new_tokens": 2 + i % 5, "sampling_seed": 50 + i, "ignore_eos": True}
        if i % 4 == 0:
            sp["n"] = 3
        return {"input_ids": [4 + i % 3, 8, 9], "sampling_params": sp, "return_logprob": True}

    def passes(c: Any) -> int:
        return int(c.get("/server_info").json()["internal_states"][0]["forward_passes"])

    with engine() as c:
        alone = [_gen(c, body(i)) for i in range(16)]
        mid = passes(c)
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda i: _gen(c, body(i)), range(16)))
        end = passes(c)

    def strip(x: Any) -> Any:
        items = x if isinstance(x, list) else [x]
        return [_sample(it) for it in items]

    assert [strip(x) for x in together] == [strip(x) for x in alone]
    assert end - mid < mid  # they did share model calls
