"""EnvPool (rollout/env_pool.py): environment instances in contained worker processes. Real processes
throughout: hangs wait on events that never come, deaths are real kills, and every wait has a generous
bound (the suite runs on loaded 2-core boxes)."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import pytest
from process_probes import group_alive, wait_until  # tests/: shared /proc probes

from rl_tpu.containment import DEFAULT_ENV_ALLOW, Limits
from rl_tpu.rollout.env_pool import EnvPool
from rl_tpu.rollout.multi_turn import EnvError

WAIT_S = 120  # the bound on any answer that should come: generous, never reached when things work

ENV = """
import asyncio, json, os, subprocess, sys, threading


BARRIERS = {}  # "together" instances wait for each other: proof that their calls run at once


class Env:
    '''What each instance does comes from its row's "kind".'''

    def reset(self, sample):
        self.kind, self.n = sample["kind"], sample.get("n", 0)
        if self.kind == "reset_raises":
            raise ValueError("no such row")
        child = None
        if self.kind == "hang":  # a process of its own in the worker's group, which the kill must take too
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]).pid
        seen = {"pid": os.getpid(), "child": child, "PATH": os.environ.get("PATH")}
        seen["secret"] = os.environ.get("RL_TPU_TEST_SECRET")
        return [{"role": "user", "content": json.dumps(seen)}]

    def step(self, messages):
        if self.kind == "hang":
            threading.Event().wait()  # for something that never happens
        if self.kind == "exit":
            os._exit(7)
        if self.kind == "alloc":
            bytearray(2 * 2**30)  # 2 GiB: past the worker's 1 GiB address-space limit
        if self.kind == "bad":
            return "not a tuple"
        if self.kind == "together":
            BARRIERS.setdefault(self.n, threading.Barrier(self.n, timeout=60)).wait()
        return [{"role": "user", "content": "again"}], float(len(messages)), False


class AsyncEnv(Env):
    async def step(self, messages):
        if self.kind == "hang":
            await asyncio.Event().wait()  # on the worker's event loop, which the others share
        return Env.step(self, messages)
"""


@pytest.fixture
def spec(tmp_path) -> str:
    f = tmp_path / "pool_env.py"
    f.write_text(textwrap.dedent(ENV))
    return f"{f}:Env"


@pytest.fixture
def pools():
    made = []

    def make(spec: str, **kw) -> EnvPool:
        made.append(EnvPool(spec, **kw))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


def seen(result) -> dict:
    """What a `reset` reported about its process (see ENV)."""
    assert result.ok, result.error
    return json.loads(result.value[0]["content"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls", ["Env", "AsyncEnv"])
def test_a_hung_call_ends_its_instance_only_and_its_worker_goes_once_the_others_end(spec, pools, cls):
    pool = pools(spec.replace(":Env", f":{cls}"), workers=1, timeout_s=3.0)
    (old,) = pool.worker_pids
    opened = [pool.reset({"kind": k}) for k in ("hang", "ok", "ok")]
    (hung, _), (a, _), (b, _) = opened
    found = [seen(f.result(WAIT_S)) for _, f in opened]
    assert {s["pid"] for s in found} == {old}  # all three in the one worker
    child = found[0]["child"]
    hang, answer = pool.step(hung, []), pool.step(a, [{"role": "user", "content": "x"}])
    # the other instance in the hung one's worker answers while it hangs
    assert answer.result(WAIT_S).value == ([{"role": "user", "content": "again"}], 1.0, False, {})
    result = hang.result(WAIT_S)
    assert result.timeout and result.error.startswith("timed out after 3 s") and not result.ok
    assert pool.timeouts == 1
    # drained: a fresh worker takes new instances; the old one still serves the instance left in it
    (new,) = pool.worker_pids
    assert new != old
    tid, f = pool.reset({"kind": "ok"})
    assert seen(f.result(WAIT_S))["pid"] == new
    assert pool.step(b, []).result(WAIT_S).value[1] == 0.0
    assert group_alive(old)
    # once its instances are released, the drained worker's whole process group is killed
    for t in (hung, a, b):
        pool.release(t)
    wait_until(lambda: not group_alive(old), "the drained worker's group is still alive", WAIT_S)
    assert not group_alive(child)  # the process the hung call started went with it
    assert pool.step(tid, []).result(WAIT_S).ok  # the fresh worker goes on
    pool.close()
    wait_until(lambda: not group_alive(new), "the closed worker's group lives", 10)


@pytest.mark.timeout(300)
def test_close_kills_a_hung_worker_still_holding_instances(spec, pools):
    pool = pools(spec, workers=1, timeout_s=2.0)
    (old,) = pool.worker_pids
    tid, f = pool.reset({"kind": "hang"})
    other, g = pool.reset({"kind": "ok"})
    child = seen(f.result(WAIT_S))["child"]
    g.result(WAIT_S)
    assert pool.step(tid, []).result(WAIT_S).timeout
    assert group_alive(old)  # draining: `other` still lives there
    pool.close()
    # SIGKILL sent to the group: its members die as the kernel schedules them (a moment under load)
    wait_until(lambda: not group_alive(old) and not group_alive(child), "the closed worker's group lives", 10)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["SIGKILL", "os._exit"])
def test_a_dead_worker_ends_its_instances_and_the_pool_serves_new_ones(spec, pools, how):
    pool = pools(spec, workers=1, timeout_s=600.0)  # no timeout can be what ends these calls
    (old,) = pool.worker_pids
    opened = [pool.reset({"kind": k}) for k in ("hang", "exit", "ok")]
    for _, f in opened:
        seen(f.result(WAIT_S))
    (hung, _), (dies, _), (idle, _) = opened
    waiting = pool.step(hung, [])  # a call in flight when the worker dies
    if how == "SIGKILL":
        os.kill(old, signal.SIGKILL)
        code = -9
    else:
        pool.step(dies, [])
        code = 7
    result = waiting.result(WAIT_S)
    assert not result.ok and not result.timeout
    assert result.error == f"its worker process died (exit code {code})"
    # an instance that was idle in it: its next call answers the same, at once
    assert pool.step(idle, []).result(WAIT_S).error == result.error
    assert pool.deaths == 1
    (new,) = pool.worker_pids
    assert new != old
    tid, f = pool.reset({"kind": "ok"})
    assert seen(f.result(WAIT_S))["pid"] == new
    assert pool.step(tid, [{"role": "user", "content": "x"}]).result(WAIT_S).value[1] == 1.0


@pytest.mark.timeout(300)
def test_the_memory_limit_makes_a_runaway_allocation_that_calls_error(spec, pools):
    pool = pools(spec, workers=1, limits=Limits(memory_mb=1024, env_allow=DEFAULT_ENV_ALLOW), timeout_s=60.0)
    (pid,) = pool.worker_pids
    greedy, f = pool.reset({"kind": "alloc"})
    fine, g = pool.reset({"kind": "ok"})
    f.result(WAIT_S), g.result(WAIT_S)
    result = pool.step(greedy, []).result(WAIT_S)
    assert result.error.startswith("raised MemoryError") and not result.timeout
    assert pool.step(fine, []).result(WAIT_S).ok  # the worker lives on
    assert pool.worker_pids == [pid] and pool.deaths == 0


@pytest.mark.timeout(300)
def test_hundreds_of_calls_run_at_once_within_a_small_memory_limit(spec, pools):
    """Each call has a thread of its own: their stacks and malloc arenas must fit the address-space limit."""
    n = 300
    pool = pools(
        spec, workers=1, limits=Limits(memory_mb=1024, env_allow=DEFAULT_ENV_ALLOW), timeout_s=WAIT_S
    )
    opened = [pool.reset({"kind": "together", "n": n}) for _ in range(n)]
    for _, f in opened:
        f.result(WAIT_S)
    results = [f.result(WAIT_S) for f in [pool.step(tid, []) for tid, _ in opened]]
    assert [r.error for r in results if not r.ok] == []


@pytest.mark.timeout(300)
def test_workers_see_only_the_allowed_environment_variables(spec, pools, monkeypatch):
    monkeypatch.setenv("RL_TPU_TEST_SECRET", "hunter2")
    plain = seen(pools(spec, workers=1).reset({"kind": "ok"})[1].result(WAIT_S))
    assert plain["PATH"] == os.environ["PATH"] and plain["secret"] is None
    allowed = pools(spec, workers=1, limits=Limits(env_allow=DEFAULT_ENV_ALLOW + ("RL_TPU_TEST_*",)))
    assert seen(allowed.reset({"kind": "ok"})[1].result(WAIT_S))["secret"] == "hunter2"


@pytest.mark.timeout(300)
def test_instances_go_to_the_least_loaded_worker_and_errors_come_back(spec, pools):
    pool = pools(spec, workers=2)
    opened = [pool.reset({"kind": k}) for k in ("ok", "ok", "ok", "ok", "reset_raises")]
    pids = [seen(f.result(WAIT_S))["pid"] for _, f in opened[:4]]
    assert sorted(pids.count(p) for p in pool.worker_pids) == [2, 2]
    failed = opened[4][1].result(WAIT_S)
    assert failed.error == "raised ValueError: no such row" and "Traceback" in failed.traceback
    pool.release(opened[4][0])  # the failed instance, then one more: its worker now holds the fewest
    pool.release(opened[0][0])
    assert seen(pool.reset({"kind": "ok"})[1].result(WAIT_S))["pid"] == pids[0]
    # a return value of the wrong shape is the class's bug: the future raises it
    tid, f = pool.reset({"kind": "bad"})
    f.result(WAIT_S)
    with pytest.raises(
        EnvError, match=r"Env.step must return \(new_messages, reward or None, done\[, info\]\)"
    ):
        pool.step(tid, []).result(WAIT_S)


BLOCKS = """
import os, threading

if "RL_TPU_TEST_DRIVER" not in os.environ:  # in a worker, whose environment is filtered
    {action}


class Env:
    def reset(self, sample):
        return [{{"role": "user", "content": "hi"}}]

    def step(self, messages):
        return [], 1.0, True
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "action, message",
    [
        ("threading.Event().wait()", r"did not start within 2 s \(does the module block"),
        ("os._exit(3)", r"exited while loading it \(exit code 3\)"),
    ],
)
def test_a_module_that_blocks_or_dies_at_import_in_a_worker_is_a_one_line_error(
    tmp_path, monkeypatch, action, message
):
    monkeypatch.setenv("RL_TPU_TEST_DRIVER", "1")  # the driver's own import goes through
    f = tmp_path / "blocking_env.py"
    f.write_text(BLOCKS.format(action=action))
    t0 = time.monotonic()
    with pytest.raises(EnvError) as e:
        EnvPool(f"{f}:Env", workers=2, startup_timeout_s=2.0)
    assert time.monotonic() - t0 < 60
    assert "\n" not in str(e.value) and str(e.value).startswith(f"rollout.env '{f}:Env': ")
    assert e.match(message)
