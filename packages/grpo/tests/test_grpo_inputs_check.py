"""Every bad user input is one line naming the problem, at ``--dry-run`` and at run time alike,
and a refused run writes nothing to ``--out-dir``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.grpo import inputs_check
from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.cli import main
from posttrain.grpo.config import GrpoConfig
from posttrain.models import ModelConfig, build_tokenizer

REWARDS = """
import math

def nan(response):
    return math.nan

def text(response):
    return "1.0"

def fine(response, label):
    return float(response == label)
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(4)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    base = tmp_path / "base-model"
    chat = tmp_path / "chat-model"
    build_tokenizer().save_pretrained(str(chat))  # the local tokenizer, with its chat template
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(base))  # the same without a template: a base model
    for model in (
        base,
        chat,
    ):  # a config the model gate accepts (the gate runs before these checks)
        (model / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict()))
    return {"good": good, "empty": empty, "rewards": rewards, "base": base, "chat": chat,
            "root": tmp_path}  # fmt: skip


def _cases(f: dict[str, Path]) -> list[tuple[list[str], str]]:
    data = ["--prompt-data", str(f["good"]), "--input-key", "q", "--label-key", "a"]
    rw = str(f["rewards"])
    return [
        (["--task", "train.jsonl"], "--task 'train.jsonl' is not one of addition, shapes; for your own prompts give --prompt-data"),
        (["--prompt-data", str(f["root"] / "nope.jsonl"), "--reward", "math"], "nope.jsonl: no such file or directory"),
        (["--prompt-data", str(f["empty"]), "--reward", "math"], "the dataset is empty"),
        ([*data[:4], "--label-key", "answer", "--reward", "math"], "row 1: no label key 'answer' (--label-key); the row has 'q', 'a'"),
        ([*data[:2], "--input-key", "question", "--reward", "math"], "no input key 'question' (--input-key)"),
        (data, "--prompt-data needs --reward"),
        ([*data, "--reward", "no_such_module_xyz:f"], "--reward no_such_module_xyz:f: cannot import no_such_module_xyz"),
        ([*data, "--reward", f"{rw}:nan"], "--reward nan: on row 1 (response = its label '1'): reward nan returned nan"),
        ([*data, "--reward", f"{rw}:text"], "--reward text: on row 1 (response = its label '1'): reward text returned str '1.0'"),
        ([*data, "--reward", "math", "--eval-data", str(f["root"] / "gone.jsonl")], "--eval-data"),
        ([*data, "--reward", "math", "--eval-every", "2"], "--eval-every needs --eval-data"),
        ([*data, "--reward", "math", "--model-path", str(f["base"])], "the tokenizer has no chat template (a base model); give --no-apply-chat-template"),
    ]  # fmt: skip


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "\n" not in err, err  # one line, no traceback
    assert err.startswith("error: ")
    return err


def test_dry_run_and_run_refuse_every_bad_input_with_one_line(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # what a real run needs besides the data: a model, a router, engines (never contacted)
    runtime = ["--model-path", str(files["chat"]), "--rollout-url", "http://127.0.0.1:9",
               "--engine-urls", "http://127.0.0.1:9", "--out-dir", str(out)]  # fmt: skip
    for argv, needle in _cases(files):
        dry = _error_line(capsys, [*argv, "--dry-run"])
        assert needle in dry, (argv, dry)
        live = _error_line(capsys, [*runtime, *argv])  # the last --model-path wins
        assert needle in live, (argv, live)
        assert not out.exists(), argv


def test_good_inputs_pass(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prompt-data", str(files["good"]), "--input-key", "q", "--label-key", "a",
            "--reward", f"{files['rewards']}:fine", "--reward", "math:0.5",
            "--eval-data", str(files["good"]), "--eval-every", "2", "--dry-run"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert "the config is valid" in capsys.readouterr().out
    cfg = GrpoConfig(prompt_data=files["good"], input_key="q", label_key="a", reward=("exact",))
    inputs_check.check_data(cfg)
    inputs_check.check_reward(cfg)
    inputs_check.check_eval(cfg)
    with pytest.raises(GrpoConfigError, match="--no-apply-chat-template"):
        inputs_check.check_data(GrpoConfig(model_path=files["base"], reward=("exact",)))
    base_raw = GrpoConfig(
        model_path=files["base"], prompt_data=files["good"], input_key="q", label_key="a",
        reward=("exact",), apply_chat_template=False,
    )  # fmt: skip
    inputs_check.check_data(base_raw)


def test_prompts_longer_than_the_context_are_refused(tmp_path: Path) -> None:
    from posttrain.models import ModelConfig, build_model, build_tokenizer, save_pretrained

    model = tmp_path / "tiny"
    config = ModelConfig.tiny(max_position_embeddings=32)
    save_pretrained(build_model(config, seed=0), model, tokenizer=build_tokenizer())
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"q": "1+1=", "a": "2"}) + "\n" + json.dumps({"q": "x" * 40, "a": "1"}) + "\n"
    )
    cfg = GrpoConfig(model_path=model, prompt_data=data, input_key="q", label_key="a",
                     reward=("exact",), max_new_tokens=4)  # fmt: skip
    with pytest.raises(GrpoConfigError) as err:
        inputs_check.check_data(cfg)
    assert f"--prompt-data {data} row 2: the prompt is" in str(err.value)
    assert "does not fit the model's context of 32" in str(err.value)
    raw = GrpoConfig(model_path=model, prompt_data=data, input_key="q", label_key="a",
                     reward=("exact",), max_new_tokens=4, apply_chat_template=False)  # fmt: skip
    with pytest.raises(GrpoConfigError, match="row 2: the prompt is 40 tokens"):
        inputs_check.check_data(raw)
