"""`TrainerWorker`: one trainer rank (a Ray actor) holding the FSDP2 policy, optional frozen reference
and optional critic, all TorchTitan models whose parameters are DTensors.

The worker composes TorchTitan-style components, one file each:
- build.py: the models, built, parallelised, loaded and converted by the declared model converters
  (converters.py: CPU matmul kernels, the log-prob head);
- optim.py: each trained model's optimizer and LR schedule;
- forward.py: the batch's rows, micro-batches and padding on this rank, and the forward passes;
- update.py: the PPO / GRPO policy update and the critic update; metrics.py: their reduction over ranks;
- checkpoint.py: checkpoints, restarts and HF export.

Invariants:
- Methods that touch parameters are collective: the group calls them on every rank, in the same order.
- `self.tc` is the trainer config in force (a restart may replace its RESTARTABLE fields); components
  get it with every call, never keep a copy of it.
- `_weights_changed` runs whenever the policy's weights change (an optimizer step, a checkpoint load,
  a restart): the host copy lazy devices sync from is then dropped.
- Lazy-tensor devices (XLA): loaded weights and optimizer state become device data before step 1;
  `perf/compiles` counts the programs compiled by this rank so far; so it does with
  `trainer.mode = "compile"` (dynamo's count, trainer/modes.py) and `"graph"` (AOTAutograd's count with
  inductor; the graphs captured with `graph_compile = "none"`).
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist

from rl_tpu import peft_folder
from rl_tpu.config import AlgorithmConfig, Config, TrainerConfig
from rl_tpu.devices import get_device, kernels
from rl_tpu.fault_hooks import fault_hook
from rl_tpu.metrics import process_rss_mb
from rl_tpu.trainer import checkpoint, lora, modes, parallel
from rl_tpu.trainer import model as tmodel
from rl_tpu.trainer.build import ModelBuilder
from rl_tpu.trainer.checkpoint import RESTARTABLE, check_restartable, restart_conflicts
from rl_tpu.trainer.forward import Forward
from rl_tpu.trainer.optim import Trained, build_optimizer
from rl_tpu.trainer.update import Updater
from rl_tpu.types import TrainBatch
from rl_tpu.weight_sync.sender import SyncSender
from rl_tpu.weight_sync.specs import ParamSpec

# imported from here by trainer/group.py and rl_tpu/controller/loop.py
__all__ = ["RESTARTABLE", "TrainerWorker", "check_restartable", "restart_conflicts"]


class TrainerWorker(SyncSender):
    def __init__(
        self, cfg: Config, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int
    ):
        tc = cfg.trainer
        self.cfg, self.tc, self.rank, self.world_size = cfg, tc, rank, world_size
        self.model_path = str(model_path)
        self.device = get_device(tc.device)
        self.device.init()  # imports the device runtime and registers its distributed backend
        torch.set_num_threads(tc.num_threads)
        parallel.init_process_group(self.device, rank, world_size, master_addr, master_port)
        self.device.seed(tc.seed)
        self.local = self.device.local_device()

        attention, self.attention_why = kernels.resolve_attention(
            tc.attention, self.device, kernels.has_triton()
        )
        self.spec = tmodel.build_model_spec(model_path, attention=attention)
        self.fwd = Forward.for_model(self.spec, self.device, tc, rank, world_size)
        self.pad_id = self.fwd.pad_id
        titan_sd = tmodel.hf_to_titan(self.spec, tmodel.load_hf_state_dict(model_path))
        self.builder = ModelBuilder(
            cfg, self.spec, self.device, rank, world_size, sum(t.numel() for t in titan_sd.values())
        )
        self.model = self.builder.policy(titan_sd)
        self.optimizer, self.scheduler = build_optimizer(self.model, tc.lr, tc, self.device.lazy_tensors)
        self.ref = self.builder.policy(titan_sd, frozen=True) if tc.reference else None
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if tc.critic:
            self.critic = self.builder.critic(titan_sd)
            self.critic_optimizer, self.critic_scheduler = build_optimizer(
                self.critic, tc.critic_lr, tc, self.device.lazy_tensors
            )
        self.updater = Updater(self.fwd, self.device, self.builder.replicated_step, self._stepped)
        self.ckpt = checkpoint.Checkpointer(self.device, rank, world_size)
        self.step = 0  # optimizer steps taken by the policy
        self._host: dict[str, torch.Tensor] | None = None  # host copy of the weights (lazy devices' sync)
        # LoRA: the adapters' PEFT names and B row orders (lora.peft_layout), computed on first use
        self._peft_layout: list | None = None
        self.device.step_end()  # loaded weights and optimizer state become device data before step 1
        if self.device.lazy_tensors:
            self.ws_shards()  # XLA compiles a transfer program per parameter shape: now, not after step 1

    def _trained(self) -> dict[str, Trained]:
        """The models that train, with their optimizers and schedules, by checkpoint name."""
        parts = {"policy": Trained(self.model, self.optimizer, self.scheduler)}
        if self.critic is not None:
            parts["critic"] = Trained(self.critic, self.critic_optimizer, self.critic_scheduler)
        return parts

    def _weights_changed(self) -> None:
        self._host = None

    def _stepped(self, prefix: str) -> None:
        """After each optimizer step of the update ("actor" or "critic")."""
        self._weights_changed()
        if prefix == "actor":
            self.step += 1

    def ready(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "arch": self.spec.arch,
            "params": sum(p.numel() for p in self.model.parameters()),
            "attention": self.spec.attention,  # trainer.attention, resolved (rl_tpu/devices/kernels.py)
            "attention_why": self.attention_why,
            "nice": os.nice(0),  # placement.json; the driver warns when it is above its own
            **self.builder.summary(),  # fsdp_step, matmul, matmul_table, matmul_cached
            **self.device.bind(set_local_rank=False).record(),  # the device Ray assigned this rank
        }

    # ------------------------------------------------------------------ public (collective) methods

    def compute_log_probs(self, batch: TrainBatch, entropy: bool = False, rows: torch.Tensor | None = None):
        self.model.eval()
        res = self._infer(batch, lambda mb: self.fwd.policy(self.model, mb, self.tc), rows)
        return [(i, r if entropy else r[:1]) for i, r in res]

    def compute_ref_log_probs(self, batch: TrainBatch, rows: torch.Tensor | None = None):
        if self.ref is None:
            raise RuntimeError("compute_ref_log_probs needs trainer.reference = true")
        res = self._infer(batch, lambda mb: self.fwd.policy(self.ref, mb, self.tc), rows)
        return [(i, r[:1]) for i, r in res]

    def compute_values(self, batch: TrainBatch):
        if self.critic is None:
            raise RuntimeError("compute_values needs trainer.critic = true")
        self.critic.eval()
        return self._infer(batch, lambda mb: (self.fwd.critic(self.critic, mb),))

    def _infer(self, batch: TrainBatch, fn, rows: torch.Tensor | None = None):
        return self.fwd.infer(batch, fn, self.tc, [self.model, self.ref, self.critic], rows)

    def train_step(self, batch: TrainBatch, algo: AlgorithmConfig) -> dict[str, float]:
        if batch.advantages is None:
            raise ValueError("train_step: TrainBatch.advantages is None (run the advantage estimator first)")
        fault_hook("train_step", self.rank, self.step)  # test-only, see rl_tpu/fault_hooks.py
        t0 = time.perf_counter()
        critic = self._trained().get("critic")
        out = self.updater.train_step(batch, algo, self.tc, self._trained()["policy"], critic, self.ref)
        tokens = float(batch.attention_mask.sum())
        elapsed = time.perf_counter() - t0
        out.update({"actor/step": float(self.step), "perf/train_tokens": tokens, "perf/train_s": elapsed})
        out.update(self.builder.moe_stats.read(self.local))  # moe/*: empty for a dense model
        compiles = self.device.compile_count()
        if compiles is None and self.builder.compiled:  # trainer.mode = "compile": dynamo's programs
            compiles = modes.compiled_programs()
        if compiles is None and self.builder.graph_compile == "inductor":  # trainer.mode = "graph"
            compiles = modes.aot_compiles()  # the compiler's own count of the graphs it built
        elif compiles is None and self.builder.graph_compile:  # graphs captured, run as they are
            compiles = sum(m.rl_graph.traces for m in (self.model, self.critic) if m is not None)
        if compiles is not None:
            out["perf/compiles"] = float(compiles)
        if self.builder.graph_compile:  # the latest captured graph's (graph.py)
            out["perf/graph_saved_mb"] = self.model.rl_graph.saved / 2**20
            out["perf/recomputed_nodes"] = float(self.model.rl_graph.recomputed)
        out["memory/trainer_rss_mb"] = process_rss_mb()  # after the update: the same phase every step
        peak = self.device.take_peak_memory()
        if peak is not None:
            out["memory/trainer_device_peak_gb"] = peak / 2**30
        return out

    def policy_grads(
        self, batch: TrainBatch, algo: AlgorithmConfig
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Full gradient of the policy loss over the whole batch (one mini-batch), without stepping:
        what `train_step` would clip and apply, and the loss metrics. For verification; leaves no
        gradient behind."""
        return self.updater.policy_grads(batch, algo, self.tc, self._trained()["policy"], self.ref)

    def preflight(self, batch: TrainBatch, algo: AlgorithmConfig) -> None:
        """The update's forward and backward over `batch`, leaving no trace: no optimizer step, gradients
        dropped, the MoE counters drained (rl_tpu/controller/preflight.py says why)."""
        trained = self._trained()
        self.updater.preflight(batch, algo, self.tc, trained["policy"], trained.get("critic"), self.ref)
        self.builder.moe_stats.read(self.local)

    # ------------------------------------------------------------------ checkpoints and export

    def save_checkpoint(self, path: str) -> str:
        return self.ckpt.save(path, self._trained(), self.step)

    def load_checkpoint(self, path: str) -> int:
        self.step = self.ckpt.load(path, self._trained())
        self._weights_changed()
        return self.step

    def restart_from(self, model_path: str, tc: TrainerConfig | None = None) -> int:
        """Become what `TrainerWorker(cfg, model_path, ...)` would be, without a new process: the policy
        (and reference) take the HF weights of `model_path`, the optimizer and scheduler start fresh (from
        `tc`'s optimizer settings when given: lr, schedule, steps, micro-batch...), the seed is set again,
        the step count is 0. The folder must hold the same architecture and shapes (a checkpoint of this
        model); a critic keeps its weights. Saves the start-up (imports, process group, build)."""
        if tc is not None:
            check_restartable(self.tc, tc, "restart_from")
        titan_sd = checkpoint.load_same_architecture(self.spec, model_path, self.model_path)
        self.tc = tc if tc is not None else self.tc
        self.device.seed(self.tc.seed)
        if self.ref is not None:
            parallel.load_full_state_dict(self.ref, titan_sd)
        if self.builder.lora:  # the new base under fresh first adapters (B = 0): the base model again
            shapes = {n: p.shape for n, p in parallel.named_parameters(self.model) if lora.is_adapter(n)}
            titan_sd = titan_sd | lora.initial_adapters(shapes, self.tc.seed)
        parallel.load_full_state_dict(self.model, titan_sd)  # strict: names and shapes checked
        lazy = self.device.lazy_tensors
        self.optimizer, self.scheduler = build_optimizer(self.model, self.tc.lr, self.tc, lazy)
        self.model_path, self.step = str(model_path), 0
        self.device.step_end()
        self._weights_changed()
        self.ckpt.barrier()
        return self.step

    def _refuse_lora(self, what: str) -> None:
        # TorchTitan's HF adapters drop the adapter weights without a word: these paths would hand the
        # engines the base model as if it were the policy
        if self.builder.lora:
            raise NotImplementedError(
                f"{what} with trainer.lora: the base model alone is not the policy; the engines get the "
                "adapters (export_adapter, adapter_state; docs/lora.md)"
            )

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights under TorchTitan names, on every rank (collective); under trainer.lora
        the base with the adapters merged in, W + (alpha / rank) B A (PEFT's order of operations)."""
        full = parallel.full_state_dict(self.model)
        if not self.builder.lora:
            return full
        lc = self.builder.lora
        return lora.merged(*lora.split(full), lc.alpha / lc.rank)

    def export_hf(self, out_dir: str) -> str | None:
        """The policy as an HF folder (rank 0 writes): `policy_state`, with `model.path`'s side files."""
        full = self.policy_state()
        if self.rank == 0:
            tmodel.save_hf(self.spec, full, out_dir, self.model_path)
        self.ckpt.barrier()
        return str(out_dir)

    def export_adapter(self, out_dir: str) -> str | None:
        """The adapters as a PEFT folder (rank 0 writes): what PEFT's `from_pretrained` and vLLM's LoRA
        loader read, over the base in `model.path`."""
        if not self.builder.lora:
            raise ValueError("export_adapter: trainer.lora.rank = 0, the policy has no adapters")
        tensors = self.peft_tensors()
        if self.rank == 0:
            peft_folder.save(out_dir, tensors, self.builder.lora, self.model_path)
        self.ckpt.barrier()
        return str(out_dir)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """The adapters under PEFT's names (what `export_adapter` writes), full, on rank 0 (None
        elsewhere); collective. What `--sync.verify` compares the engines' LoRA slots with."""
        if not self.builder.lora:
            raise ValueError("adapter_state: trainer.lora.rank = 0, the policy has no adapters")
        tensors = self.peft_tensors()
        return tensors if self.rank == 0 else None

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """The adapters under PEFT's names, full, on every rank (collective); the names and row orders are
        computed once."""
        adapters = parallel.full_state_dict(self.model, lambda n, _: lora.is_adapter(n))
        if self._peft_layout is None:
            self._peft_layout = lora.peft_layout(self.spec, adapters)
        return lora.peft_state(adapters, self._peft_layout)

    def adapter_rows(self) -> dict[str, dict]:
        """This rank's share of the adapters under PEFT's names (`lora.peft_rows`): its FSDP row chunks as
        they are, no gather; `lora.join_peft_rows` of every rank's share is `peft_tensors()`. What the
        adapter sync into the engines' LoRA slots sends."""
        if not self.builder.lora:
            raise ValueError("adapter_rows: trainer.lora.rank = 0, the policy has no adapters")
        adapters = {n: p for n, p in parallel.named_parameters(self.model) if lora.is_adapter(n)}
        if self._peft_layout is None:
            self._peft_layout = lora.peft_layout(self.spec, adapters)
        return lora.peft_rows(adapters, self._peft_layout, first=self.rank == 0)

    def adapter_rows_ref(self) -> list:
        """`adapter_rows` put in Ray's object store by this rank, as a one-element list: the driver hands
        the reference on and each engine fetches the rows from here (the driver never copies them)."""
        import ray

        return [ray.put(self.adapter_rows())]

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full tensors under HF names on rank 0 (None elsewhere): the full-tensor sync fallback."""
        self._refuse_lora("hf_state_dict")
        full = parallel.full_state_dict(self.model)
        return tmodel.titan_to_hf(self.spec, full) if self.rank == 0 else None

    def policy_tensors(self, trainable: bool) -> dict[str, torch.Tensor] | None:
        """Full tensors under TorchTitan names of the policy's trainable parameters (`trainable`; the
        adapters under trainer.lora) or of its frozen ones, on rank 0 (None elsewhere); collective."""
        full = parallel.full_state_dict(self.model, lambda _, p: p.requires_grad == trainable)
        return full if self.rank == 0 else None

    def optimizer_parameters(self) -> int:
        """How many tensors the policy's optimizer updates."""
        return sum(len(g["params"]) for g in self.optimizer.param_groups)

    # ------------------------------------------------------------------ weight-sync surface

    def param_specs(self) -> list[ParamSpec]:
        self._refuse_lora("the weight sync")
        return [ParamSpec.from_tensor(n, p) for n, p in parallel.named_parameters(self.model)]

    def ws_name_maps(self):
        """HF names, shapes and rows of this model through its own TorchTitan adapter (`NameMaps`): the
        driver plans the weight sync with them and needs no TorchTitan of its own."""
        from rl_tpu.weight_sync.names import NameMaps

        return NameMaps.from_adapter(self.param_specs(), functools.partial(tmodel.titan_to_hf, self.spec))

    def ping(self) -> int:
        """Liveness check (`TrainerGroup.check_alive`); returns the optimizer steps taken."""
        return self.step

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ weight sync (sender side)
    def ws_shards(self) -> dict[str, torch.Tensor]:
        """This rank's local shards for `SyncSender.ws_pack` (views of the live parameters). Lazy devices
        pack from one host copy per policy version (slicing device tensors per bucket piece would trace
        and compile), dropped whenever the weights change."""
        from rl_tpu.weight_sync.sender import fsdp_local_shards

        if not self.device.lazy_tensors:
            return fsdp_local_shards(self.model)
        if self._host is None:
            self._host = {n: t.cpu() for n, t in fsdp_local_shards(self.model).items()}
        return self._host
