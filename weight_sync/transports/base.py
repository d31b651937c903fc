"""The transport interface every route implements, and the pooled device buffers two of them share."""

from __future__ import annotations

from typing import Any


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


def pooled(pool: dict | None, key, nbytes: int, device):
    """A uint8 device buffer of `nbytes`: `pool[key]`'s, grown when too small (reused across syncs), or a
    new one without a pool."""
    import torch

    buf = pool.get(key) if pool is not None else None
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        if pool is not None:
            pool[key] = buf
    return buf[:nbytes]
