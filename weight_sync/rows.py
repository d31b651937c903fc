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


def merge_rows(seg: np.ndarray) -> np.ndarray:
    """Merge row segments (dst_row, dst_col, ncols, hf, hf_row, hf_col) into multi-row runs."""
    if seg.shape[0] == 0:
        return np.zeros((0, len(ENGINE_COLS)), dtype=np.int64)
    # a segment continues the previous one (in (dst_col, ncols, hf, hf_col, dst_row) order) when it sits
    # one engine row lower and one HF row lower with the same columns
    order = np.lexsort((seg[:, 0], seg[:, 5], seg[:, 3], seg[:, 2], seg[:, 1]))
    s = seg[order]
    cont = np.zeros(s.shape[0], dtype=bool)
    cont[1:] = (
        (s[1:, 1] == s[:-1, 1])
        & (s[1:, 2] == s[:-1, 2])
        & (s[1:, 3] == s[:-1, 3])
        & (s[1:, 5] == s[:-1, 5])
        & (s[1:, 0] == s[:-1, 0] + 1)
        & (s[1:, 4] == s[:-1, 4] + 1)
    )
    starts = np.flatnonzero(~cont)
    nrows = np.diff(np.append(starts, s.shape[0]))
    h = s[starts]
    out = np.stack([h[:, 0], h[:, 1], nrows, h[:, 2], h[:, 3], h[:, 4], h[:, 5]], axis=1)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


# ------------------------------------------------------------------------------------------------------
# Decoding an engine layout one byte at a time. Index codes as wide as the model (int32 per element) made
# derivation cost twice the bf16 weights of the layer in flight; instead each HF row and column gets a
# code, `row code = 1 + row offset of its tensor + row` and `col code = 1 + col`, fed one byte per pass as
# uint8 (stride-0 inputs: a tensor's rows or columns, not its elements), so the engine materialises one
# byte per element and the per-element work happens a block at a time. Each pass refines the parameter's
# row segments (runs of one HF row with columns stepping by one); bytes already decoded are carried per
# segment, so no per-element state outlives a pass.


def digit_passes(max_row_code: int, max_col_code: int) -> list[tuple[str, int]]:
    """(kind, byte index) of every pass: all row-code bytes first (padding must be known before the
    column passes), then the column-code bytes."""

    def nbytes(m: int) -> int:
        return max(1, (int(m).bit_length() + 7) // 8)

    return [("row", k) for k in range(nbytes(max_row_code))] + [
        ("col", k) for k in range(nbytes(max_col_code))
    ]


def digit_input(kind: str, k: int, row_offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Byte `k` of an HF tensor's row codes (or column codes) as a stride-0 uint8 tensor of its shape."""
    R, C = rows_cols(shape)
    if kind == "row":
        d = ((torch.arange(row_offset + 1, row_offset + 1 + R) >> (8 * k)) & 255).to(torch.uint8).view(R, 1)
    else:
        d = ((torch.arange(1, C + 1) >> (8 * k)) & 255).to(torch.uint8).view(1, C)
    return d.expand(R, C).view(shape)


class Workspace:
    """Block buffers reused by every `Segments.refine` of a derivation. Allocating them per block let
    glibc's heap grow by about 1.5 GB over one embedding-sized parameter (freed, never returned); reused
    buffers keep derivation's memory at the engine's uint8 layer plus these."""

    def __init__(self, size: int = 1 << 20):
        self.size = 0
        self._grow(max(1, size))

    def _grow(self, size: int) -> None:
        self.size = size
        self.flags = torch.zeros(2, size, dtype=torch.bool)
        self.ints = torch.zeros(4, size, dtype=torch.int64)
        self.iota = torch.arange(size, dtype=torch.int64)

    def views(self, n: int):
        """brk, live (bool) and sid, v, g, h (int64), each `n` long (one engine row may exceed the size)."""
        if n > self.size:
            self._grow(n)
        return (*(self.flags[i, :n] for i in range(2)), *(self.ints[i, :n] for i in range(4)))


class Segments:
    """Row segments of one engine parameter, decoded so far: flat start positions (sorted; every engine
    row starts one) with each segment's row code and column code (the bytes decoded up to now)."""

    def __init__(self, starts: torch.Tensor, row: torch.Tensor, col: torch.Tensor, shape: tuple[int, int]):
        self.starts, self.row, self.col, self.shape = starts, row, col, shape

    @classmethod
    def whole_rows(cls, R: int, C: int) -> Segments:
        z = torch.zeros(R, dtype=torch.int64)
        return cls(torch.arange(R, dtype=torch.int64) * C, z, z.clone(), (R, C))

    def refine(self, digits: torch.Tensor, kind: str, k: int, work: Workspace | None = None) -> Segments:
        """Read byte `k` of the row (or column) codes from `digits` (the parameter's 2-D uint8 view after
        the loaders ran on that pass's inputs) and split segments wherever the codes stop continuing."""
        R, C = self.shape
        assert tuple(digits.shape) == (R, C), (tuple(digits.shape), self.shape)
        work = work or Workspace(min(R * C, 1 << 20))
        scale, step = 256**k, max(1, work.size // max(C, 1))
        parts = []
        for r0 in range(0, R, step):
            lo, hi = r0 * C, min(R, r0 + step) * C
            n = hi - lo
            a, b = (int(torch.searchsorted(self.starts, x)) for x in (lo, hi))
            s_loc = self.starts[a:b] - lo
            brk, live, sid, v, g, h = work.views(n)
            h.zero_()
            h[s_loc] = 1
            torch.cumsum(h, 0, out=sid)  # int64 in and out: a bool input costs an 8 MB temporary per block
            sid.sub_(1)
            v.copy_(digits[r0 : r0 + step].reshape(-1))
            v.mul_(scale)
            if kind == "row":
                v.add_(torch.index_select(self.row[a:b], 0, sid, out=g))
                torch.ne(v[1:], v[:-1], out=brk[1:])
            else:  # bytes below k step with the position inside the segment
                torch.index_select(self.col[a:b], 0, sid, out=g)
                g.add_(work.iota[:n]).sub_(torch.index_select(s_loc, 0, sid, out=h)).remainder_(scale)
                v.add_(g)
                torch.add(v[:-1], 1, out=g[:-1]).remainder_(scale * 256)
                torch.ne(v[1:], g[:-1], out=brk[1:])
                # padding (row code 0) stays one segment whatever its columns
                torch.gt(torch.index_select(self.row[a:b], 0, sid, out=h), 0, out=live)
                brk[1:].logical_and_(live[1:])
            brk.index_fill_(0, s_loc, True)  # every segment start stays one
            new = torch.nonzero(brk).flatten()
            old = sid[new] + a
            row, col = (v[new], self.col[old]) if kind == "row" else (self.row[old], v[new])
            parts.append((new + lo, row, col))
        if not parts:
            return self
        return Segments(*(torch.cat(x) for x in zip(*parts)), shape=self.shape)

    def runs(self, row_offsets: np.ndarray) -> np.ndarray:
        """The decoded segments as an `ENGINE_COLS` run table (padding dropped, vertical runs merged)."""
        R, C = self.shape
        starts, row, col = self.starts.numpy(), self.row.numpy(), self.col.numpy()
        ends = np.append(starts[1:], R * C)  # every engine row starts a segment, so none crosses a row
        keep = row > 0
        if (col[keep] <= 0).any():
            raise ValueError(
                "a loaded element has a row code but no column code: vLLM's loader did not copy "
                "HF values as whole rows and columns"
            )
        starts, ends, row, col = starts[keep], ends[keep], row[keep] - 1, col[keep] - 1
        offs = np.asarray(row_offsets, dtype=np.int64)
        tid = np.searchsorted(offs, row, side="right") - 1
        seg = np.stack([starts // C, starts % C, ends - starts, tid, row - offs[tid], col], axis=1)
        return merge_rows(seg.astype(np.int64))


def split_at(
    starts: np.ndarray, lengths: np.ndarray, bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
