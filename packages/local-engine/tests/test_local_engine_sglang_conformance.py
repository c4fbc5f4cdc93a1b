"""Optional: the request bodies local-engine accepts are accepted by SGLang's own struct.

Runs where ``sglang`` imports: CI runs it in the side environment ``.ci/sglang-conformance``
builds (a pinned sglang with ``--no-deps`` plus the light packages its io_struct imports, torch
from the lock), where it must pass; the workspace's own suite skips it.
``token_ids_logprob_positions`` is left out: it exists only in patched SGLang.
"""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.interface import GenerateRequest

io_struct = pytest.importorskip("sglang.srt.managers.io_struct")

BODIES: list[dict[str, Any]] = [
    {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.5}},
    {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0, "sampling_seed": 3},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": [4, 5],
        "lora_path": "a",
        "rid": "r1",
    },
    {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 2}},
    {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
    # media: one request with two images and one audio clip; a batch with a list per prompt
    {"input_ids": [1, 101, 101, 102], "image_data": ["aW1n", "/tmp/x.png"], "audio_data": "YXVk"},
    {"text": ["a", "b"], "image_data": [["aW1n"], ["aW1n", "aW1n"]]},
    N_BODY := {  # a session router group with --parallel-sampling: one /generate with n
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 1.0,
            "sampling_seed": 70,
            "n": 3,
            "no_stop_trim": False,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_text_in_logprobs": False,
        "lora_path": "a",
        "extra_key": "a:v0",
    },
]


@pytest.mark.parametrize("body", BODIES)
def test_sglang_accepts_our_generate_bodies(body: dict[str, Any]) -> None:
    ours = GenerateRequest.parse(body).to_dict()
    req = io_struct.GenerateReqInput(**ours)
    req.normalize_batch_and_arguments()


def test_sglang_gives_parallel_samples_one_seed() -> None:
    """Why the session router's --parallel-sampling is for local engines only: SGLang expands
    ``n`` into n copies of the prompt that share the request's one ``sampling_params`` (local
    engine: sample j draws with ``sampling_seed + j``)."""
    req = io_struct.GenerateReqInput(**GenerateRequest.parse(N_BODY).to_dict())
    req.normalize_batch_and_arguments()
    assert req.parallel_sample_num == 3
    assert not req.is_single
    seeds = {sp["sampling_seed"] for sp in req.sampling_params}
    assert seeds == {70}


def test_sglang_accepts_our_memory_occupation_bodies() -> None:
    for tags in (None, ["weights"], ["kv_cache", "weights"]):
        assert io_struct.ReleaseMemoryOccupationReqInput(tags=tags).tags == tags
        assert io_struct.ResumeMemoryOccupationReqInput(tags=tags).tags == tags
