"""verl's own GSM8K interaction and GSM8K tool, unchanged, in rl-tpu's environment and tool workers.

verl removed both in 0.8 (the `verl` extra is 0.9.1), so they come from verl 0.7.1 itself, installed alone
into .verl-0.7.1/ (`scripts/setup.sh --verl-0.7.1`, which `make test` runs) and put on the workers'
PYTHONPATH, as a user of that verl would have it: `verl.interactions.gsm8k_interaction.Gsm8kInteraction`
and `verl.tools.gsm8k_tool.Gsm8kTool`, named in verl's own config files, not copies. Checked: the
interaction answers a wrong answer with its message and ends the trajectory on a right one, its turn score
reported, its state released when the trajectory ends; the tool's step rewards (0 for a better answer,
-0.05 otherwise); `rl-tpu train` runs both for every step with `batch_size x n` samples."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from rl_tpu.rollout.tools import ToolCall, Tools

SIDE = Path(__file__).resolve().parents[2] / ".verl-0.7.1"
pytestmark = pytest.mark.skipif(
    not (SIDE / "verl" / "interactions" / "gsm8k_interaction.py").is_file(),
    reason="needs verl 0.7.1 in .verl-0.7.1/ (scripts/setup.sh --verl-0.7.1; `make test` runs it)",
)

INTERACTION_YAML = """
interaction:
  - name: gsm8k
    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
    config: {}
"""

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml (verl 0.7.1)
TOOL_YAML = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""  # noqa: E501 - the file as verl has it


@pytest.fixture
def verl_071(monkeypatch):
    """Workers started from here import verl 0.7.1 (this process keeps the `verl` extra it imported; the
    driver's checks find modules on its path, without importing them)."""
    monkeypatch.syspath_prepend(str(SIDE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SIDE), os.environ.get("PYTHONPATH")])))


def _file(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(textwrap.dedent(text))
    return str(tmp_path / name)


def _row(uid: str, truth: str) -> dict:
    question = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
    return {
        "uid": uid,
        "messages": [{"role": "user", "content": question}],
        "extra_info": {
            "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": truth},
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
        },
    }


def test_verls_gsm8k_interaction_answers_in_an_environment_worker(tmp_path, verl_071):
    from rl_tpu.rollout.env_pool import EnvPool

    pool = EnvPool(_file(tmp_path, "interaction.yaml", INTERACTION_YAML), workers=1, timeout_s=60)
    try:
        assert pool.name == "Gsm8kInteraction"
        row = _row("r1", "72")
        tid, opened = pool.reset(row)
        assert opened.result(60).value == row["messages"]
        asked = [*row["messages"], {"role": "assistant", "content": "She sold 70."}]
        wrong = pool.step(tid, asked).result(60).value
        asked += [*wrong[0], {"role": "assistant", "content": "48 + 24 = 72\n#### 72"}]
        right = pool.step(tid, asked).result(60).value
        pool.release(tid)
    finally:
        pool.close()
    msg = "Your response is incorrect! You need to reflect on your answer and try again."
    assert wrong == ([{"role": "user", "content": msg}], None, False, {"turn_score": 0.0})
    assert right == ([], None, True, {"turn_score": 1.0})  # verl's strict "#### 72" match ends it


def test_an_instance_is_closed_in_its_worker_when_its_trajectory_is_released(tmp_path):
    from rl_tpu.rollout.env_pool import EnvPool

    spec = _file(
        tmp_path,
        "closing_env.py",
        f"""
        class Env:
            def reset(self, sample):
                self.uid = sample["uid"]
                return sample["messages"]

            def step(self, messages):
                return [], None, True

            async def close(self):
                with open({str(tmp_path / "closed.txt")!r}, "a") as f:
                    f.write(self.uid + "\\n")
        """,
    )
    pool = EnvPool(f"{spec}:Env", workers=1, timeout_s=60)
    try:
        for uid in ("a", "b"):
            tid, opened = pool.reset(_row(uid, "1"))
            opened.result(60)
            pool.release(tid)
        closed, deadline = tmp_path / "closed.txt", time.monotonic() + 60
        while len(closed.read_text().split() if closed.exists() else []) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # `close` runs on a thread of its own in the worker; nobody answers for it
    finally:
        pool.close()
    assert closed.read_text().split() == ["a", "b"]


def test_verls_gsm8k_tool_runs_unchanged_in_a_tool_worker(tmp_path, verl_071):
    tools = Tools([_file(tmp_path, "tools.yaml", TOOL_YAML)], timeout_s=60, workers=1)
    try:
        assert tools.names == ["calc_gsm8k_reward"]
        row = _row("t1", "72")
        right = tools.run(tools.bind([ToolCall("calc_gsm8k_reward", {"answer": "72"})], row))
        wrong = tools.run(tools.bind([ToolCall("calc_gsm8k_reward", {"answer": "71"})], row))
    finally:
        tools.close()
    # verl's text and step reward: 0.0 for an answer better than the instance's last (a new instance per
    # call: its last is 0), -0.05 otherwise
    assert [(r.text, r.reward, r.error) for r in right] == [
        ("Current parsed answer='72' reward=1.0", 0.0, False)
    ]
    assert [(r.text, r.reward, r.error) for r in wrong] == [
        ("Current parsed answer='71' reward=0.0", -0.05, False)
    ]


@pytest.mark.usefixtures("loop_ray")
def test_rl_tpu_train_runs_verls_interaction_and_tool_config_files(tmp_path, verl_071, tiny_qwen3, capsys):
    from rl_tpu.commands import cli

    rows = []
    for i in range(8):
        r = _row(f"g{i}", str(10 + i))
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": r["messages"],
                "reward_model": {"style": "rule", "ground_truth": str(10 + i)},
                "extra_info": r["extra_info"],
            }
        )
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, batch, n = 2, 2, 2
    rc = cli.main(
        [
            "train",
            f"--model.path={tiny_qwen3}",
            f'--data.train_files=["{data}"]',
            f"--data.batch_size={batch}",
            f"--rollout.n={n}",
            f"--rollout.env={_file(tmp_path, 'interaction.yaml', INTERACTION_YAML)}",
            f'--rollout.tools=["{_file(tmp_path, "tools.yaml", TOOL_YAML)}"]',
            "--rollout.max_turns=3",
            "--rollout.max_tokens=8",
            # a random tiny model seldom samples its stop token: stop turns on a quarter of the vocabulary
            f"--rollout.stop_token_ids={list(range(100, 228))}",
            "--rollout.env_workers=1",
            "--rollout.tool_workers=1",
            '--reward.functions=["rl_tpu.rewards.gsm8k"]',
            "--reward.workers=1",
            f"--trainer.total_steps={steps}",
            "--trainer.test_freq=0",
            "--checkpoint.every=0",
            f"--logging.run_dir={tmp_path / 'run'}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/samples"] for m in metrics] == [batch * n] * steps
    assert all(m["rollout/env_errors"] == 0 and m["rollout/env_timeouts"] == 0 for m in metrics), metrics
    # the tiny model never writes "#### <the answer>": each turn is answered "incorrect", scored 0.0 by the
    # interaction, and the trajectories go on past their first turn
    assert all(m["rollout/env_info/turn_score_mean"] == 0.0 for m in metrics), metrics
    assert max(m["rollout/turns_mean"] for m in metrics) > 1, [m["rollout/turns_mean"] for m in metrics]
    assert all("rollout/tool_calls" in m for m in metrics)  # the tools' schemas were in every prompt
