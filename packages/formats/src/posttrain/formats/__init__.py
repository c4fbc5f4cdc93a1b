"""posttrain.formats: every format two posttrain packages exchange, implemented once.

Each format lives here in both directions (write and read), so the two packages
that exchange it cannot drift apart. Depends only on ``posttrain-interface``,
torch, safetensors and httpx (for the one client it owns).

Error tree (rooted in ``posttrain.interface.PosttrainError``)::

    FormatsError                     a payload, file or request in one of our formats is invalid
"""

from posttrain.formats._errors import FormatsError

__all__ = [
    "FormatsError",
]
