"""Transports move one packed bucket (a safetensors buffer, see `wire`) from a sender to a receiver.

One interface, four kinds:
- `inprocess`: sender and receiver share a process; the handle is the buffer itself.
- `shm`: same host; the sender writes the bucket into a file under /dev/shm and the receiver maps it
  read-only (zero copy), then the driver unlinks it. Works across Python environments: any reader that
  can mmap a file and parse safetensors can consume it.
- `ray`: cross host; the sender `ray.put`s a numpy view of the bucket and the receiver gets a read-only,
  zero-copy view from the object store.
- `collective`: torch.distributed point-to-point (gloo here, nccl / tpu_dist on devices) needs one process
  group spanning trainer ranks and engine workers; not implemented yet (the factory raises).

Invariant: a handle is small and picklable (a path, an ObjectRef wrapped in a list so Ray does not
resolve it on the way, or the buffer for inprocess), so the driver routes handles, never bytes.
"""

from __future__ import annotations

import atexit
import mmap
import os
import uuid
from typing import Any

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class Transport:
    name = "base"

    def alloc(self, nbytes: int, slot: Any = None) -> tuple[Any, memoryview]:
        """Sender: a writable buffer of `nbytes` and the state needed to publish it. With a `slot` key
        the buffer is reused across calls (pre-faulted memory: no page-fault cost per sync); the caller
        guarantees the receiver is done with a slot before it reuses it."""
        raise NotImplementedError

    def publish(self, state: Any) -> Any:
        """Sender: turn a filled buffer into a handle for the receiver."""
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

    def publish(self, state):
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

    def publish(self, state):
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
        if "_pool_" in os.path.basename(path):
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    @classmethod
    def _cleanup(cls) -> None:
        for path, mm, _ in cls._pool.values():
            try:
                mm.close()
                os.unlink(path)
            except (OSError, BufferError):
                pass
        cls._pool.clear()


class RayObjectStore(Transport):
    name = "ray"

    def alloc(self, nbytes, slot=None):  # no pooling: ray.put copies into the object store anyway
        import numpy as np

        arr = np.empty(nbytes, dtype=np.uint8)
        return arr, memoryview(arr)

    def publish(self, state):
        import ray

        return [ray.put(state)]  # wrapped: Ray resolves top-level ObjectRef arguments

    def open(self, handle):
        import ray

        return memoryview(ray.get(handle[0]))

    # release: the object is freed when the driver drops the last reference to the handle


TRANSPORTS: dict[str, type[Transport]] = {"inprocess": InProcess, "shm": SharedMemory, "ray": RayObjectStore}


def get_transport(name: str) -> Transport:
    if name == "collective":
        raise NotImplementedError(
            "sync.transport = 'collective' is not implemented yet: it needs one torch.distributed group over "
            "trainer ranks and engine workers; use 'shm' (same host) or 'ray' (cross host)"
        )
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(f"unknown sync.transport {name!r}; choose one of {sorted(TRANSPORTS) + ['collective']}") from None
