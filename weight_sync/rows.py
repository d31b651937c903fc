"""Row runs: the unit every weight-sync map is expressed in. Pure numpy.

Every tensor on every side (TorchTitan parameter, Hugging Face tensor, engine parameter) is viewed as a
2-D matrix `[rows, cols]` with `cols = shape[-1]` (a 1-D tensor of n elements is `[n, 1]`). The maps
between the sides move whole rows, possibly narrowed to a column range (vLLM's row-parallel linears
narrow the input dim), so a map is a short table of *runs*: `nrows` consecutive rows and `ncols`
consecutive columns of one tensor that land on consecutive rows and columns of another. Table size
grows with the number of tensors, TP/FSDP ranks and row permutations (Llama's q/k RoPE permutation),
never with the number of elements; that is what lets the driver plan a 70B model in seconds.

Run tables are int64 arrays; the column order of each kind is given by the `*_COLS` tuples below.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Engine layout of one engine parameter: dst rows/cols <- HF tensor `hf` rows/cols.
ENGINE_COLS = ("dst_row", "dst_col", "nrows", "ncols", "hf", "hf_row", "hf_col")


def rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view `[rows, cols]` of a tensor shape (1-D: `[n, 1]`, 0-D: `[1, 1]`)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return int(shape[0]), 1
    return math.prod(shape[:-1]), int(shape[-1])


def as_2d(t: torch.Tensor) -> torch.Tensor:
    r, c = rows_cols(tuple(t.shape))
    return t.reshape(r, c)


def runs_1d(values: np.ndarray) -> np.ndarray:
    """Maximal runs of +1 steps in an int array: `[n, 3]` rows of (start index, first value, length)."""
    values = np.asarray(values, dtype=np.int64)
    if values.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.ones(values.size, dtype=bool)
    brk[1:] = values[1:] != values[:-1] + 1
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, values.size))
    return np.stack([starts, values[starts], lengths], axis=1)


def engine_runs(codes: torch.Tensor, hf_offsets: np.ndarray, hf_cols: np.ndarray,
                block: int = 1 << 22) -> np.ndarray:
    """Compress one engine parameter's element codes into an `ENGINE_COLS` run table.

    `codes` is the parameter (2-D view) after vLLM's loaders ran on index-coded HF tensors: each element
    holds `1 + global HF flat index` (HF tensors concatenated in `hf_offsets` order), 0 where nothing
    loaded (padding). Row segments (constant HF tensor and row, columns stepping by one) are found per
    engine row, a block of about `block` elements at a time (segments never cross engine rows, so
    blocks of whole rows are exact and temporaries stay small); then segments that continue each other
    on the next engine row and the next HF row are merged vertically.
    """
    R, C = codes.shape
    offs = torch.from_numpy(np.asarray(hf_offsets, dtype=np.int64))
    cols = torch.from_numpy(np.asarray(hf_cols, dtype=np.int64))
    step = max(1, block // max(C, 1))
    segs = [_row_segments(codes[r0:r0 + step], r0, offs, cols) for r0 in range(0, R, step)]
    seg = np.concatenate(segs) if segs else np.zeros((0, 6), dtype=np.int64)
    return _merge_rows(seg)


def _row_segments(codes: torch.Tensor, row0: int, offs: torch.Tensor, cols: torch.Tensor) -> np.ndarray:
    """(dst_row, dst_col, ncols, hf, hf_row, hf_col) of every row segment of a block of engine rows."""
    R, C = codes.shape
    flat = codes.reshape(-1).to(torch.int64) - 1
    if flat.numel() == 0:
        return np.zeros((0, 6), dtype=np.int64)
    valid = flat >= 0
    tid = (torch.searchsorted(offs, flat.clamp(min=0), right=True) - 1).clamp(min=0)
    local = flat - offs[tid]
    hr, hc = local // cols[tid], local % cols[tid]
    brk = torch.ones(R * C, dtype=torch.bool)
    brk[1:] = ~((tid[1:] == tid[:-1]) & (hr[1:] == hr[:-1]) & (hc[1:] == hc[:-1] + 1) & valid[1:] & valid[:-1])
    brk[torch.arange(0, R * C, C)] = True  # segments never wrap engine rows
    starts = torch.nonzero(brk & valid).flatten()
    ends = torch.nonzero(brk).flatten()
    nxt = torch.searchsorted(ends, starts, right=True)  # each segment ends at the next break after its start
    seg_end = torch.where(nxt < ends.numel(), ends[nxt.clamp(max=ends.numel() - 1)], torch.tensor(R * C))
    return np.stack([
        (starts // C).numpy() + row0, (starts % C).numpy(), (seg_end - starts).numpy(),
        tid[starts].numpy(), hr[starts].numpy(), hc[starts].numpy(),
    ], axis=1)


def _merge_rows(seg: np.ndarray) -> np.ndarray:
    """Merge row segments (dst_row, dst_col, ncols, hf, hf_row, hf_col) into multi-row runs."""
    if seg.shape[0] == 0:
        return np.zeros((0, len(ENGINE_COLS)), dtype=np.int64)
    # a segment continues the previous one (in (dst_col, ncols, hf, hf_col, dst_row) order) when it sits
    # one engine row lower and one HF row lower with the same columns
    order = np.lexsort((seg[:, 0], seg[:, 5], seg[:, 3], seg[:, 2], seg[:, 1]))
    s = seg[order]
    cont = np.zeros(s.shape[0], dtype=bool)
    cont[1:] = ((s[1:, 1] == s[:-1, 1]) & (s[1:, 2] == s[:-1, 2]) & (s[1:, 3] == s[:-1, 3])
                & (s[1:, 5] == s[:-1, 5]) & (s[1:, 0] == s[:-1, 0] + 1) & (s[1:, 4] == s[:-1, 4] + 1))
    starts = np.flatnonzero(~cont)
    nrows = np.diff(np.append(starts, s.shape[0]))
    h = s[starts]
    out = np.stack([h[:, 0], h[:, 1], nrows, h[:, 2], h[:, 3], h[:, 4], h[:, 5]], axis=1)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def split_at(starts: np.ndarray, lengths: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split intervals `[starts, starts + lengths)` at the sorted boundaries `bounds` (segment starts of
    a table that covers every interval). Returns (interval index, piece start, piece length) per piece,
    and each piece lies inside one segment: `searchsorted(bounds, piece start, 'right') - 1`."""
    first = np.searchsorted(bounds, starts, side="right") - 1
    last = np.searchsorted(bounds, starts + lengths - 1, side="right") - 1
    count = last - first + 1
    idx = np.repeat(np.arange(starts.size), count)
    k = np.arange(idx.size) - np.repeat(np.cumsum(count) - count, count)
    seg = first[idx] + k
    lo = np.maximum(starts[idx], bounds[seg])
    hi_bound = np.append(bounds[1:], np.iinfo(np.int64).max)[seg]
    hi = np.minimum(starts[idx] + lengths[idx], hi_bound)
    return idx, lo, hi - lo
