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

import mmap
import os
import uuid
from typing import Any

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class Transport:
    name = "base"

    def alloc(self, nbytes: int) -> tuple[Any, memoryview]:
        """Sender: a writable buffer of `nbytes` and the state needed to publish it."""
        raise NotImplementedError

    def publish(self, state: Any) -> Any:
        """Sender: turn a filled buffer into a handle for the receiver."""
        raise NotImplementedError

    def open(self, handle: Any):
        """Receiver: a readable buffer (zero copy where the transport allows)."""
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        """Driver, after the receiver is done: free the bucket."""


class InProcess(Transport):
    name = "inprocess"

    def alloc(self, nbytes):
        buf = bytearray(nbytes)
        return buf, memoryview(buf)

    def publish(self, state):
        return state

    def open(self, handle):
        return handle


class SharedMemory(Transport):
    name = "shm"

    def alloc(self, nbytes):
        path = os.path.join(_SHM_DIR, f"rl_tpu_ws_{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        return (path, mm), memoryview(mm)[:nbytes]

    def publish(self, state):
        path, mm = state
        try:
            mm.close()
        except BufferError:  # a view is still alive; the mapping closes when it is collected
            pass
        return path

    def open(self, handle):
        with open(handle, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def release(self, handle):
        try:
            os.unlink(handle)
        except FileNotFoundError:
            pass


class RayObjectStore(Transport):
    name = "ray"

    def alloc(self, nbytes):
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
