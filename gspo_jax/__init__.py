"""gspo_jax: Group Sequence Policy Optimization (arXiv:2507.18071) in JAX / Flax NNX.

The loss components are pure functions over arrays (`gspo_jax.objectives.losses`,
`gspo_jax.objectives.advantages`); the model is bound in at the train step.

Arrays are named with their shape (`adv_BxG`, `logp_BxGxT`) under one legend for the whole
package, docs/shapes.md: B prompts, G responses per prompt, R = B*G rows, P prompt and T
response positions, V vocabulary, D model width, ... (the loss library's `_BxT` counts
rows; that page says where else a public name reads differently).
"""

from gspo_jax.models.logprobs import token_logprobs, token_logprobs_from_hidden
from gspo_jax.objectives.advantages import group_advantages
from gspo_jax.objectives.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOSS_DEFAULTS,
    LOSSES,
    Surrogate,
    aggregate,
    clipped_surrogate,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    kl_loss,
    kl_penalty,
    policy_metrics,
    row_lengths,
    sequence_log_ratio,
    token_advantages,
    token_log_ratio,
)

__version__ = "0.1.0"
