"""`SyncSender`: the trainer rank's side of the weight sync, taken on whole by the trainer actor (a mixin).

The host class provides `ws_shards()`: this rank's local shards by TorchTitan name, without copies
(DTensor `to_local()` views of the live parameters, `fsdp_local_shards`). The driver (`WeightSync`)
calls `ws_setup` / `ws_regions` once per plan; receivers call `ws_pack` for each bucket they pull.

Invariants: a bucket's pieces are packed in plan order; a pooled slot is reused only two buckets later
(the receiver keeps at most two rounds in flight, so what last used it is consumed); route
`shm_region` writes straight into the receiver's region in the engine's dtype and returns no buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .calls import node_id
from .rows import as_2d, rows_cols
from .transports import (
    CudaIpc,
    InProcess,
    Region,
    SharedMemory,
    device_uuid,
    get_transport,
    join_group,
    leave_group,
)
from .wire import begin_pack, bucket_meta, bucket_nbytes


@dataclass
class _SenderState:
    names: list[str] = field(default_factory=list)  # TorchTitan names by the plan's source index
    buckets: dict[int, np.ndarray] = field(default_factory=dict)  # bucket -> source pieces [k, 5]
    dtypes: dict[int, torch.dtype] = field(default_factory=dict)  # bucket -> wire dtype (else the shards')
    regions: dict[int, dict] = field(default_factory=dict)  # plan receiver index -> its region table
    dst: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # bucket -> (receiver, pieces)
    views: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (receiver, param) -> view


class SyncSender:
    """Mixin for a trainer rank: packs this rank's buckets of the plan. Needs `ws_shards()`."""

    def ws_shards(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("a SyncSender's host class provides ws_shards()")

    @property
    def _ws_send(self) -> _SenderState:
        st = self.__dict__.get("_ws_sender_state")
        if st is None:
            st = self.__dict__["_ws_sender_state"] = _SenderState()
        return st

    def ws_setup(
        self, names: list[str], buckets: dict[int, np.ndarray], dtypes: dict[int, str] | None = None
    ) -> int:
        """Keep this rank's buckets (`SyncPlan.for_sender`) and the dtype each travels in
        (`SyncPlan.sender_dtypes`: the receiver's wire dtype; without it, the shards' own)."""
        st = self._ws_send
        st.names, st.buckets = list(names), buckets
        st.dtypes = {int(b): getattr(torch, d) for b, d in (dtypes or {}).items()}
        self.ws_regions({i: None for i in st.regions}, {})
        return len(buckets)

    def ws_regions(self, regions: dict[int, dict | None], dst: dict[int, tuple[int, np.ndarray]]) -> int:
        """Receiver regions this rank writes into. `regions[i]`: plan receiver i's region table ({path,
        nbytes, params: [[offset, shape, dtype], ...] by the receiver's param index}) or None (none any
        more); `dst[bucket]`: (i, the pieces' destinations `[k, 5]` (dst, dst_row, dst_col, nrows, ncols)
        in the order of the bucket's source pieces), replacing those of every receiver named in
        `regions`. Each region is mapped now, so its engine may unlink the file's name at its first sync."""
        st = self._ws_send
        for i, info in regions.items():
            st.regions.pop(int(i), None)
            if info:
                st.regions[int(i)] = info
        st.dst = {b: v for b, v in st.dst.items() if v[0] not in regions}
        st.dst.update({int(b): (int(i), np.asarray(p)) for b, (i, p) in dst.items()})
        st.views = {}
        for info in st.regions.values():
            Region.attach(info["path"], int(info["nbytes"]))
        Region.detach_except({info["path"] for info in st.regions.values()})
        return len(st.dst)

    def ws_pack(self, bucket: int, transport: str, version: int, slot: Any = None) -> Any:
        """Pack `bucket` into the transport's reusable `slot` and return its handle. Route `shm_region`:
        the pieces go straight into the receiver's region (no slot); the handle is (receiver, bucket)."""
        if transport == "shm_region":
            return self._ws_write_region(bucket)
        pieces = self._ws_send.buckets[bucket]
        shards = self.ws_shards()
        total = int((pieces[:, 3] * pieces[:, 4]).sum())
        dtype = self._ws_send.dtypes.get(bucket) or next(iter(shards.values())).dtype
        tr = get_transport(transport)
        # the receiver computes the same size with `bucket_nbytes` (the collective transport posts with it)
        state, buf = tr.alloc(bucket_nbytes(dtype, total, version, bucket), slot=slot)
        data = begin_pack(buf, "data", dtype, total, bucket_meta(version, bucket))
        off = 0
        with torch.no_grad():
            for piece in self._ws_pieces(bucket, shards):  # cast to the wire dtype as it is copied
                n = piece.numel()
                data[off : off + n].view(piece.shape).copy_(piece)
                off += n
        del data
        if isinstance(buf, memoryview):
            buf.release()
        return tr.publish(state, peer=slot[0] if isinstance(slot, tuple) else None, bucket=bucket)

    def ws_node(self) -> str:
        return node_id()

    def ws_device(self) -> str:
        """Where this rank's shards live (the collective transport's group picks its backend from it)."""
        return str(next(iter(self.ws_shards().values())).device)

    def ws_cuda_uuid(self) -> str | None:
        """The UUID of the GPU this rank's shards live on (None off CUDA): the `cuda_ipc` route's test."""
        dev = next(iter(self.ws_shards().values())).device
        if dev.type != "cuda":
            return None
        return device_uuid(dev.index if dev.index is not None else torch.cuda.current_device())

    def ws_join(self, host: str, port: int, world: int, rank: int, senders: int, backend: str) -> int:
        """Collective transport: join the sync group as `rank` (senders are ranks 0 .. senders - 1)."""
        return join_group(host, port, world, rank, senders, backend, self.ws_device())

    def ws_close(self) -> None:
        """Free this process's pooled transport slots (shm files would outlive a killed actor) and unmap
        the receiver regions."""
        self.ws_regions({i: None for i in self._ws_send.regions}, {})
        SharedMemory._cleanup()
        InProcess._pool.clear()
        CudaIpc.close()
        leave_group()

    def _ws_pieces(self, bucket: int, shards: dict[str, torch.Tensor]) -> Iterator[torch.Tensor]:
        """`bucket`'s source pieces in order, as 2-D views of this rank's shards (no copies)."""
        st = self._ws_send
        views: dict[int, torch.Tensor] = {}
        for src, r, c, nr, nc in st.buckets[bucket].tolist():
            v = views.get(src)
            if v is None:
                v = views[src] = as_2d(shards[st.names[src]])
            yield v[r : r + nr, c : c + nc]

    def _ws_region_view(self, i: int, d: int) -> torch.Tensor:
        st = self._ws_send
        v = st.views.get((i, d))
        if v is None:
            info = st.regions[i]
            off, shape, dtype = info["params"][d]
            reg = Region.attach(info["path"], int(info["nbytes"]))
            v = reg.view(int(off), shape, getattr(torch, dtype)).view(rows_cols(tuple(shape)))
            st.views[(i, d)] = v
        return v

    def _ws_write_region(self, bucket: int) -> tuple[int, int]:
        """Copy `bucket`'s pieces straight into the receiver's region (engine dtype); return the handle."""
        st = self._ws_send
        if bucket not in st.dst:
            raise RuntimeError(
                f"weight sync: bucket {bucket} is routed into a receiver region this rank was not "
                "given (WeightSync.build / replace_receiver hands them out)"
            )
        i, dst = st.dst[bucket]
        with torch.no_grad():
            for piece, (d, dr, dc, nr, nc) in zip(self._ws_pieces(bucket, self.ws_shards()), dst.tolist()):
                self._ws_region_view(i, d)[dr : dr + nr, dc : dc + nc].copy_(piece)
        return (i, bucket)


def fsdp_local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A TorchTitan model's local shards (FSDP2 resharded first: it swaps in unsharded params between
    forward and backward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        # an activation-checkpointed block's wrapper adds this to its parameters' names (trainer/parallel.py)
        out[name.replace("_checkpoint_wrapped_module.", "")] = t.to_local() if hasattr(t, "to_local") else t
    return out


class LocalSender(SyncSender):
    """A sender around a function returning shards, outside any trainer actor (benches, tests)."""

    def __init__(self, shards):
        self._shards = shards

    def ws_shards(self) -> dict[str, torch.Tensor]:
        return self._shards()
