"""RL math as pure tensor functions: advantage estimators, policy/value/KL losses, DAPO sampling helpers.

Importable with torch alone (no Ray, vLLM or TorchTitan). Name -> function dicts (`ADV_ESTIMATORS`,
`POLICY_LOSSES`) are the only registry; names and defaults follow verl 0.9.1 `core_algos.py`.
"""

from rl_tpu.algorithms.advantages import ADV_ESTIMATORS, compute_advantages
from rl_tpu.algorithms.losses import (
    POLICY_LOSSES,
    agg_loss,
    apply_kl_in_reward,
    compute_policy_loss,
    compute_value_loss,
    kl_penalty,
    rollout_is_weights,
)
from rl_tpu.algorithms.sampling import keep_groups_with_variance, overlong_penalty

__all__ = [
    "ADV_ESTIMATORS",
    "compute_advantages",
    "keep_groups_with_variance",
    "overlong_penalty",
    "POLICY_LOSSES",
    "agg_loss",
    "apply_kl_in_reward",
    "compute_policy_loss",
    "compute_value_loss",
    "kl_penalty",
    "rollout_is_weights",
]
