"""The loop's producer side: each step's data (`Rollouts`), generated and scored from prompts.

`sync` mode makes a step's batch when the step asks for it; `async` mode makes batches ahead in a
thread while the trainer trains, within `algorithm.max_staleness` (see `Rollouts`). The engines take
turns between generation calls and the loop's weight syncs (`rl_tpu.rollout.partial.EngineTurns`);
`Sampler` is what generation goes through: one call per turn, in chunks under `rollout.partial` (the
engines hold unfinished sequences between chunks, `rl_tpu.rollout.held`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from rl_tpu.algorithms import keep_groups_with_variance
from rl_tpu.config import Config, response_budget
from rl_tpu.data import Example, PromptLoader, encode_prompts
from rl_tpu.rewards import RewardInput, RewardPool
from rl_tpu.rollout.env_pool import EnvPool
from rl_tpu.rollout.multi_turn import MultiTurn, Trajectory, retokenize_drift
from rl_tpu.rollout.partial import EngineTurns, generate_held
from rl_tpu.rollout.tools import Tools
from rl_tpu.types import Completion

__all__ = [
    "Rollouts",
    "Sampler",
    "Scored",
    "generate_and_score",
    "score_groups",
    "turn_metrics",
    "with_env_rewards",
]


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


def with_env_rewards(groups: list[list[Completion]], scores: list[float]) -> list[float]:
    """`scores` (the reward functions', flat over `groups`) with an environment's own reward in place of
    the score of its trajectory's final answer, where the environment gave one."""
    flat = [c for g in groups for c in g]
    return [s if c.extra.get("env_reward") is None else c.extra["env_reward"] for c, s in zip(flat, scores)]


def turn_metrics(trajs: list[Trajectory], prefix: str, tools: bool) -> dict[str, float]:
    """Multi-turn trajectories' metrics under `prefix` ("rollout/" per step, "eval/"): turns_mean,
    env_reward_frac, env_errors, env_timeouts, truncated (stopped by `max_turns` or `max_total_tokens`)
    and, with `tools`, tool_calls, tool_errors, tool_timeouts (sums), tool_calls_mean and tool_reward_mean
    (per trajectory: the step rewards tools gave, `ToolReply`); `env_info/<key>_mean` for each key an
    environment's `step` reported (the mean of each reporting trajectory's last value)."""
    metrics = {
        f"{prefix}turns_mean": sum(t.turns for t in trajs) / len(trajs),
        f"{prefix}env_reward_frac": sum(t.reward is not None for t in trajs) / len(trajs),
        f"{prefix}env_errors": float(sum(t.env_error for t in trajs)),
        f"{prefix}env_timeouts": float(sum(t.env_timeout for t in trajs)),
        f"{prefix}truncated": float(sum(t.finish_reason in ("max_turns", "max_total_tokens") for t in trajs)),
    }
    for key in sorted({k for t in trajs for k in t.env_info}):  # what `step` reported, over those that did
        values = [t.env_info[key] for t in trajs if key in t.env_info]
        metrics[f"{prefix}env_info/{key}_mean"] = sum(values) / len(values)
    if tools:
        metrics[f"{prefix}tool_calls_mean"] = sum(t.tool_calls for t in trajs) / len(trajs)
        metrics[f"{prefix}tool_calls"] = float(sum(t.tool_calls for t in trajs))
        metrics[f"{prefix}tool_errors"] = float(sum(t.tool_errors for t in trajs))
        metrics[f"{prefix}tool_timeouts"] = float(sum(t.tool_timeouts for t in trajs))
        metrics[f"{prefix}tool_reward_mean"] = sum(t.tool_reward for t in trajs) / len(trajs)
    return metrics


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
        t = time.perf_counter()
        if cfg.rollout.env or cfg.rollout.tools:
            groups, turn_metrics = rollout.multi_turn(examples)
        else:
            prompts = encode_prompts(tok, examples, cfg.data.max_prompt_length, cfg.data.truncation)
            groups, turn_metrics = rollout.generate(prompts), {}
        timings["time/rollout"] += time.perf_counter() - t
        # the engines' own generate time (the slowest engine's): time/rollout minus this is our overhead
        timings["time/generate"] += max(
            (c.extra.get("generate_s", 0.0) for g in groups for c in g), default=0.0
        )
        rss = [c.extra["engine_rss_mb"] for g in groups for c in g if "engine_rss_mb" in c.extra]
        if rss:  # each engine's resident memory after its call's heap trim: the largest engine's
            turn_metrics = turn_metrics | {"memory/engine_rss_mb": max(rss)}
        t = time.perf_counter()
        scores, metrics = score_groups(pool, examples, groups)
        metrics.update(turn_metrics)
        scores = with_env_rewards(groups, scores)
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
    n_kept = min(len(kept.groups), n)  # logged as kept: 0 when the fallback below trains on uniform groups
    if not kept.groups:  # every group was uniform: nothing to learn from, train on the last draw as is
        kept = Scored(examples, groups, scores, kept.metrics)
    per = len(kept.groups[0])
    kept = Scored(kept.examples[:n], kept.groups[:n], kept.scores[: n * per], kept.metrics)
    kept.metrics["dynamic_sampling/kept_groups"] = float(n_kept)
    kept.metrics["dynamic_sampling/drawn_groups"] = float(drawn_groups)
    return kept, timings


class Sampler:
    """What `generate_and_score` samples from: the engines, one generation call per engine turn
    (`EngineTurns`), in chunks under `rollout.partial`."""

    def __init__(self, cfg: Config, rollout, turns: EngineTurns, tok):
        self.cfg, self.rollout, self.turns, self.tok = cfg, rollout, turns, tok
        rc = cfg.rollout
        self.turn_runner = self.tools = self.envs = None
        try:  # loaded here (workers started), so a bad tool or environment fails before the first step
            if rc.tools:
                self.tools = Tools.from_config(rc)
            if rc.env:
                self.envs = EnvPool.from_config(rc)
            if rc.env or rc.tools:
                self.turn_runner = MultiTurn(
                    tok,
                    self.envs,
                    lambda prompts, max_tokens: [
                        g[0] for g in self._call(prompts, n=1, max_tokens=max_tokens)
                    ],
                    max_turns=rc.max_turns,
                    max_tokens=rc.max_tokens,
                    max_total_tokens=response_budget(cfg),
                    tools=self.tools,
                    scheduling=rc.turn_scheduling,
                )
        except BaseException:  # the workers started so far are not left behind
            self.close()
            raise

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
        if self.envs is not None:
            self.envs.close()

    def _call(self, prompts: list[list[int]], **kw) -> list[list[Completion]]:
        with self.turns.generating():
            return self.rollout.generate(prompts, **kw)

    def generate(self, prompts: list[list[int]]) -> list[list[Completion]]:
        rc = self.cfg.rollout
        # a response that fits one chunk is never paused: the plain call is the same generation without
        # the chunked path's per-batch costs (docs/decisions.md)
        if not rc.partial or rc.max_tokens <= rc.partial_chunk_tokens:
            return self._call(prompts)
        return generate_held(self._chunk, prompts, n=rc.n, tokenizer=self.tok)

    def _chunk(self, seqs: list[Completion]) -> list:
        with self.turns.generating():
            return self.rollout.generate_chunk(seqs, self.cfg.rollout.partial_chunk_tokens)

    def multi_turn(self, examples: list[Example]) -> tuple[list[list[Completion]], dict[str, float]]:
        """`rollout.n` multi-turn trajectories per example (`rollout.env`, `rollout.tools`), and their
        turn metrics."""
        n = self.cfg.rollout.n
        trajs = self.turn_runner.rollout([dataclasses.asdict(ex) for ex in examples], n=n)
        groups = [[trajs[i * n + j].completion(i, j) for j in range(n)] for i in range(len(examples))]
        return groups, turn_metrics(trajs, "rollout/", self.tools is not None) | {
            "rollout/retokenize_drift": float(sum(retokenize_drift(self.tok, t) for t in trajs)),
            "rollout/turn_calls": self.turn_runner.stats["generate_calls"],
            "rollout/turns_per_call": self.turn_runner.stats["turns_per_call"],
        }


class Rollouts:
    """Each step's data: the producer side of the loop.

    `sync` mode: generated when the step asks for it. `async` mode: a producer thread generates and
    scores one step's batch after another into a buffer while the trainer trains; the step takes the
    oldest. The batch the trainer will update from policy version `v` (= `v0 + j` for the j-th batch of
    this run) starts generating only once the engines serve version >= `v - algorithm.max_staleness`
    (`wait`), so no token of it is older than the bound; under `drop` the producer does not wait for
    versions (it keeps at most `max_staleness + 1` finished batches), and the step drops the groups with
    a token over the bound and generates them again, with the current weights (`rollout/dropped` counts them).
    The engines take turns (`EngineTurns`): the loop's weight syncs and evaluations run in
    `turns.exclusive()`, between two generation calls (two chunks under `rollout.partial`).
    `loader_state()` / `rollout_state()` are what a checkpoint records: the positions before the oldest
    batch not trained yet, which a resume draws again (sampled with the checkpoint's weights, so async
    resumes are not bit-reproducible)."""

    def __init__(
        self, cfg: Config, rollout, pool: RewardPool, loader: PromptLoader, tok, *, version: int, steps: int
    ):
        self.cfg, self.rollout, self.pool, self.loader, self.tok = cfg, rollout, pool, loader, tok
        self.turns = EngineTurns()
        self.sampler = Sampler(cfg, rollout, self.turns, tok)
        self.ahead = cfg.cluster.mode == "async"
        self.v0, self.steps = version, steps  # the version the first batch is trained at; batches to make
        self._cv = threading.Condition()
        self._served = version  # the version the engines serve (`updated`)
        self._ready: list[tuple[Scored, dict[str, float]]] = []
        self._states: list[tuple[dict, dict]] = []  # (loader, rollout) state before each batch made
        self._taken = 0  # batches the trainer took
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.ahead and steps > 0:
            self._thread = threading.Thread(target=self._produce, daemon=True, name="rl_tpu-rollouts")
            self._thread.start()

    def _make(self) -> tuple[Scored, dict[str, float]]:
        with self._cv:
            self._states.append((self.loader.state_dict(), self.rollout.state_dict()))
        return generate_and_score(self.cfg, self.sampler, self.pool, self.loader, self.tok)

    def _produce(self) -> None:
        a = self.cfg.algorithm
        try:
            for j in range(self.steps):
                oldest = self.v0 + j - a.max_staleness  # the oldest version this batch may be sampled by
                with self._cv:
                    if a.staleness_policy == "wait":
                        self._cv.wait_for(lambda oldest=oldest: self._closed or self._served >= oldest)
                    else:
                        self._cv.wait_for(lambda: self._closed or len(self._ready) <= a.max_staleness)
                    if self._closed:
                        return
                made = self._make()
                with self._cv:
                    self._ready.append(made)
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's side in `next`
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def next(self, trainer_version: int) -> tuple[Scored, dict[str, float]]:
        """This step's data and its timings (`time/trainer_idle`: how long the step waited for it)."""
        t = time.perf_counter()
        if not self.ahead:
            data, timings = self._make()
            self._states.clear()
        else:
            with self._cv:
                self._cv.wait_for(lambda: self._ready or self._error is not None)
                if not self._ready:
                    raise self._error  # type: ignore[misc]
                data, timings = self._ready.pop(0)
                self._taken += 1
                self._cv.notify_all()
            data = self._within_bound(data, trainer_version)
        timings["time/trainer_idle"] = time.perf_counter() - t
        return data, timings

    def _within_bound(self, data: Scored, trainer_version: int) -> Scored:
        """`data` with no token more than `algorithm.max_staleness` versions behind `trainer_version`:
        under `drop`, the groups over it are generated and scored again; under `wait` none can be."""
        a = self.cfg.algorithm
        stale = [
            i
            for i, g in enumerate(data.groups)
            if any(trainer_version - min(c.versions(), default=c.policy_version) > a.max_staleness for c in g)
        ]
        if stale and a.staleness_policy == "wait":
            raise RuntimeError(
                f"async rollouts: {len(stale)} group(s) over algorithm.max_staleness = {a.max_staleness} "
                f"under the wait policy (trainer at version {trainer_version})"
            )
        if stale:
            examples = [data.examples[i] for i in stale]
            prompts = encode_prompts(
                self.tok, examples, self.cfg.data.max_prompt_length, self.cfg.data.truncation
            )
            fresh = self.sampler.generate(prompts)
            scores, _ = score_groups(self.pool, examples, fresh)
            per = len(data.groups[0])
            flat = [data.scores[i * per : (i + 1) * per] for i in range(len(data.groups))]
            for i, g, k in zip(stale, fresh, range(len(stale))):
                data.groups[i], flat[i] = g, scores[k * per : (k + 1) * per]
            data.scores = [s for row in flat for s in row]
        data.metrics["rollout/dropped"] = float(sum(len(data.groups[i]) for i in stale))
        return data

    def updated(self, version: int) -> None:
        """The engines now serve `version` (a weight sync finished)."""
        with self._cv:
            self._served = version
            self._cv.notify_all()

    def loader_state(self) -> dict:
        with self._cv:
            return (
                self._states[self._taken][0] if len(self._states) > self._taken else self.loader.state_dict()
            )

    def rollout_state(self) -> dict:
        with self._cv:
            if len(self._states) > self._taken:
                return self._states[self._taken][1]
            return self.rollout.state_dict()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.sampler.close()
