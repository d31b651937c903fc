"""The policy (PPO / GRPO) and critic updates of one trainer rank: mini-batches, micro-batches, gradient
accumulation, clipping and the optimizer step.

Invariants:
- Optimizer steps per `train_step` = ppo_epochs x ppo_mini_batches; mini-batches are contiguous row
  blocks in batch order (no shuffling); the LR schedule advances once per optimizer step.
- Gradients are summed across micro-batches and ranks (FSDP sum reduction, see `parallel.py`); each
  micro-batch's loss is its share of the whole mini-batch loss (`global_tokens` / `global_seqs`, counted
  over all of the mini-batch's rows), so N ranks x M micro-batches give the same update as one rank with
  one micro-batch.
- Every rank runs the same number of micro-batches (`Forward.micro_batches`); a rank with nothing to
  run runs the pad row, so every rank joins the same collectives.
- With `trainer.fsdp_step = "replicated"` gradients stay full and local until a rank's last
  micro-batch, then one reduce-scatter; gradient sync is switched back on even when a micro-batch fails.
- Lazy-tensor devices (XLA): every optimizer step ends its graph (`Device.step_end`) before the step's
  single read of the metrics (metrics.py), so each step is ONE program, the same for every step of a
  shape bucket.
- `on_step(prefix)` runs after every optimizer step ("actor" or "critic"): the weights have changed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rl_tpu.algorithms.losses import MAX_METRICS
from rl_tpu.config import AlgorithmConfig, TrainerConfig
from rl_tpu.devices import Device
from rl_tpu.trainer import metrics, parallel
from rl_tpu.trainer.forward import Forward
from rl_tpu.trainer.optim import Trained
from rl_tpu.types import TrainBatch

# (micro-batch, global tokens, global sequences) -> (loss share, metrics)
LossFn = Callable[[TrainBatch, float, float], tuple[torch.Tensor, dict]]


class Updater:
    """The update of one rank: which rows run, in which micro-batches (`fwd`), and the optimizer steps.
    The trainer config in force (`tc`) and the models come with each call."""

    def __init__(self, fwd: Forward, device: Device, replicated_step: bool, on_step: Callable[[str], None]):
        self.fwd, self.device, self.replicated_step, self.on_step = fwd, device, replicated_step, on_step

    # ------------------------------------------------------------------ whole steps

    def train_step(
        self,
        batch: TrainBatch,
        algo: AlgorithmConfig,
        tc: TrainerConfig,
        policy: Trained,
        critic: Trained | None,
        ref: torch.nn.Module | None,
    ) -> dict[str, float]:
        """The policy's optimizer steps over `batch`, then the critic's (when there is one and the batch
        has returns); the mean of their metrics."""
        from rl_tpu.algorithms.losses import mini_batch_rows

        stats = []
        policy.model.train()
        actor_loss = self.policy_loss(algo, tc, policy.model, ref)
        skip = self.skips_zero_advantage(algo, tc)
        for _ in range(tc.ppo_epochs):
            for rows in mini_batch_rows(batch.num_seqs, tc.ppo_mini_batches):
                stats.append(
                    self.update(batch, rows, policy, actor_loss, "actor", tc, skip_zero_advantage=skip)
                )
        if critic is not None and batch.returns is not None:
            critic.model.train()
            critic_loss = self.value_loss(algo, critic.model)
            for _ in range(tc.ppo_epochs):
                for rows in mini_batch_rows(batch.num_seqs, tc.ppo_mini_batches):
                    stats.append(self.update(batch, rows, critic, critic_loss, "critic", tc))
        if ref is not None:
            parallel.reshard(ref)  # the reference may have run inside the actor loss
        return metrics.mean_dicts(stats)

    def preflight(
        self,
        batch: TrainBatch,
        algo: AlgorithmConfig,
        tc: TrainerConfig,
        policy: Trained,
        critic: Trained | None,
        ref: torch.nn.Module | None,
    ) -> None:
        """The update's forward and backward over every row of `batch` as one mini-batch (the policy's,
        then the critic's), with no optimizer step and the gradients dropped (rl_tpu/controller/preflight.py)."""
        rows = torch.arange(batch.num_seqs)
        parts = [(policy, self.policy_loss(algo, tc, policy.model, ref))]
        if critic is not None and batch.returns is not None:
            parts.append((critic, self.value_loss(algo, critic.model)))
        for part, loss_fn in parts:
            part.model.train()
            part.optimizer.zero_grad(set_to_none=True)
            self.accumulate(batch, rows, part.model, loss_fn, tc)
            self.device.step_end()  # lazy devices: run the program, so its memory is really taken
            part.optimizer.zero_grad(set_to_none=True)
        if ref is not None:
            parallel.reshard(ref)

    def policy_grads(
        self, batch: TrainBatch, algo: AlgorithmConfig, tc: TrainerConfig, policy: Trained, ref
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Full gradient of the policy loss over the whole batch (one mini-batch), without stepping, and
        the loss metrics; leaves no gradient behind."""
        model, optimizer = policy.model, policy.optimizer
        model.train()
        optimizer.zero_grad(set_to_none=True)
        rows, skip = torch.arange(batch.num_seqs), self.skips_zero_advantage(algo, tc)
        run = self.rows_to_run(batch, rows, skip)
        sums, weighted, weight, maxima = self.accumulate(
            batch, rows, model, self.policy_loss(algo, tc, model, ref), tc, run
        )
        out_metrics = metrics.reduce(sums, weighted, weight, self.fwd.local, maxima)
        if skip:
            out_metrics["actor/skipped_frac"] = 1 - len(run) / max(len(rows), 1)
        out = {}
        for n, p in parallel.named_parameters(model):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
        optimizer.zero_grad(set_to_none=True)
        if ref is not None:
            parallel.reshard(ref)
        return out, out_metrics

    # ------------------------------------------------------------------ losses

    def policy_loss(self, algo: AlgorithmConfig, tc: TrainerConfig, model, ref) -> LossFn:
        from rl_tpu.algorithms.losses import compute_policy_loss

        local = self.fwd.local

        def dev(t):
            return None if t is None else t.to(local)

        def with_ref(mb: TrainBatch) -> TrainBatch:
            if mb.ref_log_probs is None and algo.use_kl_loss and ref is not None:
                with torch.no_grad():  # the reference's forward in the same call: the batch crosses once
                    return mb.replace(ref_log_probs=self.fwd.policy(ref, mb, tc)[0])
            return mb

        def loss(mb: TrainBatch, g_tok: float, g_seq: float):
            mb = with_ref(mb)
            lp, ent = self.fwd.policy(model, mb, tc)
            # on-policy (one epoch, one mini-batch): the pre-update log-probs are this very forward's, so
            # the loop skips its separate pass and the ratio is exactly 1 (the clip cannot bind)
            old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
            ref_lp = mb.ref_log_probs
            return compute_policy_loss(
                algo,
                lp,
                dev(old),
                dev(mb.advantages),
                dev(mb.response_mask),
                ref_log_prob=dev(ref_lp),
                entropy=ent,
                rollout_log_prob=dev(mb.rollout_log_probs),
                global_tokens=g_tok,
                global_seqs=g_seq,
            )

        loss.prepare = with_ref  # graph mode runs it before the captured graph (trainer/graph.py)
        return loss

    def value_loss(self, algo: AlgorithmConfig, critic) -> LossFn:
        from rl_tpu.algorithms.losses import compute_value_loss

        local = self.fwd.local

        def loss(mb: TrainBatch, g_tok: float, g_seq: float):
            v = self.fwd.critic(critic, mb)
            old = mb.values.to(local) if mb.values is not None else v.detach()
            return compute_value_loss(
                v,
                old,
                mb.returns.to(local),
                mb.response_mask.to(local),
                algo.cliprange_value,
                global_tokens=g_tok,
            )

        return loss

    @staticmethod
    def skips_zero_advantage(algo: AlgorithmConfig, tc: TrainerConfig) -> bool:
        from rl_tpu.algorithms.losses import zero_advantage_inert

        return tc.skip_zero_advantage and zero_advantage_inert(algo)

    def rows_to_run(self, batch: TrainBatch, rows: torch.Tensor, skip_zero_advantage: bool) -> torch.Tensor:
        """`rows` less the sequences whose advantage is zero on every token, when `skip_zero_advantage`
        (the loss gives them exactly zero gradient: `losses.zero_advantage_inert`). When no sequence has
        an advantage each rank still runs one of them (its gradient is exactly zero too), so the step's
        token metrics (actor/entropy, mismatch/*) keep a sample instead of vanishing from the log."""
        if not skip_zero_advantage:
            return rows
        from rl_tpu.algorithms.losses import rows_to_run

        return rows[rows_to_run(batch.advantages[rows], batch.response_mask[rows], self.fwd.world_size)]

    # ------------------------------------------------------------------ one optimizer step

    def accumulate(
        self, batch, rows, model, loss_fn: LossFn, tc: TrainerConfig, run: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
        """Forward/backward of this rank's micro-batches of mini-batch `rows` (gradients add up); only
        the rows in `run` (default: all) are run, but all of `rows` normalise the loss.

        Metrics stay device tensors (float64 sums): nothing here waits for the device, so on XLA/TPU the
        micro-batches trace without a host sync."""
        padded = self.fwd.padded(batch)
        mask = batch.response_mask[rows]
        g_tok, g_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())  # host tensors: no device sync
        sums: dict[str, torch.Tensor] = {}
        weighted: dict[str, torch.Tensor] = {}
        maxima: dict[str, torch.Tensor] = {}
        weight = 0.0
        micro = self.fwd.micro_batches(padded, rows if run is None else run, tc)
        defer = self.replicated_step and isinstance(model, FSDPModule) and len(micro) > 1
        try:
            for i, idx in enumerate(micro):
                if defer:  # gradients stay full and local until the last micro-batch, then one reduce-scatter
                    last = i == len(micro) - 1
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                mb = padded.select(idx)
                if getattr(model, "rl_graph", None) is not None:  # trainer.mode = "graph": one captured step
                    loss, mb_metrics = model.rl_graph.run(loss_fn, mb, g_tok, g_seq)
                else:
                    loss, mb_metrics = loss_fn(mb, g_tok, g_seq)
                    loss.backward()
                w = float(mb.response_mask.sum())  # host tensor
                weight += w
                for k, v in mb_metrics.items():
                    v = torch.as_tensor(v, device=self.fwd.local).to(torch.float64)
                    if k.startswith("loss/"):
                        sums[k] = sums[k] + v if k in sums else v
                    elif k in MAX_METRICS:
                        maxima[k] = torch.maximum(maxima[k], v) if k in maxima else v
                    else:
                        weighted[k] = weighted[k] + w * v if k in weighted else w * v
        finally:
            if defer:  # a failed micro-batch must not leave the next call without gradient sync
                model.set_requires_gradient_sync(True)
                model.set_reshard_after_backward(True)
        return sums, weighted, weight, maxima

    def update(
        self,
        batch: TrainBatch,
        rows: torch.Tensor,
        part: Trained,
        loss_fn: LossFn,
        prefix: str,
        tc: TrainerConfig,
        skip_zero_advantage: bool = False,
    ) -> dict[str, float]:
        """One optimizer step of `part` over mini-batch `rows`, split over ranks and micro-batches."""
        from torchtitan.distributed import utils as dist_utils

        model, optimizer, scheduler = part
        run = self.rows_to_run(batch, rows, skip_zero_advantage)
        sums, weighted, weight, maxima = self.accumulate(batch, rows, model, loss_fn, tc, run)
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        foreach = None if self.device.lazy_tensors else True  # torch has no foreach kernels for xla tensors
        # expert-parallel experts live on a mesh of their own: TorchTitan then sums the norm per mesh
        ep = any(isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ()) for p in params)
        grad_norm = dist_utils.clip_grad_norm_(params, max_norm, foreach=foreach, ep_enabled=ep)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        keys, vec = metrics.metric_vector(sums, weighted, weight, self.fwd.local, maxima)
        self.device.step_end()  # lazy devices: the update, the metrics and the grad norm are one program
        self.on_step(prefix)
        out = metrics.read_metrics(sums, keys, vec)
        out = {
            (f"critic/{k[5:]}" if prefix == "critic" and k.startswith("loss/") else k): v
            for k, v in out.items()
        }
        out[f"{prefix}/grad_norm"] = float(grad_norm)
        out[f"{prefix}/lr"] = float(lr)
        if skip_zero_advantage:
            out[f"{prefix}/skipped_frac"] = 1 - len(run) / max(len(rows), 1)
        return out
