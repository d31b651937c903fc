"""Fault injection on the real stack: an engine process killed (SIGKILL, as an operator or the OOM
killer would) in the middle of a run. The run must finish with every step's batch whole."""

import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rl_tpu.config import load_config

DIGITS_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    return sum(ch.isdigit() for ch in solution_str[:64]) / 16.0
"""


pytestmark = pytest.mark.usefixtures("loop_ray")


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _kill_engine_during_step(run_dir: Path, engine: int, step: int, delay_s: float, out: dict) -> None:
    """Once step `step - 1` is logged (the next step's generation starts at once), SIGKILL engine
    `engine`'s actor process, found in placement.json."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if any(r.get("step") == step - 1 for r in _rows(run_dir / "metrics.jsonl")):
            actors = json.loads((run_dir / "placement.json").read_text())["actors"]
            pid = next(a["pid"] for a in actors if a["role"] == "rollout" and a["index"] == engine)
            time.sleep(delay_s)
            os.kill(pid, signal.SIGKILL)
            out["killed"] = pid
            return
        time.sleep(0.05)


def test_engine_killed_mid_step_is_restarted_resynced_and_no_sample_lost(tmp_path, caplog):
    from rl_tpu.loop import train

    (tmp_path / "digits.py").write_text(textwrap.dedent(DIGITS_REWARD))
    run_dir = tmp_path / "run"
    batch, n = 8, 8
    cfg = load_config(
        None,
        [
            f"--logging.run_dir={run_dir}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--trainer.world_size=2",
            "--trainer.micro_batch_size=64",
            f"--rollout.n={n}",
            "--rollout.engines=2",
            "--rollout.max_tokens=48",
            f"--data.batch_size={batch}",
            "--data.synthetic_train_size=64",
            "--data.synthetic_test_size=8",
            "--trainer.test_freq=0",
            "--reward.workers=1",
            "--checkpoint.every=0",
            "--trainer.total_steps=4",
            "--sync.verify=true",
            f'--reward.functions=["{tmp_path / "digits.py"}:compute_score"]',
        ],
    )
    killed: dict = {}
    killer = threading.Thread(target=_kill_engine_during_step, args=(run_dir, 1, 2, 0.3, killed), daemon=True)
    killer.start()
    summary = train(cfg)  # verify runs after every sync, the restarted engine's included: a mismatch raises
    killer.join(timeout=5)
    assert "killed" in killed, "the fault was never injected"
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and summary["steps"] == 4
    assert [r["rollout/samples"] for r in rows] == [batch * n] * 4  # none lost, none duplicated
    assert [r["rollout/restarts"] for r in rows] == [0, 1, 1, 1]  # restarted within step 2
    restarts = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert len(restarts) == 1 and restarts[0].startswith("rollout worker 1: "), restarts
    print("restart:", restarts[0])  # lost during generation ("actor died") or during the sync
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 3, 4}
