"""The errors of ``posttrain.grpo``, rooted in the interface's base.

PosttrainError (posttrain.interface)
└── GrpoError                    a GRPO computation, run or option failed
"""

from __future__ import annotations

from posttrain.interface import PosttrainError


class GrpoError(PosttrainError):
    """Base of every error ``posttrain.grpo`` raises; the message names what is wrong."""
