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


MEDIA_TOKENS = ("<|image|>", "<|audio|>")
"""Media sentinels of the multimodal tokenizer, ids ``VOCAB_SIZE`` and ``VOCAB_SIZE + 1``
(``ModelConfig.multimodal_tiny``'s ``image_token_id`` = 101, ``audio_token_id`` = 102)."""
MULTIMODAL_VOCAB_SIZE = VOCAB_SIZE + len(MEDIA_TOKENS)


def build_tokenizer(*, multimodal: bool = False) -> PreTrainedTokenizerFast:
    """The character-level tokenizer (``VOCAB_SIZE`` = 101 tokens) with a ChatML chat template.

    With ``multimodal`` the special tokens ``<|image|>`` (101) and ``<|audio|>`` (102) follow
    (``MULTIMODAL_VOCAB_SIZE`` = 103): one of them in a prompt's text stands for one media item.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    extra = MEDIA_TOKENS if multimodal else ()
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS, *extra))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *extra],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
