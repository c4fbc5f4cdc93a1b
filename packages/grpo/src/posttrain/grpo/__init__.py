"""posttrain.grpo: GRPO advantages, policy losses, TIS, and the loop that composes the packages.

Error tree (rooted in ``posttrain.interface.PosttrainError``)::

    GrpoError                        a GRPO computation, run or option failed
"""

from posttrain.grpo._errors import GrpoError

__all__ = [
    "GrpoError",
]
