"""A `cpu` platform for verl, so a CPU-only host selects it instead of verl's CUDA fallback.

verl 0.9.1 resolves its device layer once per process (`verl/plugin/platform/platform_manager.py`,
`_detect_platform_name`): it probes the registered platforms (nvidia, huawei, amd) and, when none is
available, "Falling back to 'nvidia'", after which `get_device_id()` calls `torch.cuda.current_device()`
and fails ("Torch not compiled with CUDA enabled"). This class uses verl's own extension point
(`PlatformRegistry.register`), registered after the built-in ones, so it is chosen only where no
accelerator platform claims the host; `VERL_PLATFORM=cpu` forces it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import types
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _cpu_device_module() -> types.ModuleType:
    """What verl calls on `get_torch_device()`: torch.cpu's functions plus the memory statistics verl
    logs after every step (`engine_workers.py`, `_postprocess_output`), which torch.cpu lacks (0 here)."""
    m = types.ModuleType("rl_tpu_verl_cpu_device")
    for name in (
        "current_device",
        "device_count",
        "is_available",
        "synchronize",
        "set_device",
        "Stream",
        "current_stream",
        "stream",
        "Event",
    ):
        if hasattr(torch.cpu, name):
            setattr(m, name, getattr(torch.cpu, name))
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(m, name, lambda *a, **k: 0)
    m.empty_cache = lambda: None
    m.reset_peak_memory_stats = lambda *a, **k: None
    m.manual_seed = torch.manual_seed
    m.manual_seed_all = torch.manual_seed
    m.mem_get_info = lambda *a, **k: (0, 0)
    # verl/utils/flops_counter.py:77 recognises a CPU only when the device module *is* torch.cpu, else it
    # asks the module for a device name; "CPU" is the name its own CPU branch uses
    m.get_device_name = lambda *a, **k: "CPU"
    return m


def _tpu_host() -> bool:
    """A Cloud TPU VM: its chips appear as /dev/accel* (v2-v4) or VFIO groups (v5e and later), and
    the VM's metadata sets `TPU_ACCELERATOR_TYPE` / `TPU_NAME` for the processes of the runtime. Checked
    without importing a TPU library, which may be absent or claim the chips."""
    if os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_NAME"):
        return True
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _accelerator_present() -> bool:
    """Whether this host has an accelerator verl or rl-tpu runs on (CUDA/ROCm, Ascend, XPU, TPU): the
    CPU platform must not claim it, or verl would train there on the CPU without a word."""
    if torch.cuda.is_available() or (hasattr(torch, "npu") and torch.npu.is_available()):
        return True
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return True
    return _tpu_host()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    _module = None

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        if PlatformCPU._module is None:
            PlatformCPU._module = _cpu_device_module()
        return PlatformCPU._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # the last resort: claim the host only where no accelerator is visible (verl probes in
        # registration order and ours registers after nvidia/huawei/amd)
        return not _accelerator_present()

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # verl's Worker reads it; nothing on CPU depends on its value

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl places every worker by accelerator slots (single_controller/ray/base.py:229 counts only "GPU"
        # or "NPU"; vllm_async_server.py:1348 indexes get_accelerator_ids() by this name). On CPU those are
        # Ray's logical GPU slots, advertised with `+ray_kwargs.ray_init.num_gpus=N` (docs/verl.md).
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
