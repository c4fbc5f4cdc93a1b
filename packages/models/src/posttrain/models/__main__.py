"""``python -m posttrain.models init [--arch tiny|inkling-tiny|multimodal-tiny] DIR``: a seeded checkpoint + tokenizer.

The directory it writes is what every CPU path of posttrain starts from: the
local engine serves it (``--model-path DIR``), the session router renders its
chat template (``--tokenizer DIR``), ``transformers`` and SGLang load it (as
``MellumForCausalLM`` when dense and MoE layers mix, else ``Qwen3MoeForCausalLM``) and
``quant-convert`` converts it. The write is atomic
(``posttrain.formats.atomic_directory``: a temporary directory, fsynced, swapped into
place), so an interrupted run leaves nothing that looks complete.

argparse rather than typer (the project's CLI library): this package's dependencies are what
its models compute with, and one subcommand needs nothing more. Every option has help and
shows its default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posttrain.formats import atomic_directory
from posttrain.models._config import ModelConfig
from posttrain.models._errors import CheckpointError, ModelConfigError
from posttrain.models._model import build_model
from posttrain.models._tokenizer import MULTIMODAL_VOCAB_SIZE, VOCAB_SIZE, build_tokenizer

ARCHS = ("tiny", "inkling-tiny", "multimodal-tiny")
"""``tiny``: the Qwen3-MoE-layout Dense/MoE config; ``inkling-tiny``: the same with every
optional block on (``ModelConfig.inkling_tiny``: sconv, relative bias, sliding-window and
global layers, sigmoid router with shared experts, embedding norm, logits divisor);
``multimodal-tiny``: ``tiny`` plus frozen vision and audio towers
(``ModelConfig.multimodal_tiny``) and the tokenizer with ``<|image|>`` / ``<|audio|>``."""


def init_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    max_positions: int = 256,
    overwrite: bool = False,
    arch: str = "tiny",
) -> Path:
    """Write the ``arch`` config (vocab sized to the local tokenizer) seeded by ``seed``.

    sconv weights are written as zeros (each convolution starts as the identity).
    """
    target = Path(path)
    if arch not in ARCHS:
        raise CheckpointError(f"unknown --arch {arch!r}; choose one of {list(ARCHS)}")
    occupied = any(target.iterdir()) if target.is_dir() else target.exists()
    if occupied and not overwrite:
        raise CheckpointError(f"{target} exists and is not empty (pass --overwrite)")
    multimodal = arch == "multimodal-tiny"
    if multimodal:
        config = ModelConfig.multimodal_tiny(
            vocab_size=MULTIMODAL_VOCAB_SIZE, max_position_embeddings=max_positions
        )
    else:
        make = ModelConfig.inkling_tiny if arch == "inkling-tiny" else ModelConfig.tiny
        config = make(vocab_size=VOCAB_SIZE, max_position_embeddings=max_positions)
    model = build_model(config, seed=seed)
    with atomic_directory(target) as staging:
        model.save_pretrained(staging, tokenizer=build_tokenizer(multimodal=multimodal))
    return target


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m posttrain.models",
        description="Tools for posttrain.models checkpoints.",
        formatter_class=fmt,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    init = commands.add_parser(
        "init",
        help="write a seeded tiny checkpoint and its tokenizer",
        description="Write a seeded tiny Dense/MoE checkpoint (Qwen3-MoE HF layout) and its "
        "tokenizer to PATH: what local-engine serves, the session router tokenizes with, "
        "transformers loads and quant-convert converts.",
        formatter_class=fmt,
    )
    init.add_argument("path", type=Path, metavar="PATH", help="directory to create")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.add_argument(
        "--arch",
        choices=ARCHS,
        default="tiny",
        help="tiny: Qwen3-MoE layout; inkling-tiny: every optional block on; "
        "multimodal-tiny: tiny plus frozen vision and audio towers",
    )
    init.add_argument(
        "--max-positions", type=int, default=256, help="context length (= KV capacity)"
    )
    init.add_argument(
        "--overwrite", action="store_true", help="replace PATH if it exists and is not empty"
    )
    args = parser.parse_args(argv)
    try:
        written = init_checkpoint(
            args.path,
            seed=args.seed,
            max_positions=args.max_positions,
            overwrite=args.overwrite,
            arch=args.arch,
        )
    except (CheckpointError, ModelConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
