"""Process group, DeviceMesh and FSDP2 for one trainer rank, through TorchTitan's parallelize functions.

Invariants:
- One rank per Ray actor, bound to the device Ray assigned it (`init_process_group`, before the process
  group exists); the backend comes from the devices table (`gloo` on CPU, `nccl`, `tpu_dist`,
  `xla`), never from `if device == ...` here.
- After `build_parallel_model` every parameter is a DTensor on the `fsdp` mesh dimension
  (FSDP2 `Shard(0)`), also with one rank, so `param_specs()` looks the same at any world size.
  Exception: with `trainer.expert_parallel` > 1 an MoE model's experts live on TorchTitan's sparse
  mesh (`efsdp` x `ep`: `_StridedShard(0)`, `Shard(0)`), one block of whole experts per EP rank.
- Gradients are SUMMED across ranks (`set_force_sum_reduction_for_comms(True)`: gloo has no
  PREMUL_SUM, so FSDP's default average is unavailable). Losses must therefore be normalised by
  global (all-rank) token/sequence counts, which is what makes N ranks equal 1 rank.
- `trainer.fsdp_step = "replicated"` (the "auto" choice up to 500M parameters) builds with
  `reshard_after_forward="never"`, and the worker skips gradient sync and post-backward resharding until a
  rank's last micro-batch: one all-gather and one reduce-scatter per unit per optimizer step.
- Devices whose row has `fsdp2 = False` (xla: torch_xla 2.9's DeviceMesh carries no process groups,
  so `fully_shard` raises "DeviceMesh process groups not initialized!") train on ONE rank with plain,
  unsharded parameters: `make_parallel_dims` returns None and `build_parallel_model` skips the
  parallelize function. Compute is in the parameters' dtype (fp32): there is no FSDP mixed precision.
- `trainer.fsdp = "simple"`: TorchTitan's SimpleFSDP (experiments/graph_trainer/simple_fsdp.py) instead
  of FSDP2. Every parameter is again a DTensor `Shard(0)` on the `fsdp` mesh dimension (what
  `named_parameters()`, the optimizer, checkpoints and weight sync see), but no module is an
  `FSDPModule`: a parametrization all-gathers each parameter when a forward reads it (a DTensor
  redistribute, so a compiled block traces the collective into its program) and its backward
  reduce-scatters the gradient with a SUM (`Partial("sum")`), per micro-batch; `trainer.fsdp_step`
  does not apply. Dense models without TP/EP only (TorchTitan's parallelize function is skipped: at
  TP = EP = 1 all it does is FSDP2, compile and AC, which the trainer applies itself).
- `trainer.activation_checkpoint` ("selective" / "full"): TorchTitan's own policies (`SelectiveAC` /
  `FullAC`, torchtitan/distributed/activation_checkpoint.py) wrap each transformer block of the trained
  models in TorchTitan's order, after TP/EP and before FSDP: with FSDP2 TorchTitan's parallelize function
  applies them itself (`ac_config`), with SimpleFSDP `_simple_fsdp` applies them first. A wrapped block's
  parameters are registered under `_checkpoint_wrapped_module.`: `named_parameters(model)` below gives
  the unwrapped names everything else keys on (DCP's state dicts strip it themselves).
- TorchTitan 0.3.0 facts (docs/decisions.md, stack facts): `ParallelDims` builds meshes on
  `tools.utils.device_type`, which is "cuda" on a CPU-only host, so it is pointed at the devices-table
  device; the `partial_dtensor` SPMD backend is the one that works on gloo.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from rl_tpu.devices import Device


def init_process_group(
    device: Device, rank: int, world_size: int, master_addr: str, master_port: int
) -> None:
    """Bind this rank to its device, then join the trainer group (blocks until all `world_size` ranks
    have joined).

    The device index comes from the accelerator ids Ray assigned this actor (`rl_tpu.devices.bind`:
    CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS as Ray set them, or Ray's id itself in verl's
    RAY_EXPERIMENTAL_NOSET_* mode), and LOCAL_RANK is set to it, so torch's DeviceMesh, TorchTitan and
    torch-tpu pick the same device as `device.local_device()`. Where the group already exists (verl's
    worker made it and set LOCAL_RANK), the environment is left as it is and the binding only read."""
    if dist.is_initialized():
        device.bind(set_local_rank=False)
        return
    device.bind()
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    dist.init_process_group(
        backend=device.dist_backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )


def make_parallel_dims(device: Device, world_size: int, tp: int = 1, ep: int = 1):
    """FSDP over all ranks (times TP where the backend supports it), with `ep`-way expert parallelism
    of an MoE model's experts (FSDP over the other world_size / ep ranks for them); None on a device
    without FSDP2 (one rank, plain parameters)."""
    if world_size % ep:
        raise ValueError(f"trainer.expert_parallel = {ep} must divide trainer.world_size = {world_size}")
    if not device.fsdp2:
        if world_size != 1 or tp != 1 or ep != 1:
            raise ValueError(
                f"trainer.device = {device.name!r} trains on one rank without FSDP2 (docs/devices.md): "
                f"set trainer.world_size = 1 (got {world_size}, tp {tp})"
            )
        return None
    import torchtitan.distributed.parallel_dims as pd_mod
    import torchtitan.distributed.utils as dist_utils

    pd_mod.device_type = device.torch_device  # TorchTitan defaults this to "cuda" without a GPU
    dist_utils.set_spmd_backend("partial_dtensor")
    pdims = pd_mod.ParallelDims(
        dp_replicate=1,
        dp_shard=-1,
        cp=1,
        tp=tp,
        pp=1,
        ep=ep,
        world_size=world_size,
        spmd_backend="partial_dtensor",
    )
    pdims.build_mesh()
    return pdims


def build_parallel_model(
    spec,
    pdims,
    device: Device,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str = "default",
    extra_modules: dict | None = None,
    drop_lm_head: bool = False,
    fsdp: str = "fsdp2",
    activation_checkpoint: str = "none",
) -> torch.nn.Module:
    """Build `spec.config` on meta, parallelize with TorchTitan's fn, materialise on the local device.

    `extra_modules` (name -> TorchTitan Module) are attached to the root before FSDP, so they are
    sharded with the root unit (used for the critic's value head). Weights are uninitialised until
    `load_full_state_dict`; buffers (RoPE caches) are initialised here. `activation_checkpoint` wraps the
    transformer blocks in TorchTitan's policy of that name (module docstring).
    """
    ac = ac_config(activation_checkpoint)
    config = spec.config if pdims is None or pdims.ep == 1 else expert_parallel_config(spec, pdims.ep)
    with torch.device("meta"):
        model = config.build()
        if drop_lm_head:
            model.lm_head = None
        for name, mod in (extra_modules or {}).items():
            setattr(model, name, mod.build() if hasattr(mod, "build") else mod)
    if pdims is None:  # one rank, plain parameters (see the module docstring)
        if param_dtype != "float32":
            raise ValueError(
                f"trainer.param_dtype = {param_dtype!r}: {device.name!r} trains without FSDP2 mixed "
                "precision, in the parameters' float32 (set trainer.param_dtype = 'float32')"
            )
        if ac is not None:
            ac.build().apply(model)
    elif fsdp == "simple":
        model = _simple_fsdp(model, pdims, param_dtype, reduce_dtype, ac)
    elif fsdp == "fsdp2":
        model = _parallelize(spec, model, pdims, param_dtype, reduce_dtype, reshard_after_forward, ac)
    else:
        raise ValueError(f"trainer.fsdp = {fsdp!r}: expected 'fsdp2' or 'simple'")
    local = device.local_device()
    model.to_empty(device=local)
    with torch.no_grad(), _parametrization_off(model):
        model.init_weights(buffer_device=local)
    return model


AC_POLICIES = ("none", "selective", "full")  # trainer.activation_checkpoint


def ac_config(name: str):
    """TorchTitan's activation-checkpointing config for `trainer.activation_checkpoint` (None: "none")."""
    if name not in AC_POLICIES:
        raise ValueError(f"trainer.activation_checkpoint = {name!r}: expected one of {AC_POLICIES}")
    if name == "none":
        return None
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return SelectiveAC.Config() if name == "selective" else FullAC.Config()


def checkpointed_blocks(model: torch.nn.Module) -> int:
    """How many of `model`'s modules an activation-checkpointing policy wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    return sum(isinstance(m, ActivationWrapper) for m in model.modules())


_AC_PREFIX = "_checkpoint_wrapped_module."


def named_parameters(model: torch.nn.Module):
    """`model.named_parameters()` under the names of the unwrapped model: an activation-checkpointed
    block registers its module as `_checkpoint_wrapped_module` (torch's checkpoint_wrapper)."""
    for name, p in model.named_parameters():
        yield name.replace(_AC_PREFIX, ""), p


def _simple_fsdp(model, pdims, param_dtype: str, reduce_dtype: str, ac=None) -> torch.nn.Module:
    """TorchTitan's `apply_simple_fsdp` (graph_trainer/common_utils.py) on the built model (module
    docstring), after activation checkpointing `ac` (TorchTitan's order: AC, then FSDP)."""
    from torchtitan.config import TrainingConfig
    from torchtitan.experiments.graph_trainer.common_utils import apply_simple_fsdp

    if pdims.tp != 1 or pdims.ep != 1:
        raise ValueError(
            f"trainer.fsdp = 'simple' shards dense models over data parallelism only (TP {pdims.tp}, "
            f"EP {pdims.ep}): use trainer.fsdp = 'fsdp2'"
        )
    if ac is not None:
        ac.build().apply(model)
    training = TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce=reduce_dtype)
    return apply_simple_fsdp(model, parallel_dims=pdims, training=training)


def uses_simple_fsdp(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("SimpleFSDP") for m in model.modules())


def _parametrization_off(model: torch.nn.Module):
    """SimpleFSDP's parameters read as their DTensor shards (no all-gather) inside this context, so
    `init_weights` writes the shards in place; a no-op context for other models."""
    import contextlib

    if not uses_simple_fsdp(model):
        return contextlib.nullcontext()
    from torchtitan.experiments.graph_trainer.simple_fsdp import disable_active_parametrization

    return disable_active_parametrization()


def expert_parallel_config(spec, ep: int):
    """A copy of `spec.config` carrying TorchTitan's expert-parallel sharding declarations
    (`set_qwen3_sharding_config`, sequence parallelism off), which `parallelize_qwen3` applies
    (`Module.parallelize`): experts `Shard(0)` over the `ep` mesh dim (FSDP2 then shards each rank's
    experts over `efsdp`, as `_StridedShard(0)`), the router replicated, tokens dispatched all-to-all.
    Dense modules are declared too but stay FSDP only (TP is 1)."""
    import copy

    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    layers = [layer.moe for layer in spec.config.layers if getattr(layer, "moe", None) is not None]
    if spec.arch != "qwen3_moe" or not layers:
        raise ValueError(f"trainer.expert_parallel = {ep}: the model ({spec.arch}) has no experts")
    for moe in layers:
        if moe.num_experts % ep:
            raise ValueError(
                f"trainer.expert_parallel = {ep} must divide the number of experts ({moe.num_experts})"
            )
    config = copy.deepcopy(spec.config)
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    return config


def _parallelize(
    spec, model, pdims, param_dtype: str, reduce_dtype: str, reshard_after_forward: str, ac=None
) -> torch.nn.Module:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    if spec.parallelize_fn is None:
        raise ValueError(
            "this TorchTitan has no parallelize function for the trainer's model (TorchTitan 0.2.0, "
            "rl_tpu.trainer.titan_compat): it trains on one rank without FSDP2 only"
        )
    model = spec.parallelize_fn(
        model,
        parallel_dims=pdims,
        training=TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce=reduce_dtype),
        parallelism=ParallelismConfig(
            spmd_backend="partial_dtensor",
            tensor_parallel_degree=pdims.tp,
            fsdp_reshard_after_forward=reshard_after_forward,
        ),
        compile_config=CompileConfig(enable=False),
        ac_config=ac,  # applied after TP/EP, before FSDP
        dump_folder="",
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


# "auto" replicates within a step up to this size: full fp32 parameters + gradients on each rank, 4 GB
REPLICATED_STEP_MAX_PARAMS = 500_000_000


def replicated_step(mode: str, num_params: int) -> bool:
    """Whether FSDP2 keeps parameters gathered and gradients local for a whole optimizer step
    (`trainer.fsdp_step`). On CPU the gloo collectives do not overlap compute, so each one saved counts
    (docs/decisions.md has the measurement)."""
    if mode not in ("auto", "sharded", "replicated"):
        raise ValueError(f"trainer.fsdp_step = {mode!r}: expected 'auto', 'sharded' or 'replicated'")
    return mode == "replicated" or (mode == "auto" and num_params <= REPLICATED_STEP_MAX_PARAMS)


def reshard(model: torch.nn.Module) -> None:
    """Return every FSDP unit to its sharded state. A forward without backward leaves units built with
    `reshard_after_forward=False` (the root, norm+lm_head) unsharded, i.e. plain full tensors."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def load_full_state_dict(
    model: torch.nn.Module, full_sd: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Copy full (unsharded) tensors into the model's DTensor shards; no communication (every rank
    holds the full tensor, so each takes its own slice)."""
    params = dict(named_parameters(model))
    missing = sorted(set(params) - set(full_sd))
    unexpected = sorted(set(full_sd) - set(params))
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing {missing[:5]} unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if name not in full_sd:
                continue
            src = full_sd[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(
                    f"parameter {name}: checkpoint shape {tuple(src.shape)} != model {tuple(p.shape)}"
                )
            src = src.to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                shard = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())
            else:
                p.copy_(src)


def full_state_dict(
    model: torch.nn.Module, keep: Callable[[str, torch.Tensor], bool] | None = None
) -> dict[str, torch.Tensor]:
    """Unsharded parameters on CPU (collective: every rank must call it, with the same `keep`), only those
    `keep(name, param)` accepts when given. FSDP's row shards (`Shard(0)` over one mesh dimension) are
    gathered together, one collective per group of `GATHER_BYTES` of them rather than one per tensor:
    many small tensors (a LoRA policy's adapters) otherwise cost one round trip each."""
    out, batch, names = {}, [], []
    for name, p in named_parameters(model):
        if keep is not None and not keep(name, p):
            continue
        names.append(name)
        t = p.detach()
        if isinstance(t, DTensor) and row_sharded(t):
            batch.append((name, t))
            continue
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name] = t.to("cpu").clone()
    # consecutive shards on one mesh and dtype gather together; every rank walks the same parameters in
    # the same order, so every rank forms the same groups
    group: list[tuple[str, DTensor]] = []
    nbytes = 0
    for name, t in batch:
        size = _chunk_numel(t) * t.device_mesh.size() * t.element_size()
        if group and (not _same_group(group[0][1], t) or nbytes + size > GATHER_BYTES):
            out.update(_gather_rows(group))
            group, nbytes = [], 0
        group.append((name, t))
        nbytes += size
    out.update(_gather_rows(group))
    return {name: out[name] for name in names}


GATHER_BYTES = 256 * 2**20  # the gathered bytes of one batched collective in `full_state_dict`


def row_sharded(t: DTensor) -> bool:
    """FSDP's row sharding: `Shard(0)` over a one-dimensional mesh (each rank holds torch.chunk's rows)."""
    from torch.distributed.tensor import Shard

    return t.device_mesh.ndim == 1 and t.placements == (Shard(0),) and t.dim() >= 1


def _same_group(a: DTensor, b: DTensor) -> bool:
    return a.device_mesh == b.device_mesh and a.dtype == b.dtype


def _chunk_numel(t: DTensor) -> int:
    """Elements of one rank's padded chunk: torch.chunk's row count (ceil) times the row size."""
    rows = -(-t.shape[0] // t.device_mesh.size())
    return rows * (t.numel() // max(t.shape[0], 1))


def _gather_rows(group: list[tuple[str, DTensor]]) -> dict[str, torch.Tensor]:
    """Full tensors of row-sharded DTensors on one mesh and dtype, by one all-gather of every rank's
    chunks, each padded to torch.chunk's size."""
    if not group:
        return {}
    mesh = group[0][1].device_mesh
    world = mesh.size()
    sizes = [_chunk_numel(t) for _, t in group]
    send = torch.zeros(sum(sizes), dtype=group[0][1].dtype, device=group[0][1].to_local().device)
    offset = 0
    for (_, t), n in zip(group, sizes):
        local = t.to_local().reshape(-1)
        send[offset : offset + local.numel()] = local
        offset += n
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send, group=mesh.get_group())
    out = {}
    offset = 0
    for (name, t), n in zip(group, sizes):
        row = t.numel() // max(t.shape[0], 1)
        chunk_rows = n // row if row else 0
        parts = []
        for r in range(world):
            rows = max(0, min(chunk_rows, t.shape[0] - r * chunk_rows))
            parts.append(recv[r][offset : offset + rows * row])
        out[name] = torch.cat(parts).reshape(t.shape).to("cpu").clone()
        offset += n
    return out
