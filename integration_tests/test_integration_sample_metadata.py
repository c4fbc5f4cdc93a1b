"""The sample metadata the session router writes is the metadata grpo reads.

The key is one constant (``posttrain.interface.WEIGHT_VERSIONS_KEY``); here the session router
assembles a multi-turn sample from real turn records, the sample crosses samples/1 as it does
between the two processes, and grpo's stale-sample filter judges it: a rename on either side
would make a stale sample pass as current, and this test fail.
"""

from __future__ import annotations

import time

from posttrain.formats import decode_samples, encode_samples
from posttrain.grpo.fleet import is_stale, turn_versions
from posttrain.interface import WEIGHT_VERSIONS_KEY, Sample
from posttrain.session_router import TurnRecord, assemble_samples


def _turn(prompt: list[int], output: list[int], weight_version: str) -> TurnRecord:
    return TurnRecord(
        timestamp=time.time(),
        request_timestamp=time.time(),
        method="POST",
        path="/generate",
        request={"input_ids": prompt},
        response={"meta_info": {"weight_version": weight_version}},  # SGLang's string form
        status_code=200,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[-0.5] * len(output),
        finish_reason="stop",
    )


def _assembled(versions: list[str]) -> Sample:
    """A conversation of one turn per version, assembled and sent through samples/1."""
    records, prompt = [], [1, 2]
    for i, version in enumerate(versions):
        output = [10 + i, 20 + i]
        records.append(_turn(list(prompt), output, version))
        prompt = [*prompt, *output, 7]  # the observation the next turn's prompt appends
    (sample,) = assemble_samples(records, prompt[:-1], max_trim_tokens=0).samples
    (wired,) = decode_samples(encode_samples([sample])).samples
    return wired


def test_a_turn_from_old_weights_makes_the_router_sample_stale_for_grpo() -> None:
    mixed = _assembled(["4", "5", "5"])
    assert mixed.metadata[WEIGHT_VERSIONS_KEY] == [4, 5, 5]
    assert turn_versions(mixed) == [4, 5, 5]
    assert is_stale(mixed, 5)
    current = _assembled(["5", "5"])
    assert turn_versions(current) == [5, 5]
    assert not is_stale(current, 5)
