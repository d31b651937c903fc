"""Transports move one packed bucket (a safetensors buffer, see `wire`) from a sender to a receiver.

One interface, five kinds:
- `inprocess`: sender and receiver share a process; the handle is the buffer itself.
- `shm`: same host; the sender writes the bucket into a file under /dev/shm and the receiver maps it
  read-only (zero copy), then the driver unlinks it. Works across Python environments: any reader that
  can mmap a file and parse safetensors can consume it.
- `shm` into a receiver-owned region (internal route name `shm_region`, chosen per route by `WeightSync`
  when the engine rank offers one): the engine rank keeps one /dev/shm file holding all its loaded-layout
  parameters (`Region`); senders map it writable and copy their pieces straight into place, casting to
  the engine dtype, so no bucket file exists and the engine copies nothing. The handle is
  (receiver index, bucket); the bytes are already in place when it is returned.
- `cuda_ipc`: same node, both sides on CUDA (`auto` picks it there): the receiver maps the sender's
  pooled GPU bucket through a CUDA IPC handle and copies on the device (`CudaIpc`).
- `ray`: cross host; the sender `ray.put`s a numpy view of the bucket and the receiver gets a read-only,
  zero-copy view from the object store.
- `collective`: torch.distributed point-to-point over one extra process group spanning the trainer
  ranks and every engine worker (`join_group`; the trainer's FSDP group and vLLM's TP group are left
  alone). The receiver posts its receive first, then the sender packs and posts its send (see
  `Collective` for why NCCL needs that order). nccl with buffers on the GPU when every member's
  parameters live on CUDA (connected eagerly); otherwise gloo on host buffers for all (TPU/XLA
  receivers copy into their device parameters).

Invariant: a handle is small and picklable (a path, an ObjectRef wrapped in a list so Ray does not
resolve it on the way, (source rank, bucket id, size) for collective, or the buffer for inprocess), so the
driver routes handles, never bytes.
"""

from __future__ import annotations

import atexit
import mmap
import os
import uuid
import weakref
from typing import Any

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class Transport:
    name = "base"

    def alloc(self, nbytes: int, slot: Any = None) -> tuple[Any, memoryview]:
        """Sender: a writable buffer of `nbytes` and the state needed to publish it. With a `slot` key
        the buffer is reused across calls (pre-faulted memory: no page-fault cost per sync); the caller
        guarantees the receiver is done with a slot before it reuses it."""
        raise NotImplementedError

    def publish(self, state: Any, peer: int | None = None, bucket: int | None = None) -> Any:
        """Sender: turn a filled buffer into a handle for receiver `peer` (the plan's receiver index) and
        `bucket` (the collective transport needs both)."""
        raise NotImplementedError

    def open(self, handle: Any):
        """Receiver: a readable buffer (zero copy where the transport allows)."""
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        """Driver, after the receiver is done: free the bucket (pooled slots stay for reuse)."""


class InProcess(Transport):
    name = "inprocess"
    _pool: dict = {}  # slot -> bytearray, per process

    def alloc(self, nbytes, slot=None):
        buf = self._pool.get(slot) if slot is not None else None
        if buf is None or len(buf) < nbytes:
            buf = bytearray(nbytes)
            if slot is not None:
                self._pool[slot] = buf
        return memoryview(buf)[:nbytes], memoryview(buf)[:nbytes]

    def publish(self, state, peer=None, bucket=None):
        return state

    def open(self, handle):
        return handle


class SharedMemory(Transport):
    """Files under /dev/shm. A handle is (path, nbytes); the file holds exactly one safetensors image
    in its first nbytes (a pooled slot file may be larger; readers map only nbytes)."""

    name = "shm"
    _pool: dict = {}  # slot -> (path, mmap, size), per process; unlinked at exit

    def alloc(self, nbytes, slot=None):
        if slot is None:
            path = os.path.join(_SHM_DIR, f"rl_tpu_ws_{uuid.uuid4().hex}")
            state = (path, self._create(path, nbytes), nbytes, False)
            return state, self.view(state)
        ent = self._pool.get(slot)
        if ent is None or ent[2] < nbytes:
            if ent is not None:
                ent[1].close()
                os.unlink(ent[0])
            _sweep_once()
            path = os.path.join(_SHM_DIR, f"rl_tpu_ws_pool_{os.getpid()}_{uuid.uuid4().hex[:8]}")
            ent = self._pool[slot] = (path, self._create(path, nbytes), nbytes)
            if len(self._pool) == 1:
                atexit.register(SharedMemory._cleanup)
        state = (ent[0], ent[1], nbytes, True)
        return state, self.view(state)

    @staticmethod
    def _create(path: str, nbytes: int) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            return mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)

    @staticmethod
    def view(state) -> memoryview:
        return memoryview(state[1])[: state[2]]

    def publish(self, state, peer=None, bucket=None):
        path, mm, nbytes, pooled = state
        if not pooled:
            try:
                mm.close()
            except BufferError:  # a view is still alive; the mapping closes when it is collected
                pass
        return (path, nbytes)

    def open(self, handle):
        path, nbytes = handle
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map all pages now: no per-page faults
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), max(nbytes, 1), flags=flags, prot=mmap.PROT_READ)

    def release(self, handle):
        path, _ = handle
        if "_pool_" not in os.path.basename(path):
            _unlink_quietly(path)

    @classmethod
    def _cleanup(cls) -> None:
        for path, mm, _ in cls._pool.values():
            try:
                mm.close()
                os.unlink(path)
            except (OSError, BufferError):
                pass
        cls._pool.clear()


class SharedRegion(Transport):
    """Route `shm_region`: the bytes are written by the sender straight into the receiver's `Region`, so
    a handle carries no buffer (opening and releasing it is nothing)."""

    name = "shm_region"

    def open(self, handle):
        return None


class Region:
    """One /dev/shm file mapped read-write and shared (`MAP_SHARED`): a receiver-owned region holding an
    engine rank's loaded-layout parameters. The engine rank creates it (zero-filled: padding reads 0),
    senders `attach` it by path. `unlink` removes the name once every sender has mapped it, so nothing
    stays under /dev/shm if a process dies; the memory goes with the last mapping."""

    _attached: dict = {}  # path -> Region, per process (senders: one mapping per receiver region)

    def __init__(self, path: str, nbytes: int, create: bool):
        import torch

        self.path, self.nbytes, self.linked = path, nbytes, True
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, max(nbytes, 1))  # tmpfs: reads as zeros until written
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault every page in now
            self.mm = mmap.mmap(fd, max(nbytes, 1), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8, count=max(nbytes, 1))

    @classmethod
    def create(cls, nbytes: int) -> Region:
        _sweep_once()
        r = cls(
            os.path.join(_SHM_DIR, f"rl_tpu_ws_region_{os.getpid()}_{uuid.uuid4().hex[:8]}"), nbytes, True
        )
        weakref.finalize(r, _unlink_quietly, r.path)  # at exit or when dropped, whichever comes first
        return r

    @classmethod
    def attach(cls, path: str, nbytes: int) -> Region:
        r = cls._attached.get(path)
        if r is None or r.nbytes != nbytes:
            r = cls._attached[path] = cls(path, nbytes, False)
        return r

    @classmethod
    def detach_except(cls, keep: set) -> None:
        """Drop this process's mappings of regions not in `keep` (their memory goes with the last one)."""
        for path in [p for p in cls._attached if p not in keep]:
            cls._attached.pop(path).close()

    def view(self, offset: int, shape, dtype):
        """A tensor of `shape` and `dtype` over the region at byte `offset` (no copy)."""
        import math

        n = math.prod(shape) * dtype.itemsize
        return self.bytes[offset : offset + n].view(dtype).view(tuple(shape))

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            _unlink_quietly(self.path)

    def close(self) -> None:
        """Unlink and drop our references; the mapping closes when no tensor views it any more."""
        self.unlink()
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # views are still alive; the mapping goes when they are collected
            pass


def sweep_stale_files(shm_dir: str = _SHM_DIR) -> list[str]:
    """Unlink the pooled slot and region files (`rl_tpu_ws_pool_PID_*`, `rl_tpu_ws_region_PID_*`) whose
    process is gone: a SIGKILLed trainer or engine never unlinks its own, and a pool is a bucket's size
    (GBs for a large model), so crash-and-resume cycles would fill /dev/shm. Only files of this user whose
    PID is not alive in this PID namespace (the one /dev/shm is shared in); returns the paths removed."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        head, _, rest = name.partition("_ws_")
        kind, _, tail = rest.partition("_")
        pid = tail.split("_", 1)[0]
        if head != "rl_tpu" or kind not in ("pool", "region") or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError:  # another process swept it first
            pass
    return removed


_SWEPT = False


def _sweep_once() -> None:
    """Before this process's first pooled slot or region: the files killed processes left go first."""
    global _SWEPT
    if not _SWEPT:
        _SWEPT = True
        sweep_stale_files()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class RayObjectStore(Transport):
    name = "ray"

    def alloc(self, nbytes, slot=None):  # no pooling: ray.put copies into the object store anyway
        import numpy as np

        arr = np.empty(nbytes, dtype=np.uint8)
        return arr, memoryview(arr)

    def publish(self, state, peer=None, bucket=None):
        import ray

        return [ray.put(state)]  # wrapped: Ray resolves top-level ObjectRef arguments

    def open(self, handle):
        import ray

        return memoryview(ray.get(handle[0]))

    # release: the object is freed when the driver drops the last reference to the handle


class Collective(Transport):
    """Point-to-point sends over the group made by `join_group`. Group ranks: senders first (trainer rank
    r is r), then the plan's receivers in order (receiver i is `senders + i`).

    Order, which NCCL needs (it matches sends to receives by posting order per pair and ignores tags): the
    receiver posts its receive for a bucket (`post`, into a reused buffer of the bucket's known size)
    before it asks the sender to pack it, and the sender's send is posted as soon as the bucket is
    packed, so no send ever waits on a receive that is not there. On NCCL every operation runs as its own
    coalesced group, which puts it on the group's communicator that `join_group` connected eagerly: a
    lone p2p op would build a two-rank communicator lazily, blocking until the peer does the same, and
    the peer is waiting for our answer. gloo runs the same order and matches by tag (the bucket id), so
    the default CPU suite exercises it. Waits are bounded (`timeout_s` of the group) and name the peer.

    A handle is (source rank, bucket id, nbytes); the receiver checks the bucket id in the header too,
    so a broken order fails loudly instead of installing the wrong bytes. The sender's buffer stays alive
    until its send completes (waited on before the slot is reused, or at `leave_group`)."""

    name = "collective"
    _group: dict = {}  # per process: pg, rank, senders, device, coalesce, timeout_s, store
    _pool: dict = {}  # slot -> uint8 tensor (sender) or ("recv", slot) -> uint8 tensor (receiver)
    _inflight: dict = {}  # slot -> (Work of the last send from that slot, buffer, receiver rank)
    _posted: dict = {}  # (source rank, bucket id) -> (Work of the posted receive, buffer, slot)

    @classmethod
    def _g(cls) -> dict:
        if not cls._group:
            raise RuntimeError(
                "collective weight sync: this process has not joined the sync group "
                "(WeightSync.build() forms it; was the group closed?)"
            )
        return cls._group

    @classmethod
    def _buffer(cls, key, nbytes: int):
        return _pooled(cls._pool, key, nbytes, cls._g()["device"])

    @classmethod
    def _p2p(cls, op: str, buf, peer: int, tag: int):
        g = cls._g()
        pg = g["pg"]
        if not g["coalesce"]:
            return getattr(pg, op)([buf], peer, tag)
        pg._start_coalescing(g["device"])
        getattr(pg, op)([buf], peer, tag)
        return pg._end_coalescing(g["device"])

    def alloc(self, nbytes, slot=None):
        if slot is None:  # one-off buffer, kept alive with its send
            buf = _pooled(None, None, nbytes, self._g()["device"])
            return (buf, ("once", id(buf))), buf
        prev = self._inflight.pop(slot, None)
        if prev is not None:
            wait_work(prev[0], self._g()["timeout_s"], f"the send to sync group rank {prev[2]}")
        buf = self._buffer(slot, nbytes)
        return (buf, slot), buf

    def publish(self, state, peer=None, bucket=None):
        if peer is None or bucket is None:
            raise ValueError("collective transport: publish needs the receiver index (peer) and the bucket")
        buf, key = state
        g = self._g()
        dst = g["senders"] + peer
        self._inflight[key] = (self._p2p("send", buf, dst, bucket), buf, dst)
        return (g["rank"], bucket, buf.numel())

    @classmethod
    def post(cls, src: int, bucket: int, nbytes: int, slot) -> None:
        """Receiver: post the receive of `bucket` (`nbytes` packed) from sync group rank `src` into the
        reused buffer of `slot`, before the sender is asked for it."""
        if (src, bucket) in cls._posted or any(x[2] == slot for x in cls._posted.values()):
            raise RuntimeError(
                f"collective weight sync: bucket {bucket} from rank {src} posted twice, or into the "
                f"buffer of slot {slot} while a receive into it is still open"
            )
        buf = cls._buffer(("recv", slot), nbytes)
        cls._posted[(src, bucket)] = (cls._p2p("recv", buf, src, bucket), buf, slot)

    def open(self, handle):
        src, bucket, nbytes = handle
        try:
            work, buf, _ = self._posted.pop((src, bucket))
        except KeyError:
            raise RuntimeError(
                f"collective weight sync: bucket {bucket} from trainer rank {src} arrived with no receive "
                "posted for it (Collective.post must come before the sender packs)"
            ) from None
        if buf.numel() != nbytes:
            raise RuntimeError(
                f"collective weight sync: bucket {bucket} from trainer rank {src} is {nbytes} bytes, the "
                f"receive was posted for {buf.numel()} (do sender and receiver hold the same plan?)"
            )
        wait_work(work, self._g()["timeout_s"], f"bucket {bucket} from trainer rank {src}")
        return buf


class CudaIpc(Transport):
    """Route `cuda_ipc`: sender and receiver on one node, both on CUDA. The sender packs into a pooled
    buffer on its GPU and hands out a CUDA IPC handle of it (torch's own: `reduce_tensor` /
    `rebuild_cuda_tensor`, with its cross-process reference counting and the producer's stream event);
    the receiver maps that memory and copies the pieces into its parameters on the device: no host copy
    at all. The handle is plain values (vLLM's RPC carries nothing else) and names the GPU by UUID, since
    the two processes may number their visible devices differently. The receiver synchronises its stream
    before acknowledging a round, so a slot is free when the sender reuses it two buckets later."""

    name = "cuda_ipc"
    _pool: dict = {}  # slot -> uint8 CUDA tensor, per process

    def alloc(self, nbytes, slot=None):
        import torch

        dev = torch.device("cuda", torch.cuda.current_device())
        buf = _pooled(self._pool if slot is not None else None, slot, nbytes, dev)
        return buf, buf

    def publish(self, state, peer=None, bucket=None):
        import inspect

        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        rebuild, args = reduce_tensor(state)
        a = inspect.signature(rebuild_cuda_tensor).bind(*args).arguments
        return {
            "uuid": device_uuid(a["storage_device"]),
            "nbytes": int(state.numel()),
            "offset": int(a["tensor_offset"]),
            "storage": [a["storage_handle"], int(a["storage_size_bytes"]), int(a["storage_offset_bytes"])],
            "ref": [a["ref_counter_handle"], int(a["ref_counter_offset"])],
            "event": [a["event_handle"], bool(a["event_sync_required"])],
        }

    def open(self, handle):
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = local_cuda_index(handle["uuid"])
        (storage, size, offset), (ref, ref_offset), (event, sync) = (
            handle["storage"],
            handle["ref"],
            handle["event"],
        )
        return rebuild_cuda_tensor(
            torch.Tensor,
            (handle["nbytes"],),
            (1,),
            handle["offset"],
            type(torch.empty(0)._typed_storage()),
            torch.uint8,
            index,
            storage,
            size,
            offset,
            False,
            ref,
            ref_offset,
            event,
            sync,
        )

    @classmethod
    def close(cls) -> None:
        cls._pool.clear()


def _pooled(pool: dict | None, key, nbytes: int, device):
    """A uint8 device buffer of `nbytes`: `pool[key]`'s, grown when too small (reused across syncs), or a
    new one without a pool."""
    import torch

    buf = pool.get(key) if pool is not None else None
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        if pool is not None:
            pool[key] = buf
    return buf[:nbytes]


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index` (stable across processes' device numberings)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def visible_cuda_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by local index ([] without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def local_cuda_index(uuid: str) -> int:
    """This process's index of the CUDA device with `uuid`; an error naming what it sees otherwise."""
    seen = visible_cuda_uuids()
    if uuid not in seen:
        raise RuntimeError(
            f"weight sync (cuda_ipc): the sender's GPU {uuid} is not visible to this process (it sees "
            f"{seen}); the route needs both on one node with that GPU visible: use sync.transport=shm"
        )
    return seen.index(uuid)


def wait_work(work, timeout_s: float, what: str) -> None:
    """Wait for a torch.distributed Work at most `timeout_s`, raising a `TimeoutError` that says `what`
    never completed. NCCL's `wait` only orders streams, so its completion is polled; gloo's point-to-point
    work completes only inside `wait`, which takes the timeout itself."""
    import datetime
    import time

    if Collective._group.get("coalesce"):  # nccl
        deadline, delay = time.monotonic() + timeout_s, 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise _timed_out(what, timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if "imed out" in str(e) or "imeout" in str(e):
            raise _timed_out(what, timeout_s) from e
        raise RuntimeError(f"weight sync (collective transport): {what} failed: {e}") from e


def _timed_out(what: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(
        f"weight sync (collective transport): {what} did not complete within {timeout_s:.0f} s; "
        "is that process alive?"
    )


def group_backend(devices: list[str]) -> str:
    """One backend for every member of the sync group: nccl only if every member's parameters are on
    CUDA (members of one group cannot mix backends), else gloo on host buffers (CUDA members stage
    through host memory; TPU/XLA receivers copy into their device parameters)."""
    import torch

    return "nccl" if devices and all(torch.device(d).type == "cuda" for d in devices) else "gloo"


def join_group(
    host: str,
    port: int,
    world: int,
    rank: int,
    senders: int,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 300.0,
) -> int:
    """Join the weight-sync process group as `rank` of `world` (all members must call it concurrently;
    the TCP store at host:port is the driver's). `backend` is the group's (`group_backend`); with nccl
    the communicator is connected now on `device` (every member is in this call), not at the first op."""
    import datetime

    import torch
    import torch.distributed as dist

    leave_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(
        "rl_tpu_ws", dist.TCPStore(host, port, world + 1, is_master=False, timeout=timeout)
    )
    if backend == "nccl":
        dev = torch.device(device)
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        pg.eager_connect_single_device(dev)
    elif backend == "gloo":
        dev = torch.device("cpu")
        pg = dist.ProcessGroupGloo(store, rank, world, timeout)
    else:
        raise ValueError(f"weight sync group backend {backend!r}: choose nccl or gloo")
    Collective._group.update(
        pg=pg,
        rank=rank,
        senders=senders,
        device=dev,
        coalesce=backend == "nccl",
        timeout_s=timeout_s,
        store=store,
    )
    return rank


def leave_group() -> None:
    """Wait for this process's sends, drop its buffers, posted receives and its group membership."""
    timeout = Collective._group.get("timeout_s", 300.0)
    for work, _, dst in Collective._inflight.values():
        wait_work(work, timeout, f"the send to sync group rank {dst}")
    Collective._inflight.clear()
    Collective._posted.clear()
    Collective._pool.clear()
    Collective._group.clear()


TRANSPORTS: dict[str, type[Transport]] = {
    "inprocess": InProcess,
    "shm": SharedMemory,
    "ray": RayObjectStore,
    "collective": Collective,
    "cuda_ipc": CudaIpc,
}


def get_transport(name: str) -> Transport:
    """A transport by `sync.transport` name, or by the internal route name `shm_region`."""
    try:
        return (SharedRegion if name == "shm_region" else TRANSPORTS[name])()
    except KeyError:
        raise ValueError(f"unknown sync.transport {name!r}; choose one of {sorted(TRANSPORTS)}") from None
