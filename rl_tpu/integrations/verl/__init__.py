"""rl-tpu as a verl plugin: loaded by `import verl` (entry-point group `verl.plugins`, pyproject.toml)
in the driver and in every Ray worker, it registers with verl's own registries:

- `platform.PlatformCPU`: verl's device layer on a CPU-only host (verl otherwise falls back to CUDA);
- `engine.RlTpuEngine`: training engine `rl_tpu` (`actor_rollout_ref.actor.strategy=rl_tpu`);
- `checkpoint.RlTpuCheckpointEngine`: weight-sync backend `rl_tpu`
  (`actor_rollout_ref.rollout.checkpoint_engine.backend=rl_tpu`).

Rewards need no registration: `reward.custom_reward_function.path=pkg://rl_tpu.rewards.gsm8k` with
`name=compute_score` loads ours unchanged. See docs/verl.md.

verl logs a failing plugin import only at debug level, so `loaded()` lets a user (and the tests) check.
"""

# the platform registers first: the engine and checkpoint registrations run on it
# isort: off
from rl_tpu.integrations.verl import platform  # noqa: F401  (registers on import)
from rl_tpu.integrations.verl import engine  # noqa: F401
from rl_tpu.integrations.verl import checkpoint  # noqa: F401
from rl_tpu.integrations.verl import patches
# isort: on

patches.apply()  # verl workarounds (patches.py names each verl line); the CPU ones only on a CPU host

ENGINE_BACKEND = engine.BACKEND
CHECKPOINT_BACKEND = checkpoint.BACKEND


def loaded() -> dict[str, bool]:
    """Which of our classes verl's registries hold (all True once `import verl` loaded this plugin)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.engine import EngineRegistry

    engines = EngineRegistry._engines.get("language_model", {}).get(ENGINE_BACKEND, {})
    return {
        "platform": PlatformRegistry.get("cpu") is platform.PlatformCPU,
        "engine": all(engines.get(d) is engine.RlTpuEngine for d in engine.DEVICES),
        "checkpoint": CheckpointEngineRegistry._registry.get(CHECKPOINT_BACKEND)
        is checkpoint.RlTpuCheckpointEngine,
        "cpu_patches": "gloo_process_group" in patches._APPLIED or platform._accelerator_present(),
    }
