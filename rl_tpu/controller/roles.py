"""The roles of a run: one trainer group and its engines, started side by side in the run's placement.

`train(cfg)` starts its own and ends them; the demo starts them once (`start_shared_roles`) and runs
SFT, GRPO, a control and evaluations on the same processes (`train(cfg, roles=...)`), which checks
first that the roles fit the config (`check_roles`). Either way a step sees the same two groups.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_tpu.config import Config, to_dict
from rl_tpu.placement import (
    PlacementGroups,
    niceness_note,
    placement_record,
    plan_from_config,
    write_placement,
)

log = logging.getLogger("rl_tpu")

if TYPE_CHECKING:
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup


@dataclass
class Roles:
    """A trainer group and engines started once for several jobs on the same processes (the demo: SFT,
    GRPO, an SFT control and evaluations); `train(cfg, roles=...)` runs on them without starting any."""

    trainer: TrainerGroup
    rollout: RolloutGroup
    groups: PlacementGroups  # the loop's placement for the config they were started with

    def shutdown(self) -> None:
        for group in (self.rollout, self.trainer):
            group.shutdown()
        self.groups.remove()


def start_shared_roles(
    cfg: Config, model_path: str, trainer_then: Callable[[Any], Any] | None = None
) -> Roles:
    """Reserve the loop's placement for `cfg` and start its trainer group and engines on `model_path`, side
    by side (Ray must be running: `start_ray`). `trainer_then(trainer)` runs as soon as the trainer is up,
    while the engines may still be starting (the preflight). The caller ends them with `Roles.shutdown()`."""
    groups = PlacementGroups(plan_from_config(cfg, os.cpu_count() or 1))
    try:
        return Roles(*start_roles(cfg, model_path, groups, trainer_then), groups)
    except BaseException:
        groups.remove()
        raise


# rollout settings the driver alone uses (its multi-turn loop, tool workers, environments): a run may set
# them differently from the run the roles were started for
DRIVER_ROLLOUT = ("env", "max_turns", "max_total_tokens", "tools", "tool_timeout_s", "tool_workers")


def check_roles(cfg: Config, roles: Roles, plan) -> None:
    """ValueError naming what `cfg` asks of the placement, the engines or the trainer's processes that
    `roles` (started for another config) cannot give."""
    from rl_tpu.trainer.checkpoint import restart_conflicts

    if roles.groups.plan != plan:
        raise ValueError(
            "train: the roles were started for another placement (trainer.world_size / num_threads, "
            "rollout.engines / tensor_parallel_size / num_threads, cluster.*): start them with this "
            "config"
        )
    started = roles.rollout.cfg
    have = to_dict(started.rollout)
    differ = [
        f"rollout.{k}" for k, v in to_dict(cfg.rollout).items() if k not in DRIVER_ROLLOUT and have[k] != v
    ]
    differ += [f"trainer.{k}" for k in restart_conflicts(roles.trainer.cfg.trainer, cfg.trainer)]
    if cfg.model.dtype != started.model.dtype or cfg.model.dtype != roles.trainer.cfg.model.dtype:
        differ.append("model.dtype")
    if differ:
        raise ValueError(
            f"train: {', '.join(differ)} differ from what the roles were started with (fixed when "
            "their processes start: the engines' sampling, the trainer's shape): start them with this "
            "config"
        )


def engines_first(cfg: Config, placement: str) -> bool:
    """Whether the engines must be up before the trainer starts: colocated on an accelerator whose vLLM
    sizes its KV cache from the device's memory (`gpu_memory_utilization`: vLLM's profiler reads the
    device-wide free memory before and after its own profile run, and a trainer loading on the same device
    meanwhile would count as the engine's, or leave less free than it asked for)."""
    from rl_tpu.devices import rollout_device
    from rl_tpu.rollout.engine import engine_traits

    device = rollout_device(cfg)
    return (
        placement == "colocated"
        and device.ray_resource is not None
        and not engine_traits(device).kv_cache_from_gb
    )


def start_roles(
    cfg: Config, model_path: str, groups: PlacementGroups, trainer_then: Callable[[Any], Any] | None = None
):
    """Trainer ranks and engines, started at the same time (each mostly waits on its own processes:
    TorchTitan builds, vLLM engine start-up), or the engines first where they size their KV cache from
    the device's free memory on a device they share with the trainer (`engines_first`);
    `trainer_then(trainer)` in the trainer's thread once it is up (an engine takes longer to start: its
    warm-up generations)."""
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup

    def trainer():
        group = TrainerGroup(cfg, model_path, placement=groups)
        if trainer_then is not None:
            try:
                trainer_then(group)
            except BaseException:
                group.shutdown()
                raise
        return group

    def engines():
        return RolloutGroup(cfg, model_path, placement=groups)

    if engines_first(cfg, groups.plan.placement):
        rollout = engines()
        try:
            return trainer(), rollout
        except BaseException:
            rollout.shutdown()
            raise
    return start_side_by_side(trainer, engines)


def start_side_by_side(*makers: Callable[[], Any]) -> tuple:
    """Call each maker in its own thread. If one fails, those that started are closed (`close()` or
    `shutdown()`) and the first error is raised."""
    with ThreadPoolExecutor(max_workers=len(makers)) as ex:
        futures = [ex.submit(m) for m in makers]
    made, errors = [], []
    for f in futures:
        try:
            made.append(f.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below once the others are closed
            errors.append(e)
    if errors:
        for obj in made:
            (getattr(obj, "close", None) or obj.shutdown)()
        raise errors[0]
    return tuple(made)


def write_placement_json(
    run_dir: Path, groups: PlacementGroups, rollout, sync_routes: list, trainer=None, warn: bool = False
) -> Path:
    """RUN_DIR/placement.json: where every actor runs (engines report their own node, threads, nice value
    and device binding; trainer ranks theirs, from `ready()`, when the `trainer` group is given). `warn`:
    also log a warning if actors run at a lower CPU priority than this driver (`niceness_note`)."""
    reports = {("rollout", i): r for i, r in enumerate(rollout.threads())}
    if trainer is not None:
        reports |= {("trainer", i): r for i, r in enumerate(trainer.info)}
    actors = placement_record(groups.plan, groups.bundle_nodes(), groups.node_ips, reports)
    note = niceness_note(actors, os.nice(0)) if warn else None
    if note:
        log.warning(note)
    return write_placement(run_dir / "placement.json", groups.plan.placement, actors, sync_routes)
