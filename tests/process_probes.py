"""What the process-containment tests ask of /proc (tests/unit/test_env_pool.py,
tests/integration/test_env_isolation.py)."""

from __future__ import annotations

from pathlib import Path


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
