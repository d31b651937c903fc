"""Pick the built-in reward by `data_source`, like verl's `default_compute_score`: for files mixing tasks.

    arithmetic -> arithmetic    countdown (or a source containing "countdown") -> countdown
    a source containing "gsm8k" -> gsm8k (strict)    a source containing "math" -> math (math_verify)

An unknown data_source raises NotImplementedError naming it (counted in reward/errors, or stopping the
run under `on_error = "raise"`). Importing this module imports every built-in, math_verify included
(about 3 s per worker at startup).
"""

from __future__ import annotations

from typing import Any

from rl_tpu.rewards import arithmetic, countdown, gsm8k, math


def select(data_source: str):
    source = data_source.lower()
    if source == "arithmetic":
        return arithmetic.compute_score
    if "countdown" in source:
        return countdown.compute_score
    if "gsm8k" in source:
        return gsm8k.compute_score
    if "math" in source:
        return math.compute_score
    raise NotImplementedError(
        f"no built-in reward for data_source {data_source!r}; name a reward function in reward.functions"
    )


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kw
) -> float:
    return select(data_source)(data_source, solution_str, ground_truth, extra_info, **kw)
