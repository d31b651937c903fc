"""Worker processes for user code (rewards, tools, environments), started contained.

`start(entry, init, limits)` starts `python -m rl_tpu.containment` as a new process (never a fork of the
driver, and never a re-import of its `__main__`) connected to the caller by one socket pair, and calls
`entry(conn, init)` in it ("module:function"). What `Limits` asks for is applied before the entry (and so
before any user module) runs:

- its own session and process group (`start_new_session`): `WorkerProcess.kill` SIGKILLs the group, so
  whatever a call started dies with its worker (unless it left the group with `setsid`); the worker kills
  its own group when its parent is gone (a driver killed with SIGKILL);
- `memory_mb`: RLIMIT_AS, soft and hard (the user's code cannot raise it back);
- `env_allow`: the process's environment holds only the variables whose names match one of these
  `fnmatch` patterns (None: the caller's whole environment). The environment is filtered when the process
  is created, so `/proc/self/environ` holds nothing else either;
- `sandbox`: the process runs under bubblewrap (`bwrap`): no network (a namespace of its own with only a
  loopback device), its own process-id namespace (it sees and can signal no other process, the driver
  included), the whole filesystem read-only except `scratch` (its working directory and `TMPDIR`), and
  it dies with its parent (and so does every process it started: they live in its process-id
  namespace). bwrap is a Debian/Ubuntu/Fedora package (`bubblewrap`); `scripts/setup.sh --sandbox`
  installs it where it runs as root with apt.

What a worker can still do in each mode is stated in docs/multi_turn.md ("What a tool or environment can
do"), each claim tried by tests/unit/test_containment.py.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rl_tpu.errors import UserError

# variables a tool or environment worker sees by default: what Python, locales and common libraries
# read; nothing that usually holds a credential
DEFAULT_ENV_ALLOW = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TERM",
    "TMPDIR",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "VIRTUAL_ENV",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)


class SandboxError(UserError, RuntimeError):
    """`rollout.sandbox` was asked for and bubblewrap is missing or cannot start here."""


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 0  # RLIMIT_AS in MiB; 0: none
    env_allow: tuple[str, ...] | None = None  # fnmatch patterns of variable names kept; None: all
    sandbox: bool = False  # run under bubblewrap (see the module docstring)
    scratch: str = ""  # the sandbox's writable folder (made if missing); "": a fresh temp folder per worker


def filtered_env(allow: Sequence[str] | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with only the names matching one of `allow`; all of it for None."""
    env = dict(os.environ if env is None else env)
    if allow is None:
        return env
    return {k: v for k, v in env.items() if any(fnmatch.fnmatchcase(k, p) for p in allow)}


def bwrap_argv(scratch: str) -> list[str]:
    """The bubblewrap command line that `sandbox` prefixes to the worker's."""
    exe = shutil.which("bwrap")
    if exe is None:
        raise SandboxError(
            "rollout.sandbox = true needs bubblewrap (`bwrap`), which is not on PATH: install the "
            "'bubblewrap' package (apt install bubblewrap), or set rollout.sandbox = false"
        )
    return [
        exe,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--bind", scratch, scratch,
        "--setenv", "TMPDIR", scratch,
        "--chdir", scratch,
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--die-with-parent",
        "--",
    ]  # fmt: skip


def check_sandbox() -> None:
    """Raise `SandboxError` (with bwrap's own words) unless a sandboxed process can start here."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rl-tpu-sandbox-check-") as d:
        argv = bwrap_argv(d) + [sys.executable, "-c", "pass"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise SandboxError(
            f"rollout.sandbox = true: bubblewrap cannot start a process here (exit {r.returncode}: "
            f"{r.stderr.strip()[:300]}); unprivileged user namespaces may be disabled on this machine "
            "(sysctl kernel.unprivileged_userns_clone, or AppArmor's restrict_unprivileged_userns); "
            "set rollout.sandbox = false to run without it"
        )


class WorkerProcess:
    """A started worker: its pid, the parent's end of its connection, and a group kill."""

    def __init__(self, popen: subprocess.Popen, conn: Connection, scratch: str | None):
        self.popen, self.conn, self._scratch = popen, conn, scratch

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and what its calls started in it), reap it,
        close the connection and remove a scratch folder made for it."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # it leads its own session and group
        except (ProcessLookupError, PermissionError):
            pass
        if self.is_alive():
            self.popen.kill()
        self.join(timeout=5)
        self.conn.close()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def start(entry: str, init: Any, limits: Limits = Limits(), name: str = "rl-tpu-worker") -> WorkerProcess:
    """Start a worker calling `entry(conn, init)` (`init` is pickled; module-level functions in it travel
    by name) under `limits`."""
    parent, child = socket.socketpair()
    # the worker watches this process (its parent) unless bwrap stands between them
    watch = 0 if limits.sandbox else os.getpid()
    argv = [sys.executable, "-m", "rl_tpu.containment", str(child.fileno()), name, str(watch)]
    made_scratch = None
    cwd = None
    if limits.sandbox:
        import tempfile

        scratch = limits.scratch or tempfile.mkdtemp(prefix="rl-tpu-scratch-")
        made_scratch = None if limits.scratch else scratch
        os.makedirs(scratch, exist_ok=True)
        argv = bwrap_argv(scratch) + argv
        cwd = scratch
    env = filtered_env(limits.env_allow)
    try:
        popen = subprocess.Popen(
            argv, pass_fds=(child.fileno(),), start_new_session=True, env=env, cwd=cwd, close_fds=True
        )
    finally:
        child.close()
    conn = Connection(parent.detach())
    # the worker's module search path is the caller's: specs name modules the caller can import
    conn.send(([os.path.abspath(p) for p in sys.path], entry, init, limits.memory_mb))
    return WorkerProcess(popen, conn, made_scratch)


def limit_memory(memory_mb: int) -> None:
    """Cap this process's address space (RLIMIT_AS) at `memory_mb` MiB, soft and hard: an allocation past
    it raises MemoryError in the call that made it. Linux and macOS; a no-op where `resource` is missing."""
    try:
        import resource
    except ImportError:  # Windows
        return
    limit = memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _watch_parent(parent: int) -> None:
    """Kill this worker's process group once `parent`, the process that started it, is gone (a SIGKILLed
    driver cannot close its workers; an orphan is re-parented, so its parent pid changes). Polls from a
    daemon thread, so it works while user code blocks at import or in a call. 0: no watch (under bwrap,
    whose `--die-with-parent` does it and whose process-id namespace hides the real parent)."""
    import threading
    import time

    if not parent:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="rl_tpu-parent-watch").start()


def _main(fd: int, parent: int) -> None:
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills us
    _watch_parent(parent)
    conn = Connection(fd)
    try:
        path, entry, init, memory_mb = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = path
    if memory_mb:
        limit_memory(memory_mb)  # before the user's modules load: their imports count too
    module, _, fn = entry.partition(":")
    getattr(importlib.import_module(module), fn)(conn, init)


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[3]))
