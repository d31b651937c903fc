"""What the process-containment tests ask of /proc, and how they wait for it (tests/unit/test_containment.py,
tests/unit/test_env_pool.py, tests/integration/test_env_isolation.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.05


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies do not count: this box's init may never
    reap an orphan)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def exited(pid: int) -> bool:
    """Whether process `pid` no longer runs: gone, or dead and not yet reaped (a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def sleeping(marker: str) -> list[int]:
    """Pids of `sleep <marker>` processes on this machine."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                    out.append(int(pid))
        except OSError:
            pass
    return out


def proc_status(pid: int) -> str:
    """Name, state, parent and arguments of `pid`, for a failure message."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError as e:
        return f"/proc/{pid}: {e.strerror}"
    return (
        " ".join(line for line in status if line.split(":")[0] in ("Name", "State", "PPid")) + f" {cmdline!r}"
    )


def wait_empty(probe: Callable[[], list], timeout_s: float) -> list:
    """Poll `probe` until it returns an empty list or `timeout_s` passes; return its last answer (what is
    left), so that a failing assert names it."""
    deadline = time.monotonic() + timeout_s
    while (left := probe()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return left


def wait_until(check: Callable[[], object], what: str, timeout_s: float) -> None:
    """Poll `check` until it returns something true; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} after {timeout_s} s"
        time.sleep(POLL_S)
