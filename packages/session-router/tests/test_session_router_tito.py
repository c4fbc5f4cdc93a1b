"""TITO state: prefix invariant, at most one rollback step, first-turn retry, commit rules."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.session_router import (
    BadChatRequestError,
    ChatTokenizer,
    PreparedTurn,
    SessionState,
    TitoMismatchError,
    TurnRecord,
    UpstreamReplyError,
    commit_turn,
    parse_generate_reply,
    prepare_turn,
)


def run_turn(
    state: SessionState, messages: list[dict[str, Any]], tok: ChatTokenizer, engine: Any, **kw: Any
) -> tuple[PreparedTurn, dict[str, Any]]:
    prepared = prepare_turn(state, messages, tok, **kw)
    reply_json = engine({"input_ids": prepared.prompt_ids})
    reply = parse_generate_reply(
        reply_json, prompt_len=len(prepared.prompt_ids), url="http://engine"
    )
    record = TurnRecord(
        timestamp=time.time(),
        request_timestamp=time.time(),
        method="POST",
        path="/generate",
        request={"input_ids": prepared.prompt_ids},
        response=reply_json,
        status_code=200,
        prompt_ids=prepared.prompt_ids,
        output_ids=reply.output_ids,
        output_logprobs=reply.output_logprobs,
        finish_reason=reply.finish_reason,
    )
    assistant = {"role": "assistant", "content": reply.text}
    assert commit_turn(state, prepared, reply, record, assistant)
    return prepared, assistant


def test_three_turns_extend_checkpoints_and_match_a_full_render(
    chat_tok: ChatTokenizer, make_engine: Any
) -> None:
    state, engine = SessionState(session_id="s"), make_engine(chat_tok)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    for turn in range(3):
        prepared, assistant = run_turn(state, msgs, chat_tok, engine)
        if turn == 0:
            assert prepared.keep_checkpoints == 0
        else:
            prev = state.checkpoints[-2]
            assert prepared.prompt_ids[: len(prev)] == prev
        msgs = [*msgs, assistant, {"role": "user", "content": f"and then {turn}?"}]
    # For a ChatML template whose rendering tokenizes stably, TITO equals a full re-render.
    full = chat_tok.encode(chat_tok.render(state.messages, add_generation_prompt=False))
    assert state.accumulated_token_ids == full[: len(state.accumulated_token_ids)]
    assert len(state.records) == 3
    assert state.ckpt_msg_ends == [3, 5, 7]


def test_first_turn_retry_goes_back_to_empty(chat_tok: ChatTokenizer, make_engine: Any) -> None:
    state, engine = SessionState(session_id="s"), make_engine(chat_tok)
    first = [{"role": "user", "content": "hello"}]
    p1, _ = run_turn(state, first, chat_tok, engine)
    p2, _ = run_turn(state, first, chat_tok, engine)  # the same first turn again
    assert p2.keep_checkpoints == 0
    assert p2.prompt_ids == p1.prompt_ids
    assert len(state.checkpoints) == 1
    assert state.rollbacks == 1


def test_rollback_is_at_most_one_checkpoint(chat_tok: ChatTokenizer, make_engine: Any) -> None:
    state, engine = SessionState(session_id="s"), make_engine(chat_tok)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    history = []
    for i in range(3):
        _, assistant = run_turn(state, msgs, chat_tok, engine)
        history.append(list(msgs))
        msgs = [*msgs, assistant, {"role": "user", "content": f"u{i}"}]
    before = (list(state.messages), [list(c) for c in state.checkpoints], state.version)
    # Editing the user message of turn 2 (of 3) would discard two checkpoints: refused, unchanged.
    edited = [*history[1][:-1], {"role": "user", "content": "edited"}]
    with pytest.raises(BadChatRequestError, match="at most 1"):
        prepare_turn(state, edited, chat_tok)
    assert (state.messages, state.checkpoints, state.version) == before
    # Retrying the last turn with an edited user message discards one checkpoint: allowed.
    retry = [*history[2][:-1], {"role": "user", "content": "edited"}]
    prepared = prepare_turn(state, retry, chat_tok)
    assert prepared.keep_checkpoints == 2
    assert prepared.prompt_ids[: len(state.checkpoints[1])] == state.checkpoints[1]


def test_appending_an_assistant_turn_is_refused(chat_tok: ChatTokenizer, make_engine: Any) -> None:
    state, engine = SessionState(session_id="s"), make_engine(chat_tok)
    _, assistant = run_turn(state, [{"role": "user", "content": "a"}], chat_tok, engine)
    fake = [
        {"role": "user", "content": "a"},
        assistant,
        {"role": "assistant", "content": "made up"},
    ]
    with pytest.raises(BadChatRequestError, match="role 'assistant' cannot be appended"):
        prepare_turn(state, fake, chat_tok)
    with pytest.raises(BadChatRequestError, match="appends none"):
        prepare_turn(state, [{"role": "user", "content": "a"}, assistant], chat_tok)


def test_commit_rejects_a_broken_prefix_with_the_index(
    chat_tok: ChatTokenizer, make_engine: Any
) -> None:
    state, engine = SessionState(session_id="s"), make_engine(chat_tok)
    _, assistant = run_turn(state, [{"role": "user", "content": "a"}], chat_tok, engine)
    msgs = [{"role": "user", "content": "a"}, assistant, {"role": "user", "content": "b"}]
    prepared = prepare_turn(state, msgs, chat_tok)
    bad_prompt = list(prepared.prompt_ids)
    bad_prompt[4] += 1
    forged = PreparedTurn(
        prompt_ids=bad_prompt,
        keep_checkpoints=1,
        version=state.version,
        request_messages=msgs,
        trimmed=0,
    )
    reply = parse_generate_reply(
        engine({"input_ids": bad_prompt}), prompt_len=len(bad_prompt), url="u"
    )
    record = state.records[0]
    with pytest.raises(TitoMismatchError) as info:
        commit_turn(state, forged, reply, record, {"role": "assistant", "content": reply.text})
    assert info.value.index == 4
    assert state.mismatch is not None
    assert len(state.checkpoints) == 1


def test_a_turn_prepared_before_another_commit_is_not_committed(
    chat_tok: ChatTokenizer, make_engine: Any
) -> None:
    state, engine = SessionState(session_id="s"), make_engine(chat_tok)
    msgs = [{"role": "user", "content": "a"}]
    stale = prepare_turn(state, msgs, chat_tok)
    run_turn(state, msgs, chat_tok, engine)
    reply = parse_generate_reply(
        engine({"input_ids": stale.prompt_ids}), prompt_len=len(stale.prompt_ids), url="u"
    )
    assert not commit_turn(
        state, stale, reply, state.records[0], {"role": "assistant", "content": "x"}
    )
    state.closing = True
    fresh = prepare_turn(
        state, [*msgs, state.messages[-1], {"role": "user", "content": "b"}], chat_tok
    )
    assert not commit_turn(
        state, fresh, reply, state.records[0], {"role": "assistant", "content": "x"}
    )
    assert len(state.records) == 1


def test_a_bare_eos_is_trimmed_and_the_template_tail_added(
    chat_tok: ChatTokenizer, make_engine: Any
) -> None:
    state = SessionState(session_id="s")
    eos_engine = make_engine(chat_tok, stop="<|endoftext|>")
    _, assistant = run_turn(state, [{"role": "user", "content": "a"}], chat_tok, eos_engine)
    msgs = [{"role": "user", "content": "a"}, assistant, {"role": "user", "content": "b"}]
    prepared = prepare_turn(state, msgs, chat_tok)
    ckpt = state.checkpoints[0]
    assert prepared.trimmed == 1
    assert prepared.prompt_ids[: len(ckpt) - 1] == ckpt[:-1]
    assert prepared.prompt_ids[len(ckpt) - 1 : len(ckpt) + 1] == chat_tok.encode("<|im_end|>\n")


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ({"text": "x"}, "no meta_info"),
        ({"text": "x", "meta_info": {"completion_tokens": 0}}, "output_token_logprobs is missing"),
        (
            {
                "text": "x",
                "meta_info": {"completion_tokens": 2, "output_token_logprobs": [[-0.1, 5, None]]},
            },
            "completion_tokens=2",
        ),
        (
            {
                "text": None,
                "meta_info": {"completion_tokens": 1, "output_token_logprobs": [[-0.1, 5, None]]},
            },
            "text is missing",
        ),
        (
            {
                "text": "x",
                "meta_info": {"completion_tokens": 1, "output_token_logprobs": [["a", 5]]},
            },
            r"output_token_logprobs\[0\]",
        ),
        (
            {
                "text": "x",
                "output_ids": [6],
                "meta_info": {"completion_tokens": 1, "output_token_logprobs": [[-0.1, 5]]},
            },
            "output_ids disagree",
        ),
        (
            {
                "text": "x",
                "meta_info": {
                    "prompt_tokens": 9,
                    "completion_tokens": 0,
                    "output_token_logprobs": [],
                },
            },
            "prompt_tokens=9",
        ),
    ],
)
def test_reply_validation(reply: dict[str, Any], message: str) -> None:
    with pytest.raises(UpstreamReplyError, match=message):
        parse_generate_reply(reply, prompt_len=3, url="http://engine/generate")


actions = st.lists(
    st.sampled_from(["continue", "retry_last", "retry_first", "edit_two_back"]),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    plan=actions,
    texts=st.lists(st.text(alphabet="abc xyz?!", min_size=1, max_size=12), min_size=6, max_size=6),
)
def test_tito_invariants_under_random_retries(
    chat_tok: ChatTokenizer, make_engine: Any, plan: list[str], texts: list[str]
) -> None:
    state, engine = SessionState(session_id="s"), make_engine(chat_tok)
    requests: list[list[dict[str, Any]]] = []  # the request that produced each checkpoint
    msgs: list[dict[str, Any]] = [{"role": "user", "content": texts[0]}]
    for step, action in enumerate(plan):
        n_before = len(state.checkpoints)
        snapshot = ([list(c) for c in state.checkpoints], list(state.messages), state.version)
        # Edited contents contain "-", which the drawn texts never do, so edits always diverge.
        if action == "continue" or not requests:
            req, expected_keep = msgs, n_before
        elif action == "retry_last":
            req = [*requests[-1][:-1], {"role": "user", "content": f"retry-{step}"}]
            expected_keep = n_before - 1
        elif action == "retry_first":
            req, expected_keep = [{"role": "user", "content": f"first-{step}"}], 0
        elif len(requests) >= 2:
            req = [*requests[-2][:-1], {"role": "user", "content": f"edit-{step}"}]
            expected_keep = n_before - 2
        else:
            req, expected_keep = [{"role": "user", "content": f"edit-{step}"}], 0
        try:
            prepared, assistant = run_turn(state, req, chat_tok, engine)
        except BadChatRequestError:
            # Refused exactly when more than one checkpoint would go; then nothing changed.
            assert n_before - expected_keep > 1
            assert (state.checkpoints, state.messages, state.version) == snapshot
            continue
        assert n_before - expected_keep <= 1
        assert prepared.keep_checkpoints == expected_keep
        if expected_keep == 0:  # a first-turn retry goes back to the empty checkpoint
            assert prepared.prompt_ids == chat_tok.encode(
                chat_tok.render(req, add_generation_prompt=True)
            )
        requests = [*requests[: prepared.keep_checkpoints], req]
        msgs = [*req, assistant, {"role": "user", "content": texts[(step + 1) % 6]}]
        # Prefix invariant between consecutive checkpoints (up to max_trim_tokens=1).
        for prev, new in zip(state.checkpoints, state.checkpoints[1:], strict=False):
            assert new[: len(prev) - 1] == prev[: len(prev) - 1]
        assert len(state.checkpoints) == len(state.records) == len(state.ckpt_msg_ends)
        assert state.messages[-1] == assistant


def test_a_template_that_rewrites_history_is_refused(
    chat_tok: ChatTokenizer, make_engine: Any
) -> None:
    # A header that depends on the message count changes earlier text when messages are appended.
    template = "{{ messages | length }}:{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    tok = ChatTokenizer(
        chat_tok.tokenizer,
        template,
        stop_token_ids=sorted(chat_tok.stop_token_ids),
        source="counting",
    )
    state, engine = SessionState(session_id="s"), make_engine(tok)
    _, assistant = run_turn(state, [{"role": "user", "content": "a"}], tok, engine)
    with pytest.raises(
        BadChatRequestError, match="counting does not render appended messages as a suffix"
    ):
        prepare_turn(
            state,
            [{"role": "user", "content": "a"}, assistant, {"role": "user", "content": "b"}],
            tok,
        )


def test_template_loading_errors(tmp_path: Any, tok_dir: Any) -> None:
    from posttrain.interface import ConfigError

    with pytest.raises(ConfigError, match=r"tokenizer\.json does not exist"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    base = ChatTokenizer.from_dir(tmp_path)  # a base model: raw prompts only
    with pytest.raises(BadChatRequestError, match=r"no chat template \(a base model\)"):
        base.render([{"role": "user", "content": "a"}], add_generation_prompt=True)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTokenizer.from_dir(tmp_path)
