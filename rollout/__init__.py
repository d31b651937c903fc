"""vLLM rollout workers: `RolloutGroup` (M engines as Ray actors), `RolloutWorker` (one engine),
the `WorkerExtension` vLLM worker extension, and `generate_text` (one in-process engine, no Ray).

Importing this package does not import vLLM or start Ray; engines start when a group or worker is made.
"""

from rl_tpu.rollout.engine import ENGINE_TRAITS, generate_text, sampling_params
from rl_tpu.rollout.group import RolloutGroup, RolloutWorkerError, assign_prompts
from rl_tpu.rollout.worker import RolloutWorker

__all__ = [
    "ENGINE_TRAITS",
    "RolloutGroup",
    "RolloutWorker",
    "RolloutWorkerError",
    "assign_prompts",
    "generate_text",
    "sampling_params",
]
