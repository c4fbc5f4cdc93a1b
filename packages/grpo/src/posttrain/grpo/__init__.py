"""posttrain.grpo: GRPO advantages, policy losses, TIS, and the loop that composes the packages.

Error tree (rooted in ``posttrain.interface.PosttrainError``)::

    GrpoError                            a GRPO computation, run or option failed
    ├── GrpoConfigError (ConfigError)    an option is invalid; names the field and value
    │   └── GrpoUnsupportedError         a valid option this build cannot honour; names the
    │                                    option and what would honour it
    └── GrpoInputError (ValueError)      a tensor handed to the GRPO math is malformed;
                                         names the tensor and the shapes
"""

from posttrain.grpo._errors import (
    GrpoConfigError,
    GrpoError,
    GrpoInputError,
    GrpoUnsupportedError,
)
from posttrain.grpo.advantages import (
    contiguous_group_ids,
    expand_to_tokens,
    group_normalized_advantages,
    whiten_advantages,
)
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.losses import (
    PolicyLoss,
    aggregate_loss,
    entropy_from_logits,
    importance_weights,
    kl_penalty,
    mismatch_metrics,
    ppo_clip_loss,
)
from posttrain.grpo.objective import LossSettings, PolicyObjective, policy_objective

__all__ = [
    "GrpoConfig",
    "GrpoConfigError",
    "GrpoError",
    "GrpoInputError",
    "GrpoUnsupportedError",
    "LossSettings",
    "PolicyLoss",
    "PolicyObjective",
    "aggregate_loss",
    "contiguous_group_ids",
    "entropy_from_logits",
    "expand_to_tokens",
    "group_normalized_advantages",
    "importance_weights",
    "kl_penalty",
    "mismatch_metrics",
    "policy_objective",
    "ppo_clip_loss",
    "whiten_advantages",
]
