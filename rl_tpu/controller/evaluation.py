"""Held-out evaluation: the loop's every `trainer.test_freq` steps, and the demos' (`Evaluator`).

Greedy, one response per test prompt, scored as training scores it:
- single-turn (neither `rollout.env` nor `rollout.tools`): the prompt as training renders it, one greedy
  completion of at most `rollout.max_tokens`, scored by `reward.functions`;
- multi-turn (`rollout.env` or `rollout.tools`): one greedy trajectory per prompt through `MultiTurn`,
  with training's limits (`rollout.max_turns`, `max_tokens`, `max_total_tokens`), the tools running and
  the environment answering; its score is the environment's reward when it gives one, else the reward
  functions on the last assistant turn (as `rl_tpu.controller.producer.generate_and_score` scores a trajectory).

The evaluator's tools and environment run in workers of its own (`rollout.tool_workers` and
`rollout.env_workers` more processes): in async mode the producer thread may be running the training
rollouts' tool calls and environments while an evaluation runs.

Metrics, under `eval/`: `accuracy` (the share of prompts scoring >= 1) and `reward_mean`; multi-turn adds
`turns_mean`, `env_reward_frac`, `env_errors`, `env_timeouts`, and with tools `tool_calls`, `tool_errors`,
`tool_timeouts` (sums over the prompts, as the `rollout/` ones are per step) and `tool_use` (the share of
prompts on which the model wrote a tool call).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rl_tpu.config import Config, response_budget
from rl_tpu.controller.producer import score_groups, turn_metrics, with_env_rewards
from rl_tpu.data import Example, encode_prompts
from rl_tpu.rewards import RewardPool
from rl_tpu.rollout.env_pool import EnvPool
from rl_tpu.rollout.multi_turn import MultiTurn
from rl_tpu.rollout.tools import Tools
from rl_tpu.types import Completion


class Evaluator:
    """Greedy held-out evaluation of `test_set` on engines it does not own (`rollout`: a `RolloutGroup`).
    `pool`: the run's `RewardPool` (None: one of its own, closed by `close`)."""

    def __init__(self, cfg: Config, rollout, tok, test_set: list[Example], pool=None):
        self.cfg, self.rollout, self.tok, self.test_set = cfg, rollout, tok, test_set
        self._own_pool = pool is None
        self.pool = RewardPool(cfg.reward) if pool is None else pool
        self.version = 0  # the policy version `evaluate(model_dir)` gave the engines last
        self.wrote_tool_call: list[bool] = []  # per prompt, at the last evaluation: a `<tool_call>` written
        rc = cfg.rollout
        self.tools = self.turns = self.envs = None
        if rc.tools:
            self.tools = Tools.from_config(rc)
        try:
            if rc.env:
                self.envs = EnvPool.from_config(rc)
            if rc.env or rc.tools:
                self.turns = MultiTurn(
                    tok,
                    self.envs,
                    self._greedy,
                    max_turns=rc.max_turns,
                    max_tokens=rc.max_tokens,
                    max_total_tokens=response_budget(cfg),
                    tools=self.tools,
                )
        except BaseException:  # e.g. a chat template multi-turn cannot use: the workers are not left behind
            self.close()
            raise

    def _greedy(self, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        return [g[0] for g in self.rollout.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)]

    def evaluate(self, model_dir: str | Path | None = None) -> dict[str, float]:
        """The `eval/` metrics (see the module docstring); `model_dir`: a HF folder whose weights the
        engines get first (the demos; the loop's engines hold the policy already)."""
        if model_dir is not None:
            self.install(model_dir)
        if not self.test_set:
            return {}
        metrics: dict[str, float] = {}
        if self.turns is None:
            prompts = encode_prompts(
                self.tok, self.test_set, self.cfg.data.max_prompt_length, self.cfg.data.truncation
            )
            groups = self.rollout.generate(prompts, n=1, temperature=0.0)
            self.wrote_tool_call = ["<tool_call>" in g[0].text for g in groups]
        else:
            trajs = self.turns.rollout([dataclasses.asdict(ex) for ex in self.test_set])
            groups = [[t.completion(i, 0)] for i, t in enumerate(trajs)]
            # a call the model wrote was answered (counted), or it is in the last turn, which runs none
            self.wrote_tool_call = [t.tool_calls > 0 or "<tool_call>" in t.last_text for t in trajs]
            metrics = turn_metrics(trajs, "eval/", self.tools is not None)
            if self.tools is not None:
                metrics["eval/tool_use"] = self.tool_use
        scores, _ = score_groups(self.pool, self.test_set, groups)
        scores = with_env_rewards(groups, scores)  # as in training
        return {
            "eval/accuracy": sum(s >= 1.0 for s in scores) / len(scores),
            "eval/reward_mean": sum(scores) / len(scores),
        } | metrics

    def install(self, model_dir: str | Path) -> None:
        """The engines serve `model_dir`'s weights (a HF folder) from now on, as the next version."""
        self.version += 1
        self.rollout.load_weights_full(str(Path(model_dir) / "model.safetensors"), self.version)

    def accuracy(self, model_dir: str | Path | None = None) -> float:
        return self.evaluate(model_dir)["eval/accuracy"]

    @property
    def tool_use(self) -> float:
        """The share of prompts on which the model wrote a tool call, at the last evaluation."""
        return sum(self.wrote_tool_call) / max(len(self.wrote_tool_call), 1)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
        if self.envs is not None:
            self.envs.close()
        if self._own_pool:
            self.pool.close()
