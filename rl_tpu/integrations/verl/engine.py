"""`RlTpuEngine`: verl's training-engine interface (`verl.workers.engine.BaseEngine`) over rl-tpu's trainer.

verl selects it with `actor_rollout_ref.actor.strategy=rl_tpu` (registered for the `cpu`, `cuda` and `tpu`
device keys under model type `language_model`). It holds one `rl_tpu.trainer.worker.TrainerWorker`
per rank: the same TorchTitan model, FSDP2 mesh, chunked log-prob head, AdamW, LR schedule and DCP
checkpoints as `rl-tpu train`; only the batch format and the loss come from verl.

Invariants and decisions:
- verl's batch is "no padding": `input_ids` / `position_ids` are jagged nested tensors of prompt+response
  tokens. Our model runs right-padded rows starting at position 0 (SDPA causal, see trainer/model.py), so
  each micro-batch is right-padded here and the per-token outputs are packed back into jagged tensors;
  rows whose `position_ids` are not 0..n-1 (packed or multi-modal rows) are refused.
- `model_output["log_probs"][t]` is the log-prob of token t+1 at position t (verl's `torch.roll(ids, -1)`
  labels); the last position of a row is never read (`no_padding_2_padding` stops one short).
- Gradients: verl's losses are scaled for FSDP's *averaged* gradients (`ppo_loss` multiplies by
  `dp_size`); our FSDP *sums* them (gloo has no PREMUL_SUM, trainer/parallel.py), so the backward runs on
  `loss / dp_size`. The reported loss is verl's own value.
- Micro-batching is verl's (`prepare_micro_batches` / `postprocess_batch_func`), driven by the
  engine config's `use_dynamic_bsz` / `micro_batch_size_per_gpu` as for verl's own engines.
- LoRA (`model.lora_rank > 0`, `lora_alpha`, `target_modules` "all-linear" or a list of the decoder's
  linears) maps onto `trainer.lora`, and weights leave as verl's own FSDP engine hands them to its
  rollout: `get_per_tensor_param(base_sync_done=False)` the frozen base under HF names (with the PEFT
  config), `base_sync_done=True` the adapters under PEFT's names, `model.lora.merge = true` the merged
  weights; `disable_adapter()` (verl's reference without a separate model) zeroes the adapter path.
- Not implemented (raise NotImplementedError naming the option): parameter/optimizer offload, LoRA's
  `lora_adapter_path` and `exclude_modules`, fp16, optimizers other than AdamW, per-shard exports, hdfs
  checkpoint paths, 3-D (m-RoPE) positions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.engine.base import BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from rl_tpu.config import Config, LoraConfig, check_lora

BACKEND = "rl_tpu"  # actor_rollout_ref.actor.strategy / critic.strategy
DEVICES = ["cpu", "cuda", "tpu"]
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def lora_config(model_config: Any) -> LoraConfig:
    """verl's LoRA keys (`model.lora_rank`, `lora_alpha`, `target_modules`) as `trainer.lora` (rank 0: off)."""
    from rl_tpu.config import LORA_TARGETS

    rank = int(getattr(model_config, "lora_rank", 0) or 0)
    if not rank:
        return LoraConfig()
    for key in ("lora_adapter_path", "exclude_modules"):
        if getattr(model_config, key, None):
            raise NotImplementedError(f"rl_tpu engine: LoRA with model.{key} is not implemented")
    targets = getattr(model_config, "target_modules", "all-linear")
    if targets == "all-linear":
        targets = list(LORA_TARGETS)
    if isinstance(targets, str) or not set(targets) <= set(LORA_TARGETS):
        raise NotImplementedError(
            f"rl_tpu engine: model.target_modules = {targets!r}: 'all-linear' or a list of "
            f"{', '.join(LORA_TARGETS)}"
        )
    return LoraConfig(rank=rank, alpha=float(getattr(model_config, "lora_alpha", 16)), targets=list(targets))


def trainer_config(
    engine_config: Any, optimizer_config: Any, device: str, world_size: int, lora: LoraConfig | None = None
) -> Config:
    """rl-tpu's `Config` for one verl engine: verl's engine/optimizer keys mapped onto `[trainer]`."""
    opt = optimizer_config
    dtype = _DTYPES.get(str(engine_config.dtype))
    if dtype is None:
        raise NotImplementedError(
            f"rl_tpu engine: engine dtype {engine_config.dtype!r} is not supported (float32 or bfloat16)"
        )
    name = getattr(opt, "optimizer", None) or getattr(opt, "name", "AdamW")
    if name != "AdamW":
        raise NotImplementedError(f"rl_tpu engine: optimizer {name!r} is not supported (AdamW)")
    if getattr(opt, "eps", 1e-8) != 1e-8:
        raise NotImplementedError(f"rl_tpu engine: optim eps {opt.eps} is not supported (1e-8)")
    schedule = getattr(opt, "lr_scheduler_type", None) or getattr(opt, "warmup_style", None) or "constant"
    if schedule not in ("constant", "cosine"):
        raise NotImplementedError(
            f"rl_tpu engine: lr scheduler {schedule!r} is not supported (constant, cosine)"
        )
    total = opt.total_training_steps if opt.total_training_steps and opt.total_training_steps > 0 else 1
    warmup = opt.lr_warmup_steps
    if warmup is None or warmup < 0:  # verl: -1 defers to the ratio of total steps
        warmup = int(opt.lr_warmup_steps_ratio * total)
    cfg = Config()
    cfg.model.dtype = dtype
    t = cfg.trainer
    t.device, t.world_size, t.seed = device, world_size, int(engine_config.seed)
    t.lr, t.weight_decay, t.betas = float(opt.lr), float(opt.weight_decay), [float(b) for b in opt.betas]
    t.grad_clip = float(opt.clip_grad) if opt.clip_grad is not None else 0.0
    t.total_steps, t.warmup_steps, t.lr_schedule = int(total), int(warmup), schedule
    t.min_lr_ratio = float(getattr(opt, "min_lr_ratio", None) or 0.0)
    t.num_threads = torch.get_num_threads()  # keep the process's thread count (verl sets it per worker)
    if lora is not None and lora.rank:
        t.lora = lora
        check_lora(cfg)  # k/v together, the modes LoRA runs with
    return cfg


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=DEVICES)
class RlTpuEngine(BaseEngine):
    """One rank of rl-tpu's FSDP2 TorchTitan trainer behind verl's engine interface."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any):
        super().__init__()
        for key in ("param_offload", "optimizer_offload"):
            if getattr(engine_config, key, False):
                raise NotImplementedError(f"rl_tpu engine: {key} is not implemented")
        self.lora = lora_config(model_config)
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.worker = None  # rl_tpu.trainer.worker.TrainerWorker, built by initialize()
        self.mode = None

    # ------------------------------------------------------------------ construction

    def initialize(self) -> None:
        """Build the policy (collective). verl's `reset()` calls this; a second call keeps the weights."""
        if self.worker is not None:
            return
        from rl_tpu.trainer.worker import TrainerWorker

        if not dist.is_initialized():
            raise RuntimeError("rl_tpu engine: torch.distributed is not initialised (verl's worker does it)")
        path = getattr(self.model_config, "local_path", None) or self.model_config.path
        cfg = trainer_config(
            self.engine_config, self.optimizer_config, get_device_name(), dist.get_world_size(), self.lora
        )
        # TrainerWorker joins the group verl already initialised (init_process_group is skipped then)
        self.worker = TrainerWorker(
            cfg,
            path,
            dist.get_rank(),
            dist.get_world_size(),
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", 0)),
        )

    @property
    def module(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs) -> BaseEngineCtx:
        return _TrainMode(self, **kwargs)

    def eval_mode(self, **kwargs) -> BaseEngineCtx:
        return _EvalMode(self, **kwargs)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_size(self) -> int:
        return dist.get_world_size()

    def get_data_parallel_group(self):
        return dist.group.WORLD  # FSDP over every rank (trainer/parallel.py: dp_shard=-1, no TP)

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True  # no model parallelism: every rank holds its own rows' outputs

    # ------------------------------------------------------------------ compute

    def forward_backward_batch(
        self, data: TensorDict, loss_function: Callable | None, forward_only: bool = False
    ) -> Any:
        """Forward (and backward unless `forward_only`) of this rank's rows, in verl's micro-batches;
        returns verl's `{"model_output", "loss", "metrics"}` with jagged `log_probs` (and `entropy`)."""
        w = self.worker
        group = self.get_data_parallel_group()
        dp_size = self.get_data_parallel_size()
        # global token count: verl's losses normalise by it (`agg_loss(..., batch_num_tokens=...)`)
        n_tok = data["loss_mask"].sum().to(device=w.local, dtype=torch.float64).reshape(1)
        dist.all_reduce(n_tok, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=int(n_tok.item()), dp_size=dp_size)
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        outputs = []
        for mb in micro_batches:
            with torch.no_grad() if forward_only else nullcontext():
                loss, out = self._forward_step(mb, loss_function)
                if not forward_only:
                    (loss / dp_size).backward()  # FSDP sums over ranks where verl's loss expects a mean
            outputs.append(out)
        if forward_only:
            from rl_tpu.trainer import parallel

            parallel.reshard(w.model)  # a forward without backward leaves the root unit unsharded
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def _forward_step(self, mb: TensorDict, loss_function: Callable | None) -> tuple[torch.Tensor, dict]:
        from rl_tpu.trainer import ops

        w = self.worker
        mb = mb.to(w.local)
        ids_nt = mb["input_ids"]
        offsets = ids_nt.offsets()
        lens = offsets.diff().tolist()
        _check_positions(mb["position_ids"], lens)
        b, L = len(lens), max(lens)
        ids = torch.nested.to_padded_tensor(ids_nt, padding=w.pad_id, output_size=(b, L))
        Lb = ops.bucket_length(L, w.tc.seq_len_buckets)  # static shapes on TPU/XLA; right padding is inert
        if Lb > L:
            ids = torch.nn.functional.pad(ids, (0, Lb - L), value=w.pad_id)
        hidx = torch.arange(L, device=ids.device).expand(b, L)
        targets = torch.roll(ids[:, :L], shifts=-1, dims=1)  # position t scores token t+1
        head = w.model.lm_head
        head.rl_index, head.rl_temperature = (hidx, targets), _temperature(mb)
        try:
            lp, ent = w.model(ids)  # [b, L] each (the chunked log-prob head, trainer/converters.py)
        finally:
            head.rl_index, head.rl_temperature = None, 1.0

        def jagged(x: torch.Tensor) -> torch.Tensor:
            return torch.nested.nested_tensor_from_jagged(
                torch.cat([x[i, :n] for i, n in enumerate(lens)]), offsets
            )

        model_output = {"log_probs": jagged(lp)}
        if tu.get_non_tensor_data(data=mb, key="calculate_entropy", default=False):
            model_output["entropy"] = jagged(ent)
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=mb, dp_group=self.get_data_parallel_group()
            )
        else:
            loss, metrics = torch.zeros((), device=w.local), {}
        out = {
            "model_output": {k: v.detach() for k, v in model_output.items()},
            "loss": float(loss.detach().item()),
            "metrics": metrics,
        }
        return loss, out

    def optimizer_zero_grad(self) -> None:
        self.worker.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Clip (trainer.grad_clip = verl's optim.clip_grad) and step; a non-finite norm skips the step."""
        from torchtitan.distributed import utils as dist_utils

        w = self.worker
        params = [p for p in w.model.parameters() if p.grad is not None]
        max_norm = w.tc.grad_clip if w.tc.grad_clip > 0 else float("inf")
        grad_norm = dist_utils.clip_grad_norm_(params, max_norm, foreach=True)
        if torch.isfinite(grad_norm):
            w.optimizer.step()
            w._stepped("actor")  # the step count, and a lazy device's host copy of the weights is stale
        w.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def lr_scheduler_step(self) -> float:
        self.worker.scheduler.step()
        return float(self.worker.scheduler.get_last_lr()[0])

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        if (model or optimizer) and torch.device(device).type != self.worker.local.type:
            raise NotImplementedError(
                f"rl_tpu engine: moving the model to {device!r} (offload) is not implemented; "
                f"it stays on {self.worker.local}"
            )

    # ------------------------------------------------------------------ weights out

    def get_per_tensor_param(
        self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs
    ) -> tuple[Generator[tuple[str, torch.Tensor], None, None], dict | None]:
        """Full tensors under Hugging Face names, and verl's PEFT config (None without LoRA). Lazy: the
        gather (collective, every rank must iterate) starts at the first `next()`. verl calls this before
        every `send_weights` (engine_workers.py:764); the `rl_tpu` checkpoint backend never iterates it,
        so it never gathers. Under LoRA, as verl's FSDP engine: the frozen base (`base_sync_done` False),
        the adapters under PEFT's names (True), or the merged weights (`model.lora.merge`, no config)."""
        if not self.lora.rank:
            return self._hf_params(), None
        if (getattr(self.model_config, "lora", None) or {}).get("merge", False):
            return self._hf_params(), None  # the merged weights, W + (alpha / rank) B A
        from rl_tpu import peft_folder

        params = self._adapter_params() if base_sync_done else self._base_params()
        return params, peft_folder.config(self.lora)

    def _hf_params(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        from rl_tpu.trainer import model as tmodel

        yield from tmodel.titan_to_hf(self.worker.spec, self.worker.policy_state()).items()

    def _base_params(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        from rl_tpu.trainer import lora, parallel
        from rl_tpu.trainer import model as tmodel

        base = parallel.full_state_dict(self.worker.model, lambda n, _: not lora.is_adapter(n))
        yield from tmodel.titan_to_hf(self.worker.spec, base).items()

    def _adapter_params(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        yield from self.worker.peft_tensors().items()

    def disable_adapter(self):
        """The base model for the span of the context (verl's reference without a separate model)."""
        from rl_tpu.trainer import lora

        return lora.adapters_off(self.worker.model)

    def get_per_tensor_param_shard(self, **kwargs):
        raise NotImplementedError(
            "rl_tpu engine: per-shard export (verl's delta_sharded backends) is not "
            "implemented; the `rl_tpu` checkpoint backend syncs shards by plan instead"
        )

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs,
    ) -> None:
        if hdfs_path:
            raise NotImplementedError("rl_tpu engine: hdfs checkpoint paths are not implemented")
        self.worker.save_checkpoint(local_path)  # DCP: model + optimizer + scheduler (trainer/checkpoint.py)

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs
    ) -> None:
        if hdfs_path:
            raise NotImplementedError("rl_tpu engine: hdfs checkpoint paths are not implemented")
        self.worker.load_checkpoint(local_path)


def _check_positions(position_ids: torch.Tensor, lens: list[int]) -> None:
    """Our model places row tokens at 0..n-1 (no positions input); refuse anything else rather than
    silently computing with wrong positions."""
    if position_ids.dim() == 3:
        raise NotImplementedError("rl_tpu engine: 3-D (m-RoPE) position_ids are not supported")
    expected = torch.cat([torch.arange(n) for n in lens]).to(position_ids.device)
    if not torch.equal(position_ids.values().to(expected.dtype), expected):
        raise NotImplementedError(
            "rl_tpu engine: rows must be one sequence at positions 0..n-1 "
            "(packed or offset position_ids are not supported)"
        )


def _temperature(mb: TensorDict) -> float:
    t = mb["temperature"] if "temperature" in mb.keys() else 1.0
    if torch.is_tensor(t):
        if t.numel() > 1 and not bool((t == t.flatten()[0]).all()):
            raise NotImplementedError("rl_tpu engine: a different temperature per row is not supported")
        t = t.flatten()[0].item()
    return float(t)


class _TrainMode(BaseEngineCtx):
    def __init__(self, engine: RlTpuEngine, **kwargs):
        super().__init__(engine=engine, mode="train", **kwargs)

    def __enter__(self):
        super().__enter__()
        self.engine.worker.model.train()

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.zero_grad_on_exit or exc_type is not None:
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_val, exc_tb)


class _EvalMode(BaseEngineCtx):
    def __init__(self, engine: RlTpuEngine, **kwargs):
        super().__init__(engine=engine, mode="eval", **kwargs)

    def __enter__(self):
        super().__enter__()
        self.engine.worker.model.eval()


# ---------------------------------------------------------------------- verl's separate-async trainer


def save_local_shards(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's parameter shards. verl's fsdp2 helper uses `.cpu()`, which on a CPU host
    returns the live tensor itself, so the "saved" pi_old would follow every optimizer step; this clones."""
    from rl_tpu.weight_sync.sender import fsdp_local_shards

    return {n: t.clone() for n, t in fsdp_local_shards(module).items()}


@torch.no_grad()
def restore_local_shards(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy shards saved by `save_local_shards` back into the same parameters, in place."""
    from rl_tpu.weight_sync.sender import fsdp_local_shards

    local = fsdp_local_shards(module)  # views of the parameters' own storage
    if local.keys() != saved.keys():
        raise ValueError(
            f"rl_tpu engine: saved shards do not match the model's parameters "
            f"(missing {sorted(local.keys() - saved.keys())[:3]}, extra {sorted(saved.keys() - local.keys())[:3]})"
        )
    for n, t in local.items():
        t.copy_(saved[n])


def _hook_detach_worker() -> None:
    """verl's v1 `separate_async` trainer (trainer_separate_async.py:203-210) keeps pi_old through
    `DetachActorWorker.save_model_to_cpu` / `restore_model_from_cpu`, whose handlers are chosen by strategy
    (verl/experimental/separation/engine_workers.py:108 raises for any other): ours for `rl_tpu`. The
    restore branch for strategies other than fsdp2/veomni (:158) passes the saved object as is."""
    from rl_tpu.integrations.verl.patches import _after_import

    def patch(mod) -> None:
        cls = mod.DetachActorWorker
        orig = cls._get_strategy_handlers
        if getattr(orig, "_rl_tpu", False):
            return

        def _get_strategy_handlers(self):
            if self.config.actor.strategy == BACKEND:
                return save_local_shards, restore_local_shards
            return orig(self)

        _get_strategy_handlers._rl_tpu = True
        cls._get_strategy_handlers = _get_strategy_handlers

    _after_import("verl.experimental.separation.engine_workers", patch)


_hook_detach_worker()
