"""What a tool or environment worker can and cannot do (rl_tpu/containment.py), tried as a hostile tool
would, one test per claim of docs/multi_turn.md ("What a tool or environment can do"). Real worker
processes through `CallPool`; the sandbox tests run real bubblewrap (`scripts/setup.sh --sandbox`)."""

from __future__ import annotations

import os
import shutil
import socket
import textwrap
import time

import pytest
from process_probes import (  # tests/: shared /proc probes
    exited,
    proc_status,
    sleeping,
    wait_empty,
    wait_until,
)

from rl_tpu import containment
from rl_tpu.call_pool import CallPool
from rl_tpu.containment import DEFAULT_ENV_ALLOW, Limits

HOSTILE = textwrap.dedent(
    """
    import os, socket, subprocess

    def environ():
        with open("/proc/self/environ", "rb") as f:
            raw = f.read().decode()
        return {"os": dict(os.environ), "proc": raw}

    def connect(port):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return "connected"
        except OSError as e:
            return f"refused: {e}"

    def write(path):
        try:
            with open(path, "w") as f:
                f.write("x")
            return "written"
        except OSError as e:
            return f"refused: {e}"

    def read(path):
        with open(path) as f:
            return f.read()

    def where():
        import tempfile
        fd, path = tempfile.mkstemp()
        os.close(fd)
        return {"cwd": os.getcwd(), "tempfile": path}

    def signal_parent(pid):
        try:
            os.kill(pid, 0)
            return "reached"
        except OSError as e:
            return f"refused: {e}"

    def parent_environ(pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return "read " + f.read().decode()
        except OSError as e:
            return f"refused: {e}"

    def escape(marker):
        # leave the worker's process group, as a hostile tool would, then sleep for a while
        subprocess.Popen(["setsid", "sleep", marker], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return "started"

    def spawn_many(n, marker):
        # a fork bomb's first steps: as many long sleeps as it is allowed
        pids = []
        for _ in range(n):
            try:
                pids.append(subprocess.Popen(["sleep", marker], stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)
            except OSError as e:
                return {"started": len(pids), "pids": pids, "error": str(e)}
        return {"started": len(pids), "pids": pids, "error": None}

    def spin():
        while True:
            pass
    """
)
NAMES = [
    "environ", "connect", "write", "read", "where", "signal_parent", "parent_environ", "escape",
    "spawn_many", "spin",
]  # fmt: skip

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="needs bubblewrap (bwrap): scripts/setup.sh --sandbox"
)


@pytest.fixture
def hostile(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    return [f"{path}:{n}" for n in NAMES]


def _call(pool: CallPool, name: str, **kwargs):
    (res,) = pool.run([(NAMES.index(name), kwargs)])
    assert res.ok, res.error
    return res.value


def _pool(specs, **kw) -> CallPool:
    return CallPool(specs, timeout_s=30, name="tool", limits=Limits(**kw))


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


# --- the environment allow-list (tools and environments; reward functions see everything)


def test_allow_list_keeps_secrets_out_of_the_environment_and_proc(hostile, monkeypatch):
    monkeypatch.setenv("RL_TPU_TEST_SECRET", "s3cret-value")
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW) as pool:
        env = _call(pool, "environ")
    assert "RL_TPU_TEST_SECRET" not in env["os"] and "s3cret-value" not in env["proc"]
    assert env["os"]["PATH"] == os.environ["PATH"]
    with _pool(hostile, env_allow=(*DEFAULT_ENV_ALLOW, "RL_TPU_TEST_*")) as pool:  # rollout.worker_env
        assert _call(pool, "environ")["os"]["RL_TPU_TEST_SECRET"] == "s3cret-value"
    with _pool(hostile) as pool:  # env_allow None: the reward pool's, the whole environment
        assert _call(pool, "environ")["os"]["RL_TPU_TEST_SECRET"] == "s3cret-value"


# --- without the sandbox: what the docs say a tool can still do, it can


def test_unsandboxed_worker_can_use_the_network_files_and_the_drivers_environ(hostile, listener, tmp_path):
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW) as pool:
        assert _call(pool, "connect", port=listener) == "connected"
        assert _call(pool, "write", path=str(tmp_path / "outside.txt")) == "written"
        assert _call(pool, "signal_parent", pid=os.getpid()) == "reached"
        # the allow-list filters the worker's own environment only: the driver's is readable as this user
        assert _call(pool, "parent_environ", pid=os.getpid()).startswith("read ")


# --- the sandbox (rollout.sandbox = true)


@needs_bwrap
def test_sandbox_has_no_network(hostile, listener):
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW, sandbox=True) as pool:
        assert _call(pool, "connect", port=listener).startswith("refused")


@needs_bwrap
def test_sandbox_filesystem_is_read_only_but_its_scratch_folder(hostile, tmp_path):
    secret = tmp_path / "readable.txt"
    secret.write_text("the user's file")
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW, sandbox=True) as pool:
        assert _call(pool, "write", path=str(tmp_path / "outside.txt")).startswith("refused")
        assert not (tmp_path / "outside.txt").exists()
        assert _call(pool, "write", path=os.path.join(os.getcwd(), "in_checkout.txt")).startswith("refused")
        assert _call(pool, "write", path="scratch.txt") == "written"  # its working directory: scratch
        assert _call(pool, "write", path="/tmp/rl_tpu_sandbox_probe.txt").startswith("refused")
        seen = _call(pool, "where")
        assert os.path.dirname(seen["tempfile"]) == seen["cwd"]  # TMPDIR is the scratch folder
        assert os.path.isfile(os.path.join(seen["cwd"], "scratch.txt"))  # scratch is a real folder
        assert _call(pool, "read", path=str(secret)) == "the user's file"  # reading is allowed: docs say so
    assert not os.path.exists(seen["cwd"])  # a scratch folder made for the worker goes with it


@needs_bwrap
def test_sandbox_sees_and_signals_no_other_process(hostile):
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW, sandbox=True) as pool:
        assert _call(pool, "signal_parent", pid=os.getpid()).startswith("refused")
        assert _call(pool, "parent_environ", pid=os.getpid()).startswith("refused")


def _wait_sleeping(marker: str) -> None:
    wait_until(lambda: sleeping(marker), f"no `sleep {marker}` process started", 30)


def _not_sleeping_yet(pids: list[int], marker: str) -> list[int]:
    """Of `pids`, those not yet `sleep <marker>` after up to 30 s. `Popen` returns when the child's exec
    closes its close-on-exec pipe, which the kernel does before it writes the new program's arguments:
    under load a child was seen a moment later still named `python`, with an empty cmdline."""
    return wait_empty(lambda: sorted(set(pids) - set(sleeping(marker))), 30)


def _wait_gone(marker: str, timeout_s: float = 10) -> list[int]:
    return wait_empty(lambda: sleeping(marker), timeout_s)


def _kill_all(marker: str) -> None:
    for pid in sleeping(marker):
        os.kill(pid, 9)


@needs_bwrap
def test_sandbox_kills_what_a_tool_started_even_outside_its_group(hostile):
    marker = f"{300 + os.getpid() % 1000}.{int(time.time()) % 1000}"
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW, sandbox=True) as pool:
        assert _call(pool, "escape", marker=marker) == "started"
        _wait_sleeping(marker)
    assert _wait_gone(marker, timeout_s=30) == []  # the pid namespace's end takes it down


def test_without_sandbox_a_process_that_left_the_group_outlives_the_worker(hostile):
    """The documented gap: `setsid` escapes the group kill unless the sandbox is on."""
    marker = f"{300 + os.getpid() % 1000}.{int(time.time()) % 1000 + 1}"
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW) as pool:
        assert _call(pool, "escape", marker=marker) == "started"
        _wait_sleeping(marker)
    try:
        assert sleeping(marker)
    finally:
        _kill_all(marker)


needs_pids_cgroup = pytest.mark.skipif(
    not containment._pids_bases(),
    reason="needs a pids cgroup this user may write (root with cgroup v1 `pids`, or a delegated cgroup v2)",
)


@needs_pids_cgroup
def test_process_limit_stops_a_fork_bomb_and_its_processes_die_with_the_worker(hostile):
    """`rollout.worker_procs`: a worker making processes without end is refused past the limit (threads
    count too: the worker's own are a few), and every process it made, in its group or not, dies with it."""
    marker = f"{400 + os.getpid() % 1000}.{int(time.time()) % 1000 + 1}"
    try:
        with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW, procs=16) as pool:
            out = _call(pool, "spawn_many", n=64, marker=marker)
            assert 0 < out["started"] < 16 and "Resource temporarily unavailable" in out["error"], out
            missing = _not_sleeping_yet(out["pids"], marker)
            assert missing == [], {pid: proc_status(pid) for pid in missing}
        assert _wait_gone(marker) == []
    finally:
        _kill_all(marker)


@needs_pids_cgroup
def test_with_a_process_limit_a_process_that_left_the_group_dies_with_the_worker(hostile):
    """The worker's cgroup holds what `setsid` took out of its group: the gap above closes."""
    marker = f"{500 + os.getpid() % 1000}.{int(time.time()) % 1000 + 1}"
    try:
        with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW, procs=64) as pool:
            assert _call(pool, "escape", marker=marker) == "started"
            _wait_sleeping(marker)
        assert _wait_gone(marker) == []
    finally:
        _kill_all(marker)


def test_cpu_time_limit_kills_a_spinning_worker_which_is_replaced(hostile):
    """`rollout.worker_cpu_s`: a call that spins past the worker's CPU budget ends with its worker, well
    before the call's own timeout, and the next call runs on a new worker."""
    with _pool(hostile, env_allow=DEFAULT_ENV_ALLOW, cpu_s=1) as pool:
        t = time.monotonic()
        (res,) = pool.run([(NAMES.index("spin"), {})])
        assert not res.ok and not res.timeout and "worker process died (exit code -9)" in res.error, res
        assert time.monotonic() - t < 25  # the call's timeout is 30 s
        assert _call(pool, "write", path=os.devnull) == "written"


def test_sandbox_that_cannot_start_is_one_clear_error(monkeypatch, tmp_path):
    """`rollout.sandbox` where bubblewrap is missing: a UserError naming the package, before the run."""
    from rl_tpu.containment import SandboxError, check_sandbox
    from rl_tpu.errors import UserError

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(
        SandboxError, match=r"rollout.sandbox = true needs bubblewrap .*apt install bubblewrap"
    ):
        check_sandbox()
    assert issubclass(SandboxError, UserError)


@needs_bwrap
def test_sandbox_check_passes_where_bwrap_runs():
    from rl_tpu.containment import check_sandbox

    check_sandbox()


FORGER = textwrap.dedent(
    """
    import os, pickle, sys
    from multiprocessing.connection import Connection


    class Payload:
        def __init__(self, path):
            self.path = path

        def __reduce__(self):  # unpickling it creates the file: code run in whoever unpickles it
            return (open, (self.path, "w"))


    def forge(path):
        # the worker's connection to the driver is the fd on its command line: write a pickle into it
        Connection(int(sys.argv[1])).send(Payload(path))
        return "sent"
    """
)


def test_a_worker_cannot_run_code_in_the_driver_through_its_answers(tmp_path):
    """Workers answer in JSON: a pickle a hostile tool forges onto the worker's connection is not
    unpickled by the driver (it would have created the file); that call fails, the worker is replaced."""
    (tmp_path / "forger.py").write_text(FORGER)
    target = tmp_path / "created_by_unpickling"
    with _pool([f"{tmp_path / 'forger.py'}:forge"], env_allow=DEFAULT_ENV_ALLOW) as pool:
        (res,) = pool.run([(0, {"path": str(target)})])
        assert not res.ok and "unreadable answer" in res.error, res
        assert not target.exists()
        (again,) = pool.run([(0, {"path": str(target)})])  # a fresh worker, the same refusal
        assert not again.ok and not target.exists()


DRIVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from rl_tpu.containment import Limits, start

    worker = start("blocks_at_import:fn", None, Limits())
    print(worker.pid, flush=True)
    time.sleep(300)
    """
)


def test_a_worker_dies_with_a_driver_killed_by_sigkill(tmp_path):
    """A SIGKILLed driver cannot close its workers: each one notices its parent is gone and kills its own
    group, even while user code blocks at import."""
    import signal
    import subprocess
    import sys

    (tmp_path / "blocks_at_import.py").write_text(
        "import time\ntime.sleep(300)\n\ndef fn(conn, init):\n    pass\n"
    )
    (tmp_path / "driver.py").write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(driver.stdout.readline())
        assert not exited(worker)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    wait_until(lambda: exited(worker), f"worker {worker} outlived its SIGKILLed driver", 15)
