"""The planned install: each engine rank gets exactly its shard's bytes. Planned once (`build`): names
and shapes checked against the engine's checkpoint, the engines' layouts derived by running vLLM's own
loaders on index codes, the plan built (`plan.build_plan`), every sender given its buckets and every
receiver its bucket tables, install order and receiver region; per sync every receiver pulls its buckets
from the senders (`receiver.SyncReceiver.ws_sync`) and the driver collects the acknowledgements."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..calls import call, get, get_each, route
from ..engine_layout import EngineLayout
from ..plan import DCOL, DROW, DST, NC, NR, SyncPlan, build_plan, check_names
from ..specs import ParamSpec
from ..transports import check_distinct_gpus, get_transport, group_backend
from .base import Installer, SyncStats

if TYPE_CHECKING:
    from ..names import NameMaps

log = logging.getLogger("rl_tpu")


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


class PlannedInstall(Installer):
    """See the module docstring; `WeightSync`'s arguments of the same names."""

    def __init__(
        self,
        specs: list[ParamSpec],
        to_hf: Callable[[dict], dict] | NameMaps | None,
        senders: list,
        receivers: list,
        *,
        transport: str,
        bucket_bytes: int,
        region_bytes: int,
        engine_model_dir: str | None,
        direct: bool | None,
    ):
        self.specs, self.to_hf, self.senders, self.receivers = specs, to_hf, senders, receivers
        self.transport, self.bucket_bytes, self.region_bytes = transport, bucket_bytes, region_bytes
        self.engine_model_dir, self.direct = engine_model_dir, direct
        if transport != "auto":
            get_transport(transport)  # fail early on an unknown or unimplemented transport
        self.plan: SyncPlan | None = None
        self.layouts: list[tuple[tuple[int, int], EngineLayout]] = []
        self.plan_seconds = 0.0
        self.route_transport: list[dict[int, str]] = []
        self.regions: list[dict] = []  # per engine: {str(tp): each rank's answer (region table or why not)}
        # per engine: {str(tp): the rank's install path, "direct" or "layerwise", and why (rl_ws_install)}
        self.installs: list[dict] = []

    def build(self) -> SyncPlan | None:
        """Check names/shapes against the engine's checkpoint, derive engine layouts, build the plan."""
        from ..names import NameMaps, checkpoint_shapes

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
        decided from the engine's own processing (`EngineSide._ws_probe_install`) unless `direct` forces it."""
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
        engine_devices = get([call(r.ws_device) for r in self.receivers])
        devices += [d for per_rank in engine_devices for d in per_rank]
        backend = group_backend(devices)
        if backend == "nccl":
            import torch

            # NCCL refuses two members on one GPU: say so before it does
            gpus = {
                f"trainer rank {r}": u
                for r, u in enumerate(get([call(s.ws_cuda_uuid) for s in self.senders]))
            }
            for e, (rcv, devs) in enumerate(zip(self.receivers, engine_devices)):
                for tp, (d, seen) in enumerate(zip(devs, get(call(rcv.ws_cuda_uuids)))):
                    gpus[f"engine {e} rank {tp}"] = seen[torch.device(d).index or 0]
            check_distinct_gpus(gpus)
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

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        plan = self.plan or self.build()
        t0 = time.perf_counter()
        per_engine = get_each(
            [call(self.receivers[e].ws_sync, version, keep, self.direct) for e in engines], timeout
        )
        mine = np.isin(plan.buckets[:, 0], [i for i, (e, _) in enumerate(plan.engine_ranks) if e in engines])
        return SyncStats(
            version=version,
            seconds=time.perf_counter() - t0,
            bytes=int(plan.buckets[mine, 2].sum()),
            buckets=int(mine.sum()),
            acks=[a for acks in per_engine for a in acks],
        )

    def replace(self, engine: int) -> None:
        """The restarted engine's loaders are run again on codes and must lay weights out exactly as the
        plan says; then it gets its tables (it holds the weights it started with until synced)."""
        if self.plan is None:
            return
        receiver = self.receivers[engine]
        if self.transport == "collective":
            raise RuntimeError(
                "weight sync: the collective transport cannot take back a restarted engine (its "
                "process group lost a member); use sync.transport = auto, shm or ray"
            )
        from ..plan import PlanError

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
        """Free the senders' pooled shared-memory slots (before trainer actors are killed)."""
        get([call(s.ws_close) for s in self.senders])
        if self.transport == "collective" and self.plan is not None:
            get([call(r.ws_leave) for r in self.receivers])
            self._store = None


def auto_route(same_node: bool, sender_gpu: str | None, receiver_gpus: list[list[str]]) -> str:
    """`sync.transport = auto` for one (sender, engine) route: `cuda_ipc` when both are on one node and
    every engine rank can map the sender's GPU (`receiver_gpus`: per rank, the UUIDs it sees: under `auto`
    a CUDA engine sees its whole node, `rl_tpu.devices.engine_sees_node`), else `shm` on one node, else
    `ray`."""
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
