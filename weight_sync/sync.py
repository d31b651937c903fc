"""`WeightSync`: compute the plan once, then per iteration move each receiver exactly its shard's bytes.

Roles and where code runs:
- driver (`WeightSync`): derives layouts and builds the plan once, hands every sender its buckets and
  every receiver its bucket tables and install order; per sync it only starts the receivers and
  collects their acknowledgements (versions, bytes). It never touches bucket handles or bytes.
- sender = a trainer rank. `Sender` (held by `TrainerWorker`, called as `ws_*` actor methods) packs a
  bucket from the rank's local DTensor shards into the transport and returns a small handle.
- receiver = one vLLM engine. `Receiver` (held by `RolloutWorker`) pulls its buckets from the senders
  in install order, at most two rounds ahead (every round at once on routes into a receiver region: no
  buffer is reused, so senders write ahead), and hands each round to its engine's TP ranks through the
  `WeightReceiver` worker extension (`rl_ws_*` methods called by name; `engine_side.EngineSide` inside).
  Engines install in parallel with each other.

Sync protocol for policy version v, per receiver: `rl_ws_begin` -> for each round (at most one bucket
per TP rank): senders pack, engine ranks copy their pieces and process every layer that became
complete -> `rl_ws_finish` (the rest of vLLM's post-processing; records v) -> `reset_prefix_cache()`.

Receiver regions (shm routes into a CPU engine, `receiver_buffers=True`, under `receiver_buffer_mb` per
engine rank): at setup each engine rank creates one /dev/shm file holding its loaded-layout parameters
and the driver hands every sender the region table and, per bucket, where its pieces go; `ws_pack` then
copies pieces straight into the engine's parameters (casting to the engine dtype) and returns
(receiver index, bucket). Above the cap, or with `receiver_buffers=False`, shm routes carry bucket files.

Nothing is half-installed on bad input: name and shape checks run at plan time, before any bytes move.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .engine_layout import EngineLayout
from .plan import DCOL, DROW, DST, NC, NR, Plan, build_plan, check_names
from .rows import as_2d, rows_cols
from .specs import ParamSpec
from .transports import InProcess, Region, SharedMemory, get_transport, join_group, leave_group
from .wire import begin_pack, packed_size

if TYPE_CHECKING:
    from rl_tpu.rollout import RolloutGroup

    from .names import NameMaps


def _invoke(obj, method: str, *args):
    """Call `obj.method(*args)`: asynchronously (an ObjectRef) on a Ray actor, directly on a local object."""
    fn = getattr(obj, method)
    return fn.remote(*args) if hasattr(fn, "remote") else fn(*args)


def _node_id() -> str:
    """This process's Ray node id ("local" outside Ray): where shared memory is reachable."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return "local"


class ReceiverLost(RuntimeError):
    """Engines whose actor died during a sync (the others finished theirs): restart them, then
    `replace_receiver` and sync them alone."""

    def __init__(self, engines: list[int], why: str):
        super().__init__(f"weight sync: engine(s) {engines} died during the sync ({why})")
        self.engines = engines


def _get_each(xs: list) -> list:
    """Like `_get` over a list of calls, but an engine whose Ray actor died does not stop the wait for the
    others: the dead ones are raised together as `ReceiverLost` once the rest finished. A call that
    raised (the engine is alive) is raised at once."""
    if not xs or type(xs[0]).__name__ != "ObjectRef":
        return xs
    import ray

    out, lost, why = [], [], ""
    for i, ref in enumerate(xs):
        try:
            out.append(ray.get(ref))
        except (
            ray.exceptions.RayTaskError
        ):  # the engine's call failed (e.g. a sender died): not a lost engine
            raise
        except ray.exceptions.RayActorError as e:
            out.append(None)
            lost.append(i)
            why = why or str(e).splitlines()[0]
    if lost:
        raise ReceiverLost(lost, why)
    return out


def route(transport: str, region: bool) -> str:
    """The route a (sender, engine rank) pair takes: `shm` into an engine rank that offers a receiver
    region becomes `shm_region`. Driver and receiver apply this one rule."""
    return "shm_region" if transport == "shm" and region else transport


def _ready(refs: list) -> bool:
    """Whether every call in `refs` has finished (local calls always have)."""
    refs = [r for r in refs if type(r).__name__ == "ObjectRef"]
    if not refs:
        return True
    import ray

    return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)


def _get(x):
    if type(x).__name__ == "ObjectRef":
        import ray

        return ray.get(x)
    if isinstance(x, list) and x and type(x[0]).__name__ == "ObjectRef":
        import ray

        return ray.get(x)
    return x


# ---------------------------------------------------------------------------------------------------
# sender side (trainer rank)


class Sender:
    """Packs this rank's buckets. `shards()` returns the rank's local shards by TorchTitan name, without
    copies (DTensor `to_local()` views of the live parameters)."""

    def __init__(self, shards):
        self.shards = shards
        self.names: list[str] = []
        self.buckets: dict[int, np.ndarray] = {}
        self.regions: dict[int, dict] = {}  # plan receiver index -> its engine rank's region table
        self.dst: dict[int, tuple[int, np.ndarray]] = {}  # bucket -> (receiver index, destination pieces)
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (receiver, dst param) -> 2-D region view

    def ws_setup(self, names: list[str], buckets: dict[int, np.ndarray]) -> int:
        self.names, self.buckets = list(names), buckets
        self.ws_regions({i: None for i in self.regions}, {})
        return len(buckets)

    def ws_regions(self, regions: dict[int, dict | None], dst: dict[int, tuple[int, np.ndarray]]) -> int:
        """Receiver regions this rank writes into. `regions[i]`: plan receiver i's region table ({path,
        nbytes, params: [[offset, shape, dtype], ...] by the receiver's param index}) or None (none any
        more); `dst[bucket]`: (i, the pieces' destinations `[k, 5]` (dst, dst_row, dst_col, nrows, ncols)
        in the order of the bucket's source pieces), replacing those of every receiver named in
        `regions`. Each region is mapped now, so its engine may unlink the file's name at its first sync."""
        for i, info in regions.items():
            self.regions.pop(int(i), None)
            if info:
                self.regions[int(i)] = info
        self.dst = {b: v for b, v in self.dst.items() if v[0] not in regions}
        self.dst.update({int(b): (int(i), np.asarray(p)) for b, (i, p) in dst.items()})
        self._views = {}
        for info in self.regions.values():
            Region.attach(info["path"], int(info["nbytes"]))
        Region.detach_except({info["path"] for info in self.regions.values()})
        return len(self.dst)

    def _region_view(self, i: int, d: int) -> torch.Tensor:
        v = self._views.get((i, d))
        if v is None:
            info = self.regions[i]
            off, shape, dtype = info["params"][d]
            reg = Region.attach(info["path"], int(info["nbytes"]))
            v = self._views[(i, d)] = reg.view(int(off), shape, getattr(torch, dtype)).view(
                rows_cols(tuple(shape))
            )
        return v

    def _write_region(self, bucket: int) -> tuple[int, int]:
        """Copy `bucket`'s pieces straight into the receiver's region (engine dtype); return the handle."""
        if bucket not in self.dst:
            raise RuntimeError(
                f"weight sync: bucket {bucket} is routed into a receiver region this rank was not "
                "given (WeightSync.build / replace_receiver hands them out)"
            )
        i, dst = self.dst[bucket]
        with torch.no_grad():
            for piece, (d, dr, dc, nr, nc) in zip(self._pieces(bucket, self.shards()), dst.tolist()):
                self._region_view(i, d)[dr : dr + nr, dc : dc + nc].copy_(piece)
        return (i, bucket)

    def _pieces(self, bucket: int, shards: dict[str, torch.Tensor]) -> Iterator[torch.Tensor]:
        """`bucket`'s source pieces in order, as 2-D views of this rank's shards (no copies)."""
        views: dict[int, torch.Tensor] = {}
        for src, r, c, nr, nc in self.buckets[bucket].tolist():
            v = views.get(src)
            if v is None:
                v = views[src] = as_2d(shards[self.names[src]])
            yield v[r : r + nr, c : c + nc]

    def ws_pack(self, bucket: int, transport: str, version: int, slot: Any = None) -> Any:
        """Pack `bucket` into the transport's reusable `slot` and return its handle. The receiver that
        asked keeps at most two rounds in flight, so the bucket that last used this slot is consumed.
        Route `shm_region`: the pieces go straight into the receiver's region (no slot)."""
        if transport == "shm_region":
            return self._write_region(bucket)
        pieces = self.buckets[bucket]
        shards = self.shards()
        total = int((pieces[:, 3] * pieces[:, 4]).sum())
        dtype = next(iter(shards.values())).dtype
        meta = {"version": str(version), "bucket": str(bucket)}
        tr = get_transport(transport)
        state, buf = tr.alloc(packed_size([("data", dtype, total)], meta), slot=slot)
        data = begin_pack(buf, "data", dtype, total, meta)
        off = 0
        with torch.no_grad():
            for piece in self._pieces(bucket, shards):
                n = piece.numel()
                data[off : off + n].view(piece.shape).copy_(piece)
                off += n
        del data
        if isinstance(buf, memoryview):
            buf.release()
        return tr.publish(state, peer=slot[0] if isinstance(slot, tuple) else None)

    def ws_node(self) -> str:
        return _node_id()

    def ws_join(self, host: str, port: int, world: int, rank: int, senders: int) -> int:
        device = next(iter(self.shards().values())).device
        return join_group(host, port, world, rank, senders, str(device))

    def ws_close(self) -> None:
        """Free this process's pooled transport slots (shm files would outlive a killed actor) and unmap
        the receiver regions."""
        self.ws_regions({i: None for i in self.regions}, {})
        SharedMemory._cleanup()
        InProcess._pool.clear()
        leave_group()


def fsdp_local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A TorchTitan model's local shards (FSDP2 resharded first: it swaps in unsharded params between
    forward and backward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = t.to_local() if hasattr(t, "to_local") else t
    return out


# ---------------------------------------------------------------------------------------------------
# receiver side (host of one engine)


class Receiver:
    """One engine's side of the sync, in the process that owns the `vllm.LLM` (`engine`: anything with
    `collective_rpc(method, args=...)` and `reset_prefix_cache()`). `crosses_process`: the engine's
    workers live in other processes (multiprocess core or TP > 1), so handles must be plain values."""

    def __init__(self, engine, crosses_process: bool = False):
        self.engine, self.crosses_process = engine, crosses_process
        self.rounds: list[dict[int, tuple]] = []
        self.senders: list = []
        self.version = -1

    def _rpc(self, method: str, *args) -> list:
        return self.engine.collective_rpc(method, args=args)

    def ws_derive(self, hf_specs: list) -> list[dict]:
        return self._rpc("rl_ws_derive", [[n, list(s)] for n, s in hf_specs])

    def ws_node(self) -> str:
        return _node_id()

    def ws_setup(
        self, tables: dict, rounds: list, senders: list, region_bytes: int = 0, direct: bool | None = None
    ) -> dict:
        """`tables[str(tp)]`: that rank's bucket tables; `rounds`: install order, each a dict
        tp -> (bucket id, sender rank, slot key, transport) with at most one bucket per TP rank.
        `region_bytes` > 0 and a shm route: each rank is asked for a receiver region of at most that many
        bytes; returns {str(tp): region table, or {rank, why} where the rank takes bucket files}."""
        self._rpc("rl_ws_setup", tables)
        offered = {}
        if region_bytes > 0 and any(x[3] == "shm" for rnd in rounds for x in rnd.values()):
            offered = {str(d["rank"]): d for d in self._rpc("rl_ws_region", int(region_bytes), direct)}
        self.rounds = [
            {
                tp: (b, snd, slot, route(tr, "path" in offered.get(str(tp), {})))
                for tp, (b, snd, slot, tr) in rnd.items()
            }
            for rnd in rounds
        ]
        self.senders = senders
        return offered

    def _plain(self, handle: Any, transport: str) -> Any:
        """A handle the engine ranks can open: object-store and in-process buffers become bytes when the
        ranks live in other processes (vLLM's RPC carries plain values only)."""
        if not self.crosses_process:
            return handle
        if transport == "ray":
            import ray

            return bytes(memoryview(ray.get(handle[0])))
        if transport == "inprocess":
            return bytes(handle)
        return handle

    def ws_sync(self, version: int, keep: bool = False, direct: bool | None = None) -> list[dict]:
        self._rpc("rl_ws_begin", version, keep, direct)

        def issue(k: int, region: bool) -> dict:
            return {
                tp: (bid, tr, _invoke(self.senders[snd], "ws_pack", bid, tr, version, slot))
                for tp, (bid, snd, slot, tr) in self.rounds[k].items()
                if (tr == "shm_region") == region
            }

        n = len(self.rounds)
        pending = [issue(k, True) for k in range(n)]  # region routes reuse no buffer: every round now
        for k in range(min(2, n)):  # the others keep two rounds in flight (pooled slots are reused)
            pending[k].update(issue(k, False))
        i = 0
        while i < n:
            # round i, and every later round already packed, go to the engine in one call (in order)
            j = i + 1  # a round past i + 1 whose other routes are not issued yet must wait for them
            while (
                j < n
                and (j <= i + 1 or all(x[3] == "shm_region" for x in self.rounds[j].values()))
                and _ready([ref for _, _, ref in pending[j].values()])
            ):
                j += 1
            handles: dict[str, list] = {}
            done = []
            for k in range(i, j):
                for tp, (bid, tr, ref) in pending[k].items():
                    h = _get(ref)
                    handles.setdefault(str(tp), []).append([bid, self._plain(h, tr), tr])
                    done.append((tr, h))
                pending[k] = None
            self._rpc("rl_ws_receive", handles)
            for tr, h in done:
                get_transport(tr).release(h)
            for k in range(max(i + 2, j), min(j + 2, n)):
                pending[k].update(issue(k, False))
            i = j
        acks = self._rpc("rl_ws_finish")
        self.engine.reset_prefix_cache()
        self.version = version
        return acks

    def ws_verify(self, hf_weights) -> list[dict]:
        if self.crosses_process and not isinstance(hf_weights, str):
            import os
            import tempfile

            from safetensors.torch import save_file

            fd, path = tempfile.mkstemp(
                suffix=".safetensors", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            )
            os.close(fd)
            try:
                save_file({n: t.contiguous() for n, t in hf_weights}, path)
                return self._rpc("rl_ws_verify", path)
            finally:
                os.unlink(path)
        return self._rpc("rl_ws_verify", hf_weights)

    def ws_join(self, host: str, port: int, world: int, ranks: dict, senders: int) -> list:
        return self._rpc("rl_ws_join", host, port, world, ranks, senders)

    def ws_leave(self) -> None:
        self._rpc("rl_ws_leave")


# ---------------------------------------------------------------------------------------------------
# driver


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


def receiver_tables(plan: Plan, engine: int, transport: str | dict = "shm") -> tuple[dict, list]:
    """Engine `engine`'s bucket tables per TP rank and its install rounds (plain values, any process).
    `transport`: one name, or a dict sender rank -> name for this engine's routes."""
    tables, per_tp = {}, {}
    for i, (e, tp) in enumerate(plan.receivers):
        if e != engine:
            continue
        mine = plan.for_receiver(i)
        tables[str(tp)] = {
            "names": plan.dst_names[i],
            "shapes": {n: list(s) for n, s in plan.dst_shapes[i].items()},
            "numel": plan.dst_numel[i],
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
    """Plan-based resharding from trainer ranks (senders) into vLLM engines (receivers).

    `senders[r]` is trainer rank r and `receivers[e]` engine e: Ray actor handles (`TrainerWorker`,
    `RolloutWorker`) or local objects with the same `ws_*` methods, or a `RolloutGroup` (its workers;
    the group then knows its engines hold synced weights, which it cannot give an engine it restarts:
    such a restart is an error until `on_restart` is set, see `replace_receiver`). `to_hf` is
    TorchTitan's `StateDictAdapter.to_hf`, or the `NameMaps` a trainer rank computed with it.
    """

    def __init__(
        self,
        specs: list[ParamSpec],
        to_hf: Callable[[dict], dict] | NameMaps,
        senders: list,
        receivers: list | RolloutGroup,
        *,
        transport: str = "shm",
        bucket_mb: float = 64.0,
        engine_model_dir: str | None = None,
        direct: bool | None = None,
        receiver_buffers: bool = True,
        receiver_buffer_mb: float = 4096.0,
    ):
        self.group = None if isinstance(receivers, (list, tuple)) else receivers
        if self.group is not None:
            receivers = self.group.workers  # the group's own list: a restart replaces its entry in place
        self.specs, self.to_hf, self.senders, self.receivers = specs, to_hf, senders, receivers
        self.transport, self.bucket_bytes = transport, int(bucket_mb * 2**20)
        # shm routes into a CPU engine rank write straight into its receiver region, up to this size
        self.region_bytes = int(receiver_buffer_mb * 2**20) if receiver_buffers else 0
        self.regions: list[
            dict
        ] = []  # per engine: {str(tp): what each rank answered (region table or why not)}
        self.engine_model_dir, self.direct = engine_model_dir, direct
        if transport != "auto":
            get_transport(transport)  # fail early on an unknown or unimplemented transport
        self.plan: Plan | None = None
        self.layouts: list[tuple[tuple[int, int], EngineLayout]] = []
        self.plan_seconds = 0.0
        self.route_transport: list[dict[int, str]] = []
        self.version = -1

    def build(self) -> Plan:
        """Check names/shapes against the engine's checkpoint, derive engine layouts, build the plan."""
        from .names import NameMaps, checkpoint_shapes

        t0 = time.perf_counter()
        maps = (
            self.to_hf if isinstance(self.to_hf, NameMaps) else NameMaps.from_adapter(self.specs, self.to_hf)
        )
        if self.engine_model_dir is not None:
            check_names(maps.shapes, checkpoint_shapes(self.engine_model_dir))
        self._hf_order = hf_order = sorted(maps.shapes.items())
        row_map = maps.rows
        derived = _get([_invoke(r, "ws_derive", hf_order) for r in self.receivers])
        self.layouts = layouts = engine_layouts(derived)  # what each engine's loaders do
        self.plan = plan = build_plan(self.specs, row_map, hf_order, layouts, self.bucket_bytes)
        _get(
            [_invoke(s, "ws_setup", plan.titan_names, plan.for_sender(r)) for r, s in enumerate(self.senders)]
        )
        self.route_transport = self._choose_routes()
        setups = []
        for e, rcv in enumerate(self.receivers):
            tables, rounds = receiver_tables(plan, e, self.route_transport[e])
            setups.append(
                _invoke(rcv, "ws_setup", tables, rounds, self.senders, self.region_bytes, self.direct)
            )
        self.regions = [r or {} for r in _get(setups)]
        self._give_regions(range(len(self.receivers)))
        if self.transport == "collective":
            self._form_group()
        self.plan_seconds = time.perf_counter() - t0
        return plan

    def _give_regions(self, engines) -> None:
        """Hand every sender the region tables of `engines`' ranks it writes into and, per bucket, where
        its pieces go (the plan's destination columns, in the bucket's piece order)."""
        plan, engines = self.plan, set(engines)
        regions = [{} for _ in self.senders]
        for i, (e, tp) in enumerate(plan.receivers):
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
        _get([_invoke(s, "ws_regions", regions[r], dst[r]) for r, s in enumerate(self.senders)])

    def _choose_routes(self) -> list[dict[int, str]]:
        """Per engine, sender rank -> transport. `auto`: shared memory between actors on the same Ray node,
        the object store between nodes; any other name applies to every route."""
        if self.transport != "auto":
            return [{r: self.transport for r in range(len(self.senders))} for _ in self.receivers]
        snd = self._sender_nodes = _get([_invoke(s, "ws_node") for s in self.senders])
        rcv = _get([_invoke(r, "ws_node") for r in self.receivers])
        return [{r: "shm" if snd[r] == node else "ray" for r in range(len(self.senders))} for node in rcv]

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

        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        n_snd, world = len(self.senders), len(self.senders) + len(self.plan.receivers)
        futures = [
            s.ws_join.remote(host, self._store.port, world, r, n_snd) for r, s in enumerate(self.senders)
        ]
        with concurrent.futures.ThreadPoolExecutor(max(len(self.receivers), 1)) as pool:
            joins = []
            for e, rcv in enumerate(self.receivers):
                ranks = {str(tp): n_snd + i for i, (ee, tp) in enumerate(self.plan.receivers) if ee == e}
                joins.append(
                    pool.submit(
                        lambda r=rcv, k=ranks: _get(
                            _invoke(r, "ws_join", host, self._store.port, world, k, n_snd)
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
        timings and acks. Raises `ReceiverLost` naming engines whose actor died, once the others are done."""
        plan = self.plan or self.build()
        engines = list(range(len(self.receivers))) if engines is None else engines
        t0 = time.perf_counter()
        if self.group is not None:  # from here the engines may hold weights no file holds
            self.group.keep_for_restart(None)
        per_engine = _get_each(
            [_invoke(self.receivers[e], "ws_sync", version, keep_for_verify, self.direct) for e in engines]
        )
        if len(engines) == len(self.receivers):
            self.version = version
            if self.group is not None:
                self.group.policy_version = version
        mine = np.isin(plan.buckets[:, 0], [i for i, (e, _) in enumerate(plan.receivers) if e in engines])
        return SyncStats(
            version=version,
            seconds=time.perf_counter() - t0,
            bytes=int(plan.buckets[mine, 2].sum()),
            buckets=int(mine.sum()),
            acks=[a for acks in per_engine for a in acks],
        )

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
        new = [EngineLayout.from_wire(d) for d in _get(_invoke(receiver, "ws_derive", self._hf_order))]
        if sorted(lay.tp_rank for lay in new) != sorted(old) or not all(
            _same_layout(lay, old[lay.tp_rank]) for lay in new
        ):
            raise PlanError(
                f"weight sync: restarted engine {engine} lays out its weights differently from the "
                "engine it replaces (another vLLM config?); the plan no longer fits it"
            )
        if self.transport == "auto":
            node = _get(_invoke(receiver, "ws_node"))
            self.route_transport[engine] = {
                r: "shm" if n == node else "ray" for r, n in enumerate(self._sender_nodes)
            }
        tables, rounds = receiver_tables(self.plan, engine, self.route_transport[engine])
        self.regions[engine] = (
            _get(_invoke(receiver, "ws_setup", tables, rounds, self.senders, self.region_bytes, self.direct))
            or {}
        )
        self._give_regions([engine])

    def routes(self) -> list[dict]:
        """One entry per (sender rank, receiver) pair the plan moves bytes over, with its transport."""
        if self.plan is None:
            return []
        pairs = sorted({(int(r), int(s)) for r, s, _ in self.plan.buckets.tolist()})
        out = []
        for r, s in pairs:
            e, tp = self.plan.receivers[r]
            tr = self.route_transport[e][s]
            out.append(
                {
                    "sender": s,
                    "receiver": [e, tp],
                    "transport": tr,
                    "receiver_region": route(tr, "path" in self.regions[e].get(str(tp), {})) == "shm_region",
                }
            )
        return out

    def close(self) -> None:
        """Free the senders' pooled shared-memory slots (call before killing trainer actors)."""
        _get([_invoke(s, "ws_close") for s in self.senders])
        if self.transport == "collective" and self.plan is not None:
            _get([_invoke(r, "ws_leave") for r in self.receivers])
            self._store = None

    def verify(self, hf_weights, engines: list[int] | None = None) -> dict[tuple[int, str], float]:
        """After `sync(v, keep_for_verify=True)`: max |diff| per (engine, engine param) against vLLM's own
        loaders fed with `hf_weights` (the trainer's full HF tensors: (name, tensor) pairs, or a
        safetensors file path where the engine runs vLLM workers in other processes). The engines keep
        serving what the sync installed."""
        engines = list(range(len(self.receivers))) if engines is None else engines
        out = {}
        for e, per_rank in zip(
            engines, _get([_invoke(self.receivers[e], "ws_verify", hf_weights) for e in engines])
        ):
            for res in per_rank:
                for name, d in res.items():
                    out[(e, name)] = max(out.get((e, name), 0.0), d)
        return out


def _same_layout(a: EngineLayout, b: EngineLayout) -> bool:
    return (
        a.tp_size == b.tp_size
        and a.dtype == b.dtype
        and a.shapes == b.shapes
        and list(a.runs) == list(b.runs)
        and all(np.array_equal(a.runs[n], b.runs[n]) for n in a.runs)
    )
