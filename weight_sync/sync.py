"""`WeightSync`: the one owner of the weight sync on the driver. It plans once, then per policy version
moves each engine exactly its shard's bytes, verifies them when asked, and takes back restarted engines.

Who does what (each side is one class that its actor takes on whole):
- driver (`WeightSync`, here): checks names and shapes against the engine's checkpoint, derives the
  engines' layouts by running vLLM's own loaders on index codes, builds the plan (`plan.build_plan`),
  hands every sender its buckets and every receiver its bucket tables and install order. Per sync it
  starts every receiver at once and collects their acknowledgements; it never touches bytes.
- sender = a trainer rank (`sender.SyncSender`, a mixin of `TrainerWorker`): packs a bucket from the
  rank's local DTensor shards into the transport and returns a small handle.
- receiver = one engine's host (`receiver.SyncReceiver`, a mixin of `RolloutWorker`): pulls its buckets
  from the senders in install order and hands each round to its engine's TP ranks, where our vLLM worker
  extension (`rl_tpu.rollout.worker_extension`, state in `engine_side.EngineSide`) copies the pieces
  and runs vLLM's per-layer processing.

Transports (`sync.transport`): `inprocess`, `shm` (/dev/shm files, or straight into a receiver region),
`ray` (object store), `collective` (one torch.distributed group over senders and engine ranks), `auto`
(shm on the same node, ray across nodes), and `reload`: the full-tensor reference path, where the
trainer exports HF safetensors and every engine reloads them through vLLM's own loader (no plan).

Policy version: the trainer group owns it (`TrainerGroup.policy_version`, advanced by each update); a
sync reads it once and every engine records what it serves (`RolloutWorker.version`), which stamps its
completions. Nothing else holds a copy.

Sync protocol for policy version v, per receiver: `begin` -> for each round (at most one bucket per TP
rank): senders pack, engine ranks copy their pieces and process every layer that became complete ->
`finish` (the rest of vLLM's post-processing) -> `reset_kv` (prefix cache reset, held sequences recomputed)
-> the receiver records v.

Receiver regions (shm routes into a CPU engine, under `receiver_buffer_mb` per engine rank): at setup
each engine rank creates one /dev/shm file holding its loaded-layout parameters and the driver hands
every sender the region table and, per bucket, where its pieces go; `ws_pack` then copies pieces
straight into the engine's parameters (casting to the engine dtype). Above the cap, or with
`receiver_buffers=False`, shm routes carry bucket files.

Install path, per engine rank: "direct" (pieces straight into the kernel tensors) only where the engine's
own per-layer processing is the identity, probed at setup; else "layerwise" (pieces into the loaded
layout, then vLLM's processing). `routes()` says which, per route.

Verify (`sync.verify`): the engines compare the tensors they serve bit for bit with what vLLM's own
loaders and per-layer processing make of the trainer's full HF tensors (in the loaded layout where the
processed kernel is no tensor: vLLM-CPU's packed linears).

Nothing is half-installed on bad input: name and shape checks run at plan time, before any bytes move.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .calls import ReceiverLost, call, get, get_each, route
from .engine_layout import EngineLayout
from .plan import DCOL, DROW, DST, NC, NR, SyncPlan, build_plan, check_names
from .specs import ParamSpec
from .transports import get_transport, group_backend

if TYPE_CHECKING:
    from rl_tpu.config import SyncConfig
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup

    from .names import NameMaps

log = logging.getLogger("rl_tpu")

__all__ = ["ReceiverLost", "SyncStats", "WeightSync", "engine_layouts", "receiver_tables"]


@dataclass
class SyncStats:
    version: int
    seconds: float
    bytes: int
    buckets: int
    acks: list[dict]

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def engine_layouts(derived: list[list[dict]]) -> list[tuple[tuple[int, int], EngineLayout]]:
    """((engine, tp rank), layout) for every rank of every engine, from each engine's `ws_derive` answer
    (one wire layout per TP rank), engines in order: what `build_plan` takes."""
    return [
        ((e, lay.tp_rank), lay)
        for e, per_rank in enumerate(derived)
        for lay in map(EngineLayout.from_wire, per_rank)
    ]


def receiver_tables(plan: SyncPlan, engine: int, transport: str | dict = "shm") -> tuple[dict, list]:
    """Engine `engine`'s bucket tables per TP rank and its install rounds (plain values, any process).
    `transport`: one name, or a dict sender rank -> name for this engine's routes."""
    tables, per_tp = {}, {}
    for i, (e, tp) in enumerate(plan.engine_ranks):
        if e != engine:
            continue
        mine = plan.for_receiver(i)
        tables[str(tp)] = {
            "names": plan.dst_names[i],
            "shapes": {n: list(s) for n, s in plan.dst_shapes[i].items()},
            "numel": plan.dst_numel[i],
            "dtype": plan.wire_dtypes[i],
            "buckets": {str(b): np.ascontiguousarray(p).tobytes() for b, _, p in mine},
        }
        # slots alternate per receiver stream: a sender reuses (receiver, parity) two buckets later
        per_tp[tp] = [
            (b, snd, (i, k % 2), transport if isinstance(transport, str) else transport[snd])
            for k, (b, snd, _) in enumerate(mine)
        ]
    rounds = [
        {tp: x for tp, x in zip(per_tp, col) if x is not None}
        for col in itertools.zip_longest(*per_tp.values())
    ]
    return tables, rounds


class WeightSync:
    """Resharding from trainer ranks (senders) into vLLM engines (receivers), planned once.

    `senders[r]` is trainer rank r and `receivers[e]` engine e: Ray actor handles (`TrainerWorker`,
    `RolloutWorker`) or local objects with the same `ws_*` methods (`SyncSender`, `SyncReceiver`), or a
    `RolloutGroup` (its workers; the group then knows its engines hold synced weights, which it cannot
    give an engine it restarts: such a restart is an error until `on_restart` is set, see
    `replace_receiver`). `to_hf` is TorchTitan's `StateDictAdapter.to_hf`, or the `NameMaps` a trainer
    rank computed with it. `trainer` (a `TrainerGroup`, as the loop passes through `for_run`): the
    owner of the policy version, of the full HF tensors verify compares with and of the export the
    `reload` transport installs; `push` and `engine_restarted` need it.

    `lock` is held while an update changes the trainer's weights and its version, so a restarted engine
    is never synced mid-update (async mode restarts an engine from the generation thread while the
    trainer trains).
    """

    def __init__(
        self,
        specs: list[ParamSpec],
        to_hf: Callable[[dict], dict] | NameMaps | None,
        senders: list,
        receivers: list | RolloutGroup,
        *,
        transport: str = "shm",
        bucket_mb: float = 64.0,
        engine_model_dir: str | None = None,
        direct: bool | None = None,
        receiver_buffers: bool = True,
        receiver_buffer_mb: float = 4096.0,
        verify: bool = False,
        trainer: TrainerGroup | None = None,
    ):
        self.group = None if isinstance(receivers, (list, tuple)) else receivers
        if self.group is not None:
            receivers = self.group.workers  # the group's own list: a restart replaces its entry in place
        self.specs, self.to_hf, self.senders, self.receivers = specs, to_hf, senders, receivers
        self.transport, self.bucket_bytes = transport, int(bucket_mb * 2**20)
        self.verify_each, self.trainer = verify, trainer
        # shm routes into a CPU engine rank write straight into its receiver region, up to this size
        self.region_bytes = int(receiver_buffer_mb * 2**20) if receiver_buffers else 0
        self.regions: list[dict] = []  # per engine: {str(tp): each rank's answer (region table or why not)}
        # per engine: {str(tp): the rank's install path, "direct" or "layerwise", and why (install_info)}
        self.installs: list[dict] = []
        self.engine_model_dir, self.direct = engine_model_dir, direct
        if transport not in ("auto", "reload"):
            get_transport(transport)  # fail early on an unknown or unimplemented transport
        self.plan: SyncPlan | None = None
        self.layouts: list[tuple[tuple[int, int], EngineLayout]] = []
        self.plan_seconds = 0.0
        self.route_transport: list[dict[int, str]] = []
        self.lock = threading.Lock()
        self._tmp: Path | None = None  # the reload transport's export folder

    @classmethod
    def for_run(cls, sync: SyncConfig, trainer: TrainerGroup, rollout: RolloutGroup, model_path: str):
        """The loop's weight sync between its trainer group and its engines (`sync.*` config)."""
        plan_based = sync.transport != "reload"
        return cls(
            trainer.param_specs() if plan_based else [],
            # names and rows from rank 0's own adapter: the driver needs no TorchTitan of its own
            trainer.name_maps() if plan_based else None,
            trainer.actors,
            rollout,
            transport=sync.transport,
            bucket_mb=sync.bucket_mb,
            receiver_buffer_mb=sync.receiver_buffer_mb,
            engine_model_dir=model_path,
            verify=sync.verify,
            trainer=trainer,
        )

    @property
    def plan_based(self) -> bool:
        return self.transport != "reload"

    # -- the loop's calls ---------------------------------------------------------------------------
    def push(self) -> dict[str, float]:
        """Every engine gets the trainer's weights as its current policy version; returns the metrics.
        An engine that dies during the sync is restarted and synced alone (the others are done)."""
        version = self.trainer.policy_version
        t = time.perf_counter()
        try:
            nbytes, verified = self._sync_and_verify(version)
        except ReceiverLost as e:
            for engine in e.engines:  # restart_worker calls engine_restarted, which syncs it
                self.group.restart_worker(engine, f"{e.what} of version {version}")
            nbytes, verified = 0, None
        except Exception:
            self.trainer.check_alive()  # a dead trainer rank fails every engine's sync: name it
            raise
        out = {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t}
        if verified is not None:
            out["sync/verified_params"] = float(verified)  # engine parameters found bit-identical
        return out

    def engine_restarted(self, engine: int) -> None:
        """`RolloutGroup.on_restart`: the new engine takes its slot and gets the current policy."""
        with self.lock:
            self.replace_receiver(engine, self.group.workers[engine])
            version = self.trainer.policy_version
            self._sync_and_verify(version, engines=[engine])
            log.info("rollout worker %d restarted and synced to policy version %d", engine, version)

    def _sync_and_verify(self, version: int, engines: list[int] | None = None) -> tuple[int, int | None]:
        """Sync `version` into `engines` (all by default) and, with `verify`, compare every engine
        parameter with vLLM's own loader fed with the trainer's tensors. Returns (bytes, parameters
        verified or None)."""
        stats = self.sync(version, keep_for_verify=self.verify_each, engines=engines)
        if not self.verify_each:
            return stats.bytes, None
        diffs = self.verify(sorted(self.trainer.hf_state_dict().items()), engines)
        bad = {f"engine {e} {n}": d for (e, n), d in diffs.items() if d != 0.0}
        if bad:
            raise RuntimeError(f"weight sync verify: engine weights differ from the trainer's: {bad}")
        return stats.bytes, len(diffs)

    def build(self) -> SyncPlan | None:
        """Check names/shapes against the engine's checkpoint, derive engine layouts, build the plan
        (nothing to plan for the `reload` transport: each engine checks the names of what it reloads)."""
        from .names import NameMaps, checkpoint_shapes

        if not self.plan_based:
            return None
        t0 = time.perf_counter()
        maps = (
            self.to_hf if isinstance(self.to_hf, NameMaps) else NameMaps.from_adapter(self.specs, self.to_hf)
        )
        if self.engine_model_dir is not None:
            check_names(maps.shapes, checkpoint_shapes(self.engine_model_dir))
        self._hf_order = hf_order = sorted(maps.shapes.items())
        row_map = maps.rows
        derived = get([call(r.ws_derive, hf_order) for r in self.receivers])
        self.layouts = layouts = engine_layouts(derived)  # what each engine's loaders do
        self.plan = plan = build_plan(self.specs, row_map, hf_order, layouts, self.bucket_bytes)
        get(
            [
                call(s.ws_setup, plan.titan_names, plan.for_sender(r), plan.sender_dtypes(r))
                for r, s in enumerate(self.senders)
            ]
        )
        self.route_transport = self._choose_routes()
        setups = []
        for e, rcv in enumerate(self.receivers):
            tables, rounds = receiver_tables(plan, e, self.route_transport[e])
            setups.append(call(rcv.ws_setup, tables, rounds, self.senders, self.region_bytes, self.direct))
        self.regions = [r or {} for r in get(setups)]
        self.installs = [
            self._installs(e, answer)
            for e, answer in enumerate(get([call(r.ws_install, self.direct) for r in self.receivers]))
        ]
        self._give_regions(range(len(self.receivers)))
        if self.transport == "collective":
            self._form_group()
        self.plan_seconds = time.perf_counter() - t0
        return plan

    def _installs(self, engine: int, per_rank: list[dict]) -> dict:
        """{str(tp): install info} of one engine's ranks, logged: the path each rank's installs take,
        decided from the engine's own processing (`EngineSide.probe_install`) unless `direct` forces it."""
        out = {}
        for info in per_rank:
            out[str(info["rank"])] = info
            log.info(
                "weight sync: engine %d rank %d installs %s (%s; %d of %d layers processed by vLLM)",
                engine,
                info["rank"],
                info["install"],
                "forced by the driver" if info["forced"] else "the engine's own processing",
                len(info["processed"]),
                info["layers"],
            )
        return out

    def _give_regions(self, engines) -> None:
        """Hand every sender the region tables of `engines`' ranks it writes into and, per bucket, where
        its pieces go (the plan's destination columns, in the bucket's piece order)."""
        plan, engines = self.plan, set(engines)
        regions = [{} for _ in self.senders]
        for i, (e, tp) in enumerate(plan.engine_ranks):
            if e in engines:
                info = self.regions[e].get(str(tp), {})
                for r in range(len(self.senders)):
                    regions[r][i] = (
                        info if route(self.route_transport[e][r], "path" in info) == "shm_region" else None
                    )
        dst = [{} for _ in self.senders]
        cut = plan._bucket_slices()
        for b, (i, snd, _) in enumerate(plan.buckets.tolist()):
            if regions[snd].get(i):
                dst[snd][b] = (i, plan.pieces[cut[b] : cut[b + 1]][:, [DST, DROW, DCOL, NR, NC]])
        get([call(s.ws_regions, regions[r], dst[r]) for r, s in enumerate(self.senders)])

    def _choose_routes(self) -> list[dict[int, str]]:
        """Per engine, sender rank -> transport. `auto` (`auto_route`): CUDA IPC between GPUs of one node
        the engine can map, shared memory between actors on the same Ray node, the object store between
        nodes; any other name applies to every route."""
        if self.transport != "auto":
            return [{r: self.transport for r in range(len(self.senders))} for _ in self.receivers]
        self._sender_nodes = get([call(s.ws_node) for s in self.senders])
        self._sender_gpus = get([call(s.ws_cuda_uuid) for s in self.senders])
        return [self._auto_routes(r) for r in self.receivers]

    def _auto_routes(self, receiver) -> dict[int, str]:
        node, gpus = get(call(receiver.ws_node)), get(call(receiver.ws_cuda_uuids))
        return {
            r: auto_route(n == node, self._sender_gpus[r], gpus) for r, n in enumerate(self._sender_nodes)
        }

    def _form_group(self) -> None:
        """One process group over every sender and every engine worker, for the collective transport.
        Every member must join at once: Ray actors are called asynchronously, local objects from threads;
        the driver hosts the rendezvous store."""
        import torch.distributed as dist

        if not all(hasattr(s.ws_join, "remote") for s in self.senders):
            raise ValueError(
                "sync.transport = 'collective' needs trainer ranks as Ray actors (each joins the "
                "group from its own process); use 'inprocess' or 'shm' for local senders"
            )
        import ray

        devices = get([call(s.ws_device) for s in self.senders])
        devices += [d for per_rank in get([call(r.ws_device) for r in self.receivers]) for d in per_rank]
        backend = group_backend(devices)
        log.info(
            "weight sync: collective group over %d members uses %s (devices %s)",
            len(devices),
            backend,
            sorted(set(devices)),
        )
        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        n_snd, world = len(self.senders), len(self.senders) + len(self.plan.engine_ranks)
        futures = [
            s.ws_join.remote(host, self._store.port, world, r, n_snd, backend)
            for r, s in enumerate(self.senders)
        ]
        with concurrent.futures.ThreadPoolExecutor(max(len(self.receivers), 1)) as pool:
            joins = []
            for e, rcv in enumerate(self.receivers):
                ranks = {str(tp): n_snd + i for i, (ee, tp) in enumerate(self.plan.engine_ranks) if ee == e}
                joins.append(
                    pool.submit(
                        lambda r=rcv, k=ranks: get(
                            call(r.ws_join, host, self._store.port, world, k, n_snd, backend)
                        )
                    )
                )
            for j in joins:
                j.result()
        ray.get(futures)

    def sync(
        self, version: int, keep_for_verify: bool = False, engines: list[int] | None = None
    ) -> SyncStats:
        """Every receiver (or those in `engines`) pulls its buckets, in parallel across engines; returns
        timings and acks. Raises `ReceiverLost` naming engines whose actor died, once the others are done.
        Each engine records `version` as the policy it serves once its install is complete."""
        engines = list(range(len(self.receivers))) if engines is None else engines
        if self.group is not None:  # from here the engines may hold weights no file holds
            self.group.keep_for_restart(None)
        if not self.plan_based:
            return self._reload(version, keep_for_verify, engines)
        plan = self.plan or self.build()
        t0 = time.perf_counter()
        per_engine = get_each(
            [call(self.receivers[e].ws_sync, version, keep_for_verify, self.direct) for e in engines],
            self._timeout(),
        )
        mine = np.isin(plan.buckets[:, 0], [i for i, (e, _) in enumerate(plan.engine_ranks) if e in engines])
        return SyncStats(
            version=version,
            seconds=time.perf_counter() - t0,
            bytes=int(plan.buckets[mine, 2].sum()),
            buckets=int(mine.sum()),
            acks=[a for acks in per_engine for a in acks],
        )

    def _reload(self, version: int, keep: bool, engines: list[int]) -> SyncStats:
        """The `reload` transport: the trainer exports its full HF tensors (safetensors, gathered from its
        shards) and every engine reloads them through vLLM's own loader."""
        if self.trainer is None:
            raise ValueError("weight sync: the reload transport needs the trainer group (WeightSync.for_run)")
        t0 = time.perf_counter()
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="rl_tpu_sync_"))
        self.trainer.export_hf(str(self._tmp))
        path = self._tmp / "model.safetensors"
        acks = get_each(
            [call(self.receivers[e].load_weights, str(path), version, True, keep) for e in engines],
            self._timeout(),
        )
        return SyncStats(version, time.perf_counter() - t0, path.stat().st_size, 1, acks)

    def _timeout(self) -> float | None:
        """How long an engine may take to install a version before it counts as hung (and is restarted
        like a dead one): the engine group's call timeout (`rollout.timeout_s`); no limit without one."""
        return self.group.timeout_s if self.group is not None else None

    def replace_receiver(self, engine: int, receiver) -> None:
        """A restarted engine (same model folder and config) takes slot `engine`. Its loaders are run
        again on codes and must lay weights out exactly as the plan says; then it gets its tables. It
        holds the weights it started with until `sync(version, engines=[engine])`."""
        self.receivers[engine] = receiver
        if self.plan is None:
            return
        if self.transport == "collective":
            raise RuntimeError(
                "weight sync: the collective transport cannot take back a restarted engine (its "
                "process group lost a member); use sync.transport = auto, shm or ray"
            )
        from .plan import PlanError

        old = {lay.tp_rank: lay for (e, _), lay in self.layouts if e == engine}
        new = [EngineLayout.from_wire(d) for d in get(call(receiver.ws_derive, self._hf_order))]
        if sorted(lay.tp_rank for lay in new) != sorted(old) or not all(
            _same_layout(lay, old[lay.tp_rank]) for lay in new
        ):
            raise PlanError(
                f"weight sync: restarted engine {engine} lays out its weights differently from the "
                "engine it replaces (another vLLM config?); the plan no longer fits it"
            )
        if self.transport == "auto":
            self.route_transport[engine] = self._auto_routes(receiver)
        tables, rounds = receiver_tables(self.plan, engine, self.route_transport[engine])
        self.regions[engine] = (
            get(call(receiver.ws_setup, tables, rounds, self.senders, self.region_bytes, self.direct)) or {}
        )
        self.installs[engine] = self._installs(engine, get(call(receiver.ws_install, self.direct)))
        self._give_regions([engine])

    def routes(self) -> list[dict]:
        """One entry per (sender rank, receiver) pair the plan moves bytes over, with its transport and
        the receiving rank's install path (`install`: "direct" into the kernel tensors, or "layerwise"
        through vLLM's per-layer processing)."""
        if self.plan is None:
            return []
        pairs = sorted({(int(r), int(s)) for r, s, _ in self.plan.buckets.tolist()})
        out = []
        for r, s in pairs:
            e, tp = self.plan.engine_ranks[r]
            tr = self.route_transport[e][s]
            out.append(
                {
                    "sender": s,
                    "receiver": [e, tp],
                    "transport": tr,
                    "receiver_region": route(tr, "path" in self.regions[e].get(str(tp), {})) == "shm_region",
                    "install": self.installs[e].get(str(tp), {}).get("install", "unknown"),
                }
            )
        return out

    def close(self) -> None:
        """Free the senders' pooled shared-memory slots (call before killing trainer actors)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if not self.plan_based:
            return
        get([call(s.ws_close) for s in self.senders])
        if self.transport == "collective" and self.plan is not None:
            get([call(r.ws_leave) for r in self.receivers])
            self._store = None

    def verify(self, hf_weights, engines: list[int] | None = None) -> dict[tuple[int, str], float]:
        """After `sync(v, keep_for_verify=True)`: max |diff| per (engine, engine param) against vLLM's own
        loaders fed with `hf_weights` (the trainer's full HF tensors: (name, tensor) pairs, or a
        safetensors file path where the engine runs vLLM workers in other processes). The engines keep
        serving what the sync installed."""
        engines = list(range(len(self.receivers))) if engines is None else engines
        out = {}
        for e, per_rank in zip(
            engines, get([call(self.receivers[e].ws_verify, hf_weights) for e in engines])
        ):
            for res in per_rank:
                for name, d in res.items():
                    out[(e, name)] = max(out.get((e, name), 0.0), d)
        return out


def auto_route(same_node: bool, sender_gpu: str | None, receiver_gpus: list[list[str]]) -> str:
    """`sync.transport = auto` for one (sender, engine) route: `cuda_ipc` when both are on one node and
    every engine rank can map the sender's GPU (`receiver_gpus`: per rank, the UUIDs it sees), else `shm`
    on one node, else `ray`."""
    if not same_node:
        return "ray"
    if sender_gpu is not None and receiver_gpus and all(sender_gpu in seen for seen in receiver_gpus):
        return "cuda_ipc"
    return "shm"


def _same_layout(a: EngineLayout, b: EngineLayout) -> bool:
    return (
        a.tp_size == b.tp_size
        and a.dtype == b.dtype
        and a.shapes == b.shapes
        and list(a.runs) == list(b.runs)
        and all(np.array_equal(a.runs[n], b.runs[n]) for n in a.runs)
    )
