"""`cuda_ipc`: same node, both sides on CUDA; the receiver maps the sender's pooled GPU bucket by IPC handle."""

from __future__ import annotations

from .base import Transport, pooled


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
        buf = pooled(self._pool if slot is not None else None, slot, nbytes, dev)
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
