"""posttrain.grpo: GRPO advantages, policy losses, TIS, and the loop that composes the packages.

Error tree (rooted in ``posttrain.interface.PosttrainError``)::

    GrpoError                            a GRPO computation, run or option failed
    ├── GrpoConfigError (ConfigError)    an option is invalid; names the field and value
    │   └── GrpoUnsupportedError         a valid option this build cannot honour; names the
    │                                    option and what would honour it
    ├── GrpoInputError (ValueError)      a tensor handed to the GRPO math is malformed
    └── GrpoRunError                     a run step failed: rollout, weight sync, checkpoint,
                                         a trainer rank (names the URL, file or rank)
"""

from posttrain.grpo._errors import (
    GrpoConfigError,
    GrpoError,
    GrpoInputError,
    GrpoRunError,
    GrpoUnsupportedError,
)
from posttrain.grpo.config import GrpoConfig

__all__ = [
    "GrpoConfig",
    "GrpoConfigError",
    "GrpoError",
    "GrpoInputError",
    "GrpoRunError",
    "GrpoUnsupportedError",
]
