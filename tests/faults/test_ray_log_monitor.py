"""Ray's log monitor in a cluster `rl_tpu.cluster.init_ray` starts (real Ray, in a child process whose
output is the driver's): a restarted actor's dead worker leaves no log file open in the monitor (Ray's
default kept both of its files open until 200 were: +2 fds per engine restart in bench/soak.py), and the
workers' stderr lines still reach the driver, from live workers and from one right before it dies."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 4

DRIVER = r"""
import json, os, signal, sys, time

import psutil
import ray

from rl_tpu.cluster import init_ray

assert init_ray(num_cpus=1, include_dashboard=False)


# The driver's stdout or stderr, also kept here: Ray's log thread prints the workers' lines to whichever
# sys.stderr / sys.stdout is current, so the script can wait for a line to arrive.
class Seen:
    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, s):
        self.text.append(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


sys.stdout, sys.stderr = Seen(sys.stdout), Seen(sys.stderr)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class Echo:
    def __init__(self):
        print(f"started {os.getpid()}", file=sys.stderr, flush=True)

    def pid(self):
        return os.getpid()

    def say(self, line):
        print(line, file=sys.stderr, flush=True)

    def say_and_die(self, line):
        print(line, file=sys.stderr, flush=True)
        time.sleep(0.5)
        os._exit(1)


monitor = next(
    p for p in psutil.Process().children(recursive=True) if any("log_monitor.py" in c for c in p.cmdline())
)


def worker_logs():
    # the worker log files (worker-<id>-<job>-<pid>.out/.err) the monitor has open: [pid, name]
    out = []
    for fd in os.listdir(f"/proc/{monitor.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{monitor.pid}/fd/{fd}")
        except OSError:
            continue
        name = os.path.basename(target)
        if name.startswith("worker-"):
            out.append([int(name.rsplit("-", 1)[1].split(".")[0]), name])
    return sorted(out)


def live_pid(actor):
    for _ in range(600):
        try:
            return ray.get(actor.pid.remote())
        except ray.exceptions.RayActorError:  # restarting
            time.sleep(0.1)
    raise TimeoutError("the actor did not come back")


echo = Echo.remote()
rounds = []
for i in range(ROUNDS + 1):
    pid = live_pid(echo)
    ray.get(echo.say.remote(f"marker-{i}-from-{pid}"))
    # wait (not a fixed sleep) until the monitor has the live worker's log open and no dead one's, or 30 s:
    # with the defect the dead logs stay open, the wait runs out and the assertions below name them
    dead = {r["pid"] for r in rounds}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = {p for p, _ in worker_logs()}
        if pid in held and not held & dead:
            break
        time.sleep(0.05)
    rounds.append({"pid": pid, "open": worker_logs(), "fds": monitor.num_fds()})
    if i < ROUNDS:
        os.kill(pid, signal.SIGKILL)
pid = live_pid(echo)
try:
    ray.get(echo.say_and_die.remote(f"last-words-from-{pid}"))
except ray.exceptions.RayActorError:
    pass
live_pid(echo)
# until the dying worker's last line has reached the driver (or 60 s: then the test names what is missing)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not any(
    f"last-words-from-{pid}" in "".join(s.text) for s in (sys.stdout, sys.stderr)
):
    time.sleep(0.05)
print("RESULT " + json.dumps(rounds), flush=True)
""".replace("ROUNDS", str(ROUNDS))


def test_dead_workers_logs_are_closed_and_lines_reach_the_driver(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_LOG_MONITOR_") and k != "RAY_ADDRESS"}
    env["RAY_DEDUP_LOGS"] = "0"  # one line per worker, not "[repeated 3x across cluster]"
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    rounds = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    pids = [r["pid"] for r in rounds]
    assert len(set(pids)) == ROUNDS + 1, pids  # every kill brought a new worker process

    # Every line a worker printed reached the driver, through the log monitor (Ray's "(Echo pid=N)" prefix).
    for i, pid in enumerate(pids):
        assert re.search(rf"\(Echo pid={pid}\)\S* marker-{i}-from-{pid}$", out, re.M), out[-3000:]
    assert re.search(r"\(Echo pid=(\d+)\)\S* last-words-from-\1$", out, re.M), out[-3000:]

    # The monitor holds at most 2 worker log files at a time, never a dead worker's after its restart, and
    # its fds do not grow with restarts (Ray's default: the dead workers' files stayed open, +2 a restart).
    for r in rounds:
        assert len(r["open"]) <= 2, rounds
    for i, r in enumerate(rounds[1:], 1):
        dead = set(pids[:i])
        assert not [name for pid, name in r["open"] if pid in dead], rounds
    assert rounds[-1]["fds"] <= rounds[0]["fds"] + 2, rounds


def test_actor_death_summary_finds_the_log_the_monitor_moved_to_old(tmp_path):
    """Ray's log monitor moves a dead worker's log to logs/old once it closes it, which init_ray's setting
    makes prompt: the actor-death summary still names it and its crash line."""
    from rl_tpu.cluster import actor_death_summary

    death = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutWorker\n\tpid: 23972\n"
    )
    (tmp_path / "old").mkdir()
    log = tmp_path / "old" / "worker-60a9-01000000-23972.err"
    log.write_text("Loading weights\n*** SIGSEGV received at time=1796400424 on cpu 0 ***\n")
    (tmp_path / "worker-60a9-01000000-23973.err").write_text("a live worker's log\n")
    short = actor_death_summary(RuntimeError(death), str(tmp_path))
    assert short.endswith(f"; its log: {log} (*** SIGSEGV received)"), short
