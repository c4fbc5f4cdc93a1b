"""A small character-level tokenizer built locally (no download), as a ``transformers`` fast tokenizer.

The vocabulary is fixed and tiny so it fits the tiny test models (vocab_size >= 128):
special tokens first (``<|endoftext|>`` = 0 is also the pad token, ``<unk>`` = 1,
``<|im_start|>`` = 2, ``<|im_end|>`` = 3 is the end-of-turn/eos token), then newline,
tab and printable ASCII, one token per character. Departure from a real BPE: there are
no merges, so every character is a token and anything outside ASCII becomes ``<unk>``.
The chat template is ChatML, as Qwen uses. ``save_pretrained`` puts it next to the
weights, so a model directory is also a tokenizer path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>")
CHARACTERS = "\n\t" + "".join(chr(c) for c in range(32, 127))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer (``VOCAB_SIZE`` = 101 tokens) with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
