"""What a worker of `CallPool` (tools, rewards) holds its user code to: every process a call starts dies
with the worker (its own process group, killed whole after a timeout and at close), and the memory cap
is a hard limit, which code not running as root cannot raise."""

from __future__ import annotations

import time

import pytest
from process_probes import exited  # tests/: shared /proc probes

from rl_tpu.call_pool import CallPool
from rl_tpu.containment import Limits

HOSTILE = """
import resource, subprocess, time

def spawn(seconds: float = 0, pid_file: str = "") -> int:
    child = subprocess.Popen(["sleep", "300"])  # outlives the call unless its group is killed
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
    time.sleep(seconds)
    return child.pid

def limits() -> list:
    return list(resource.getrlimit(resource.RLIMIT_AS))
"""


def _gone(pid: int, within: float = 10.0) -> bool:
    """The process `pid` has exited (no longer running: gone, or a zombie no one reaped yet)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if exited(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def hostile(tmp_path):
    path = tmp_path / "hostile_tool.py"
    path.write_text(HOSTILE)
    return str(path)


def test_processes_a_call_started_die_when_the_pool_closes(hostile):
    pool = CallPool([f"{hostile}:spawn"], timeout_s=30, name="tool")
    (res,) = pool.run([(0, {})])
    assert res.ok and not _gone(res.value, within=0.5)  # alive after its call returned
    pool.close()
    assert _gone(res.value)


def test_processes_a_timed_out_call_started_die_with_its_worker(hostile, tmp_path):
    pid_file = tmp_path / "child.pid"
    with CallPool([f"{hostile}:spawn"], timeout_s=1, name="tool") as pool:
        (res,) = pool.run([(0, {"seconds": 60, "pid_file": str(pid_file)})])
        assert res.timeout
        assert _gone(int(pid_file.read_text()))  # before the pool closes: the timeout killed the group


def test_the_memory_cap_is_a_hard_limit(hostile):
    with CallPool([f"{hostile}:limits"], timeout_s=30, name="tool", limits=Limits(memory_mb=2048)) as pool:
        (res,) = pool.run([(0, {})])
    assert res.ok and res.value == [2048 * 2**20, 2048 * 2**20]
