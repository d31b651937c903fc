"""Checkpoints and restarts of one trainer rank (the HF export is `TrainerWorker.export_hf`).

Invariants:
- A checkpoint folder holds `dcp/` (torch.distributed.checkpoint: every trained model and its optimizer
  state, keys `{name}_model` / `{name}_optim`, resharded on load to this run's world size) and one
  `extra_rank{r}.pt` per rank (policy step, LR schedules, torch and Python RNG states); a rank without
  its own file (a checkpoint of fewer ranks) reads rank 0's.
- Lazy devices (XLA): DCP reads and writes host copies (`set_state_dict` copies them back), and a
  trainer without FSDP2 (one rank) runs DCP without its coordination collectives, which the `xla`
  backend rejects on CPU tensors.
- A restart (`TrainerWorker.restart_from`) may change only the RESTARTABLE fields of the trainer
  config; the others shape the processes, the model build or the sharding and are fixed at start.
- A model with frozen parameters (a LoRA policy's base) saves its trained ones only (`_options`): the
  frozen ones come from `model.path`, as at the run's start.
- Saving and loading are collective (every rank calls them); saving ends on a barrier, so the folder is
  complete when any rank returns.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch
import torch.distributed as dist

from rl_tpu.config import TrainerConfig
from rl_tpu.devices import Device
from rl_tpu.trainer import model as tmodel
from rl_tpu.trainer.optim import Trained

# what `restart_from` may change: the optimizer, its schedule and the step's batching and row layout; the
# rest shapes the processes, the model build or the sharding and is fixed at start
RESTARTABLE = frozenset(
    {
        "total_steps",
        "lr",
        "weight_decay",
        "betas",
        "warmup_steps",
        "lr_schedule",
        "min_lr_ratio",
        "grad_clip",
        "ppo_epochs",
        "ppo_mini_batches",
        "micro_batch_size",
        "share_prompts",
        "skip_zero_advantage",
        "balance_tokens",
        "test_freq",
        "seed",
    }
)


def restart_conflicts(old: TrainerConfig, new: TrainerConfig) -> list[str]:
    """The fields of `new` outside RESTARTABLE that differ from `old` (a restart cannot apply them)."""
    return [
        f.name
        for f in dataclasses.fields(old)
        if f.name not in RESTARTABLE and getattr(old, f.name) != getattr(new, f.name)
    ]


def check_restartable(old: TrainerConfig, new: TrainerConfig, who: str) -> None:
    """ValueError naming the fields a restart from `old` to `new` cannot apply (`restart_conflicts`)."""
    fixed = restart_conflicts(old, new)
    if fixed:
        raise ValueError(
            f"{who}: {', '.join('trainer.' + f for f in fixed)} differ from the trainer's; they are "
            "fixed when its processes start (start a new TrainerGroup)"
        )


def _options(model: torch.nn.Module, loading: bool = False):
    """DCP state-dict options: a model with frozen parameters (a LoRA policy) saves its trained ones only;
    loading then leaves the frozen ones as they are (`strict` would call them missing). Every trained
    parameter is still loaded: `dcp.load` raises for a key of the state the checkpoint lacks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


class Checkpointer:
    """Saves and loads the trained models (`{"policy": Trained, "critic": Trained}`) of this rank."""

    def __init__(self, device: Device, rank: int, world_size: int):
        self.device, self.rank, self.world_size = device, rank, world_size

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _dcp_state(self, parts: dict[str, Trained]) -> tuple[dict, dict]:
        """The DCP state of every trained model, and DCP's extra arguments. Frozen parameters (a LoRA
        policy's base, `_options`) are not saved: they come from `model.path`, as at the run's start."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.utils._pytree import tree_map_only

        state = {}
        for name, (m, opt, _) in parts.items():
            state[f"{name}_model"], state[f"{name}_optim"] = get_state_dict(m, opt, options=_options(m))
        if self.device.lazy_tensors:
            state = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), state)
        return state, ({} if self.device.fsdp2 else {"no_dist": True})

    def save(self, path: str, parts: dict[str, Trained], step: int) -> str:
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        state, kw = self._dcp_state(parts)
        dcp.save(state, checkpoint_id=str(path / "dcp"), **kw)
        extra = {"step": step, "scheduler": parts["policy"].scheduler.state_dict()}
        extra["critic_scheduler"] = parts["critic"].scheduler.state_dict() if "critic" in parts else None
        extra.update(torch_rng=torch.get_rng_state(), py_rng=random.getstate(), world_size=self.world_size)
        torch.save(extra, path / f"extra_rank{self.rank}.pt")
        self.barrier()
        return str(path)

    def load(self, path: str, parts: dict[str, Trained]) -> int:
        """Load the models, optimizers, schedules and RNG states saved under `path`; returns the policy step."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        if not (path / "dcp").is_dir():
            raise FileNotFoundError(f"checkpoint {str(path)!r} has no dcp/ folder (not a trainer checkpoint)")
        state, kw = self._dcp_state(parts)
        dcp.load(state, checkpoint_id=str(path / "dcp"), **kw)
        for name, (m, opt, _) in parts.items():
            set_state_dict(
                m,
                opt,
                model_state_dict=state[f"{name}_model"],
                optim_state_dict=state[f"{name}_optim"],
                options=_options(m, loading=True),
            )
        self.device.step_end()
        own = path / f"extra_rank{self.rank}.pt"
        extra = torch.load(own if own.is_file() else path / "extra_rank0.pt", weights_only=False)
        parts["policy"].scheduler.load_state_dict(extra["scheduler"])
        if "critic" in parts and extra["critic_scheduler"] is not None:
            parts["critic"].scheduler.load_state_dict(extra["critic_scheduler"])
        torch.set_rng_state(extra["torch_rng"])
        random.setstate(extra["py_rng"])
        return extra["step"]


def saved_shapes(folder: str | Path, name: str = "policy") -> dict[str, tuple[int, ...]] | None:
    """The parameter shapes of the trained model `name` in the trainer checkpoint `folder`, by TorchTitan
    name, read from DCP's metadata (no tensor is read); None when there is none or it cannot be read."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(Path(folder) / "dcp")).read_metadata()
    except Exception:  # noqa: BLE001 - a missing or damaged file: the manifest check and the load say what
        return None
    prefix = f"{name}_model."
    return {
        key[len(prefix) :]: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }


def model_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """The parameter shapes the trainer loads from the HF folder `model_path`, by TorchTitan name: its
    config.json through the model's state-dict adapter, on the safetensors headers (no weight is read)."""
    from safetensors import safe_open

    spec = tmodel.build_model_spec(model_path)
    hf = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as reader:
            for key in reader.keys():
                hf[key] = torch.empty(reader.get_slice(key).get_shape(), device="meta")
    return {key: tuple(t.shape) for key, t in tmodel.hf_to_titan(spec, hf).items()}


def _layers(shapes: dict[str, tuple[int, ...]]) -> int:
    return len({key.split(".")[1] for key in shapes if key.startswith("layers.")})


def describe_shapes(shapes: dict[str, tuple[int, ...]]) -> str:
    """`vocab 512, hidden 128, 2 layers`: the sizes a model's parameter shapes show."""
    vocab_hidden = shapes.get("tok_embeddings.weight")
    dims = (
        f"vocab {vocab_hidden[0]}, hidden {vocab_hidden[1]}, "
        if vocab_hidden and len(vocab_hidden) == 2
        else ""
    )
    return f"{dims}{_layers(shapes)} layers"


def lora_mismatch(
    saved: dict[str, tuple[int, ...]], base: dict[str, tuple[int, ...]], rank: int
) -> str | None:
    """What keeps a checkpoint with parameter shapes `saved` from resuming a run whose `trainer.lora.rank`
    is `rank` (0: full fine-tuning) over a model of parameter shapes `base` (None: nothing LoRA stands in
    the way; a full-model checkpoint is then compared by `shape_mismatch`)."""
    adapters = {k: v for k, v in saved.items() if ".lora_a." in k or ".lora_b." in k}
    saved_rank = next((v[0] for k, v in adapters.items() if ".lora_a." in k), 0)
    if not rank:
        return (
            f"it holds LoRA adapters of rank {saved_rank}: resume with trainer.lora.rank = {saved_rank}"
            if adapters
            else None
        )
    if not adapters:
        return "it holds full-model weights, not LoRA adapters: resume it with trainer.lora.rank = 0"
    if saved_rank != rank:
        return f"its adapters have rank {saved_rank}, trainer.lora.rank is {rank}"
    for key, shape in sorted(adapters.items()):
        weight = key.split(".lora_")[0] + ".weight"
        if weight not in base or len(base[weight]) != 2:
            return f"{key} adapts {weight}, which the model does not have"
        out, inp = base[weight]
        want = (rank, inp) if ".lora_a." in key else (out, rank)
        if tuple(shape) != want:
            return f"{key} is {list(shape)} in the checkpoint, {list(want)} over this model"
    return None


def shape_mismatch(saved: dict[str, tuple[int, ...]], current: dict[str, tuple[int, ...]]) -> str | None:
    """What keeps a checkpoint with parameter shapes `saved` from loading into a model of shapes
    `current` (None: nothing): a parameter of another shape, another layer count, or a parameter the
    checkpoint lacks (which DCP refuses). Parameters only the checkpoint has are ignored, as DCP does."""
    differ = [key for key in current if key in saved and saved[key] != current[key]]
    if differ:  # shapes as lists: [512, 128], as the user reads them
        key = "tok_embeddings.weight" if "tok_embeddings.weight" in differ else differ[0]
        return f"{key} is {list(saved[key])} in the checkpoint, {list(current[key])} in the model"
    if _layers(saved) != _layers(current):
        return f"{_layers(saved)} layers in the checkpoint, {_layers(current)} in the model"
    missing = [key for key in current if key not in saved]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"the checkpoint has no {missing[0]}{more}"
    return None


def load_same_architecture(spec, model_path: str, current_path: str) -> dict[str, torch.Tensor]:
    """The TorchTitan weights of the HF folder `model_path`, which must hold the architecture of `spec`."""
    new = tmodel.build_model_spec(model_path)
    if new.config != spec.config:
        raise ValueError(f"restart_from: {model_path!r} is not the same architecture as {current_path!r}")
    return tmodel.hf_to_titan(new, tmodel.load_hf_state_dict(model_path))
