"""A toy model and engine layouts built by hand in the shape vLLM's loaders produce, for the weight-sync
tests that run without vLLM (tests/unit): TorchTitan-like names renamed to HF ones (q's rows permuted,
as Llama's adapter does), q/k/v fused and narrowed per TP rank with a padding row, a row-parallel weight
narrowed on columns, a replicated norm. Codes hold one full int64 index per element and
`full_code_runs` is the plain reference decoder of them."""

from __future__ import annotations

import math

import numpy as np
import torch

from rl_tpu.weight_sync.engine_layout import EngineLayout
from rl_tpu.weight_sync.rows import merge_rows, rows_cols
from rl_tpu.weight_sync.specs import ParamSpec


def full_code_runs(codes: torch.Tensor, hf_offsets: np.ndarray, hf_cols: np.ndarray) -> np.ndarray:
    """Reference decoder: an engine parameter (2-D) whose elements hold `1 + global HF flat index` (0:
    padding) -> its `ENGINE_COLS` run table. Row segments are maximal runs of one HF tensor and row with
    columns stepping by one inside an engine row; `rows.merge_rows` stacks them into multi-row runs."""
    R, C = codes.shape
    offs = torch.from_numpy(np.asarray(hf_offsets, dtype=np.int64))
    cols = torch.from_numpy(np.asarray(hf_cols, dtype=np.int64))
    flat = codes.reshape(-1).to(torch.int64) - 1
    if flat.numel() == 0:
        return merge_rows(np.zeros((0, 6), dtype=np.int64))
    valid = flat >= 0
    tid = (torch.searchsorted(offs, flat.clamp(min=0), right=True) - 1).clamp(min=0)
    local = flat - offs[tid]
    hr, hc = local // cols[tid], local % cols[tid]
    brk = torch.ones(R * C, dtype=torch.bool)
    brk[1:] = ~(
        (tid[1:] == tid[:-1]) & (hr[1:] == hr[:-1]) & (hc[1:] == hc[:-1] + 1) & valid[1:] & valid[:-1]
    )
    brk[torch.arange(0, R * C, C)] = True  # segments never wrap engine rows
    starts = torch.nonzero(brk & valid).flatten()
    ends = torch.nonzero(brk).flatten()
    nxt = torch.searchsorted(ends, starts, right=True)  # each segment ends at the next break after its start
    seg_end = torch.where(nxt < ends.numel(), ends[nxt.clamp(max=ends.numel() - 1)], torch.tensor(R * C))
    return merge_rows(
        np.stack(
            [
                (starts // C).numpy(),
                (starts % C).numpy(),
                (seg_end - starts).numpy(),
                tid[starts].numpy(),
                hr[starts].numpy(),
                hc[starts].numpy(),
            ],
            axis=1,
        )
    )


# A toy "model": TorchTitan names, HF names by a rename + (for wq) a row permutation, like Llama's adapter.
SHAPES = {"wq": (6, 4), "wk": (5, 4), "wv": (5, 4), "wo": (4, 6), "norm": (4,)}
PERM = torch.tensor([1, 0, 3, 2, 5, 4])  # HF row i = TorchTitan row PERM[i]


HF_NAME = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "norm": "norm"}


def to_hf(sd: dict) -> dict:
    """Like TorchTitan's adapters: one entry per TorchTitan tensor given, renamed (q rows permuted)."""
    return {HF_NAME[n]: (t[PERM] if n == "wq" and t.device.type != "meta" else t) for n, t in sd.items()}


def specs(world: int = 2, placement: str = "S(0)") -> list[ParamSpec]:
    return [
        ParamSpec(
            name=n,
            shape=s,
            dtype="float32",
            mesh_shape=(world,),
            mesh_dim_names=("fsdp",),
            placements=(placement,),
        )
        for n, s in SHAPES.items()
    ]


def hand_layout(hf_order, tp: int, rank: int) -> EngineLayout:
    """qkv = cat(q, k, v) narrowed to this rank's rows (QKVParallelLinear) plus a padding row; o narrowed
    to this rank's columns (RowParallelLinear); norm replicated. Codes as vLLM's loaders leave them."""
    shapes = dict(hf_order)
    off, o = {}, 0
    for n, sh in hf_order:
        off[n] = o
        o += math.prod(sh)

    def coded(n):
        return torch.arange(off[n] + 1, off[n] + 1 + math.prod(shapes[n])).view(shapes[n])

    qkv = torch.cat(
        [
            coded("q").chunk(tp)[rank],
            coded("k").chunk(tp)[rank],
            coded("v").chunk(tp)[rank],
            torch.zeros(1, 4, dtype=torch.int64),
        ]
    )
    wo = coded("o").chunk(tp, dim=1)[rank]
    norm = coded("norm")
    offsets = np.array([off[n] for n, _ in hf_order])
    cols = np.array([rows_cols(sh)[1] for _, sh in hf_order])
    params = {"qkv": qkv, "o_proj": wo, "norm": norm}
    return EngineLayout(
        tp_rank=rank,
        tp_size=tp,
        dtype="float32",
        shapes={n: tuple(t.shape) for n, t in params.items()},
        runs={
            n: full_code_runs(t.reshape(rows_cols(tuple(t.shape))), offsets, cols) for n, t in params.items()
        },
    )


def local_chunk(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank's Shard(0) piece as DTensor/FSDP2 lay it out (torch.chunk sizes; trailing ranks may be empty)."""
    cs = math.ceil(t.shape[0] / world)
    return t[rank * cs : (rank + 1) * cs].contiguous()


def engine_tensors(full: dict, tp: int, rank: int) -> dict:
    """What `hand_layout`'s engine rank holds once synced from the TorchTitan tensors `full`."""
    hf = to_hf(full)
    qkv = torch.cat(
        [hf["q"].chunk(tp)[rank], hf["k"].chunk(tp)[rank], hf["v"].chunk(tp)[rank], torch.zeros(1, 4)]
    )
    return {"qkv": qkv, "o_proj": hf["o"].chunk(tp, dim=1)[rank], "norm": hf["norm"]}
