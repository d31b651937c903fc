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
  pooled GPU bucket through a CUDA IPC handle and copies on the device (`CudaIpc`). Under `auto` a CUDA
  engine sees every GPU of its node (`rl_tpu.devices.engine_sees_node`), so every trainer rank of the node
  reaches it this way, not only one on its own GPU.
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

from .base import Transport
from .collective import Collective, check_distinct_gpus, group_backend, join_group, leave_group, wait_work
from .cuda_ipc import CudaIpc, device_uuid, local_cuda_index, visible_cuda_uuids
from .in_process import InProcess
from .ray_store import RayObjectStore
from .shm import SHM_DIR, Region, SharedMemory, SharedRegion, sweep_stale_files

__all__ = [
    "Collective",
    "CudaIpc",
    "InProcess",
    "RayObjectStore",
    "Region",
    "SharedMemory",
    "SharedRegion",
    "TRANSPORTS",
    "Transport",
    "device_uuid",
    "get_transport",
    "check_distinct_gpus",
    "group_backend",
    "join_group",
    "leave_group",
    "local_cuda_index",
    "sweep_stale_files",
    "SHM_DIR",
    "visible_cuda_uuids",
    "wait_work",
]

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
