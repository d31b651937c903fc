"""Reward functions load as any user code does (`rl_tpu.user_code`), from `module:function` or
`path/to/file.py:function`, with verl's signature: `compute_score(data_source, solution_str, ground_truth,
extra_info=None, **kw) -> float | dict` (a dict holds "score" plus numeric extras), sync or async. A
spec without `:` names `compute_score`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rl_tpu.user_code import DEFAULT_FUNCTION, SpecError, load_callable, split_spec


class RewardError(RuntimeError):
    """A reward function failed (raised, hung, returned junk) under the `raise` policy, or could not load."""


class RewardSpecError(SpecError, RewardError):
    """A reward spec string does not lead to a callable; the message says which part is wrong."""


def load_reward_fn(spec: str, label: str = "reward spec") -> Callable:
    """The reward function `spec` names; `RewardSpecError` naming what is wrong otherwise."""
    try:
        return load_callable(spec, label)
    except SpecError as e:
        raise RewardSpecError(str(e)) from e


def reward_name(spec: str) -> str:
    """A short name for metrics: the function name, or the module/file stem for `compute_score`."""
    target, fn, is_file = split_spec(spec)
    if fn != DEFAULT_FUNCTION:
        return fn
    return Path(target).stem if is_file else target.rsplit(".", 1)[-1]
