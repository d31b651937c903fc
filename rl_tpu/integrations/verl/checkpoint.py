"""`RlTpuCheckpointEngine`: verl checkpoint-engine backend `rl_tpu`, our plan-based shard-to-shard sync
behind verl's `CheckpointEngine` interface (verl/checkpoint_engine/base.py).

Select it with `actor_rollout_ref.rollout.checkpoint_engine.backend=rl_tpu` and start vLLM with our worker
extension, `actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=` `WORKER_EXTENSION` (verl
merges `engine_kwargs` over its own `worker_extension_cls`, vllm_async_server.py:330 then :349).

How verl's calls map onto the plan (verl's `CheckpointEngineManager.update_weights` order, base.py:510):
- `prepare()` on every trainer rank and every rollout worker. A trainer rank reports its `TrainerWorker`'s
  DTensor `ParamSpec`s; trainer rank 0 also hosts a TCP store (the rendezvous). A replica's leading
  rollout worker has each of its vLLM workers derive the engine layout (vLLM's own loaders run on
  index-coded tensors, `weight_sync.engine_layout`) for the HF names of the engine's checkpoint.
- `build_topology()` (the driver) checks trainer and engine names/shapes and builds the plan once:
  which trainer rank packs which pieces of its local shard for which engine TP rank.
- `init_process_group()` hands each trainer rank its buckets and each engine its bucket tables
  (`rl_ws_setup` on every vLLM worker); later syncs keep the plan (every worker reports its plan id).
- `send_weights(weights)` on each trainer rank packs only its own buckets, from the `to_local()` views of
  its FSDP shards, into /dev/shm files and publishes their handles in the store. `weights`, the lazy
  generator of `RlTpuEngine.get_per_tensor_param()`, is never iterated: nothing is gathered.
- `receive_weights()` waits for every sender's handles and yields one control record,
  (`RECORD`, uint8 tensor of JSON), through verl's own stream to the vLLM worker
  (`ServerAdapter.update_weights` -> `update_weights_from_ipc`). Our extension's `update_weights_from_ipc`
  (`receiver.VerlWeightReceiver`) reads each bucket of its TP rank and copies its pieces into the
  engine's parameter shard (`weight_sync.engine_side`: layerwise reload and per-layer processing on CPU).
  No full tensor crosses verl's stream.

Three verl behaviours are bridged here, each by a wrapper that names the line:
- verl hands the model engine to a checkpoint engine only for `delta_sharded` (engine_workers.py:762); for
  every other backend the actor's engine is built at engine_workers.py:686 with none. `_hook_actor` gives
  ours `self.actor.engine` after `ActorRolloutRefWorker.init_model`.
- `CheckpointEngineWorker` builds the checkpoint engine (base.py:337) before, and without, the rollout's
  server adapter (base.py:343). `_hook_rollout` gives ours the `ServerAdapter`.
- `vLLMHttpServer.collective_rpc` drops the workers' return values (vllm_async_server.py:256): the derived
  layouts come back through files under /dev/shm (`_rpc_results`).

Limits (each raises naming the cause): trainer ranks and engines on the same host (shared memory);
`rollout.name=vllm`; no LoRA. The senders' bucket files are pooled per process and reused every sync.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import time
import uuid
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

BACKEND = "rl_tpu"  # actor_rollout_ref.rollout.checkpoint_engine.backend
WORKER_EXTENSION = "rl_tpu.integrations.verl.receiver.VerlWeightReceiver"
RECORD = "__rl_tpu_weight_sync__"  # the one name receive_weights yields: a control record, not a weight


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


@CheckpointEngineRegistry.register(BACKEND)
class RlTpuCheckpointEngine(CheckpointEngine):
    """One worker's side of the plan-based sync: a trainer rank (after `attach_model_engine`) or a rollout
    worker (after `attach_server_adapter`). `checkpoint_engine.engine_kwargs.rl_tpu`: `timeout_s` bounds every
    wait; `verify=True` has the engines keep what they installed for `rl_ws_verify` (bit-for-bit checks)."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        timeout_s: float = 600.0,
        verify: bool = False,
        **kwargs: Any,
    ):
        if kwargs:
            raise TypeError(
                f"rl_tpu checkpoint engine: unknown checkpoint_engine.engine_kwargs.rl_tpu keys "
                f"{sorted(kwargs)} (accepted: timeout_s, verify)"
            )
        if int(bucket_size) <= 0:
            raise ValueError(
                f"rl_tpu checkpoint engine: checkpoint_engine.update_weights_bucket_megabytes must be "
                f"> 0, got bucket_size={bucket_size} bytes"
            )
        self.bucket_size, self.is_master, self.timeout_s = int(bucket_size), bool(is_master), float(timeout_s)
        self.verify = bool(verify)  # engines keep the installed loaded-layout tensors for `rl_ws_verify`
        self.model_engine = None  # trainer side: RlTpuEngine
        self.server_adapter = None  # rollout side: verl's vLLM ServerAdapter
        self.plan_id: str | None = None
        self._store = None  # torch.distributed.TCPStore (trainer rank 0 hosts it)
        self._store_addr: tuple[str, int] | None = None
        self.rank = -1  # this worker's place: trainer ranks 0..S-1, then rollout workers
        self.senders = 0
        self.buckets: list[int] = []  # trainer: the plan buckets this rank packs
        self.order: dict[str, list[int]] = {}  # rollout: engine TP rank -> its bucket ids in install order
        self._last_key: str | None = None
        self._count = 0
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------ wiring (see the hooks below)

    def attach_model_engine(self, engine: Any) -> None:
        """The trainer rank's training engine (ours: it holds the DTensor shards)."""
        from rl_tpu.integrations.verl.engine import RlTpuEngine

        if not isinstance(engine, RlTpuEngine):
            raise TypeError(
                f"checkpoint_engine.backend=rl_tpu needs actor.strategy=rl_tpu (our engine holds the "
                f"shards it sends); the actor engine is {type(engine).__name__}"
            )
        self.model_engine = engine

    def attach_server_adapter(self, adapter: Any) -> None:
        self.server_adapter = adapter

    @property
    def _worker(self):
        w = self.model_engine.worker
        if w is None:
            raise RuntimeError("rl_tpu checkpoint engine: the actor's engine is not initialised yet")
        return w

    # ------------------------------------------------------------------ CheckpointEngine

    def prepare(self) -> dict[str, Any]:
        if self.model_engine is not None:
            meta = {
                "role": "trainer",
                "node": _node_id(),
                "plan_id": self.plan_id,
                "bucket_size": self.bucket_size,
            }
            if self.is_master:
                meta["store"] = self._host_store()
            if self.plan_id is None:
                meta["specs"] = self._worker.param_specs()
                meta["model_path"] = self._worker.model_path
            return meta
        if self.server_adapter is not None:
            sa = self.server_adapter
            if getattr(sa.config, "name", "vllm") != "vllm":
                raise NotImplementedError(
                    f"rl_tpu checkpoint engine: rollout.name={sa.config.name!r} (vllm only)"
                )
            leader = sa.rollout_rank == 0
            meta = {
                "role": "rollout",
                "node": _node_id(),
                "plan_id": self.plan_id,
                "replica": sa.replica_rank,
                "leader": leader,
            }
            if leader and self.plan_id is None:
                from rl_tpu.weight_sync.names import checkpoint_shapes

                engine_hf = checkpoint_shapes(sa.model_config.local_path)
                hf_order = [[n, list(s)] for n, s in sorted(engine_hf.items())]
                meta["engine_hf"] = engine_hf
                meta["layouts"] = self._rpc_results("rl_verl_derive", hf_order)
            return meta
        raise RuntimeError(
            "rl_tpu checkpoint engine: no training engine or rollout server was handed to it "
            "(the plugin's hooks did not run: was rl_tpu.integrations.verl imported by `import verl`?)"
        )

    def _host_store(self) -> tuple[str, int]:
        if self._store is None:
            import ray
            import torch.distributed as dist

            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            self._store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=_td(self.timeout_s)
            )
            self._store_addr = (host, self._store.port)
        return self._store_addr

    def _server(self):
        sa = self.server_adapter
        if not sa._ensure_server_handle():  # verl's lazy lookup of the replica's vLLMHttpServer actor
            raise RuntimeError(
                "rl_tpu checkpoint engine: only a replica's leading rollout worker talks to its server"
            )
        return sa.server_handle

    def _rpc(self, method: str, *args) -> None:
        import ray

        try:
            ray.get(self._server().collective_rpc.remote(method, args=args), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            if method in str(e) and ("has no attribute" in str(e) or "not found" in str(e).lower()):
                raise RuntimeError(
                    f"rl_tpu checkpoint engine: the vLLM workers have no {method!r}; start vLLM with "
                    f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls="
                    f"{WORKER_EXTENSION}"
                ) from e
            raise

    def _rpc_results(self, method: str, *args) -> list:
        """Call `method` on every vLLM worker of this replica and read their results, which each worker
        writes to `<prefix>.<tp rank>` (verl's server returns none, vllm_async_server.py:256)."""
        from rl_tpu.weight_sync.transports import SHM_DIR

        prefix = os.path.join(SHM_DIR, f"rl_tpu_verl_{uuid.uuid4().hex[:12]}")
        tp = int(self.server_adapter.config.tensor_model_parallel_size)
        try:
            self._rpc(method, *args, prefix)
            out = []
            for r in range(tp):
                with open(f"{prefix}.{r}", "rb") as f:
                    out.append(pickle.load(f))
            return out
        finally:
            for r in range(tp):
                try:
                    os.unlink(f"{prefix}.{r}")
                except FileNotFoundError:
                    pass

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list], dict[str, list]]:
        """The driver: build the plan (first sync) from every worker's `prepare()` metadata."""
        S, R = actor_wg_world_size, rollout_world_size
        trainers, rollouts = metadata[:S], metadata[S:]
        if (
            len(metadata) != S + R
            or any(m.get("role") != "trainer" for m in trainers)
            or any(m.get("role") != "rollout" for m in rollouts)
        ):
            raise RuntimeError(
                f"rl_tpu checkpoint engine: expected {S} trainer then {R} rollout metadata, got roles "
                f"{[m.get('role') for m in metadata]} (verl's hybrid rollout runs in the actor's own "
                "workers; this backend needs standalone rollout workers)"
            )
        store = trainers[0].get("store")
        if store is None:
            raise RuntimeError("rl_tpu checkpoint engine: trainer rank 0 is not the master (is_master=False)")
        ids = {m["plan_id"] for m in metadata}

        def args(ranks: range, pid: str, setup: list) -> dict[str, list]:
            # `init_process_group`'s arguments, one list entry per worker of one side
            n = len(ranks)
            return {
                "rank": list(ranks),
                "world_size": [S + R] * n,
                "store": [store] * n,
                "senders": [S] * n,
                "plan_id": [pid] * n,
                "setup": setup,
            }

        if len(ids) == 1 and None not in ids:  # the plan stands: nothing to hand out
            pid = ids.pop()
            return args(range(S), pid, [None] * S), args(range(S, S + R), pid, [None] * R)
        if ids != {None}:
            raise RuntimeError(
                f"rl_tpu checkpoint engine: workers hold different plans {sorted(map(str, ids))} "
                "(a worker restarted?); rebuilding one side's plan is not implemented: restart the run"
            )
        plan, engines = _build_plan(trainers, rollouts)
        from rl_tpu.weight_sync.installers import receiver_tables

        pid = uuid.uuid4().hex[:12]
        actor_setup = [
            {"names": plan.titan_names, "buckets": plan.for_sender(r), "dtypes": plan.sender_dtypes(r)}
            for r in range(S)
        ]
        rollout_setup = []
        for m in rollouts:
            e = engines.index(m["replica"])
            tables, _ = receiver_tables(plan, e, "shm")
            order = {
                str(tp): [b for b, _, _ in plan.for_receiver(i)]
                for i, (ee, tp) in enumerate(plan.engine_ranks)
                if ee == e
            }
            rollout_setup.append({"tables": tables if m["leader"] else None, "order": order})
        return args(range(S), pid, actor_setup), args(range(S, S + R), pid, rollout_setup)

    def init_process_group(
        self,
        rank: int,
        world_size: int,
        store: tuple[str, int],
        senders: int,
        plan_id: str,
        setup: dict | None,
    ) -> None:
        import torch.distributed as dist

        self.rank, self.senders = int(rank), int(senders)
        if self._store is None:
            host, port = store
            self._store = dist.TCPStore(host, int(port), is_master=False, timeout=_td(self.timeout_s))
        if setup is None:
            if self.plan_id != plan_id:
                raise RuntimeError(
                    f"rl_tpu checkpoint engine: worker {rank} holds plan {self.plan_id}, not {plan_id}"
                )
            return
        if self.model_engine is not None:
            # TrainerWorker's SyncSender (weight_sync/sender.py)
            self._worker.ws_setup(setup["names"], setup["buckets"], setup["dtypes"])
            self.buckets = sorted(int(b) for b in setup["buckets"])
        else:
            if setup["tables"] is not None:
                self._rpc("rl_ws_setup", setup["tables"])  # every vLLM worker keeps its TP rank's tables
            self.order = setup["order"]
        self.plan_id = plan_id

    def finalize(self) -> None:
        """Nothing per sync: the plan, the store and the pooled bucket files serve the next sync."""

    def _version(self, global_steps: int | None) -> int:
        self._count += 1
        return int(global_steps) if global_steps is not None else self._count

    def _key(self, version: int, sender: int) -> str:
        return f"rl_tpu/{self.plan_id}/v{version}/s{sender}"

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, float]:
        """Pack this rank's buckets (its own shard's pieces only) and publish their handles. `weights` is not
        iterated: for our engine that generator would gather full tensors."""
        if self.model_engine is None:
            raise RuntimeError("rl_tpu checkpoint engine: send_weights on a worker without a training engine")
        if self.plan_id is None:
            raise RuntimeError(
                "rl_tpu checkpoint engine: send_weights before init_process_group handed out a plan"
            )
        version = self._version(global_steps)
        t0 = time.perf_counter()
        w = self._worker
        handles = {
            b: w.ws_pack(b, "shm", version, ("verl", b)) for b in self.buckets
        }  # pooled file per bucket
        if self._last_key is not None:
            self._store.delete_key(self._last_key)  # the previous sync's receivers are done with it
        self._last_key = self._key(version, self.rank)
        self._store.set(self._last_key, json.dumps({str(b): list(h) for b, h in handles.items()}))
        self.stats = {
            "rl_tpu/send_s": time.perf_counter() - t0,
            "rl_tpu/send_bytes": float(sum(h[1] for h in handles.values())),
        }
        return dict(self.stats)

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Wait for every sender's handles, then yield the one control record for our vLLM extension."""
        import asyncio

        if self.plan_id is None:
            raise RuntimeError(
                "rl_tpu checkpoint engine: receive_weights before init_process_group handed out a plan"
            )
        version = self._version(global_steps)
        handles: dict[str, list] = {}
        for s in range(self.senders):
            raw = await asyncio.to_thread(
                self._store.get, self._key(version, s)
            )  # blocks until set (timeout_s)
            handles.update(json.loads(raw))
        per_tp = {tp: [[b, handles[str(b)], "shm"] for b in bids] for tp, bids in self.order.items()}
        record = json.dumps(
            {"plan_id": self.plan_id, "version": version, "keep": self.verify, "handles": per_tp}
        ).encode()
        yield RECORD, torch.frombuffer(bytearray(record), dtype=torch.uint8)


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _build_plan(trainers: list[dict], rollouts: list[dict]):
    """The plan from trainer rank 0's specs and each replica leader's derived layouts; checks names, shapes
    and that every (trainer rank, engine) route stays on one host."""
    from rl_tpu.trainer import model as titan
    from rl_tpu.weight_sync.installers import engine_layouts
    from rl_tpu.weight_sync.names import NameMaps
    from rl_tpu.weight_sync.plan import build_plan, check_names

    t0 = trainers[0]
    specs = t0["specs"]
    maps = NameMaps.from_adapter(
        specs, functools.partial(titan.titan_to_hf, titan.build_model_spec(t0["model_path"]))
    )
    leaders = [m for m in rollouts if m["leader"]]
    engines = [m["replica"] for m in leaders]
    if not leaders or len(set(engines)) != len(engines):
        raise RuntimeError(
            f"rl_tpu checkpoint engine: one leading rollout worker per replica expected, got replicas "
            f"{engines}"
        )
    for m in leaders:
        check_names(maps.shapes, m["engine_hf"])  # raises naming every missing / extra / mis-shaped tensor
    layouts = engine_layouts([m["layouts"] for m in leaders])
    plan = build_plan(specs, maps.rows, sorted(maps.shapes.items()), layouts, t0["bucket_size"])
    for r, s, _ in plan.buckets.tolist():
        e = plan.engine_ranks[r][0]
        if trainers[s]["node"] != leaders[e]["node"]:
            raise NotImplementedError(
                f"rl_tpu checkpoint engine: trainer rank {s} (node {trainers[s]['node']}) and "
                f"rollout replica {engines[e]} (node {leaders[e]['node']}) are on different "
                "hosts; this backend moves shards through /dev/shm (same host only)"
            )
    return plan, engines


# ---------------------------------------------------------------------------------------------- hooks


def attach_to_actor(worker: Any) -> None:
    """After verl built an actor's engine and checkpoint engine (`ActorRolloutRefWorker.init_model`,
    engine_workers.py:686), hand ours the model engine."""
    ce = getattr(worker, "checkpoint_engine", None)
    if isinstance(ce, RlTpuCheckpointEngine):
        ce.attach_model_engine(worker.actor.engine)


def _hook_actor() -> None:
    from verl.workers.engine_workers import ActorRolloutRefWorker

    orig = ActorRolloutRefWorker.init_model
    if getattr(orig, "_rl_tpu", False):
        return

    @functools.wraps(orig)  # keeps verl's @register dispatch attributes
    def init_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        attach_to_actor(self)
        return out

    init_model._rl_tpu = True
    ActorRolloutRefWorker.init_model = init_model


def _hook_rollout() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    orig = CheckpointEngineWorker.__init__
    if getattr(orig, "_rl_tpu", False):
        return

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if isinstance(self.checkpoint_engine, RlTpuCheckpointEngine):
            self.checkpoint_engine.attach_server_adapter(self.server_adapter)

    __init__._rl_tpu = True
    CheckpointEngineWorker.__init__ = __init__


_hook_actor()
_hook_rollout()
