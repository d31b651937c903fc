"""The resharding plan: which rows each trainer rank sends to each engine rank. Pure numpy.

Inputs (static metadata, computed once per (trainer layout, engine layout)):
- trainer specs (`ParamSpec`: TorchTitan name, global shape, placements over the trainer mesh);
- the TorchTitan -> HF row map (`names.hf_row_map`: identity for Qwen3, a row permutation for Llama q/k);
- one `EngineLayout` per receiver (engine, TP rank): row runs saying which HF rows and columns vLLM's own
  loader put into each engine parameter (`engine_layout`).

Composing the three gives *pieces*: `nrows x ncols` blocks copied from a sender's local shard (2-D view,
`rows.rows_cols`) into an engine parameter's loaded layout. Pieces are ordered by engine parameter
(install order, so layers complete one after another), grouped per (receiver, sender) stream and cut at
row boundaries into buckets of about `bucket_bytes` (a bucket exceeds it by less than one row).

Invariants: every engine element that vLLM's loader fills is covered by exactly one piece; a receiver gets
exactly the bytes of its shard (no full gather); the plan holds int64 tables whose size grows with the
number of tensors, ranks and row permutations, not elements. Supported trainer placements: Replicate()
and Shard(0) on each mesh dim (FSDP2 / HSDP, nested in mesh-dim order as DTensor does), and FSDP2's
`_StridedShard(0, sf)` in front of Shard(0) dims whose sizes multiply to `sf` (experts under expert
parallelism: EP splits dim 0 first, FSDP then splits each EP rank's block); a replicated source is read
from mesh coordinate 0.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

import numpy as np

from .rows import rows_cols, split_at
from .specs import ParamSpec

# columns of `SyncPlan.pieces`
PIECE_COLS = ("bucket", "sender", "src", "src_row", "src_col", "dst", "dst_row", "dst_col", "nrows", "ncols")
B, SND, SRC, SROW, SCOL, DST, DROW, DCOL, NR, NC = range(len(PIECE_COLS))


@dataclass
class SyncPlan:
    titan_names: list[str]  # `src` indexes this list
    engine_ranks: list[tuple[int, int]]  # (engine index, tp rank): the plan's receivers, by index
    dst_names: list[list[str]]  # per receiver: engine params in install order; `dst` indexes it
    dst_shapes: list[dict[str, tuple[int, ...]]]  # per receiver: loaded-layout shape
    dst_numel: list[dict[str, int]]  # per receiver: elements each engine param receives
    src_dtype: str  # trainer parameter dtype
    dtype: str  # engine parameter dtype (of the first receiver; `wire_dtypes` has each one's)
    pieces: np.ndarray  # int64 [n, len(PIECE_COLS)], sorted by bucket then install order
    buckets: np.ndarray  # int64 [nb, 3]: receiver, sender, bytes on the wire; row i is bucket i
    wire_dtypes: list[str] = field(default_factory=list)  # per receiver: the dtype its buckets carry

    @property
    def nbytes(self) -> int:
        return int(self.buckets[:, 2].sum()) if self.buckets.size else 0

    def _bucket_slices(self) -> np.ndarray:
        return np.searchsorted(self.pieces[:, B], np.arange(len(self.buckets) + 1))

    def for_sender(self, rank: int) -> dict[int, np.ndarray]:
        """Bucket id -> pieces (src, src_row, src_col, nrows, ncols) that sender `rank` packs, in order."""
        cut = self._bucket_slices()
        return {
            int(b): self.pieces[cut[b] : cut[b + 1]][:, [SRC, SROW, SCOL, NR, NC]]
            for b in np.flatnonzero(self.buckets[:, 1] == rank)
        }

    def sender_dtypes(self, rank: int) -> dict[int, str]:
        """Bucket id -> the dtype sender `rank` packs it in (its receiver's wire dtype)."""
        return {int(b): self.bucket_dtype(b) for b in np.flatnonzero(self.buckets[:, 1] == rank)}

    def bucket_dtype(self, b: int) -> str:
        """The dtype bucket `b`'s pieces travel in: its receiver's `wire_dtype`."""
        return self.wire_dtypes[int(self.buckets[b, 0])] if self.wire_dtypes else self.src_dtype

    def for_receiver(self, i: int) -> list[tuple[int, int, np.ndarray]]:
        """(bucket id, sender, pieces (dst, dst_row, dst_col, nrows, ncols)) of receiver `i`, in install
        order across senders: each bucket by its first piece, so parameters complete one after another."""
        cut = self._bucket_slices()
        ids = np.flatnonzero(self.buckets[:, 0] == i)
        firsts = self.pieces[cut[ids]] if ids.size else np.zeros((0, len(PIECE_COLS)), dtype=np.int64)
        order = np.lexsort((firsts[:, DCOL], firsts[:, DROW], firsts[:, DST])) if ids.size else []
        return [
            (
                int(ids[k]),
                int(self.buckets[ids[k], 1]),
                self.pieces[cut[ids[k]] : cut[ids[k] + 1]][:, [DST, DROW, DCOL, NR, NC]],
            )
            for k in order
        ]


class PlanError(ValueError):
    """Names or shapes that do not line up; the message lists every problem at once."""


def owners(spec: ParamSpec) -> list[tuple[int, int, int]]:
    """(trainer rank, first row, end row) of the 2-D view each source rank holds, DTensor semantics:
    each Shard(0) mesh dim chunks the current dim-0 range with torch.chunk sizes (ceil), in mesh-dim
    order, except that a `_StridedShard(0, sf)` dim chunks after the Shard(0) dims that follow it (their
    sizes multiply to `sf`; dim 0 must then divide evenly); a Replicate() dim is read from coordinate 0
    only. Ranks holding nothing are left out. The rank at a mesh coordinate is `spec.mesh_ranks`'."""
    d0 = spec.shape[0] if spec.shape else 1
    per = rows_cols(spec.shape)[0] // max(d0, 1)  # 2-D rows per dim-0 index
    if not spec.mesh_shape:
        return [(0, 0, rows_cols(spec.shape)[0])]
    order = _chunk_order(spec, d0)
    out = []
    for coord in itertools.product(*(range(n) for n in spec.mesh_shape)):
        lo, hi = 0, d0
        source = all(c == 0 for c, p in zip(coord, spec.placements) if p in ("R", "Replicate()"))
        for i in order:
            c, n = coord[i], spec.mesh_shape[i]
            ch = math.ceil((hi - lo) / n) if hi > lo else 0
            lo, hi = min(lo + c * ch, hi), min(lo + (c + 1) * ch, hi)
        if source and hi > lo:
            flat = int(np.ravel_multi_index(coord, spec.mesh_shape))
            rank = spec.mesh_ranks[flat] if spec.mesh_ranks else flat
            out.append((rank, lo * per, hi * per))
    return out


_SHARD0 = ("S(0)", "Shard(0)", "Shard(dim=0)")
_STRIDED0 = re.compile(r"_S(?:tridedShard)?\((?:dim=)?0, (?:sf=|split_factor=)?(\d+)\)")  # str() / repr()


def _chunk_order(spec: ParamSpec, d0: int) -> list[int]:
    """The mesh dims that chunk dim 0, in the order they chunk it (see `owners`)."""
    kinds = []
    for p in spec.placements:
        if p in _SHARD0:
            kinds.append(("shard", 0))
        elif p in ("R", "Replicate()"):
            kinds.append(("replicate", 0))
        elif m := _STRIDED0.fullmatch(p):
            kinds.append(("strided", int(m.group(1))))
        else:
            raise NotImplementedError(
                f"{spec.name}: placement {p} (weight sync supports Shard(0), Replicate() and "
                "_StridedShard(0) before Shard(0))"
            )
    order: list[int] = []
    pending: list[tuple[int, int]] = []  # strided dims waiting for the Shard(0) dims behind them
    for i, (kind, sf) in enumerate(kinds):
        if kind == "strided":
            pending.append((i, sf))
        elif kind == "shard":
            order.append(i)
    if pending:
        for i, sf in pending:
            after = [j for j in order if j > i]
            if math.prod(spec.mesh_shape[j] for j in after) != sf:
                raise NotImplementedError(
                    f"{spec.name}: placement {spec.placements[i]} with Shard(0) mesh dims of sizes "
                    f"{[spec.mesh_shape[j] for j in after]} behind it (their product must be sf)"
                )
        order = [j for j in order if j not in {i for i, _ in pending}] + [i for i, _ in pending]
        if d0 % math.prod(spec.mesh_shape[j] for j in order):
            raise NotImplementedError(
                f"{spec.name}: dim 0 ({d0}) does not split evenly over {spec.placements}"
            )
    return order


def build_plan(
    specs: list[ParamSpec],
    row_map: dict[str, tuple[int, np.ndarray]],
    hf_order: list[tuple[str, tuple[int, ...]]],
    layouts: list[tuple[tuple[int, int], object]],
    bucket_bytes: int,
) -> SyncPlan:
    """Compose trainer placements, the HF row map and engine layouts into bucketed pieces.

    `row_map`: HF name -> (index into `specs`, runs (HF row, TorchTitan row, nrows)).
    `hf_order`: the (HF name, shape) list whose positions the engine layouts' `hf` column refers to.
    `layouts`: ((engine index, tp rank), EngineLayout) per receiver.
    """
    dtypes = {s.dtype for s in specs}
    if len(dtypes) != 1:
        raise PlanError(f"trainer parameters have mixed dtypes {sorted(dtypes)}; the wire carries one dtype")
    src_dtype = dtypes.pop()
    wire = [wire_dtype(src_dtype, layout.dtype) for _, layout in layouts]
    elem = np.array([_itemsize(d) for d in wire] or [_itemsize(src_dtype)], dtype=np.int64)

    # HF rows (global numbering) -> TorchTitan rows (global numbering)
    hf_rows = np.cumsum([0] + [rows_cols(s)[0] for _, s in hf_order])
    t_rows = np.cumsum([0] + [rows_cols(s.shape)[0] for s in specs])
    m_parts = []
    for h, (name, _) in enumerate(hf_order):
        tid, runs = row_map[name]
        m_parts.append(np.stack([hf_rows[h] + runs[:, 0], t_rows[tid] + runs[:, 1]], axis=1))
    m = np.concatenate(m_parts) if m_parts else np.zeros((0, 2), dtype=np.int64)
    m = m[np.argsort(m[:, 0], kind="stable")]
    # TorchTitan rows (global) -> (sender, first row of its local shard)
    o = np.array(
        [(t_rows[t] + lo, r) for t, s in enumerate(specs) for r, lo, _ in owners(s)], dtype=np.int64
    ).reshape(-1, 2)
    o = o[np.argsort(o[:, 0], kind="stable")]

    receivers, dst_names, dst_shapes, dst_numel, all_pieces = [], [], [], [], []
    for ri, (key, layout) in enumerate(layouts):
        receivers.append(key)
        names = list(layout.runs)
        dst_names.append(names)
        dst_shapes.append(dict(layout.shapes))
        runs = [np.asarray(layout.runs[n], dtype=np.int64).reshape(-1, 7) for n in names]
        dst_numel.append({n: int((r[:, 2] * r[:, 3]).sum()) for n, r in zip(names, runs)})
        e = np.concatenate(runs) if runs else np.zeros((0, 7), dtype=np.int64)
        pid = np.repeat(np.arange(len(names)), [r.shape[0] for r in runs])
        # 1. split engine runs where the HF -> TorchTitan row map breaks
        g = hf_rows[e[:, 4]] + e[:, 5]
        i1, lo1, n1 = split_at(g, e[:, 2], m[:, 0])
        k1 = np.searchsorted(m[:, 0], lo1, side="right") - 1
        trow_g = m[k1, 1] + (lo1 - m[k1, 0])
        # 2. split again where the owning trainer rank changes
        i2, lo2, n2 = split_at(trow_g, n1, o[:, 0])
        k2 = np.searchsorted(o[:, 0], lo2, side="right") - 1
        src = np.searchsorted(t_rows, lo2, side="right") - 1
        src_row = lo2 - o[k2, 0]
        base = i1[i2]
        dst_row = e[base, 0] + (lo2 - trow_g[i2]) + (lo1[i2] - g[base])
        pieces = np.stack(
            [
                np.full(i2.size, ri),
                o[k2, 1],
                src,
                src_row,
                e[base, 6],
                pid[base],
                dst_row,
                e[base, 1],
                n2,
                e[base, 3],
            ],
            axis=1,
        )
        all_pieces.append(pieces)
    pieces = np.concatenate(all_pieces) if all_pieces else np.zeros((0, len(PIECE_COLS)), dtype=np.int64)
    pieces, buckets = _bucketize(pieces, bucket_bytes, elem)
    return SyncPlan(
        titan_names=[s.name for s in specs],
        engine_ranks=receivers,
        dst_names=dst_names,
        dst_shapes=dst_shapes,
        dst_numel=dst_numel,
        src_dtype=src_dtype,
        dtype=layouts[0][1].dtype if layouts else src_dtype,
        pieces=pieces,
        buckets=buckets,
        wire_dtypes=wire,
    )


def _itemsize(dtype: str) -> int:
    return np.dtype({"bfloat16": "uint16"}.get(dtype, dtype)).itemsize


def wire_dtype(src_dtype: str, engine_dtype: str) -> str:
    """What a receiver's buckets carry: the engine's dtype where it is narrower than the trainer's (a bf16
    engine fed by an fp32 trainer gets bf16, cast on the sender: half the bytes, the same values as a
    cast on arrival), else the trainer's (widening on the wire would only add bytes)."""
    return engine_dtype if _itemsize(engine_dtype) < _itemsize(src_dtype) else src_dtype


def _bucketize(pieces: np.ndarray, bucket_bytes: int, elem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Order pieces per (receiver, sender) stream in install order, cut each stream into buckets of about
    `bucket_bytes` at row boundaries. Input column 0 holds the receiver; output column 0 the bucket id.
    `elem`: bytes per element on the wire, per receiver."""
    if pieces.shape[0] == 0:
        return pieces, np.zeros((0, 3), dtype=np.int64)
    p = pieces[np.lexsort((pieces[:, DCOL], pieces[:, DROW], pieces[:, DST], pieces[:, SND], pieces[:, B]))]
    elem = elem[p[:, B]]
    row_bytes = p[:, NC] * elem
    size = p[:, NR] * row_bytes
    stream = p[:, B] * (p[:, SND].max() + 1) + p[:, SND]
    new = np.ones(p.shape[0], dtype=bool)
    new[1:] = stream[1:] != stream[:-1]
    cum = np.cumsum(size)
    start = cum - size - (cum - size)[np.maximum.accumulate(np.where(new, np.arange(p.shape[0]), 0))]
    cap = max(int(bucket_bytes), 1)
    # a piece [a, a + size) of its stream crosses bucket boundaries k * cap; it is cut at the row holding each
    k0, k1 = start // cap, np.maximum(start + size - 1, start) // cap
    count = k1 - k0 + 1
    idx = np.repeat(np.arange(p.shape[0]), count)
    k = k0[idx] + np.arange(idx.size) - np.repeat(np.cumsum(count) - count, count)
    cut_lo = np.clip((k * cap - start[idx] + row_bytes[idx] - 1) // row_bytes[idx], 0, p[idx, NR])
    cut_lo = np.where(k == k0[idx], 0, cut_lo)
    cut_hi = np.clip(((k + 1) * cap - start[idx] + row_bytes[idx] - 1) // row_bytes[idx], 0, p[idx, NR])
    cut_hi = np.where(k == k1[idx], p[idx, NR], cut_hi)
    keep = cut_hi > cut_lo
    idx, k, cut_lo, cut_hi = idx[keep], k[keep], cut_lo[keep], cut_hi[keep]
    out = p[idx].copy()
    out[:, SROW] += cut_lo
    out[:, DROW] += cut_lo
    out[:, NR] = cut_hi - cut_lo
    # bucket ids: one per (stream, k), numbered in stream order
    key = np.stack([stream[idx], k], axis=1)
    newb = np.ones(key.shape[0], dtype=bool)
    newb[1:] = (key[1:] != key[:-1]).any(axis=1)
    bid = np.cumsum(newb) - 1
    nbytes = np.bincount(bid, weights=out[:, NR] * out[:, NC] * elem[idx]).astype(np.int64)
    buckets = np.stack([out[newb, B], out[newb, SND], nbytes], axis=1)
    out[:, B] = bid
    return out, buckets


def check_names(
    trainer_hf: dict[str, tuple[int, ...]],
    engine_hf: dict[str, tuple[int, ...]],
    ignore: tuple[str, ...] = (),
) -> None:
    """Raise one PlanError listing every HF name missing on either side and every shape mismatch."""
    missing = sorted(n for n in engine_hf if n not in trainer_hf and not n.endswith(ignore or ("\0",)))
    extra = sorted(n for n in trainer_hf if n not in engine_hf)
    shapes = sorted(
        f"{n}: trainer {list(trainer_hf[n])} vs engine {list(engine_hf[n])}"
        for n in trainer_hf.keys() & engine_hf.keys()
        if tuple(trainer_hf[n]) != tuple(engine_hf[n])
    )
    if missing or extra or shapes:
        lines = [
            f"weight sync: trainer and engine parameters do not match "
            f"({len(missing)} missing, {len(extra)} unexpected, {len(shapes)} mis-shaped)"
        ]
        lines += [f"  missing in trainer: {n}" for n in missing]
        lines += [f"  not in engine:      {n}" for n in extra]
        lines += [f"  shape mismatch:     {s}" for s in shapes]
        raise PlanError("\n".join(lines))
