"""Wire format: a safetensors file in memory (8-byte little-endian header length, JSON header, raw bytes).

Any safetensors reader, in any Python environment or torch version (or none: numpy, Rust), can read a
bucket; `unpack` returns zero-copy views into the buffer. A weight-sync bucket holds one 1-D tensor,
`data`: its pieces back to back, in the order of the plan's piece table, which sender and receiver both
hold (`begin_pack`); `__metadata__` carries the policy version and bucket id as strings, as the format
requires.

Invariants: data offsets are 8-byte aligned (safetensors' own writer aligns the header the same way),
entries are 1-D and contiguous, and `pack_into` writes straight into a caller-provided buffer (shared
memory, a pinned host buffer) with one copy per entry and no intermediate bytes object.
"""

from __future__ import annotations

import json
import warnings

import torch

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
}
_FROM = {v: k for k, v in _DTYPES.items()}


def header_for(entries: list[tuple[str, torch.dtype, int]], metadata: dict[str, str] | None = None) -> bytes:
    """Header bytes (length prefix + JSON, padded to 8 bytes) for 1-D entries (name, dtype, numel)."""
    hdr: dict = {"__metadata__": dict(metadata or {})}
    off = 0
    for name, dtype, numel in entries:
        n = numel * torch.empty((), dtype=dtype).element_size()
        hdr[name] = {"dtype": _DTYPES[dtype], "shape": [numel], "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def packed_size(entries: list[tuple[str, torch.dtype, int]], metadata: dict[str, str] | None = None) -> int:
    body = sum(n * torch.empty((), dtype=d).element_size() for _, d, n in entries)
    return len(header_for(entries, metadata)) + body


def _write_header(buf: memoryview | bytearray | torch.Tensor, header: bytes) -> torch.Tensor:
    """Copy `header` to the start of `buf`; return all of `buf` as a uint8 tensor (host or device)."""
    if isinstance(buf, torch.Tensor):
        buf[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        return buf
    mv = memoryview(buf).cast("B")
    mv[: len(header)] = header
    return torch.frombuffer(mv, dtype=torch.uint8, count=len(mv))


def pack_into(
    buf: memoryview | bytearray | torch.Tensor,
    tensors: list[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `tensors` (1-D) into `buf` as safetensors; returns bytes written. `buf` is host memory, or a
    uint8 tensor on any device (the collective transport's GPU buffers)."""
    header = header_for([(n, t.dtype, t.numel()) for n, t in tensors], metadata)
    body = _write_header(buf, header)
    off = len(header)
    for _, t in tensors:
        n = t.numel() * t.element_size()
        body[off : off + n].view(t.dtype).copy_(t.reshape(-1))
        off += n
    return off


def begin_pack(
    buf: memoryview | bytearray | torch.Tensor,
    name: str,
    dtype: torch.dtype,
    numel: int,
    metadata: dict[str, str] | None = None,
) -> torch.Tensor:
    """Write the header of a one-tensor image into `buf` and return the tensor's (typed, 1-D) body for
    the caller to fill in place: a weight-sync bucket is one tensor whose layout both sides know."""
    header = header_for([(name, dtype, numel)], metadata)
    body = _write_header(buf, header)
    n = numel * torch.empty((), dtype=dtype).element_size()
    return body[len(header) : len(header) + n].view(dtype)


def bucket_meta(version: int, bucket: int) -> dict[str, str]:
    """A weight-sync bucket's metadata: what the receiver checks on arrival."""
    return {"version": str(version), "bucket": str(bucket)}


def bucket_nbytes(dtype: torch.dtype, numel: int, version: int, bucket: int) -> int:
    """The packed size of a weight-sync bucket, known to the receiver before any byte arrives (the
    collective transport posts its receive with it)."""
    return packed_size([("data", dtype, numel)], bucket_meta(version, bucket))


def pack(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> bytearray:
    buf = bytearray(packed_size([(n, t.dtype, t.numel()) for n, t in tensors], metadata))
    pack_into(buf, tensors, metadata)
    return buf


def unpack(buf) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Zero-copy views of every tensor in a safetensors buffer (host memory, or a uint8 tensor on any
    device), and its metadata."""
    if isinstance(buf, torch.Tensor):
        n = int.from_bytes(bytes(buf[:8].cpu().numpy()), "little")
        hdr = json.loads(bytes(buf[8 : 8 + n].cpu().numpy()))
        body = buf[8 + n :]
    else:
        mv = memoryview(buf).cast("B")
        n = int.from_bytes(mv[:8], "little")
        hdr = json.loads(bytes(mv[8 : 8 + n]))
        if len(mv) == 8 + n:  # empty body: torch.frombuffer rejects zero-length buffers
            body = torch.empty(0, dtype=torch.uint8)
        else:
            with warnings.catch_warnings():  # read-only buffers (mmap, Ray) are fine: views are only read
                warnings.simplefilter("ignore", UserWarning)
                body = torch.frombuffer(mv, dtype=torch.uint8, count=len(mv), offset=0)[8 + n :]
    meta = hdr.pop("__metadata__", {}) or {}
    out = {}
    for name, info in hdr.items():
        b, e = info["data_offsets"]
        out[name] = body[b:e].view(_FROM[info["dtype"]]).view(info["shape"])
    return out, meta
