"""``python -m posttrain.models init`` writes a checkpoint that loads, tokenizes and refuses to clobber."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.models import VOCAB_SIZE, CheckpointError, ModelConfig, load_pretrained
from posttrain.models.__main__ import init_checkpoint, main


def test_init_writes_a_loadable_checkpoint_with_tokenizer(tmp_path: Path) -> None:
    target = init_checkpoint(tmp_path / "tiny", seed=3, max_positions=128)
    model = load_pretrained(target)
    assert model.config.vocab_size == VOCAB_SIZE
    assert model.config.max_position_embeddings == 128
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert max(ids) < VOCAB_SIZE
    again = init_checkpoint(tmp_path / "again", seed=3, max_positions=128)
    a, b = load_pretrained(again).hf_state_dict(), model.hf_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)  # the seed fixes the weights


def test_init_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        init_checkpoint(tmp_path / "busy")
    assert main(["init", str(tmp_path / "busy")]) == 2
    assert (tmp_path / "busy" / "keep.txt").exists()
    assert main(["init", str(tmp_path / "busy"), "--overwrite"]) == 0
    assert not (tmp_path / "busy" / "keep.txt").exists()


def test_module_command(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.models", "init", str(tmp_path / "m")],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "model.safetensors").exists()


def test_init_arch_inkling_tiny_writes_every_block(tmp_path: Path) -> None:
    assert (
        main(["init", "--arch", "inkling-tiny", "--max-positions", "32", str(tmp_path / "i")]) == 0
    )
    model = load_pretrained(tmp_path / "i")
    cfg = model.config
    assert cfg.uses_extensions
    assert cfg == ModelConfig.inkling_tiny(vocab_size=VOCAB_SIZE, max_position_embeddings=32)
    assert set(cfg.layer_types) == {"dense", "moe"}
    convs = [p for n, p in model.named_parameters() if n.endswith("_conv")]
    assert len(convs) == 4 * cfg.num_hidden_layers
    assert all(not p.any() for p in convs)  # zero-initialised: the identity
    # a context too short for the relative-bias extent is a config error, exit code 2
    assert (
        main(["init", "--arch", "inkling-tiny", "--max-positions", "8", str(tmp_path / "j")]) == 2
    )
    with pytest.raises(CheckpointError, match="unknown --arch"):
        init_checkpoint(tmp_path / "k", arch="gpt")
