"""Typed records that flow through the loop: one field per quantity, never dicts of string keys."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Completion:
    """One sampled response to one prompt, as a rollout worker returns it."""

    prompt_index: int  # index of the prompt in the request batch
    sample_index: int  # 0..n-1 within the prompt's group
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # log-probability of each response token under the sampling engine
    finish_reason: str  # "stop" | "length" | ...
    text: str
    policy_version: int  # version of the weights that generated it
    extra: dict = field(default_factory=dict)  # engine-specific details (worker id, timings)
