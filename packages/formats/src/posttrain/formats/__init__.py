"""posttrain.formats: every format two posttrain packages exchange, implemented once.

Each format lives here in both directions (write and read), so the two packages
that exchange it cannot drift apart. Depends only on ``posttrain-interface``,
torch, safetensors and httpx (for the one client it owns).

* ``lora_delta``: the LoRA forward ``linear(linear(x, A), B) * scaling`` with the caller's
  kernel, the one op order trainer (``lora-core``) and engine (``models``) share.

Error tree (rooted in ``posttrain.interface.PosttrainError``)::

    FormatsError                     a payload, file or request in one of our formats is invalid
"""

from posttrain.formats._errors import FormatsError
from posttrain.formats.lora_delta import LinearKernel, lora_delta, matmul_kernel

__all__ = [
    "FormatsError",
    "LinearKernel",
    "lora_delta",
    "matmul_kernel",
]
