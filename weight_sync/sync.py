"""`WeightSync`: compute the plan once, then per iteration move each receiver exactly its shard bytes.

Roles and where code runs:
- driver (this object): owns the plan, routes bucket handles, records versions and timings;
- sender = a trainer rank. Functions `sender_*` run there with the rank's worker object as first argument
  (via `actor.run.remote(fn, *args)` on a Ray actor, or a direct call); they read the rank's local
  shards (`worker.local_shards()` if defined, else `worker.shards`, else the model's DTensor params);
- receiver = one vLLM engine. Functions `*_worker` run inside each vLLM worker (one per TP rank) through
  `collective_rpc`; each worker picks the handles addressed to its own TP rank.

Sync protocol for policy version v: `begin` on every receiver (restores loaded layouts on the meta device
on CPU) -> for each bucket, sender packs into the transport, receiver copies its runs into the loaded
-layout parameter and installs every parameter that became complete -> `finish` (vLLM post-processing
of the rest; records v) -> `reset_prefix_cache()` -> each receiver acknowledges v. At most two buckets
are in flight per sender (packs run ahead of installs, and different senders pack in parallel).

Nothing is half-installed on bad input: name and shape checks run at plan time, before any bytes move.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .plan import Bucket, Plan, build_plan, check_names
from .specs import ParamSpec
from .transports import get_transport
from .wire import pack_into, packed_size, unpack


# ---------------------------------------------------------------------------------------------------
# sender side (trainer rank)


def _local_shards(worker) -> dict[str, torch.Tensor]:
    """This rank's local shards, without copies: DTensor `to_local()` views of the live parameters."""
    if hasattr(worker, "shards"):
        return worker.shards
    from torch.distributed.fsdp import FSDPModule

    for m in worker.model.modules():  # FSDP2 swaps in unsharded params between forward and backward
        if isinstance(m, FSDPModule):
            m.reshard()
    out = {}
    for name, p in worker.model.named_parameters():
        t = p.detach()
        out[name] = t.to_local() if hasattr(t, "to_local") else t
    return out


def sender_setup(worker, buckets: list[Bucket]) -> int:
    worker._ws_buckets = buckets
    return len(buckets)


def sender_pack(worker, index: int, transport: str, version: int, slot: int = 0) -> Any:
    """Pack bucket `index` of this rank's plan into the transport's reusable `slot`; returns the handle."""
    b = worker._ws_buckets[index]
    shards = _local_shards(worker)
    flat = {n: t.reshape(-1) for n, t in shards.items()}
    tensors = [(f"{c.dst}@{c.dst_offset}", flat[c.src][c.src_offset: c.src_offset + c.numel]) for c in b.copies]
    meta = {"version": str(version), "receiver": str(b.receiver), "sender": str(b.sender)}
    tr = get_transport(transport)
    # Two reusable slots per sender, alternated by the driver in issue order: it keeps at most two
    # buckets in flight, so the bucket that last used this slot has been consumed.
    state, mv = tr.alloc(packed_size([(n, t.dtype, t.numel()) for n, t in tensors], meta), slot=(id(worker), slot))
    with torch.no_grad():
        pack_into(mv, tensors, meta)
    if isinstance(mv, memoryview):
        mv.release()
    return tr.publish(state, peer=b.receiver)


def sender_join(worker, host: str, port: int, world: int, rank: int, senders: int) -> int:
    """Collective transport: join the sync group as trainer rank `rank` (on its shards' device)."""
    from .transports import join_group

    device = next(iter(_local_shards(worker).values())).device
    return join_group(host, port, world, rank, senders, str(device))


def sender_close(worker) -> None:
    """Free this process's pooled transport slots (shm files would outlive a killed actor)."""
    from .transports import InProcess, SharedMemory, leave_group

    SharedMemory._cleanup()
    InProcess._pool.clear()
    leave_group()


# ---------------------------------------------------------------------------------------------------
# receiver side (inside each vLLM worker)


@dataclass
class _Session:
    version: int
    shapes: dict[str, tuple[int, ...]]
    remaining: dict[str, int]  # elements still to arrive per engine parameter
    direct: bool
    keep: bool  # verify mode: keep the assembled loaded-layout tensors
    elem: int = 4  # bytes per element of the engine dtype
    layers: dict[str, tuple[Any, str]] = field(default_factory=dict)  # param -> (module, attribute)
    layer_left: dict[int, int] = field(default_factory=dict)  # id(module) -> elements still to arrive
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    received_bytes: int = 0
    process_s: float = 0.0  # time inside vLLM's post-load processing (CPU: oneDNN repacking)


def _my_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def begin_worker(worker, per_rank: dict[int, tuple[dict, dict]], version: int, keep: bool, direct: bool | None) -> int:
    """Start receiving version `version`: `per_rank[tp_rank] = (shapes, numel per engine param)`.

    Layerwise (CPU) path: vLLM restores every layer's loaded-layout parameters on the meta device; a
    layer is materialised when its first bytes arrive, bytes are copied straight into its parameters,
    and when the layer's last byte arrives vLLM's `_layerwise_process` post-processes it (repacking) and
    copies it into the original kernel tensors, freeing the loaded-layout copy. So at most the layers
    that straddle the buckets in flight are materialised at once.
    """
    from .engine_layout import _model

    shapes, numel = per_rank[_my_rank()]
    model = _model(worker)
    if direct is None:
        direct = next(model.parameters()).device.type != "cpu"
    s = _Session(version=version, shapes=shapes, remaining=dict(numel), direct=direct, keep=keep,
                 elem=next(model.parameters()).element_size())
    if not direct:
        from vllm.model_executor.model_loader.reload import layerwise

        layerwise.initialize_layerwise_reload(model)
    for name in shapes:
        module_name, _, pname = name.rpartition(".")
        layer = model.get_submodule(module_name)
        s.layers[name] = (layer, pname)
        s.layer_left[id(layer)] = s.layer_left.get(id(layer), 0) + numel[name]
    worker._ws_session = s
    return _my_rank()


def join_worker(worker, host: str, port: int, world: int, ranks: dict[int, int], senders: int) -> int:
    """Collective transport, inside a vLLM worker: join the sync group as `ranks[tp_rank]`."""
    from .engine_layout import _model
    from .transports import join_group

    device = next(_model(worker).parameters()).device
    return join_group(host, port, world, ranks[_my_rank()], senders, str(device))


def leave_worker(worker) -> None:
    from .transports import leave_group

    leave_group()


def _dst(s: _Session, name: str) -> torch.Tensor:
    """The tensor bytes of engine parameter `name` go to (loaded layout, this rank)."""
    layer, pname = s.layers[name]
    t = getattr(layer, pname)
    if not s.direct and t.is_meta:
        from vllm.model_executor.model_loader.reload import layerwise, meta

        meta.materialize_layer(layer, layerwise.get_layerwise_info(layer))
        for n2, (l2, p2) in s.layers.items():  # padding (e.g. vocab rows) reads 0, as vLLM's loader leaves it
            if l2 is layer and s.remaining[n2] < math.prod(s.shapes[n2]):
                getattr(l2, p2).data.zero_()
        t = getattr(layer, pname)
    return t.data


def receive_worker(worker, handles: dict[int, list[Any]], transport: str) -> int:
    """Copy every run addressed to this TP rank into place; process layers that became complete."""
    s: _Session = worker._ws_session
    tr = get_transport(transport)
    n_bytes = 0
    for handle in handles.get(_my_rank(), []):
        for name, n in apply_bucket(tr.open(handle), lambda name, dtype: _dst(s, name)).items():
            n_bytes += n * s.elem
            s.remaining[name] -= n
            layer, _ = s.layers[name]
            s.layer_left[id(layer)] -= n
            if s.layer_left[id(layer)] == 0:
                _complete_layer(s, layer)
    s.received_bytes += n_bytes
    return n_bytes


def apply_bucket(buf, dst_of) -> dict[str, int]:
    """Copy every `"{param}@{offset}"` run of a packed bucket into `dst_of(param, dtype)` (flattened).

    Pure torch: returns elements written per destination. The bucket's views are dropped before
    returning, so a mapped buffer can be closed by the caller's garbage collector."""
    views, _ = unpack(buf)
    written: dict[str, int] = {}
    for key, v in views.items():
        name, _, off = key.rpartition("@")
        off = int(off)
        dst_of(name, v.dtype).view(-1)[off: off + v.numel()].copy_(v)
        written[name] = written.get(name, 0) + v.numel()
    views.clear()
    return written


def _complete_layer(s: _Session, layer) -> None:
    names = [n for n, (l2, _) in s.layers.items() if l2 is layer]
    if s.keep:
        for n in names:
            s.kept[n] = getattr(layer, s.layers[n][1]).data.detach().clone()
    if s.direct:
        return
    from vllm.model_executor.model_loader.reload import layerwise

    t0 = time.perf_counter()
    # No buffered loads: the parameters already hold the loaded layout. vLLM processes the layer
    # (quant method / CPU repack), copies into the kernel tensors and puts those back on the module.
    layerwise._layerwise_process(layer, layerwise.get_layerwise_info(layer))
    s.process_s += time.perf_counter() - t0


def finish_worker(worker) -> dict:
    """Finish the install (layers not sent keep their weights), record and acknowledge the version."""
    from .engine_layout import _model

    s: _Session = worker._ws_session
    incomplete = sorted(f"{n} ({-r:+d} elements)" for n, r in s.remaining.items() if r != 0)
    if not s.direct:
        from vllm.model_executor.model_loader.reload import layerwise

        t0 = time.perf_counter()
        layerwise.finalize_layerwise_reload(_model(worker), worker.model_runner.model_config)
        s.process_s += time.perf_counter() - t0
    del worker._ws_session
    if incomplete:
        raise RuntimeError(f"weight sync v{s.version}: parameters not fully received: {incomplete}")
    worker.rl_tpu_policy_version = s.version
    worker._ws_kept = s.kept
    return {"rank": _my_rank(), "version": s.version, "bytes": s.received_bytes, "process_s": s.process_s}


def verify_worker(worker, hf_weights) -> dict[str, float]:
    """Max |diff| per engine parameter: installed shard bytes vs vLLM's own full-tensor loader output.

    `hf_weights`: (name, tensor) pairs, or a path to a safetensors file (across vLLM's process boundary).
    Reinstalls them through vLLM's reload path (the reference) to capture the reference layout, so the
    engine ends up with the same weights either way.
    """
    from .engine_layout import snapshot_loaded_worker

    if isinstance(hf_weights, str):
        from safetensors.torch import load_file

        hf_weights = sorted(load_file(hf_weights).items())
    kept = getattr(worker, "_ws_kept", {})
    ref = snapshot_loaded_worker(worker, hf_weights)
    out = {}
    for name, r in ref.items():
        mine = kept.get(name)
        if mine is None or mine.shape != r.shape:
            out[name] = float("inf")
        else:
            out[name] = (mine.double() - r.double()).abs().max().item() if r.numel() else 0.0
    return out


def policy_version_worker(worker) -> int:
    return getattr(worker, "rl_tpu_policy_version", -1)


# ---------------------------------------------------------------------------------------------------
# driver


def _call(sender, fn, *args):
    """Call `fn(worker, *args)` on a sender: a Ray actor with `run(fn, *args)` or a local object."""
    if hasattr(sender, "run") and hasattr(sender.run, "remote"):
        return sender.run.remote(fn, *args)
    return fn(sender, *args)


def _get(x):
    if type(x).__name__ == "ObjectRef":
        import ray

        return ray.get(x)
    return x


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


def _set_version(receiver, version: int) -> None:
    """Tell the rollout actor which policy version it now serves (rollouts report it)."""
    fn = getattr(receiver, "set_policy_version", None)
    if fn is None:
        return
    _get(fn.remote(version)) if hasattr(fn, "remote") else fn(version)


def _install_order(plan: Plan, by_sender: dict[int, list[Bucket]]) -> list[tuple[int, int]]:
    """(sender, bucket) pairs in engine-parameter order across senders, so parameters complete (and
    their buffers are freed) one after another instead of after the last sender's last bucket."""
    pos = [{n: i for i, n in enumerate(shapes)} for shapes in plan.dst_shapes]

    def key(rk):
        b = by_sender[rk[0]][rk[1]]
        c = b.copies[0]
        return (pos[b.receiver][c.dst], c.dst_offset, b.receiver)

    return sorted(((r, k) for r, bs in by_sender.items() for k in range(len(bs))), key=key)


class WeightSync:
    """Plan-based resharding from trainer ranks (senders) into vLLM engines (receivers).

    `senders[r]` is trainer rank r: a Ray actor handle with `run(fn, *args)` (calls `fn(worker, *args)`),
    or a local object holding the rank's shards. `receivers[e]` is engine e: anything with
    `collective_rpc(fn, args=...)` and `reset_prefix_cache()` (a `vllm.LLM`, or a Ray actor exposing
    both; Ray handles are detected and awaited). `to_hf` is TorchTitan's `StateDictAdapter.to_hf`.
    """

    def __init__(self, specs: list[ParamSpec], to_hf, senders: list, receivers: list, *,
                 transport: str = "shm", bucket_mb: float = 64.0, engine_model_dir: str | None = None,
                 direct: bool | None = None):
        self.specs, self.to_hf, self.senders, self.receivers = specs, to_hf, senders, receivers
        self.transport, self.bucket_bytes = transport, int(bucket_mb * 2**20)
        self.engine_model_dir, self.direct = engine_model_dir, direct
        get_transport(transport)  # fail early on an unknown or unimplemented transport
        self.plan: Plan | None = None
        self.plan_seconds = 0.0
        self.version = -1

    def _rpc(self, receiver, fn, *args) -> list:
        if hasattr(receiver, "collective_rpc") and hasattr(receiver.collective_rpc, "remote"):
            import ray

            return ray.get(receiver.collective_rpc.remote(fn, args=args))
        return receiver.collective_rpc(fn, args=args)

    def _reset_cache(self, receiver) -> None:
        if hasattr(receiver.reset_prefix_cache, "remote"):
            import ray

            ray.get(receiver.reset_prefix_cache.remote())
        else:
            receiver.reset_prefix_cache()

    def build(self) -> Plan:
        """Check names/shapes against the engine's checkpoint, derive engine layouts, build the plan."""
        from .engine_layout import derive_layout_worker
        from .names import checkpoint_shapes, hf_element_map, hf_shapes

        t0 = time.perf_counter()
        trainer_hf = hf_shapes(self.specs, self.to_hf)
        if self.engine_model_dir is not None:
            check_names(trainer_hf, checkpoint_shapes(self.engine_model_dir))
        hf_order = sorted(trainer_hf.items())
        hf_map = hf_element_map(self.specs, self.to_hf)
        layouts = []
        for e, rcv in enumerate(self.receivers):
            for lay in self._rpc(rcv, derive_layout_worker, hf_order):
                layouts.append(((e, lay.tp_rank), lay))
        self.plan = build_plan(self.specs, hf_map, hf_order, layouts, self.bucket_bytes)
        for r, s in enumerate(self.senders):
            _get(_call(s, sender_setup, self.plan.for_sender(r)))
        if self.transport == "collective":
            self._form_group()
        self.plan_seconds = time.perf_counter() - t0
        return self.plan

    def _form_group(self) -> None:
        """One process group over every sender and every engine worker, for the collective transport.
        Every member must join at once, so senders (Ray actors) are called asynchronously and in-process
        engines from threads; the driver hosts the rendezvous store."""
        import concurrent.futures

        import torch.distributed as dist

        if not all(hasattr(s, "run") and hasattr(s.run, "remote") for s in self.senders):
            raise ValueError("sync.transport = 'collective' needs trainer ranks as Ray actors (each joins the "
                             "group from its own process); use 'inprocess' or 'shm' for local senders")
        import ray

        host = ray.util.get_node_ip_address()  # senders are Ray actors, so Ray is up
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        n_snd, world = len(self.senders), len(self.senders) + len(self.plan.receivers)
        futures = [s.run.remote(sender_join, host, self._store.port, world, r, n_snd)
                   for r, s in enumerate(self.senders)]
        with concurrent.futures.ThreadPoolExecutor(max(len(self.receivers), 1)) as pool:
            joins = []
            for e, rcv in enumerate(self.receivers):
                ranks = {tp: n_snd + i for i, (ee, tp) in enumerate(self.plan.receivers) if ee == e}
                joins.append(pool.submit(self._rpc, rcv, join_worker, host, self._store.port, world, ranks, n_snd))
            for j in joins:
                j.result()
        ray.get(futures)

    def sync(self, version: int, keep_for_verify: bool = False) -> SyncStats:
        """Move every bucket of the plan; returns timings and every receiver's acknowledgement."""
        plan = self.plan or self.build()
        tr = get_transport(self.transport)
        t0 = time.perf_counter()
        for e, rcv in enumerate(self.receivers):
            per_rank = {tp: (plan.dst_shapes[i], plan.dst_numel[i]) for i, (ee, tp) in enumerate(plan.receivers) if ee == e}
            self._rpc(rcv, begin_worker, per_rank, version, keep_for_verify, self.direct)
        by_sender = {r: plan.for_sender(r) for r in range(len(self.senders))}
        order = _install_order(plan, by_sender)
        issued = {r: 0 for r in by_sender}

        def pack(r: int, k: int):
            issued[r] += 1  # alternate each sender's two slots in the order buckets are issued
            return _call(self.senders[r], sender_pack, k, self.transport, version, issued[r] % 2)

        # Packs run ahead of installs, in install order, while every sender has at most two buckets
        # not yet installed: its slot (issued % 2) is then free again, and senders pack in parallel.
        pending, outstanding, ahead = {}, {r: 0 for r in by_sender}, 0
        for i, (r, k) in enumerate(order):
            while ahead < len(order) and outstanding[order[ahead][0]] < 2:
                pending[ahead] = pack(*order[ahead])
                outstanding[order[ahead][0]] += 1
                ahead += 1
            handle = _get(pending.pop(i))
            e, tp = plan.receivers[by_sender[r][k].receiver]
            self._rpc(self.receivers[e], receive_worker, {tp: [handle]}, self.transport)
            outstanding[r] -= 1
            tr.release(handle)
        acks = []
        for rcv in self.receivers:
            acks += self._rpc(rcv, finish_worker)
            self._reset_cache(rcv)
            _set_version(rcv, version)
        self.version = version
        return SyncStats(version=version, seconds=time.perf_counter() - t0, bytes=plan.nbytes,
                         buckets=len(order), acks=acks)

    def close(self) -> None:
        """Free the senders' pooled shared-memory slots (call before killing trainer actors)."""
        for snd in self.senders:
            _get(_call(snd, sender_close))
        if self.transport == "collective" and self.plan is not None:
            for rcv in self.receivers:
                self._rpc(rcv, leave_worker)
            self._store = None

    def verify(self, hf_weights) -> dict[tuple[int, str], float]:
        """After `sync(v, keep_for_verify=True)`: max |diff| per (engine, engine param) against vLLM's
        full-tensor loader fed with `hf_weights` (the trainer's full HF tensors: (name, tensor) pairs,
        or a safetensors file path where the engine runs vLLM workers in other processes)."""
        out = {}
        for e, rcv in enumerate(self.receivers):
            for res in self._rpc(rcv, verify_worker, hf_weights):
                for name, d in res.items():
                    out[(e, name)] = max(out.get((e, name), 0.0), d)
        return out
