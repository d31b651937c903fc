"""The resharding plan: which bytes each trainer rank sends to each engine rank. Pure tensor math.

Inputs (all static metadata, computed once per (trainer layout, engine layout)):
- trainer specs (`ParamSpec`: TorchTitan name, global shape, placements over the trainer mesh);
- the TorchTitan -> HF element map (`names.hf_element_map`): for each HF tensor, the flat TorchTitan
  element each of its elements comes from (identity for Qwen3, a head permutation for Llama q/k);
- one `EngineLayout` per receiver (engine, TP rank): for each engine parameter element, the global HF
  element vLLM's own loader put there (-1 for padding).

Composing the three gives, for every engine element, (trainer rank, TorchTitan tensor, local offset).
Runs that are contiguous on both sides become one `Copy`; copies are grouped per (receiver, sender) and
cut into buckets of at most `bucket_bytes`, in engine-parameter order so a receiver completes (and can
install) layers one after another.

Invariants: every engine element that vLLM's loader fills is covered by exactly one copy; a receiver gets
exactly the bytes of its shard (no full gather); the plan holds no tensors, only integers, so it pickles
cheaply to every actor. Supported trainer placements: Replicate() and Shard(0) per mesh dim (FSDP2 / HSDP);
a replicated source is read from mesh coordinate 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .specs import ParamSpec


@dataclass(frozen=True)
class Copy:
    src: str  # TorchTitan parameter name (local shard on the sending rank)
    src_offset: int  # element offset in the sender's flattened local shard
    dst: str  # engine parameter name
    dst_offset: int  # element offset in the receiver's flattened loaded-layout parameter
    numel: int


@dataclass
class Bucket:
    receiver: int  # index into the plan's receiver list
    sender: int  # trainer rank
    copies: list[Copy] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Plan:
    receivers: list[tuple[int, int]]  # (engine index, tp rank)
    dst_shapes: list[dict[str, tuple[int, ...]]]  # per receiver: engine param -> loaded-layout shape
    dtype: str
    buckets: list[Bucket]
    dst_numel: list[dict[str, int]]  # per receiver: elements each engine param receives in total

    def for_sender(self, rank: int) -> list[Bucket]:
        return [b for b in self.buckets if b.sender == rank]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


class PlanError(ValueError):
    """Names or shapes that do not line up; the message lists every problem at once."""


def _owner(spec: ParamSpec, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer rank and local flat offset of each global flat element of `spec`'s tensor."""
    shape = spec.shape
    rank = torch.zeros_like(flat)
    local = flat.clone()
    if not spec.mesh_shape:
        return rank, local
    row = math.prod(shape[1:])
    stride = 1
    for mesh_dim in reversed(range(len(spec.mesh_shape))):
        p, n = spec.placements[mesh_dim], spec.mesh_shape[mesh_dim]
        if p in ("S(0)", "Shard(0)", "Shard(dim=0)"):
            chunk = math.ceil(shape[0] / n)  # torch.chunk semantics, as FSDP2 and DTensor use
            c = (flat // row) // chunk
            rank += c * stride
            local -= c * chunk * row
        elif p not in ("R", "Replicate()"):
            raise NotImplementedError(f"{spec.name}: placement {p} on mesh dim {mesh_dim} (only Shard(0)/Replicate)")
        stride *= n
    return rank, local


def _runs(keys: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Split parallel arrays into maximal runs with constant key and +1 steps on both offsets."""
    if keys.numel() == 0:
        return []
    brk = torch.ones(keys.numel(), dtype=torch.bool)
    brk[1:] = (keys[1:] != keys[:-1]) | (src_off[1:] != src_off[:-1] + 1) | (dst_off[1:] != dst_off[:-1] + 1)
    starts = torch.nonzero(brk).flatten()
    ends = torch.cat([starts[1:], torch.tensor([keys.numel()])])
    return list(zip(keys[starts].tolist(), src_off[starts].tolist(), dst_off[starts].tolist(), (ends - starts).tolist()))


def build_plan(
    specs: list[ParamSpec],
    hf_map: dict[str, tuple[str, torch.Tensor]],
    hf_order: list[tuple[str, tuple[int, ...]]],
    layouts: list[tuple[tuple[int, int], object]],
    bucket_bytes: int,
) -> Plan:
    """Compose trainer placements, the name/element map and engine layouts into bucketed copies.

    `hf_map`: HF name -> (TorchTitan name, int64 [numel] TorchTitan flat index per HF element).
    `hf_order`: the (HF name, shape) list the engine layouts' codes were derived with.
    `layouts`: ((engine index, tp rank), EngineLayout) per receiver.
    """
    spec_by_name = {s.name: s for s in specs}
    titan_names = [s.name for s in specs]
    titan_id = {n: i for i, n in enumerate(titan_names)}
    # Per global HF code: TorchTitan tensor id, sender rank and local offset.
    hf_tid, hf_rank, hf_local = [], [], []
    for name, shape in hf_order:
        tname, idx = hf_map[name]
        r, loc = _owner(spec_by_name[tname], idx)
        hf_tid.append(torch.full_like(idx, titan_id[tname]))
        hf_rank.append(r)
        hf_local.append(loc)
    tid_all, rank_all, local_all = torch.cat(hf_tid), torch.cat(hf_rank), torch.cat(hf_local)
    n_ranks = max([math.prod(s.mesh_shape) if s.mesh_shape else 1 for s in specs] + [1])
    dtypes = {s.dtype for s in specs}
    if len(dtypes) != 1:
        raise PlanError(f"trainer parameters have mixed dtypes {sorted(dtypes)}; the wire carries one dtype")
    elem = torch.empty((), dtype=getattr(torch, dtypes.pop())).element_size()

    receivers, dst_shapes, dst_numel, buckets = [], [], [], []
    for ri, (key, layout) in enumerate(layouts):
        receivers.append(key)
        dst_shapes.append(dict(layout.shapes))
        per_sender: dict[int, list[Copy]] = {r: [] for r in range(n_ranks)}
        numel = {}
        for dst_name, codes in layout.codes.items():
            if not isinstance(codes, torch.Tensor):  # numpy from a worker; Ray hands out read-only arrays
                codes = torch.from_numpy(codes if codes.flags.writeable else codes.copy())
            dst_off = torch.nonzero(codes >= 0).flatten()
            c = codes[dst_off]
            numel[dst_name] = int(c.numel())
            tid, rank, loc = tid_all[c], rank_all[c], local_all[c]
            keys = rank * len(titan_names) + tid
            for k, s_off, d_off, n in _runs(keys, loc, dst_off):
                per_sender[k // len(titan_names)].append(Copy(titan_names[k % len(titan_names)], s_off, dst_name, d_off, n))
        dst_numel.append(numel)
        for sender, copies in per_sender.items():
            buckets += _bucketize(ri, sender, copies, bucket_bytes, elem)
    return Plan(receivers=receivers, dst_shapes=dst_shapes, dtype=layouts[0][1].dtype if layouts else "",
                buckets=buckets, dst_numel=dst_numel)


def _bucketize(receiver: int, sender: int, copies: list[Copy], bucket_bytes: int, elem: int) -> list[Bucket]:
    """Cut copies (in engine order) into buckets of at most `bucket_bytes`, splitting copies that straddle."""
    cap = max(1, bucket_bytes // elem)
    out, cur = [], Bucket(receiver, sender)
    for c in copies:
        done = 0
        while done < c.numel:
            room = cap - cur.nbytes // elem
            if room == 0:
                out.append(cur)
                cur, room = Bucket(receiver, sender), cap
            n = min(room, c.numel - done)
            cur.copies.append(Copy(c.src, c.src_offset + done, c.dst, c.dst_offset + done, n))
            cur.nbytes += n * elem
            done += n
    if cur.copies:
        out.append(cur)
    return out


def check_names(
    trainer_hf: dict[str, tuple[int, ...]], engine_hf: dict[str, tuple[int, ...]], ignore: tuple[str, ...] = ()
) -> None:
    """Raise one PlanError listing every HF name missing on either side and every shape mismatch."""
    missing = sorted(n for n in engine_hf if n not in trainer_hf and not n.endswith(ignore or ("\0",)))
    extra = sorted(n for n in trainer_hf if n not in engine_hf)
    shapes = sorted(
        f"{n}: trainer {list(trainer_hf[n])} vs engine {list(engine_hf[n])}"
        for n in trainer_hf.keys() & engine_hf.keys() if tuple(trainer_hf[n]) != tuple(engine_hf[n])
    )
    if missing or extra or shapes:
        lines = [f"weight sync: trainer and engine parameters do not match "
                 f"({len(missing)} missing, {len(extra)} unexpected, {len(shapes)} mis-shaped)"]
        lines += [f"  missing in trainer: {n}" for n in missing]
        lines += [f"  not in engine:      {n}" for n in extra]
        lines += [f"  shape mismatch:     {s}" for s in shapes]
        raise PlanError("\n".join(lines))
