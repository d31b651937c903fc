"""Engine-side layouts, derived by running vLLM's own weight loaders on index-coded tensors.

We never re-implement vLLM's tensor-parallel slicing or fusion rules. Once per engine layout, every
Hugging Face tensor is replaced by an integer tensor (int32 where every code fits, else int64) whose elements encode their own global position
(`code = 1 + hf_offset[name] + flat_index`), and the engine's normal loading path (`model.load_weights`
under vLLM's layerwise reload) runs on it. `vllm_compat.capture_mode` materialises each layer's
loaded-layout parameters as integer zeros, lets vLLM's original loaders fill them, hands them to us and
puts the layer's kernel tensors back, so the engine's weights never change and no restore is needed.
Each parameter's codes are compressed to row runs (`rows.engine_runs`) as soon as its layer completes
and freed, so derivation holds at most the layers whose HF tensors are in flight (HF tensors are fed in
name order, which groups them by layer): one layer's codes and its coded inputs, never the model's.
What comes out for every engine parameter on this TP rank is which HF rows and columns land where:
fusion (q/k/v -> qkv_proj, gate/up -> gate_up_proj), TP narrowing, vocab padding (code 0), and any
row-preserving layout transform, as vLLM's loaders do them.

Installing shards is `engine_side.py`. Functions here run inside a vLLM worker (through the
`WeightReceiver` extension's methods); they import vLLM lazily so this module imports with torch alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from . import vllm_compat
from .rows import ENGINE_COLS, engine_runs, rows_cols


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
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "dtype": self.dtype,
                "shapes": {n: list(s) for n, s in self.shapes.items()},
                "runs": {n: r.astype(np.int64).tobytes() for n, r in self.runs.items()}}

    @classmethod
    def from_wire(cls, d: dict) -> "EngineLayout":
        return cls(tp_rank=int(d["tp_rank"]), tp_size=int(d["tp_size"]), dtype=d["dtype"],
                   shapes={n: tuple(s) for n, s in d["shapes"].items()},
                   runs={n: np.frombuffer(b, dtype=np.int64).reshape(-1, len(ENGINE_COLS)) for n, b in d["runs"].items()})


def derive_layout(worker, hf_specs: list[tuple[str, tuple[int, ...]]]) -> EngineLayout:
    """Inside a vLLM worker: run vLLM's loaders on index-coded HF tensors and read where each row landed."""
    model = vllm_compat.model(worker)
    dtype = next(model.parameters()).dtype
    names = {id(m): n for n, m in model.named_modules()}
    offsets = np.cumsum([0] + [math.prod(s) for _, s in hf_specs])[:-1]
    hf_cols = np.asarray([rows_cols(tuple(s))[1] for _, s in hf_specs], dtype=np.int64)
    # int32 codes where every code fits (half the memory of int64: the coded inputs and the captured
    # layer are all derivation costs beyond the engine's own weights)
    total = sum(math.prod(s) for _, s in hf_specs)
    code_dtype = torch.int32 if total < 2**31 - 1 else torch.int64
    runs: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    def capture(layer, tensors: dict[str, torch.Tensor]) -> None:
        prefix = names.get(id(layer), "")
        for pname, t in tensors.items():
            name = f"{prefix}.{pname}" if prefix else pname
            r = engine_runs(t.reshape(rows_cols(tuple(t.shape))), offsets, hf_cols)
            if r.shape[0]:
                runs[name], shapes[name] = r, tuple(t.shape)

    def coded():
        for (name, shape), off in zip(hf_specs, offsets):
            n = math.prod(shape)
            yield name, torch.arange(int(off) + 1, int(off) + 1 + n, dtype=code_dtype).view(tuple(shape))

    vllm_compat.run_loaders(worker, coded(), capture, dtype=code_dtype)
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    ordered = sorted(runs, key=lambda n: order.get(n, len(order)))
    return EngineLayout(tp_rank=vllm_compat.tp_rank(), tp_size=vllm_compat.tp_size(),
                        dtype=str(dtype).removeprefix("torch."), shapes={n: shapes[n] for n in ordered},
                        runs={n: runs[n] for n in ordered})


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
