"""The errors of ``posttrain.formats``: one subtree per format, rooted in the interface's base.

PosttrainError (posttrain.interface)
└── FormatsError                 a payload, file or request in one of our formats is invalid
"""

from __future__ import annotations

from posttrain.interface import PosttrainError


class FormatsError(PosttrainError):
    """Base of every error ``posttrain.formats`` raises; the message names the tensor or field."""
