"""Swappable reward functions with verl's signature, and the process pool that runs them.

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw) -> float | dict

Chosen by config (`reward.functions`) as `module:function` or `path/to/file.py:function`; built-ins are
`rl_tpu.rewards.{arithmetic,countdown,gsm8k,math,format}:compute_score`, and `rl_tpu.rewards.auto`
picks one of them by data_source (verl's default_compute_score). Importing this package imports
no built-in (math_verify alone takes seconds to import); workers import what their specs name.
"""

from rl_tpu.rewards.loader import RewardError, RewardSpecError, load_reward_fn, reward_name
from rl_tpu.rewards.pool import RewardInput, RewardPool, RewardResult
from rl_tpu.user_code import resolve_spec

BUILTINS = ("arithmetic", "countdown", "gsm8k", "math", "format", "auto")

__all__ = [
    "BUILTINS",
    "RewardError",
    "RewardInput",
    "RewardPool",
    "RewardResult",
    "RewardSpecError",
    "load_reward_fn",
    "resolve_spec",
    "reward_name",
]
