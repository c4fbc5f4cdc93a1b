"""``--prompt-data``: every format gives the same prompts; keys, chat vs raw, errors; the
seeded epochs and their resumable position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.data import build_prompts, eval_sets, fingerprint, load_prompts, read_rows
from posttrain.grpo.rewards import PromptStream
from posttrain.grpo.scoring import Scorer

ROWS = [
    {"question": f"What is {a} plus {b}?", "answer": str(a + b), "meta": {"a": a, "b": b}}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2)]
]
EXAMPLE = Path(__file__).parents[1] / "src/posttrain/grpo/examples/arithmetic.jsonl"


def _write_all_formats(root: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {
        "jsonl": root / "d.jsonl",
        "json": root / "d.json",
        "parquet": root / "d.parquet",
        "hf": root / "hf",
        "hf_dict": root / "hf_dict",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    paths["json"].write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), paths["parquet"])
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(paths["hf"]))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(paths["hf_dict"]))
    return paths


def test_every_format_reads_the_same_rows(tmp_path: Path) -> None:
    paths = _write_all_formats(tmp_path)
    for name, path in paths.items():
        assert read_rows(path) == ROWS, name
    assert read_rows(tmp_path / "hf_dict" / "test") == ROWS[:1]
    keys = {"input_key": "question", "label_key": "answer", "metadata_key": "meta"}
    prints = {fingerprint(load_prompts(p, **keys)) for p in paths.values()}
    assert len(prints) == 1


def test_keys_chat_messages_system_prompt_and_raw_text() -> None:
    chat = build_prompts(ROWS, input_key="question", label_key="answer", system_prompt="Be brief.")
    assert chat[0].messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 plus 2?"},
    )
    assert chat[0].text is None
    assert chat[0].label == "3"
    assert chat[0].row_metadata == {}
    raw = build_prompts(
        ROWS, input_key="question", label_key="answer", metadata_key="meta",
        apply_chat_template=False, system_prompt="Q&A",
    )  # fmt: skip
    assert raw[1].text == "Q&A\nWhat is 3 plus 4?"
    assert raw[1].messages == ()
    assert raw[1].row_metadata == {"a": 3, "b": 4}
    messages = [{"messages": [{"role": "user", "content": "hi"}], "label": "x"}]
    (p,) = build_prompts(messages, input_key="messages", label_key="label")
    assert p.messages == ({"role": "user", "content": "hi"},)
    (p,) = build_prompts(messages, input_key="messages", label_key=None)
    assert p.label is None


@pytest.mark.parametrize(
    ("rows", "kwargs", "needle"),
    [
        (
            [{"q": "x"}],
            {"input_key": "question"},
            "row 1: no input key 'question' (--input-key); the row has 'q'",
        ),
        (
            [{"question": "x"}],
            {"label_key": "answer"},
            "row 1: no label key 'answer' (--label-key)",
        ),
        ([{"question": "x", "answer": 1}], {"metadata_key": "meta"}, "no metadata key 'meta'"),
        ([{"question": 3, "answer": 1}], {}, "'question' (--input-key) is a int"),
        ([{"question": "", "answer": 1}], {}, "is an empty string"),
        ([{"question": [{"role": "user"}], "answer": 1}], {}, "message 0 is not"),
        (
            [{"question": "x", "answer": 1, "meta": [1]}],
            {"metadata_key": "meta"},
            "is a list, not an object",
        ),
    ],
)
def test_bad_rows_name_the_row_and_keys(rows: list[dict], kwargs: dict, needle: str) -> None:
    args = {"input_key": "question", "label_key": "answer", **kwargs}
    with pytest.raises(GrpoConfigError) as err:
        build_prompts(rows, **args)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_chat_messages_refused_as_raw_text() -> None:
    rows = [{"m": [{"role": "user", "content": "hi"}], "label": 1}]
    with pytest.raises(GrpoConfigError, match="need the chat template"):
        build_prompts(rows, input_key="m", label_key="label", apply_chat_template=False)


def test_bad_files(tmp_path: Path) -> None:
    cases = {
        "missing.jsonl": (None, "no such file or directory"),
        "empty.jsonl": ("\n\n", "the dataset is empty"),
        "bad.jsonl": ('{"a": 1}\n{oops\n', "line 2: not JSON"),
        "scalar.jsonl": ('{"a": 1}\n3\n', "line 2: expected an object, got int"),
        "obj.json": ('{"a": 1}', "expected a JSON list of objects"),
        "d.csv": ("a,b\n", "unknown format '.csv'"),
        "broken.parquet": ("not parquet", "not a readable parquet file"),
    }
    for name, (text, needle) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(GrpoConfigError) as err:
            read_rows(path)
        assert needle in str(err.value), name
        assert str(path) in str(err.value), name
    (tmp_path / "nothing").mkdir()
    with pytest.raises(GrpoConfigError, match=r"no \.jsonl, \.json, \.parquet files"):
        read_rows(tmp_path / "nothing")


def test_the_shipped_example_and_eval_sets(tmp_path: Path) -> None:
    cfg = GrpoConfig(
        prompt_data=EXAMPLE, input_key="question", label_key="answer", reward=("math",),
        eval_data=(str(EXAMPLE), str(EXAMPLE)),
    )  # fmt: skip
    prompts = load_prompts(EXAMPLE, input_key="question", label_key="answer")
    assert len(prompts) >= 40
    scorer = Scorer.from_specs(cfg.reward)
    assert scorer.rewards[0].name == "math"
    sets = eval_sets(cfg)
    assert list(sets) == ["arithmetic", "arithmetic_"]
    assert fingerprint(sets["arithmetic"]) == fingerprint(prompts)


def test_epochs_shuffle_and_resume_position() -> None:
    prompts = build_prompts(ROWS, input_key="question", label_key="answer")
    stream = PromptStream(prompts, seed=3)
    taken = [[p.index for p in stream.take(3)] for _ in range(4)]  # 12 prompts: 2.4 epochs
    flat = [i for step in taken for i in step]
    assert sorted(flat[:5]) == sorted(flat[5:10]) == list(range(5))  # each epoch is a permutation
    # a stream rebuilt at a mid-epoch position continues exactly
    resumed = PromptStream(prompts, seed=3, position=6)
    assert [p.index for p in resumed.take(6)] == flat[6:12]
    other = [[p.index for p in PromptStream(prompts, seed=s).take(5)] for s in range(6)]
    assert len({tuple(o) for o in other}) > 1  # the seed picks the order
