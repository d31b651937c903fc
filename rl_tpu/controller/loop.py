"""The RL driver: `train(cfg)` checks its inputs, starts the roles (or attaches the caller's), then runs
`rl_step` (rl_tpu/controller/step.py: one step, top to bottom) until `trainer.total_steps`, logging and
checkpointing between steps, and closes what it started:

    check_inputs -> Training.start -> Training.steps -> Training.finish -> Training.close

The evaluation (every `trainer.test_freq` steps and after the last) is greedy on the held-out prompts,
multi-turn with the tools and the environment when the run has them (`rl_tpu.controller.evaluation`).
Modes (`cluster.mode`):
- `sync`: strictly on-policy; the engine generates step k with the weights of step k-1.
- `async` (runs `disaggregated`, which `cluster.placement = "auto"` picks: generation and training run at
  the same time, so they cannot take turns on shared devices): the loop is a producer and a consumer
  (`rl_tpu.controller.producer.Rollouts`): a thread generates and scores batch after batch into a buffer while the
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
from typing import TYPE_CHECKING, Any

from rl_tpu.cluster import start_ray
from rl_tpu.config import Config, ConfigError, check_lora_runnable, to_dict, to_toml
from rl_tpu.containment import check_sandbox
from rl_tpu.controller.checkpoint import check_resume_model, load_state, resolve_resume, save_checkpoint
from rl_tpu.controller.evaluation import Evaluator
from rl_tpu.controller.preflight import run_preflight
from rl_tpu.controller.producer import Rollouts, Scored, generate_and_score
from rl_tpu.controller.roles import Roles, check_roles, start_shared_roles, write_placement_json
from rl_tpu.controller.step import Run, old_log_prob_rows, on_policy_update, prepare_batch, rl_step
from rl_tpu.data import Example, PromptLoader, build_datasets, check_prompt_lengths
from rl_tpu.hf_config import check_expert_parallel, check_routing_replay, read_hf_config
from rl_tpu.metrics import MetricsLogger
from rl_tpu.model_folder import check_model_folder, ensure_model, load_tokenizer
from rl_tpu.model_source import resolve_model_path
from rl_tpu.placement import PlacementPlan, check_collective_devices, plan_from_config
from rl_tpu.rewards import RewardPool
from rl_tpu.rollout import verl_interactions
from rl_tpu.rollout.multi_turn import load_env
from rl_tpu.rollout.tools import check_tools_kwargs
from rl_tpu.weight_sync import WeightSync

if TYPE_CHECKING:
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup

log = logging.getLogger("rl_tpu")

__all__ = [
    "Inputs",
    "Roles",
    "Run",
    "Training",
    "check_inputs",
    "old_log_prob_rows",
    "on_policy_update",
    "Rollouts",
    "Scored",
    "generate_and_score",
    "prepare_batch",
    "rl_step",
    "start_shared_roles",
    "train",
]


# ---------------------------------------------------------------------------------------------------
# the loop


def check_attached_base(cfg: Config, engine_model: str, model_path: str) -> None:
    """`train(roles=)` under LoRA: engines started on another model would keep it as their base (only
    adapters are synced); a `ConfigError` naming both folders."""
    if cfg.trainer.lora.rank and os.path.realpath(engine_model) != os.path.realpath(model_path):
        raise ConfigError(
            f"config error: `model.path` = {model_path!r}, but the attached engines serve {engine_model!r}: "
            "under trainer.lora only the adapters are synced, so the engines would keep their base; start "
            "new roles for this model"
        )


@dataclass
class Inputs:
    """A run's inputs, read and checked before Ray starts: a mistake in them is reported in seconds rather
    than after the trainer and the engines have started (minutes on a CPU box)."""

    run_dir: Path
    resume: Path | None  # the checkpoint to continue from (`checkpoint.resume`)
    train_set: list[Example]
    test_set: list[Example]
    loader: PromptLoader
    plan: PlacementPlan
    pool: RewardPool  # its workers loaded the reward functions: a broken one stopped here


def check_inputs(cfg: Config, roles: Roles | None = None) -> Inputs:
    """Check the user's inputs and load the cheap ones (data, reward functions, environment, tools), and
    write RUN_DIR/config.toml. `cfg.model.path` becomes a local folder (from a Hub id, GGUF file or catalog
    name); its files are checked now, its tokenizer and the prompt lengths while Ray starts."""
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
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
    cfg.model.path = resolve_model_path(cfg.model.path)
    if cfg.model.path:
        check_model_folder(cfg.model.path, trainer=True)
    if resume is not None:  # a checkpoint of another model would fail once every actor has started
        check_resume_model(cfg)
    check_lora_runnable(cfg)
    check_routing_replay(cfg)  # an MoE model, one engine call per completion
    check_expert_parallel(cfg)  # experts to split, evenly
    loader = PromptLoader(train_set, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    plan = plan_from_config(cfg, os.cpu_count() or 1)
    check_collective_devices(cfg, plan)
    if roles is not None:
        check_roles(cfg, roles, plan)
    # A multi-turn environment class and the tools load here (the tools' workers start later), and every
    # row's extra_info.tools_kwargs is checked against the tools' row parameters.
    if cfg.rollout.env:
        load_env(cfg.rollout.env)
        if verl_interactions.is_interaction_config(cfg.rollout.env):  # each row names its interaction
            verl_interactions.check_rows(cfg.rollout.env, train_set + test_set)
    if cfg.rollout.tools:
        check_tools_kwargs(list(cfg.rollout.tools), train_set + test_set)
    if cfg.rollout.sandbox and (cfg.rollout.env or cfg.rollout.tools):
        check_sandbox()  # bwrap installed and able to start a process here
    # last, as it starts processes: the reward functions load in the pool's workers, which report a
    # missing file or function, a syntax or import error
    pool = RewardPool(cfg.reward)
    return Inputs(run_dir, resume, train_set, test_set, loader, plan, pool)


class Training:
    """One `train` call after its inputs passed: `start` (Ray, the model and its tokenizer, then the roles,
    started for this run or the caller's attached, the weight sync planned, a checkpoint resumed), `steps`,
    `finish` (the trained policy exported); `close` ends what was started, whichever stage failed."""

    def __init__(self, cfg: Config, inputs: Inputs, roles: Roles | None, t_start: float):
        self.cfg, self.inputs = cfg, inputs
        self.shared = roles  # the caller's roles (`start_shared_roles`), kept running after the run
        self.own: Roles | None = None  # roles this run started, ended by `close`
        self.t_start = t_start  # when `train` was called: `time/startup` counts from here
        self.model_path: str | None = None
        self.sync: WeightSync | None = None
        self.rollouts: Rollouts | None = None
        self.evaluator: Evaluator | None = None
        self.logger: MetricsLogger | None = None
        self.bar: Any = None  # tqdm
        self.run: Run | None = None
        self.step = 0
        self.last: dict[str, float] = {}
        self.hf: str | None = None

    def start(self) -> None:
        cfg, inputs = self.cfg, self.inputs
        with ThreadPoolExecutor(max_workers=1) as ex:
            built = ex.submit(_model_and_tokenizer, cfg, inputs.run_dir, inputs.train_set + inputs.test_set)
            started = start_ray(cfg, inputs.plan)
        try:
            self.model_path, tok, longest_prompt = built.result()
        except BaseException:
            if started:  # a user's mistake leaves no Ray behind (the CLI may run in-process, as in tests)
                import ray

                ray.shutdown()
            raise
        preflight = self._preflight(tok, longest_prompt)
        if self.shared is None:  # the preflight runs while the engines start
            roles = self.own = start_shared_roles(cfg, self.model_path, trainer_then=preflight)
        else:
            roles = self._attach(self.shared, preflight)
        trainer, rollout = roles.trainer, roles.rollout
        sync = self.sync = WeightSync.for_run(cfg.sync, trainer, rollout, self.model_path)
        sync.build()  # plan now: a name/shape mismatch stops the run before step 1, and routes are known

        def engine_restarted(engine: int) -> None:
            sync.engine_restarted(engine)  # and placement.json names the new engine
            write_placement_json(inputs.run_dir, roles.groups, rollout, sync.routes(), trainer)

        rollout.on_restart = engine_restarted
        write_placement_json(inputs.run_dir, roles.groups, rollout, sync.routes(), trainer, warn=True)
        if inputs.resume is not None:
            self._resume(trainer, rollout)
        if inputs.resume is not None or self.shared is not None:
            sync.push()  # the engines hold the original weights, or whatever the caller last gave them
        self.rollouts = Rollouts(
            cfg,
            rollout,
            inputs.pool,
            inputs.loader,
            tok,
            version=trainer.policy_version,
            steps=cfg.trainer.total_steps - self.step,
        )
        if cfg.trainer.test_freq and inputs.test_set:
            self.evaluator = Evaluator(cfg, rollout, tok, inputs.test_set, pool=inputs.pool)
        colocated = inputs.plan.placement == "colocated"
        self.run = Run(
            cfg, trainer, rollout, sync, self.rollouts, inputs.pool, tok, self.evaluator, colocated
        )
        self.logger = MetricsLogger(inputs.run_dir, cfg.logging, resume_step=self.step, config=to_dict(cfg))

    def _preflight(self, tok: Any, longest_prompt: int) -> Callable[[TrainerGroup], None] | None:
        """The largest batch through the trainer before step 1 (rl_tpu/controller/preflight.py), if on."""
        if not self.cfg.trainer.preflight:
            return None
        vocab = min(len(tok), int(read_hf_config(self.model_path).get("vocab_size", len(tok))))
        return lambda trainer: run_preflight(self.cfg, trainer, longest_prompt, vocab)

    def _attach(self, roles: Roles, preflight: Callable[[TrainerGroup], None] | None) -> Roles:
        """The caller's roles as this run's: the trainer restarts from `model.path` with this run's
        optimizer settings and the engines sample as fresh ones would (call index 0); the engines get the
        weights once the sync is planned. Under LoRA only adapters reach the engines, so they must already
        serve `model.path` as their base."""
        check_attached_base(self.cfg, roles.rollout.model_path, self.model_path)
        roles.trainer.restart_from(self.model_path, self.cfg.trainer)
        roles.rollout.load_state_dict({"calls": 0})
        if preflight is not None:
            preflight(roles.trainer)
        return roles

    def _resume(self, trainer: TrainerGroup, rollout: RolloutGroup) -> None:
        resume = self.inputs.resume
        state = load_state(resume)
        trainer.load_checkpoint(str(resume / "trainer"), policy_version=state["version"])
        self.inputs.loader.load_state_dict(state["data"])
        rollout.load_state_dict(state["rollout"])
        self.step = state["step"]
        log.info("resumed from %s at step %d", resume, self.step)

    def steps(self) -> None:
        cfg, run = self.cfg, self.run
        startup_s: float | None = time.perf_counter() - self.t_start  # Ray, rewards, roles, plan: ready
        log.info("ready for the first step after %.1f s", startup_s)
        self.bar = bar = _progress(cfg, self.step)
        while self.step < cfg.trainer.total_steps:
            self.step += 1
            metrics, data = rl_step(run, self.step)
            if startup_s is not None:
                metrics["time/startup"], startup_s = startup_s, None
            self.logger.log(self.step, metrics)
            self.logger.log_samples(self.step, _samples(data, cfg.logging.samples_per_step))
            self.last = metrics
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}", tok_s=f"{metrics['throughput/tokens_per_s']:.0f}"
            )
            every = cfg.checkpoint.every
            if (every and self.step % every == 0) or self.step == cfg.trainer.total_steps:
                self._checkpoint()

    def _checkpoint(self) -> None:
        trainer = self.run.trainer
        state = {
            "version": trainer.policy_version,
            "data": self.rollouts.loader_state(),
            "rollout": self.rollouts.rollout_state(),
        }
        save_checkpoint(
            self.inputs.run_dir,
            self.step,
            state,
            lambda p: trainer.save_checkpoint(str(p)),
            self.cfg.checkpoint.keep_last,
        )

    def finish(self) -> None:
        trainer = self.run.trainer
        self.hf = trainer.export_hf(str(self.inputs.run_dir / "hf"))  # the trained policy, HF folder
        if self.cfg.trainer.lora.rank:  # and its adapters over model.path, a PEFT folder
            trainer.export_adapter(str(self.inputs.run_dir / "adapter"))

    def close(self, failing: bool) -> None:
        i = self.inputs
        _close_run(
            self.rollouts,
            self.evaluator,
            self.bar,
            self.logger,
            i.pool,
            self.sync,
            own=self.own,
            failing=failing,
        )
        if self.shared is not None:
            self.shared.rollout.on_restart = None  # this run's sync is closed; the caller keeps the roles
            # and an engine restarted between jobs gets this run's policy (none if the run stopped early)
            self.shared.rollout.keep_for_restart(self.hf, self.shared.trainer.policy_version)

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.inputs.run_dir),
            "steps": self.step,
            "final": self.last,
            "model_path": self.model_path,
            "hf": self.hf,
        }


def train(cfg: Config, roles: Roles | None = None) -> dict[str, Any]:
    """Run `trainer.total_steps` RL steps; returns a summary (final metrics, run folder, and `hf`: the
    trained policy exported to RUN_DIR/hf).

    `roles`: a trainer group and engines the caller started for this placement (`start_shared_roles`)
    and keeps between jobs. The run then starts no actors: the trainer restarts from `model.path` with
    `cfg.trainer`'s optimizer settings, the engines get its weights before step 1 and sample as fresh
    ones would (call index 0), and both are left running for the caller."""
    t_start = time.perf_counter()
    training = Training(cfg, check_inputs(cfg, roles), roles, t_start)
    finished = False
    try:
        training.start()
        training.steps()
        training.finish()
        finished = True
    finally:
        training.close(failing=not finished)
    return training.summary()


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
