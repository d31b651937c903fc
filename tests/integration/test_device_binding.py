"""Device binding and per-role device placement (issue #41, items 2 and 4).

- `local_device_index` (pure): a table of (device row, Ray's accelerator ids, environment) -> the local
  device index and where it came from.
- Placement (pure): the xla and tpu rows reserve Ray's `TPU`; the engines' bundles take `rollout.device`'s
  row, the trainer's `trainer.device`'s.
- `test_device_binding_*` (Ray on this CPU machine): Ray's logical GPUs / TPUs (`ray.init(num_gpus=4,
  resources={"TPU": 4})` assigns ids and sets the visible-devices variables without hardware). Trainer
  ranks run the real `parallel.init_process_group` (binding, LOCAL_RANK, a gloo group) on a row that
  reserves the accelerator but keeps its tensors on the host; engines call the same `bind` as
  `RolloutWorker.__init__` and report through `RolloutWorker.threads`; `write_placement_json` records
  the device id of every actor. Runs in a subprocess (its own Ray instance with logical accelerators).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_tpu.config import load_config
from rl_tpu.devices import get_device, local_device_index
from rl_tpu.placement import choose_placement, plan_from_config, plan_placement

ROOT = Path(__file__).resolve().parents[2]
NOSET_GPU = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"

# (row, Ray's accelerator ids, environment) -> (index, source)
CASES = [
    # Ray set CUDA_VISIBLE_DEVICES to the actor's GPU: device 0 of the visible set
    ("cuda", {"GPU": ["3"]}, {"CUDA_VISIBLE_DEVICES": "3"}, (0, "visible")),
    ("cuda", {"GPU": ["3"]}, {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "3"}, (0, "visible")),
    # a TP engine: Ray's ids come unordered, the lowest one is the engine's first device
    ("cuda", {"GPU": ["3", "2"]}, {"CUDA_VISIBLE_DEVICES": "3,2"}, (1, "visible")),
    # verl's NOSET mode: Ray leaves the variable unset, the process sees every GPU: Ray's id itself
    ("cuda", {"GPU": ["2"]}, {NOSET_GPU: "1"}, (2, "ray_id")),
    ("cuda", {"GPU": ["2"]}, {NOSET_GPU: "true", "LOCAL_RANK": "0"}, (2, "ray_id")),
    # NOSET under a user's own mask (the raylet started with CUDA_VISIBLE_DEVICES=4,5; Ray's ids are
    # then physical): the id's position in the mask
    ("cuda", {"GPU": ["5"]}, {NOSET_GPU: "1", "CUDA_VISIBLE_DEVICES": "4,5"}, (1, "visible")),
    # no Ray assignment (outside Ray, or torchrun): LOCAL_RANK, else 0
    ("cuda", {}, {"LOCAL_RANK": "1"}, (1, "local_rank")),
    ("cuda", {"GPU": []}, {}, (0, "local_rank")),
    # TPU: Ray sets TPU_VISIBLE_CHIPS by chip; a whole-host allocation leaves it unset
    ("tpu", {"TPU": ["2"]}, {"TPU_VISIBLE_CHIPS": "2"}, (0, "visible")),
    ("tpu", {"TPU": ["1"]}, {}, (1, "ray_id")),
    ("tpu", {"TPU": ["1"]}, {"RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS": "1"}, (1, "ray_id")),
    # two logical devices per chip (RAY_TPU_RESOURCE_PER_CHIP=2): device 3 is the 2nd of chip 1
    ("tpu", {"TPU": ["3"]}, {"TPU_VISIBLE_CHIPS": "1", "RAY_TPU_RESOURCE_PER_CHIP": "2"}, (1, "visible")),
    # xla reserves chips only when PJRT targets the TPU; on the PJRT CPU device it is the host
    ("xla", {"TPU": ["1"]}, {"PJRT_DEVICE": "TPU", "TPU_VISIBLE_CHIPS": "1"}, (0, "visible")),
    ("xla", {"TPU": ["1"]}, {}, (None, "host")),
    ("xla", {}, {"PJRT_DEVICE": "CPU"}, (None, "host")),
    # cpu: never an index, whatever Ray assigned
    ("cpu", {"GPU": ["0"]}, {"CUDA_VISIBLE_DEVICES": "0"}, (None, "host")),
]


@pytest.mark.parametrize("row,ids,env,want", CASES)
def test_local_device_index_table(row, ids, env, want):
    b = local_device_index(get_device(row), ids, env)
    assert (b.index, b.source) == want
    resource = get_device(row).reserved_resource(env)
    assert b.ray_ids == tuple(sorted(ids.get(resource, []), key=int)) if resource else b.ray_ids == ()


def test_local_device_index_refuses_a_mask_that_hides_rays_device():
    with pytest.raises(ValueError, match=r"Ray assigned this actor GPU 2, but CUDA_VISIBLE_DEVICES='0,1'"):
        local_device_index(get_device("cuda"), {"GPU": ["2"]}, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_engines_on_cuda_under_the_auto_sync_list_their_own_gpus_first_then_the_nodes():
    from rl_tpu.devices import engine_actor_env, engine_sees_node, node_gpu_ids, node_view_visible

    # a TP-2 engine on GPUs 2 and 3 of an 8-GPU node: vLLM's ranks 0 and 1 open 2 and 3, the rest is mapped
    assert node_view_visible(("2", "3"), [str(i) for i in range(8)]) == "2,3,0,1,4,5,6,7"
    # under a raylet's own mask (Ray's ids are its entries): the mask's GPUs only, in its order
    assert node_gpu_ids({"CUDA_VISIBLE_DEVICES": "4, 6,5"}) == ["4", "6", "5"]
    assert node_view_visible(("5",), node_gpu_ids({"CUDA_VISIBLE_DEVICES": "4,6,5"})) == "5,4,6"
    b = local_device_index(
        get_device("cuda"), {"GPU": ["5"]}, {NOSET_GPU: "1", "CUDA_VISIBLE_DEVICES": "5,4,6"}
    )
    assert (b.index, b.source) == (0, "visible")  # the engine's own GPU is device 0

    cuda = ["--trainer.device=cuda", "--rollout.device=cuda"]
    assert engine_sees_node(load_config(None, cuda))  # auto
    assert engine_sees_node(load_config(None, cuda + ["--sync.transport=cuda_ipc"]))
    assert engine_actor_env(load_config(None, cuda)) == {NOSET_GPU: "1"}
    for off in (cuda + ["--sync.transport=shm"], cuda + ["--sync.transport=collective"], []):
        assert not engine_sees_node(load_config(None, off)) and engine_actor_env(load_config(None, off)) == {}


def test_local_device_follows_the_binding_and_leaves_the_host_alone(monkeypatch):
    import torch

    monkeypatch.setenv("LOCAL_RANK", "2")
    cuda, cpu = get_device("cuda"), get_device("cpu")
    assert cuda.local_device() == torch.device("cuda", 2)  # unbound outside Ray: LOCAL_RANK
    assert cuda.local_device(1) == torch.device("cuda", 1)
    assert cpu.local_device() == torch.device("cpu")
    b = cpu.bind()  # the host: LOCAL_RANK left as it was
    assert (b.index, b.source, os.environ["LOCAL_RANK"]) == (None, "host", "2")


def test_tpu_and_xla_rows_reserve_tpu_chips(monkeypatch):
    assert get_device("tpu").reserved_resource({}) == "TPU"
    assert get_device("cuda").reserved_resource({}) == "GPU"
    assert get_device("cpu").reserved_resource({"PJRT_DEVICE": "TPU"}) is None
    xla = get_device("xla")
    assert xla.reserved_resource({"PJRT_DEVICE": "TPU"}) == "TPU"
    assert xla.reserved_resource({"PJRT_DEVICE": "cpu"}) is None  # PJRT reads it case-insensitively
    assert xla.reserved_resource({}) is None  # the row's default PJRT_DEVICE=CPU
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert xla.ray_resource == "TPU"
    cfg = load_config(
        None, ["--trainer.device=xla", "--rollout.device=xla", "--cluster.placement=disaggregated"]
    )
    p = plan_from_config(cfg, cores=8)
    assert p.bundles["trainer"] == [{"CPU": 1.0, "TPU": 1.0}] * cfg.trainer.world_size
    assert p.role("rollout")[0].accelerator == {"TPU": 1.0}
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    p = plan_from_config(cfg, cores=8)
    assert all(set(b) == {"CPU"} for bundles in p.bundles.values() for b in bundles)


def test_engine_bundles_take_the_rollout_device_row():
    # the case: a CPU trainer with GPU engines gives the engines GPUs, the trainer none
    cfg = load_config(
        None,
        [
            "--trainer.device=cpu",
            "--rollout.device=cuda",
            "--rollout.num_threads=2",
            "--trainer.world_size=1",
        ],
    )
    p = plan_from_config(cfg, cores=4)
    assert p.placement == "colocated"  # the roles share no device
    assert p.bundles == {"shared": [{"CPU": 3.0, "GPU": 1.0}]}
    (t,), (e,) = p.role("trainer"), p.role("rollout")
    assert (t.accelerator, e.accelerator) == ({}, {"GPU": 1.0})
    d = plan_from_config(dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, mode="async")), 4)
    assert d.bundles == {"trainer": [{"CPU": 1.0}], "rollout": [{"CPU": 2.0, "GPU": 1.0}]}
    # and the reverse: GPU trainer ranks, CPU engines
    cfg = load_config(
        None,
        [
            "--trainer.device=cuda",
            "--rollout.device=cpu",
            "--rollout.num_threads=2",
            "--trainer.world_size=1",
        ],
    )
    p = plan_from_config(cfg, cores=4)
    assert p.bundles == {"shared": [{"CPU": 3.0, "GPU": 1.0}]}
    assert [s.accelerator for s in p.slots] == [{"GPU": 1.0}, {}]


def test_colocated_mixed_accelerators_hold_each_roles_devices_whole():
    p = plan_placement(
        placement="colocated",
        accelerator="GPU",
        rollout_accelerator="TPU",
        world_size=2,
        trainer_threads=1,
        engines=1,
        tp=2,  # no device is shared, so a TP engine may be colocated
        rollout_threads=1,
    )
    assert p.bundles == {"shared": [{"CPU": 3.0, "GPU": 1.0, "TPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]}
    assert [s.accelerator for s in p.role("rollout")] == [{"TPU": 2.0}]
    assert [s.accelerator for s in p.role("trainer")] == [{"GPU": 1.0}, {"GPU": 1.0}]
    auto = dict(mode="sync", tp=2)
    assert choose_placement("auto", accelerator=None, rollout_accelerator="GPU", **auto) == "colocated"
    assert choose_placement("auto", accelerator="GPU", rollout_accelerator="GPU", **auto) == "disaggregated"
    assert choose_placement("auto", accelerator="TPU", rollout_accelerator="TPU", tp=1, mode="sync") == (
        "disaggregated"
    )
    assert (
        choose_placement("auto", accelerator="TPU", rollout_accelerator=None, tp=1, mode="sync")
        == "colocated"
    )


def test_device_binding_from_rays_logical_gpus_and_tpus(tmp_path):
    """Each trainer rank and engine is bound to a distinct device id Ray assigned it, and placement.json
    records it: Ray-set visible devices (GPU trainer ranks, TPU engines), then verl's NOSET mode (GPU
    trainer ranks and GPU engines)."""
    out = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]

    # 1. Ray sets the visible devices: trainer ranks on GPUs, engines on TPU chips (rollout.device = tpu)
    visible = json.loads((tmp_path / "visible" / "placement.json").read_text())
    actors = {(a["role"], a["index"]): a for a in visible["actors"]}
    assert sorted(actors) == [("rollout", 0), ("rollout", 1), ("trainer", 0), ("trainer", 1)]
    trainers, engines = [actors["trainer", r] for r in (0, 1)], [actors["rollout", e] for e in (0, 1)]
    for a, resource in [(t, "GPU") for t in trainers] + [(e, "TPU") for e in engines]:
        assert a["resources"][resource] == 1.0 and set(a["resources"]) == {"CPU", resource}
        assert len(a["ray_accelerator_ids"]) == 1
        assert a["visible_devices"] == a["ray_accelerator_ids"][0]  # what Ray set
        # engines on torch-tpu name their chips through the variables of torch_tpu_env, then see tpu:0
        assert (a["device_index"], a["binding"]) == (0, "visible" if resource == "GPU" else "torch_tpu")
    assert [t["device"] for t in trainers] == ["cuda:0", "cuda:0"]
    assert [e["device"] for e in engines] == ["tpu:0", "tpu:0"]
    assert len({t["ray_accelerator_ids"][0] for t in trainers}) == 2  # distinct GPUs
    assert len({e["ray_accelerator_ids"][0] for e in engines}) == 2  # distinct chips
    ranks = json.loads((tmp_path / "visible" / "ranks.json").read_text())
    for rank in ranks:
        assert rank["local_rank"] == "0" and rank["local_device"] == "cpu:0"  # host tensors, index 0
        assert rank["all_ray_ids"] == [t["ray_accelerator_ids"][0] for t in trainers]  # over the gloo group

    # 2. verl's NOSET mode: every GPU visible; trainer ranks use Ray's id as the index (LOCAL_RANK too),
    # engines narrow their own visible set to Ray's id (vLLM numbers from device 0)
    noset = json.loads((tmp_path / "noset" / "placement.json").read_text())
    actors = {(a["role"], a["index"]): a for a in noset["actors"]}
    ids = [actors[k]["ray_accelerator_ids"][0] for k in sorted(actors)]
    assert len(set(ids)) == 4  # four actors, four distinct GPUs
    ranks = json.loads((tmp_path / "noset" / "ranks.json").read_text())
    for r in (0, 1):
        t = actors["trainer", r]
        (gpu,) = t["ray_accelerator_ids"]
        assert (t["device"], t["binding"], t["visible_devices"]) == (f"cuda:{gpu}", "ray_id", None)
        assert ranks[r]["local_rank"] == gpu and ranks[r]["local_device"] == f"cpu:{gpu}"
    for e in (0, 1):
        a = actors["rollout", e]
        (gpu,) = a["ray_accelerator_ids"]
        assert (a["device"], a["binding"], a["visible_devices"]) == ("cuda:0", "visible", gpu)

    # 3. CUDA engines under the auto sync (RolloutGroup's actor environment): Ray leaves their variable
    # unset, and each engine lists its own GPU first (vLLM opens that one as device 0) and then every other
    # GPU of the node (the trainer ranks' among them, whose CUDA IPC buckets it maps); trainer ranks keep
    # Ray's mask
    node = json.loads((tmp_path / "node" / "placement.json").read_text())
    actors = {(a["role"], a["index"]): a for a in node["actors"]}
    trainer_gpus = [actors["trainer", r]["ray_accelerator_ids"][0] for r in (0, 1)]
    for r in (0, 1):
        t = actors["trainer", r]
        assert (t["device"], t["binding"], t["visible_devices"]) == ("cuda:0", "visible", trainer_gpus[r])
    for e in (0, 1):
        a = actors["rollout", e]
        (gpu,) = a["ray_accelerator_ids"]
        listed = a["visible_devices"].split(",")
        assert listed[0] == gpu and sorted(listed) == ["0", "1", "2", "3"], a["visible_devices"]
        assert set(trainer_gpus) <= set(listed)
        assert (a["device"], a["binding"]) == ("cuda:0", "visible")


# ---------------------------------------------------------------------------------------------------
# the subprocess: its own Ray instance with 4 logical GPUs and 4 logical TPU chips


def _host_row(name: str):
    """`name`'s device row as the trainer binds it (same Ray resource), but with gloo and host tensors,
    so the real `parallel.init_process_group` runs on this CPU machine."""
    return dataclasses.replace(get_device(name), dist_backend="gloo", torch_device="cpu", runtime_module=None)


class TrainerRank:
    """A trainer rank's start-up up to the model: `parallel.init_process_group` (binds the device Ray
    assigned, sets LOCAL_RANK, joins the group), then what `TrainerWorker.ready()` reports."""

    def __init__(self, row: str, rank: int, world_size: int, port: int):
        import torch.distributed as dist

        from rl_tpu.trainer import parallel

        self.device = _host_row(row)
        parallel.init_process_group(self.device, rank, world_size, "127.0.0.1", port)
        mine = self.device.bind(set_local_rank=False)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine.ray_ids[0] if mine.ray_ids else None)
        self.info = {
            "rank": rank,
            **mine.record(),
            "local_rank": os.environ.get("LOCAL_RANK"),
            "local_device": str(self.device.local_device()),
            "all_ray_ids": everyone,
        }

    def ready(self) -> dict:
        return self.info


class Engine:
    """A rollout engine's binding: the line of `RolloutWorker.__init__` before vLLM starts, and its
    `threads()` report."""

    def __init__(self, cfg):
        from rl_tpu.devices import bind, engine_sees_node
        from rl_tpu.rollout.engine import rollout_device

        self.device = rollout_device(cfg)
        self.binding = bind(self.device, set_local_rank=False, engine=True, node_view=engine_sees_node(cfg))

    def threads(self) -> dict:
        from rl_tpu.rollout.worker import RolloutWorker

        return RolloutWorker.threads(self)


class _Reports:
    def __init__(self, trainer_info: list[dict], engine_reports: list[dict]):
        self.info, self._engines = trainer_info, engine_reports

    def threads(self) -> list[dict]:
        return self._engines


def _run_case(ray, run_dir: Path, overrides: list[str], env: dict[str, str] | None) -> None:
    """`env`: every actor's extra environment; None: none for trainer ranks, and for engines what
    `RolloutGroup` gives them (`engine_actor_env`)."""
    import socket

    from rl_tpu.controller.roles import write_placement_json
    from rl_tpu.devices import engine_actor_env
    from rl_tpu.placement import PlacementGroups

    cfg = load_config(
        None,
        ["--cluster.placement=disaggregated", "--trainer.world_size=2", "--rollout.engines=2", *overrides],
    )
    groups = PlacementGroups(plan_from_config(cfg, cores=8), timeout_s=120)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        trainer_env = {"env_vars": env} if env else {}
        engine_env = trainer_env if env is not None else {"env_vars": engine_actor_env(cfg)}
        trainer_cls, engine_cls = ray.remote(TrainerRank), ray.remote(Engine)
        ranks = [
            trainer_cls.options(**groups.options(s), runtime_env=trainer_env).remote(
                cfg.trainer.device, s.index, 2, port
            )
            for s in groups.plan.role("trainer")
        ]
        engines = [
            engine_cls.options(**groups.options(s), runtime_env=engine_env).remote(cfg)
            for s in groups.plan.role("rollout")
        ]
        info = ray.get([r.ready.remote() for r in ranks], timeout=300)
        reports = ray.get([e.threads.remote() for e in engines], timeout=300)
        run_dir.mkdir(parents=True)
        write_placement_json(run_dir, groups, _Reports(info, reports), [], trainer=_Reports(info, reports))
        (run_dir / "ranks.json").write_text(json.dumps(info))
        for a in ranks + engines:
            ray.kill(a)
    finally:
        groups.remove()


def main(out: Path) -> None:
    import ray

    from rl_tpu.cluster import init_ray

    init_ray(num_cpus=8, num_gpus=4, resources={"TPU": 4}, include_dashboard=False, log_to_driver=False)
    try:
        _run_case(ray, out / "visible", ["--trainer.device=cuda", "--rollout.device=tpu"], {})
        _run_case(
            ray,
            out / "noset",
            ["--trainer.device=cuda", "--rollout.device=cuda", "--sync.transport=shm"],
            {NOSET_GPU: "1"},
        )
        _run_case(ray, out / "node", ["--trainer.device=cuda", "--rollout.device=cuda"], None)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    main(Path(sys.argv[1]))


def test_torch_tpu_env_names_the_physical_chip_because_torch_tpu_overwrites_rays_mask():
    """torch_tpu copies LOCAL_RANK into TPU_VISIBLE_CHIPS (vllm_torchtpu/worker/tpu_rank_binding.py), so a
    trainer rank on Ray's chip 2 must say LOCAL_RANK=2, not its position (0) in Ray's one-chip mask; a
    vLLM-TorchTPU engine on chips 2-3 names them three ways, as its worker's paths read them (its single-
    engine path adds DEBUG_TPU_LOCAL_RANK_OFFSET to its TP rank; the multiprocess executor pins each TP
    rank from VLLM_TPU_DEVICE_ORDER; DP/PCP read TPU_LOCAL_RANK_OFFSET); every process may load libtpu
    beside the others of its host."""
    from rl_tpu.devices import torch_tpu_env

    shared = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    assert torch_tpu_env(["2"], {"TPU_VISIBLE_CHIPS": "2"}, engine=False) == shared | {"LOCAL_RANK": "2"}
    assert torch_tpu_env(["3"], {"RAY_TPU_RESOURCE_PER_CHIP": "2"}, engine=False) == shared | {
        "LOCAL_RANK": "1"
    }
    assert torch_tpu_env(["4", "5", "6", "7"], {}, engine=True) == shared | {
        "TPU_LOCAL_RANK_OFFSET": "4",
        "DEBUG_TPU_LOCAL_RANK_OFFSET": "4",
        "VLLM_TPU_DEVICE_ORDER": "4,5,6,7",
    }  # TP 4 on the second half of an 8-chip host (the v6e recipe): chips 4-7, not 0-3
    with pytest.raises(ValueError, match="consecutive chips"):
        torch_tpu_env(["1", "3"], {}, engine=True)
    with pytest.raises(ValueError, match="opens one chip"):
        torch_tpu_env(["0", "1"], {}, engine=False)


TPU_PY = Path(__file__).resolve().parents[2] / ".venv-tpu" / "bin" / "python"


def test_torch_tpu_launch_env_set_by_the_operator_is_given_to_every_rank_as_is():
    from rl_tpu.devices import torch_tpu_launch_env

    env = {"TORCH_TPU_SLICEBUILDER_ADDRESSES": "h0:8070,h1:8070", "TORCH_TPU_TOPOLOGY": "2,2,1"}
    assert torch_tpu_launch_env("/nonexistent/python", 2, env) == env  # no child process is needed


def test_torch_tpu_trainer_on_other_hosts_gets_each_ranks_own_host_as_torch_tpu_builds_a_slice():
    """Ranks placed on hosts other than the driver's: addresses on each rank's own host at 8070 + its
    index there (torch-tpu's multi-host scheme), the operator's slice topology, one profiling session; no
    child process (the driver's host may have no chip). What cannot be right is refused in one line."""
    from rl_tpu.devices import torch_tpu_launch_env

    hosts = ["10.0.0.5"] * 4 + ["10.0.0.6"] * 4  # v5p: 4 chips a host, 8 ranks
    env = {"TORCH_TPU_TOPOLOGY": "2x2x2"}
    out = torch_tpu_launch_env("/nonexistent/python", 8, env, rank_hosts=hosts, driver_host="10.0.0.5")
    assert out["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == ",".join(
        [f"10.0.0.5:{8070 + i}" for i in range(4)] + [f"10.0.0.6:{8070 + i}" for i in range(4)]
    )
    assert out["TORCH_TPU_TOPOLOGY"] == "2x2x2" and out["TORCH_TPU_XPROF_SESSION_ID"].isdigit()
    # TPU_WORKER_HOSTNAMES in the same order, and a base port of the operator's: accepted
    ok = {**env, "TPU_WORKER_HOSTNAMES": "10.0.0.5,10.0.0.6", "TORCH_TPU_BASE_PORT": "9000"}
    out = torch_tpu_launch_env("/x", 8, ok, rank_hosts=hosts, driver_host="10.0.0.9")
    assert out["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[4] == "10.0.0.6:9000"
    # one TPU host driven from another machine: its own address, not localhost
    one = torch_tpu_launch_env("/x", 2, env, rank_hosts=["10.0.0.7"] * 2, driver_host="10.0.0.1")
    assert one["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "10.0.0.7:8070,10.0.0.7:8071"

    with pytest.raises(
        RuntimeError, match=r"ranks 0-3 on 10.0.0.5; ranks 4-7 on 10.0.0.6: set TORCH_TPU_TOPOLOGY"
    ):
        torch_tpu_launch_env("/x", 8, {}, rank_hosts=hosts, driver_host="10.0.0.5")
    with pytest.raises(RuntimeError, match="interleaves hosts"):
        torch_tpu_launch_env("/x", 4, env, rank_hosts=["a", "b", "a", "b"], driver_host="a")
    reversed_order = {**env, "TPU_WORKER_HOSTNAMES": "10.0.0.6,10.0.0.5"}
    with pytest.raises(RuntimeError, match="not in TPU_WORKER_HOSTNAMES's order"):
        torch_tpu_launch_env("/x", 8, reversed_order, rank_hosts=hosts, driver_host="10.0.0.5")


@pytest.mark.skipif(
    not TPU_PY.exists(),
    reason="needs the `tpu` extra environment .venv-tpu (Python 3.12, locks/tpu.txt): "
    "bash scripts/setup.sh --role-env tpu",
)
def test_torch_tpu_launch_env_asks_torch_tpu_itself_and_names_the_missing_tpu():
    """torch-tpu 0.2.0's own `set_tpu_launch_env` decides the variables (in .venv-tpu, a child process);
    on this TPU-less host it finds no chip, which the error says in one line."""
    from rl_tpu.devices import torch_tpu_launch_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_TPU_")}
    with pytest.raises(RuntimeError, match=r"launch environment of 2 rank\(s\).*no TPU found on this host"):
        torch_tpu_launch_env(str(TPU_PY), 2, env)
