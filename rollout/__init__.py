"""vLLM rollout workers: `RolloutGroup` (M engines as Ray actors), `RolloutWorker` (one engine),
the `WorkerExtension` vLLM worker extension, and `generate_text` (one in-process engine, no Ray); the
driver side of multi-turn rollouts (`multi_turn`), the environments' worker processes (`env_pool`), the
tools they call (`tools`) and verl's tool config files as tools (`verl_tools`).

Importing this package does not import vLLM or start Ray, and its names load on first use: a tool's
or environment's worker process imports `rl_tpu.rollout.tools` / `env_pool` alone, without torch or Ray
(it runs under a memory limit counted from its start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_tpu.rollout.engine import ENGINE_TRAITS, generate_text, sampling_params
    from rl_tpu.rollout.group import RolloutGroup, RolloutWorkerError, assign_prompts
    from rl_tpu.rollout.worker import RolloutWorker

_WHERE = {
    "ENGINE_TRAITS": "engine",
    "generate_text": "engine",
    "sampling_params": "engine",
    "RolloutGroup": "group",
    "RolloutWorkerError": "group",
    "assign_prompts": "group",
    "RolloutWorker": "worker",
}

__all__ = [
    "ENGINE_TRAITS",
    "RolloutGroup",
    "RolloutWorker",
    "RolloutWorkerError",
    "assign_prompts",
    "generate_text",
    "sampling_params",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rl_tpu.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl_tpu.rollout.{_WHERE[name]}"), name)
