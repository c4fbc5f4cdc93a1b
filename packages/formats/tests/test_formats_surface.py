"""The public surface is exactly ``__all__``; the light formats import without torch."""

from __future__ import annotations

import subprocess
import sys

import posttrain.formats as formats
from posttrain.formats import _errors
from posttrain.interface import PosttrainError


def test_all_is_exactly_the_public_surface() -> None:
    assert len(formats.__all__) == len(set(formats.__all__))
    lazy = {name for names in formats._NEEDS_TORCH.values() for name in names}
    eager = {
        name
        for name, value in vars(formats).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("posttrain.")
    } | {
        "SAMPLES_FORMAT",
        "MEDIA_SAMPLES_FORMAT",
        "STUDENT_TOP_LOGPROBS_KEY",
    }  # strings have no __module__
    assert set(formats.__all__) == lazy | eager
    for name in formats.__all__:
        value = getattr(formats, name)
        assert value is not None
        module = getattr(value, "__module__", None)
        # a type alias (NVFP4Part, a Literal; LinearKernel, a Callable) reports typing's module
        aliases = (None, "typing", "collections.abc")
        assert module in aliases or module.startswith("posttrain.formats"), (name, module)
    assert set(dir(formats)) >= set(formats.__all__)


def test_error_tree_is_documented_once() -> None:
    doc = _errors.__doc__ or ""
    for name in formats.__all__:
        value = getattr(formats, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, formats.FormatsError), name
            assert issubclass(value, PosttrainError), name
            assert name in doc, f"{name} is missing from the error tree docstring"


def test_lora_fields_and_samples_need_neither_torch_nor_httpx() -> None:
    # What a session server or a sample reader imports: with torch made unimportable, a
    # samples/1 payload still round-trips and the LoRA fields still build.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from posttrain.formats import LoraServing, apply_lora_fields, decode_samples, "
        "encode_samples\n"
        "from posttrain.interface import Sample\n"
        "s = Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.5], loss_mask=[1])\n"
        "assert decode_samples(encode_samples([s])).samples == [s]\n"
        "assert apply_lora_fields({}, LoraServing(adapter_name='a'), 3) == "
        "{'lora_path': 'a', 'extra_key': 'a:v3'}\n"
        "print(','.join(m for m in ('httpx', 'posttrain.session_router') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
