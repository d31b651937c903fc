"""The RL driver: `train(cfg)` starts the roles, then runs `rl_step` until `trainer.total_steps`.

One step reads top to bottom (`rl_step`):

    prompts -> rollout.generate (vLLM actors) -> rewards (process pool) -> advantages (pure math)
            -> trainer.train_step (TorchTitan actors) -> weight sync (the next policy version) -> eval

and `train` logs it and checkpoints. The evaluation (every `trainer.test_freq` steps and after the last)
is greedy on the held-out prompts, multi-turn with the tools and the environment when the run has them
(`rl_tpu.evaluation`). Modes (`cluster.mode`):
- `sync`: strictly on-policy; the engine generates step k with the weights of step k-1.
- `async` (runs `disaggregated`, which `cluster.placement = "auto"` picks: generation and training run at
  the same time, so they cannot take turns on shared devices): the loop is a producer and a consumer
  (`rl_tpu.producer.Rollouts`): a thread generates and scores batch after batch into a buffer while the
  trainer trains, and no trained token was sampled more than `algorithm.max_staleness` versions behind
  the version being updated (`algorithm.staleness_policy`: the producer waits, or stale groups are
  dropped and generated again). `max_staleness = 1` is the one-step pipeline. Each token carries the
  version that sampled it (`rollout/staleness_mean`, `rollout/staleness_max`); `rollout.partial`
  generates in chunks so a weight update goes between two chunks and unfinished sequences continue on
  the new weights (`rl_tpu.rollout.partial`, `rollout/partial_fraction`). Trainer log-probs are
  recomputed before each update where it needs them (`old_log_probs`), and `algorithm.rollout_is`
  corrects the inference/trainer mismatch with the per-token behaviour log-probs; `mismatch/kl`
  measures it.
Placement (`rl_tpu.placement`, docs/placement.md): the trainer ranks and engines run in Ray placement-group
bundles, shared (`colocated`, sync mode's default) or disjoint (`disaggregated`), pinned to nodes by
`cluster.*_resources`; where they landed is written to RUN_DIR/placement.json at start-up. `colocated`
also puts the engines to sleep during training (frees device memory on CUDA; vLLM-CPU has no sleep mode,
so there it is a no-op reported once); `disaggregated` never sleeps them.
The controller holds no weights. Every call into an actor is an explicit method call on a group; the
policy version is the trainer group's (`TrainerGroup.policy_version`), which the weight sync reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_tpu.algorithms import (
    apply_kl_in_reward,
    compute_advantages,
    overlong_penalty,
)
from rl_tpu.batching import RolloutBatch, build_rollout_batch, staleness_metrics
from rl_tpu.checkpoint import check_resume_model, load_state, resolve_resume, save_checkpoint
from rl_tpu.cluster import start_ray
from rl_tpu.config import Config, to_dict, to_toml
from rl_tpu.data import Example, PromptLoader, build_datasets, check_prompt_lengths
from rl_tpu.evaluation import Evaluator
from rl_tpu.metrics import MetricsLogger, process_rss_mb
from rl_tpu.model_folder import check_model_folder, ensure_model, load_tokenizer
from rl_tpu.model_source import resolve_model_path
from rl_tpu.multi_turn import load_env
from rl_tpu.placement import plan_from_config
from rl_tpu.preflight import run_preflight
from rl_tpu.producer import Rollouts, Scored, generate_and_score
from rl_tpu.rewards import RewardPool
from rl_tpu.roles import Roles, check_roles, start_shared_roles, write_placement_json
from rl_tpu.tools import check_tools_kwargs
from rl_tpu.weight_sync import WeightSync

log = logging.getLogger("rl_tpu")

__all__ = [
    "Roles",
    "Rollouts",
    "Scored",
    "generate_and_score",
    "prepare_batch",
    "rl_step",
    "start_shared_roles",
    "train",
]


# ---------------------------------------------------------------------------------------------------
# one step's pieces


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
    trainer: Any  # TrainerGroup
    rollout: Any  # RolloutGroup
    sync: WeightSync
    rollouts: Rollouts
    pool: RewardPool
    tok: Any
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


# ---------------------------------------------------------------------------------------------------
# the loop


def train(cfg: Config, roles: Roles | None = None) -> dict[str, Any]:
    """Run `trainer.total_steps` RL steps; returns a summary (final metrics, run folder, and `hf`: the
    trained policy exported to RUN_DIR/hf).

    `roles`: a trainer group and engines the caller started for this placement (`start_shared_roles`)
    and keeps between jobs. The run then starts no actors: the trainer restarts from `model.path` with
    `cfg.trainer`'s optimizer settings, the engines get its weights before step 1 and sample as fresh
    ones would (call index 0), and both are left running for the caller."""
    t_start = time.perf_counter()
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    # The user's inputs are checked before Ray starts, so a mistake in them is reported in seconds
    # rather than after the trainer and the engines have started (minutes on a CPU box).
    resume = resolve_resume(run_dir, cfg.checkpoint.resume)  # first: a damaged checkpoint stops at once
    train_set, test_set = build_datasets(cfg.data)
    if cfg.data.test_files and not cfg.trainer.test_freq:
        log.warning(
            "data.test_files holds %d held-out prompts, but trainer.test_freq = 0: nothing is evaluated "
            "(--trainer.test_freq=N evaluates every N steps and after the last)",
            len(test_set),
        )
    warning = collective_restart_warning(cfg)
    if warning:
        log.warning(warning)
    # A model folder of the user's is checked now (its files); the tokenizer (most of it importing
    # transformers) and the prompt lengths it checks, or the tiny default when it still has to be
    # built, come while Ray starts: a failure there stops Ray again and is reported.
    cfg.model.path = resolve_model_path(cfg.model.path)  # a Hub id, GGUF file or catalog name: a local folder
    if cfg.model.path:
        check_model_folder(cfg.model.path, trainer=True)
    if resume is not None:  # a checkpoint of another model would fail once every actor has started
        check_resume_model(cfg)
    from rl_tpu.trainer.model import check_routing_replay, read_hf_config

    check_routing_replay(cfg)  # an MoE model, one engine call per completion (#43)
    loader = PromptLoader(train_set, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    plan = plan_from_config(cfg, os.cpu_count() or 1)
    if roles is not None:
        check_roles(cfg, roles, plan)
    # A multi-turn environment class and the tools load here (the tools' workers start later), and every
    # row's extra_info.tools_kwargs is checked against the tools' row parameters.
    if cfg.rollout.env:
        load_env(cfg.rollout.env)
    if cfg.rollout.tools:
        check_tools_kwargs(list(cfg.rollout.tools), train_set + test_set)
    # The reward functions load in the pool's workers, which report a missing file or function, a
    # syntax or import error before the trainer and engines start.
    pool = RewardPool(cfg.reward)

    own = trainer = sync = rollouts = evaluator = logger = bar = None  # own: the roles this run starts
    finished = False
    last: dict[str, float] = {}
    step = 0
    hf: str | None = None
    model_path: str | None = None
    try:
        with ThreadPoolExecutor(max_workers=1) as ex:
            built = ex.submit(_model_and_tokenizer, cfg, run_dir, train_set + test_set)
            started = start_ray(cfg, plan)
        try:
            model_path, tok, longest_prompt = built.result()
        except BaseException:
            if started:  # a user's mistake leaves no Ray behind (the CLI may run in-process, as in tests)
                import ray

                ray.shutdown()
            raise
        preflight = None
        if cfg.trainer.preflight:  # the largest batch through the trainer before step 1 (rl_tpu/preflight.py)
            vocab = min(len(tok), int(read_hf_config(model_path).get("vocab_size", len(tok))))

            def preflight(trainer: Any) -> None:
                run_preflight(cfg, trainer, longest_prompt, vocab)

        if roles is None:  # the preflight runs while the engines start
            own = start_shared_roles(cfg, model_path, trainer_then=preflight)
        else:
            roles.trainer.restart_from(model_path, cfg.trainer)
            roles.rollout.load_state_dict({"calls": 0})
        active = own or roles
        trainer, rollout = active.trainer, active.rollout
        sync = WeightSync.for_run(cfg.sync, trainer, rollout, model_path)
        sync.build()  # plan now: a name/shape mismatch stops the run before step 1, and routes are known
        if roles is not None and resume is None:
            sync.push()  # the engines hold whatever the caller last gave them

        def engine_restarted(engine: int) -> None:
            sync.engine_restarted(engine)
            write_placement_json(run_dir, active.groups, rollout, sync.routes(), trainer)  # the new engine

        rollout.on_restart = engine_restarted
        write_placement_json(run_dir, active.groups, rollout, sync.routes(), trainer)
        if resume is not None:
            state = load_state(resume)
            trainer.load_checkpoint(str(resume / "trainer"), policy_version=state["version"])
            loader.load_state_dict(state["data"])
            rollout.load_state_dict(state["rollout"])
            step = state["step"]
            sync.push()  # the engines restart from the original weights: give them the checkpoint's
            log.info("resumed from %s at step %d", resume, step)
        if preflight is not None and roles is not None:  # started by the caller: the preflight now
            preflight(trainer)
        rollouts = Rollouts(
            cfg,
            rollout,
            pool,
            loader,
            tok,
            version=trainer.policy_version,
            steps=cfg.trainer.total_steps - step,
        )
        if cfg.trainer.test_freq and test_set:
            evaluator = Evaluator(cfg, rollout, tok, test_set, pool=pool)
        run = Run(cfg, trainer, rollout, sync, rollouts, pool, tok, evaluator, plan.placement == "colocated")
        logger = MetricsLogger(run_dir, cfg.logging, resume_step=step, config=to_dict(cfg))
        startup_s: float | None = time.perf_counter() - t_start  # Ray, rewards, roles, plan: ready
        log.info("ready for the first step after %.1f s", startup_s)
        bar = _progress(cfg, step)
        while step < cfg.trainer.total_steps:
            step += 1
            metrics, data = rl_step(run, step)
            if startup_s is not None:
                metrics["time/startup"], startup_s = startup_s, None
            logger.log(step, metrics)
            logger.log_samples(step, _samples(data, cfg.logging.samples_per_step))
            last = metrics
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}", tok_s=f"{metrics['throughput/tokens_per_s']:.0f}"
            )
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.trainer.total_steps:
                state = {
                    "version": trainer.policy_version,
                    "data": rollouts.loader_state(),
                    "rollout": rollouts.rollout_state(),
                }
                save_checkpoint(
                    run_dir, step, state, lambda p: trainer.save_checkpoint(str(p)), cfg.checkpoint.keep_last
                )
        hf = trainer.export_hf(str(run_dir / "hf"))  # the trained policy as a Hugging Face folder
        finished = True
    finally:
        _close_run(rollouts, evaluator, bar, logger, pool, sync, own=own, failing=not finished)
        if roles is not None:
            roles.rollout.on_restart = None  # this run's sync is closed; the caller keeps the roles
            # and an engine restarted between jobs gets this run's policy (none if the run stopped early)
            roles.rollout.keep_for_restart(hf, roles.trainer.policy_version)
    return {"run_dir": str(run_dir), "steps": step, "final": last, "model_path": model_path, "hf": hf}


SYNC_CLOSE_S = 30.0  # how long a failing run waits for the weight sync's close before ending the roles


def _close_run(*closers, own: Roles | None, failing: bool) -> None:
    """Close the run's parts, then end the roles it started (`own`): each part even where another fails.
    While the run is failing, its own error is the one the caller must see: an error here is logged
    instead, and the weight sync's close (a call into every trainer rank) is waited for at most
    `SYNC_CLOSE_S`: a rank whose peer died can sit in a collective until torch's 10 min timeout, and
    its close would queue behind it. Ending the roles kills it."""
    errors: list[BaseException] = []
    for closer in closers:
        if closer is None:
            continue
        try:
            if failing and isinstance(closer, WeightSync):
                if not _within(closer.close, SYNC_CLOSE_S):
                    log.warning(
                        "weight sync: closing the trainer ranks' side took over %.0f s (a rank is stuck); "
                        "ending the roles instead",
                        SYNC_CLOSE_S,
                    )
            else:
                closer.close()
        except Exception as e:  # noqa: BLE001 - the others are closed first; raised below if the run was fine
            errors.append(e)
            if failing:
                log.warning("closing %s after the run failed: %s", type(closer).__name__, e)
    if own is not None:
        own.shutdown()
    if errors and not failing:
        raise errors[0]


def collective_restart_warning(cfg: Config) -> str | None:
    """What to warn about at start-up when engine restarts are allowed but the transport cannot take a
    restarted engine back (`WeightSync.replace_receiver`: the collective group lost a member), else None."""
    if cfg.sync.transport != "collective" or cfg.rollout.max_restarts == 0:
        return None
    return (
        f"sync.transport = collective cannot take back a restarted engine: rollout.max_restarts = "
        f"{cfg.rollout.max_restarts}, but a run whose engine dies or hangs will fail at the restart "
        "(--sync.transport=auto restarts engines)"
    )


def _within(fn: Callable[[], Any], timeout_s: float) -> bool:
    """Run `fn` in a daemon thread: False if it is still running after `timeout_s` (left to finish or
    fail on its own), else True, or its error."""
    box: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)

    t = threading.Thread(target=run, daemon=True, name="rl_tpu-close")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return False
    if box:
        raise box[0]
    return True


def _model_and_tokenizer(cfg: Config, run_dir: Path, examples: list[Example]):
    """The model folder (`ensure_model`), its tokenizer, and the longest prompt's token count, with
    every prompt checked against `data.max_prompt_length`."""
    model_path = ensure_model(cfg, run_dir)
    tok = load_tokenizer(model_path, chat_template=True)
    longest = check_prompt_lengths(tok, examples, cfg.data.max_prompt_length, cfg.data.truncation)
    return model_path, tok, longest


def _samples(data: Scored, k: int) -> list[dict[str, Any]]:
    out = []
    flat_scores = iter(data.scores)
    for ex, group in zip(data.examples, data.groups):
        for c in group:
            s = next(flat_scores)
            if len(out) < k:
                out.append(
                    {
                        "uid": ex.uid,
                        "sample": c.sample_index,
                        "text": c.text,
                        "reward": s,
                        "policy_version": c.policy_version,
                        "ground_truth": str(ex.ground_truth),
                    }
                )
    return out


def _progress(cfg: Config, start: int):
    from tqdm import tqdm

    return tqdm(
        total=cfg.trainer.total_steps,
        initial=start,
        desc="rl-tpu",
        unit="step",
        disable=not cfg.logging.progress,
        dynamic_ncols=True,
    )
