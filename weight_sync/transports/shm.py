"""`shm`: bucket files under /dev/shm mapped read-only by the receiver, and `shm_region`: the receiver's own
region the senders write into; the sweep of files left by dead processes."""

from __future__ import annotations

import atexit
import mmap
import os
import tempfile
import uuid
import weakref

from .base import Transport

# where this project puts files other processes map or read: RAM-backed where the machine has it
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedMemory(Transport):
    """Files under /dev/shm. A handle is (path, nbytes); the file holds exactly one safetensors image
    in its first nbytes (a pooled slot file may be larger; readers map only nbytes)."""

    name = "shm"
    _pool: dict = {}  # slot -> (path, mmap, size), per process; unlinked at exit

    def alloc(self, nbytes, slot=None):
        if slot is None:
            path = os.path.join(SHM_DIR, f"rl_tpu_ws_{uuid.uuid4().hex}")
            state = (path, self._create(path, nbytes), nbytes, False)
            return state, self.view(state)
        ent = self._pool.get(slot)
        if ent is None or ent[2] < nbytes:
            if ent is not None:
                ent[1].close()
                os.unlink(ent[0])
            _sweep_once()
            path = os.path.join(SHM_DIR, f"rl_tpu_ws_pool_{os.getpid()}_{uuid.uuid4().hex[:8]}")
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
        r = cls(os.path.join(SHM_DIR, f"rl_tpu_ws_region_{os.getpid()}_{uuid.uuid4().hex[:8]}"), nbytes, True)
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


def sweep_stale_files(shm_dir: str = SHM_DIR) -> list[str]:
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
