"""One RL step, top to bottom (`rl_step`), and the pure pieces it is made of:

    prompts -> rollout.generate (vLLM actors) -> rewards (process pool) -> advantages (pure math)
            -> trainer.train_step (TorchTitan actors) -> weight sync (the next policy version) -> eval

The run around it (start-up, logging, checkpoints, close) is `rl_tpu.controller.loop`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rl_tpu.algorithms import (
    apply_kl_in_reward,
    compute_advantages,
    overlong_penalty,
)
from rl_tpu.batching import RolloutBatch, build_rollout_batch, staleness_metrics
from rl_tpu.config import Config
from rl_tpu.controller.evaluation import Evaluator
from rl_tpu.controller.producer import Rollouts, Scored
from rl_tpu.metrics import process_rss_mb
from rl_tpu.rewards import RewardPool
from rl_tpu.weight_sync import WeightSync

if TYPE_CHECKING:
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup


def on_policy_update(cfg: Config) -> bool:
    """One optimizer step per batch (one epoch, one mini-batch) and no KL in the reward: the old log-probs
    are then the update's own forward (detached), so the separate log-prob pass is skipped and the
    reference runs inside the update; `mismatch/kl` comes from that same forward."""
    t, a = cfg.trainer, cfg.algorithm
    return t.ppo_epochs == 1 and t.ppo_mini_batches == 1 and not a.use_kl_in_reward


def prepare_batch(cfg: Config, data: Scored, trainer, tok) -> tuple[RolloutBatch, dict[str, float]]:
    """Scores -> token rewards -> advantages, with the trainer's log-probs where the update needs them
    beforehand (several updates per batch, KL in the reward) and the critic's values (GAE)."""
    a = cfg.algorithm
    scores = list(data.scores)
    rb = build_rollout_batch(data.groups, scores, tok.pad_token_id)
    metrics: dict[str, float] = {}
    if a.overlong_buffer_len > 0:
        pen = overlong_penalty(
            rb.response_lengths, cfg.rollout.max_tokens, a.overlong_buffer_len, a.overlong_penalty_factor
        )
        rb = build_rollout_batch(data.groups, (rb.scores + pen).tolist(), tok.pad_token_id)
        metrics["reward/overlong_penalty"] = pen.mean().item()
    batch = rb.batch
    separate = not on_policy_update(cfg)
    if separate and a.use_kl_in_reward:  # the reward needs both on every sequence, before the advantages
        batch = _with_log_probs(cfg, batch, trainer, rows=None)
    if cfg.trainer.critic:
        batch = batch.replace(values=trainer.compute_values(batch))
    token_rewards = rb.token_level_scores
    if a.use_kl_in_reward:
        token_rewards, kl_metrics = apply_kl_in_reward(
            token_rewards,
            batch.old_log_probs,
            batch.ref_log_probs,
            batch.response_mask,
            a.kl_coef,
            a.kl_penalty,
        )
        metrics |= kl_metrics
    adv, returns = compute_advantages(a, token_rewards, batch.response_mask, rb.group_index, batch.values)
    batch = batch.replace(advantages=adv, returns=returns)
    if separate and not a.use_kl_in_reward:  # advantages first: only the sequences the update runs
        batch = _with_log_probs(cfg, batch, trainer, rows=old_log_prob_rows(cfg, batch, trainer.world_size))
    rb.batch = batch
    return rb, metrics


def old_log_prob_rows(cfg: Config, batch, world_size: int) -> torch.Tensor | None:
    """The sequences whose old log-probs the update reads: those it runs (`trainer.skip_zero_advantage`),
    or None for all of them."""
    from rl_tpu.algorithms.losses import update_rows, zero_advantage_inert

    if not (cfg.trainer.skip_zero_advantage and zero_advantage_inert(cfg.algorithm)):
        return None
    rows = update_rows(batch.advantages, batch.response_mask, cfg.trainer.ppo_mini_batches, world_size)
    return None if len(rows) == batch.num_seqs else rows


def _with_log_probs(cfg: Config, batch, trainer, rows: torch.Tensor | None):
    """`batch` with the trainer's pre-update log-probs (and the reference's) of `rows` (None: all)."""
    batch = batch.replace(old_log_probs=trainer.compute_log_probs(batch, rows=rows))
    if cfg.trainer.reference:
        batch = batch.replace(ref_log_probs=trainer.compute_ref_log_probs(batch, rows=rows))
    return batch


def step_metrics(rb: RolloutBatch, trainer_version: int) -> dict[str, float]:
    """Batch metrics; the inference/trainer gap (`mismatch/kl`) comes from the trainer's update."""
    return {
        "reward/std": rb.scores.std().item() if rb.scores.numel() > 1 else 0.0,
        "response/length_mean": rb.response_lengths.float().mean().item(),
        "response/length_max": rb.response_lengths.max().item(),
        "staleness": float(trainer_version - rb.policy_versions.min().item()),
    } | staleness_metrics(rb.batch, trainer_version)


@dataclass
class Run:
    """What every step of one run uses: its config, roles, weight sync, data and rewards."""

    cfg: Config
    trainer: TrainerGroup
    rollout: RolloutGroup
    sync: WeightSync
    rollouts: Rollouts
    pool: RewardPool
    tok: Any  # the model's Hugging Face tokenizer
    evaluator: Evaluator | None  # the held-out prompts' (None: `trainer.test_freq = 0` or no test set)
    colocated: bool  # trainer and engines take turns on shared devices


def rl_step(run: Run, step: int) -> tuple[dict[str, float], Scored]:
    """One RL step: data, advantages, the update, the new policy into the engines, evaluation."""
    cfg, trainer, rollout = run.cfg, run.trainer, run.rollout
    t_step, busy = time.perf_counter(), run.rollouts.turns.busy_s
    # 1. data for this step (in async mode, generated while earlier steps trained)
    data, timings = run.rollouts.next(trainer.policy_version)
    # 2. advantages and the update
    t = time.perf_counter()
    if run.colocated:
        rollout.sleep()  # hand the shared devices to the trainer (CUDA); a no-op reported once elsewhere
    rb, prep_metrics = prepare_batch(cfg, data, trainer, run.tok)
    batch_metrics = step_metrics(rb, trainer.policy_version)
    with run.sync.lock:  # a restarted engine must not be synced mid-update (see WeightSync)
        train_metrics = trainer.train_step(rb.batch, cfg.algorithm)
    if run.colocated:
        rollout.wake_up()
    timings["time/train"] = time.perf_counter() - t
    metrics = data.metrics | prep_metrics | batch_metrics | train_metrics
    metrics["rollout/samples"] = float(sum(len(g) for g in data.groups))  # completions in the update
    # 3. the new policy into the engines, between two generation calls (the engine is serial)
    with run.rollouts.turns.exclusive():
        metrics |= run.sync.push()
    run.rollouts.updated(trainer.policy_version)
    timings["time/sync"] = metrics["sync/seconds"]
    # 4. evaluation
    if run.evaluator is not None and (step % cfg.trainer.test_freq == 0 or step == cfg.trainer.total_steps):
        t = time.perf_counter()
        with run.rollouts.turns.exclusive():
            metrics |= run.evaluator.evaluate()
        timings["time/eval"] = time.perf_counter() - t  # part of time/step; benches leave it out
    metrics["rollout/restarts"] = float(rollout.restarts)  # engines restarted so far in this run
    metrics["memory/driver_rss_mb"] = process_rss_mb()
    timings["time/step"] = time.perf_counter() - t_step
    # the step's wall time in which no engine generated (for training data)
    timings["time/engine_idle"] = max(0.0, timings["time/step"] - (run.rollouts.turns.busy_s - busy))
    n_tokens = int(rb.batch.response_mask.sum().item())
    metrics |= timings | {"throughput/tokens_per_s": n_tokens / max(timings["time/rollout"], 1e-9)}
    return metrics, data
