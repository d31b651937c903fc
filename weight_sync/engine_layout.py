"""Engine-side layouts, derived by running vLLM's own weight loaders on coded tensors.

We never re-implement vLLM's tensor-parallel slicing or fusion rules. Once per engine layout, every
Hugging Face tensor is replaced by a code tensor and the engine's normal loading path (`model.load_weights`
under vLLM's layerwise reload) runs on it. Each HF row has a code (`1 + row offset of its tensor + row`)
and each column one (`1 + col`); a pass feeds one byte of them as a stride-0 uint8 tensor (`rows.digit_input`:
the size of a tensor's rows or columns, not its elements), so about five passes decode a model and the
engine materialises one byte per element of the layer in flight. `vllm_compat.capture_mode` materialises
each layer's loaded-layout parameters as uint8 zeros, lets vLLM's original loaders fill them, hands them
to us and puts the layer's kernel tensors back, so the engine's weights never change and no restore is
needed. Each pass refines every parameter's row segments (`rows.Segments`) a block of elements at a time
and frees the layer, so derivation's extra memory is one byte per element of one layer plus small blocks.
What comes out for every engine parameter on this TP rank is which HF rows and columns land where:
fusion (q/k/v -> qkv_proj, gate/up -> gate_up_proj), TP narrowing, vocab padding (code 0), and any
row-preserving layout transform, as vLLM's loaders do them.

Installing shards is `engine_side.py`. Functions here run inside a vLLM worker (through the
`WorkerExtension` extension's methods); they import vLLM lazily so this module imports with torch alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import rows, vllm_compat
from .rows import ENGINE_COLS, Segments, Workspace, digit_input, digit_passes, rows_cols


@dataclass(kw_only=True)
class EngineLayout:
    """Loaded layout of one engine TP rank: engine param name -> row runs (`rows.ENGINE_COLS`)."""

    tp_rank: int
    tp_size: int
    dtype: str  # engine parameter dtype, e.g. "float32"
    shapes: dict[str, tuple[int, ...]]  # engine param name -> loaded-layout shape on this rank
    runs: dict[str, np.ndarray] = field(repr=False)  # install order = the engine's parameter order

    def to_wire(self) -> dict:
        """Plain types only (vLLM's multiprocess RPC carries no numpy arrays or tensors)."""
        return {
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "dtype": self.dtype,
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "runs": {n: r.astype(np.int64).tobytes() for n, r in self.runs.items()},
        }

    @classmethod
    def from_wire(cls, d: dict) -> EngineLayout:
        return cls(
            tp_rank=int(d["tp_rank"]),
            tp_size=int(d["tp_size"]),
            dtype=d["dtype"],
            shapes={n: tuple(s) for n, s in d["shapes"].items()},
            runs={
                n: np.frombuffer(b, dtype=np.int64).reshape(-1, len(ENGINE_COLS))
                for n, b in d["runs"].items()
            },
        )


def cached_layout(worker, hf_specs: list[tuple[str, tuple[int, ...]]]) -> EngineLayout:
    """`derive_layout`, kept on disk: a layout depends only on vLLM's loaders (its version), the model's
    config as vLLM read it, this rank's TP position and dtype, the HF names and shapes, and the code that
    derives it, so a file keyed by all of them is reused by every later engine of the same model (a
    second run skips the derivation, seconds for a 100 M-parameter model on 2 cores). Files that cannot be read are
    derived again; `RL_TPU_LAYOUT_CACHE=0` turns the cache off."""
    import hashlib
    import json
    import os
    from pathlib import Path

    if os.environ.get("RL_TPU_LAYOUT_CACHE", "1") == "0":
        return derive_layout(worker, hf_specs)
    import vllm

    model = vllm_compat.model(worker)
    code = b"".join(Path(f).read_bytes() for f in (__file__, rows.__file__, vllm_compat.__file__))
    key = hashlib.sha256(
        json.dumps(
            [
                vllm.__version__,
                hashlib.sha256(code).hexdigest(),
                worker.vllm_config.model_config.hf_config.to_json_string(use_diff=False),
                vllm_compat.tp_rank(),
                vllm_compat.tp_size(),
                str(next(model.parameters()).dtype),
                [[n, list(s)] for n, s in hf_specs],
            ]
        ).encode()
    ).hexdigest()[:32]
    from rl_tpu.model_source import cache_dir

    path = cache_dir() / "layouts" / f"{key}.json"
    try:
        wire = json.loads(path.read_text())
        wire["runs"] = {n: bytes.fromhex(h) for n, h in wire["runs"].items()}
        return EngineLayout.from_wire(wire)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    layout = derive_layout(worker, hf_specs)
    wire = layout.to_wire()
    wire["runs"] = {n: b.hex() for n, b in wire["runs"].items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(wire))
        tmp.replace(path)
    except OSError:  # a read-only cache: derive every time
        pass
    return layout


def derive_layout(worker, hf_specs: list[tuple[str, tuple[int, ...]]]) -> EngineLayout:
    """Inside a vLLM worker: run vLLM's loaders on row and column codes, a byte per pass (`rows.digit_passes`),
    and read where each HF row landed."""
    model = vllm_compat.model(worker)
    dtype = next(model.parameters()).dtype
    names = {id(m): n for n, m in model.named_modules()}
    hf_rows = np.asarray([rows_cols(tuple(s))[0] for _, s in hf_specs], dtype=np.int64)
    row_offsets = np.cumsum(np.append(0, hf_rows))[:-1]
    max_cols = max((rows_cols(tuple(s))[1] for _, s in hf_specs), default=1)
    segments: dict[str, Segments] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    work = Workspace()

    for kind, k in digit_passes(int(hf_rows.sum()), max_cols):

        def capture(layer, tensors: dict[str, torch.Tensor]) -> None:
            prefix = names.get(id(layer), "")
            for pname, t in tensors.items():
                name = f"{prefix}.{pname}" if prefix else pname
                d = t.reshape(rows_cols(tuple(t.shape)))
                seg = segments.get(name) or Segments.whole_rows(*d.shape)
                segments[name], shapes[name] = seg.refine(d, kind, k, work), tuple(t.shape)  # noqa: B023

        inputs = (
            (name, digit_input(kind, k, int(off), tuple(shape)))
            for (name, shape), off in zip(hf_specs, row_offsets)
        )
        vllm_compat.run_loaders(worker, inputs, capture, dtype=torch.uint8)

    runs = {n: r for n, seg in segments.items() if (r := seg.runs(row_offsets)).shape[0]}
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    ordered = sorted(runs, key=lambda n: order.get(n, len(order)))
    return EngineLayout(
        tp_rank=vllm_compat.tp_rank(),
        tp_size=vllm_compat.tp_size(),
        dtype=str(dtype).removeprefix("torch."),
        shapes={n: shapes[n] for n in ordered},
        runs={n: runs[n] for n in ordered},
    )


def reference_layout(worker, hf_weights) -> dict[str, torch.Tensor]:
    """Verify mode's reference: what vLLM's own loaders put in each engine parameter of this rank
    (loaded layout, engine dtype) from full HF tensors. The engine's weights are left as they are."""
    model = vllm_compat.model(worker)
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, torch.Tensor] = {}

    def capture(layer, tensors):
        prefix = names.get(id(layer), "")
        for pname, t in tensors.items():
            out[f"{prefix}.{pname}" if prefix else pname] = t.detach().clone()

    vllm_compat.run_loaders(worker, iter(hf_weights), capture)
    return out


def reference_layouts(worker, hf_weights) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Verify mode's references from full HF tensors, both on copies (the engine's weights are left as
    they are): (loaded, kernel) where `loaded` is what vLLM's loaders put in each engine parameter of this
    rank (as `reference_layout`) and `kernel` what vLLM's per-layer processing then makes of it, by
    engine tensor name. About two copies of the rank's weights."""
    model = vllm_compat.model(worker)
    names = {id(m): n for n, m in model.named_modules()}
    loaded: dict[str, torch.Tensor] = {}
    kernel: dict[str, torch.Tensor] = {}

    def into(out):
        def capture(layer, tensors):
            prefix = names.get(id(layer), "")
            for pname, t in tensors.items():
                out[f"{prefix}.{pname}" if prefix else pname] = t.detach().clone()

        return capture

    vllm_compat.run_loaders(worker, iter(hf_weights), into(loaded), processed=into(kernel))
    return loaded, kernel
