"""Transports move one packed bucket (a safetensors buffer, see `wire`) from a sender to a receiver.

One interface, four kinds:
- `inprocess`: sender and receiver share a process; the handle is the buffer itself.
- `shm`: same host; the sender writes the bucket into a file under /dev/shm and the receiver maps it
  read-only (zero copy), then the driver unlinks it. Works across Python environments: any reader that
  can mmap a file and parse safetensors can consume it.
- `shm` into a receiver-owned region (internal route name `shm_region`, chosen per route by `WeightSync`
  when the engine rank offers one): the engine rank keeps one /dev/shm file holding all its loaded-layout
  parameters (`Region`); senders map it writable and copy their pieces straight into place, casting to
  the engine dtype, so no bucket file exists and the engine copies nothing. The handle is
  (receiver index, bucket); the bytes are already in place when it is returned.
- `ray`: cross host; the sender `ray.put`s a numpy view of the bucket and the receiver gets a read-only,
  zero-copy view from the object store.
- `collective`: torch.distributed point-to-point over one extra process group spanning the trainer
  ranks and every engine worker (`join_group`; the trainer's FSDP group and vLLM's TP group are left
  alone). The sender posts an async send of the packed bucket; the receiver receives it into a reused
  buffer. gloo on host buffers; nccl with buffers on the GPU when the members' parameters live on CUDA;
  other accelerators (TPU/XLA) fall back to gloo on host buffers and copy into the device parameters.

Invariant: a handle is small and picklable (a path, an ObjectRef wrapped in a list so Ray does not
resolve it on the way, (source rank, tag, size) for collective, or the buffer for inprocess), so the
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

    def publish(self, state: Any, peer: int | None = None) -> Any:
        """Sender: turn a filled buffer into a handle for receiver `peer` (the plan's receiver index;
        only the collective transport needs it)."""
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

    def publish(self, state, peer=None):
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

    def publish(self, state, peer=None):
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

    def publish(self, state, peer=None):
        import ray

        return [ray.put(state)]  # wrapped: Ray resolves top-level ObjectRef arguments

    def open(self, handle):
        import ray

        return memoryview(ray.get(handle[0]))

    # release: the object is freed when the driver drops the last reference to the handle


class Collective(Transport):
    """Point-to-point sends over the group made by `join_group`. Group ranks: senders first (trainer rank
    r is r), then the plan's receivers in order (receiver i is `senders + i`). A handle is
    (source rank, tag, nbytes); tags are unique per sender within a sync, so the pairing never depends
    on message order. The sender's buffer stays alive until its send completes (waited on before the
    slot is reused, or at `leave_group`); the receiver reuses one buffer for every bucket."""

    name = "collective"
    _group: dict = {}  # per process: pg, rank, senders, device, store (kept alive with the group)
    _pool: dict = {}  # slot -> uint8 tensor (sender) or "recv" -> uint8 tensor (receiver)
    _inflight: dict = {}  # slot -> Work of the last send from that slot
    _tag = 0

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
        import torch

        buf = cls._pool.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = cls._pool[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=cls._g()["device"])
        return buf[:nbytes]

    def alloc(self, nbytes, slot=None):
        import torch

        if slot is None:  # one-off buffer, kept alive with its send
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self._g()["device"])[:nbytes]
            return (buf, ("once", id(buf))), buf
        prev = self._inflight.pop(slot, None)
        if prev is not None:
            prev[0].wait()
        buf = self._buffer(slot, nbytes)
        return (buf, slot), buf

    def publish(self, state, peer=None):
        if peer is None:
            raise ValueError("collective transport: publish needs the receiver index (peer)")
        buf, key = state
        g = self._g()
        Collective._tag += 1
        self._inflight[key] = (g["pg"].send([buf], g["senders"] + peer, Collective._tag), buf)
        return (g["rank"], Collective._tag, buf.numel())

    def open(self, handle):
        src, tag, nbytes = handle
        buf = self._buffer("recv", nbytes)
        self._g()["pg"].recv([buf], src, tag).wait()
        return buf


def join_group(
    host: str, port: int, world: int, rank: int, senders: int, device: str = "cpu", timeout_s: float = 300.0
) -> int:
    """Join the weight-sync process group as `rank` of `world` (all members must call it concurrently;
    the TCP store at host:port is the driver's). nccl when `device` is CUDA, else gloo."""
    import datetime

    import torch
    import torch.distributed as dist

    leave_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(
        "rl_tpu_ws", dist.TCPStore(host, port, world + 1, is_master=False, timeout=timeout)
    )
    dev = torch.device(device)
    if dev.type == "cuda":
        pg = dist.ProcessGroupNCCL(store, rank, world)
    else:
        dev = torch.device("cpu")  # gloo moves host buffers; TPU/XLA receivers copy into device params
        pg = dist.ProcessGroupGloo(store, rank, world, timeout)
    Collective._group.update(pg=pg, rank=rank, senders=senders, device=dev, store=store)
    return rank


def leave_group() -> None:
    """Wait for this process's sends, drop its buffers and its group membership."""
    for work, _ in Collective._inflight.values():
        work.wait()
    Collective._inflight.clear()
    Collective._pool.clear()
    Collective._group.clear()


TRANSPORTS: dict[str, type[Transport]] = {
    "inprocess": InProcess,
    "shm": SharedMemory,
    "ray": RayObjectStore,
    "collective": Collective,
}


def get_transport(name: str) -> Transport:
    """A transport by `sync.transport` name, or by the internal route name `shm_region`."""
    try:
        return (SharedRegion if name == "shm_region" else TRANSPORTS[name])()
    except KeyError:
        raise ValueError(f"unknown sync.transport {name!r}; choose one of {sorted(TRANSPORTS)}") from None
