"""Test-only (tests/faults/test_faults.py, tests/integration/test_async.py): RL_TPU_TEST_HOOKS, set to a
folder before Ray starts, lets a test stop an actor at a chosen moment. A process reaching `point` finds
FOLDER/<point>.json ({"engine", "version", "seconds"}, and optionally "or_later": true), and if both
match (its index and policy version; with "or_later", any version from "version" on: an async run's
schedule decides which versions an engine generates with) it renames the file to <point>.fired, writes
its pid to <point>.pid and sleeps `seconds`: once. Points:
"sync" (an engine's weight sync has begun and its buckets are requested; its engine index and the
version it installs), "generate" (an engine's generation; the version it generates with), "train_step"
(a trainer rank entered its update; its rank and the optimizer steps taken before it). Unset: nothing is
read. The folder must be this user's own (a directory, not a link, that no one else can write), and no
file in it is followed through a link: a shared folder would let another user make actors sleep or write
a pid through a link of theirs."""

from __future__ import annotations

import json
import os
import stat
import time

_TEST_HOOKS = os.environ.get("RL_TPU_TEST_HOOKS", "")


def hooks_folder(folder: str) -> str:
    """`folder` if it may hold test hooks (see above), else a RuntimeError saying why."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise RuntimeError(f"RL_TPU_TEST_HOOKS={folder!r}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"RL_TPU_TEST_HOOKS={folder!r} must be a directory (not a link) owned by this user and "
            "writable by no one else; it is for the project's tests only: unset it"
        )
    return folder


def fault_hook(point: str, engine: int, version: int) -> None:
    if not _TEST_HOOKS:
        return
    folder = hooks_folder(_TEST_HOOKS)
    path = os.path.join(folder, f"{point}.json")
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
            spec = json.load(f)
        due = version >= spec["version"] if spec.get("or_later", False) else version == spec["version"]
        if spec["engine"] != engine or not due:
            return
        os.rename(path, os.path.join(folder, f"{point}.fired"))
    except FileNotFoundError:
        return
    pid = os.open(
        os.path.join(folder, f"{point}.pid"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600
    )
    with os.fdopen(pid, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(float(spec["seconds"]))
