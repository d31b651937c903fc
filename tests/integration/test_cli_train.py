"""`rl-tpu train` from the command line, as a user runs it: a verl-format parquet file and a user reward
file outside the package, no code change. Runs in a subprocess with its own local Ray instance."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(1200)  # above the run's own 900 s subprocess timeout, which reports better
def test_cli_with_verl_parquet_and_a_user_reward_file(tmp_path):
    from rl_tpu.data import make_synthetic, write_parquet

    train, test = make_synthetic("arithmetic", 64, 8, seed=3)
    write_parquet(train, tmp_path / "train.parquet")
    write_parquet(test, tmp_path / "test.parquet")
    (tmp_path / "my_reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return {'score': float(len(solution_str) > 0), 'chars': float(len(solution_str))}\n"
    )
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.commands.cli",
        "train",
        f'--data.train_files=["{tmp_path / "train.parquet"}"]',
        f'--data.test_files=["{tmp_path / "test.parquet"}"]',
        '--reward.functions=["my_reward.py:score"]',
        f"--logging.run_dir={run_dir}",
        "--trainer.total_steps=1",
        "--trainer.test_freq=1",
        "--rollout.n=4",
        "--rollout.max_tokens=8",
        "--data.batch_size=4",
        "--logging.tensorboard=false",
        "--reward.workers=1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # never join another test's Ray
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/mean"] == 1.0 and row["reward/score/chars"] > 0  # named after the function
    assert 0.0 <= row["eval/accuracy"] <= 1.0
    samples = (run_dir / "samples.jsonl").read_text().splitlines()
    assert samples and json.loads(samples[0])["uid"].startswith(
        "train.parquet:"
    )  # file:row names each prompt
    # the console carries our progress and result, not library noise (--verbose brings that back)
    console = r.stdout + r.stderr
    assert "trained 1 steps" in console and str(run_dir / "hf") in console
    for noise in ("returned a view tensor", "Started a local Ray instance", "NUMA binding", "FutureWarning"):
        assert noise not in console, noise
    assert row["time/startup"] > 0  # ready-for-step-1 time is logged
