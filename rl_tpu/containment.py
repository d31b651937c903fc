"""Worker processes for user code (rewards, tools, environments), started contained.

`start(entry, init, limits)` starts `python -m rl_tpu.containment` as a new process (never a fork of the
driver, and never a re-import of its `__main__`) connected to the caller by one socket pair, and calls
`entry(conn, init)` in it ("module:function"). What `Limits` asks for is applied before the entry (and so
before any user module) runs:

- its own session and process group (`start_new_session`): `WorkerProcess.kill` SIGKILLs the group, so
  whatever a call started dies with its worker (unless it left the group with `setsid`); the worker kills
  its own group when its parent is gone (a driver killed with SIGKILL);
- `memory_mb`: RLIMIT_AS, soft and hard (the user's code cannot raise it back);
- `procs`: at most this many tasks (processes and threads) at once, the worker's own included: a pids
  cgroup of the worker's own where this process may make one (root with a writable cgroup v1 `pids`
  hierarchy or cgroup v2 with `pids` delegated), whose every process `WorkerProcess.kill` kills (those that
  left the group with `setsid` too); else RLIMIT_NPROC, which counts all of the user's tasks (so it is set
  to those running now plus `procs`) and which the kernel does not apply to root: there a warning says the
  limit is not enforced;
- `cpu_s`: RLIMIT_CPU, soft and hard: the worker process is killed (SIGKILL) once it has used this many
  CPU seconds over its life (each process it starts has a budget of its own);
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
import itertools
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
    procs: int = 0  # tasks (processes and threads) at once: a pids cgroup, else RLIMIT_NPROC; 0: none
    cpu_s: float = 0.0  # RLIMIT_CPU: CPU seconds over the worker process's life; 0: none
    env_allow: tuple[str, ...] | None = None  # fnmatch patterns of variable names kept; None: all
    sandbox: bool = False  # run under bubblewrap (see the module docstring)


NO_LIMITS = Limits()


def worker_limits(rc, memory_mb: int) -> Limits:
    """The limits of a run's tool or environment workers (`rc`: its `RolloutConfig`)."""
    return Limits(
        memory_mb=int(memory_mb),
        procs=int(rc.worker_procs),
        cpu_s=float(rc.worker_cpu_s),
        env_allow=DEFAULT_ENV_ALLOW + tuple(rc.worker_env),
        sandbox=bool(rc.sandbox),
    )


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

    def __init__(
        self, popen: subprocess.Popen, conn: Connection, scratch: str | None, cgroup: str | None = None
    ):
        self.popen, self.conn, self._scratch, self.cgroup = popen, conn, scratch, cgroup

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
        if self.cgroup:  # what left the group (setsid) is still in the cgroup
            _kill_cgroup(self.cgroup)
            self.cgroup = None
        self.join(timeout=5)
        self.conn.close()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def start(entry: str, init: Any, limits: Limits = NO_LIMITS, name: str = "rl-tpu-worker") -> WorkerProcess:
    """Start a worker calling `entry(conn, init)` (`init` is pickled; module-level functions in it travel
    by name) under `limits`."""
    parent, child = socket.socketpair()
    # the worker watches this process (its parent) unless bwrap stands between them
    watch = 0 if limits.sandbox else os.getpid()
    argv = [sys.executable, "-m", "rl_tpu.containment", str(child.fileno()), name, str(watch)]
    scratch = cwd = None
    if limits.sandbox:
        import tempfile

        scratch = cwd = tempfile.mkdtemp(prefix="rl-tpu-scratch-")
        argv = bwrap_argv(scratch) + argv
    env = filtered_env(limits.env_allow)
    cgroup = _make_pids_cgroup(limits.procs) if limits.procs else None
    popen_kw = dict(pass_fds=(child.fileno(),), start_new_session=True, env=env, cwd=cwd, close_fds=True)
    try:
        try:  # the child joins its cgroup before it execs: nothing it starts is outside it
            popen = subprocess.Popen(argv, preexec_fn=_joiner(cgroup), **popen_kw)
        except subprocess.SubprocessError:  # the cgroup took no process (cgroup v2's rules): RLIMIT_NPROC
            _remove_cgroup(cgroup)
            cgroup = None
            popen = subprocess.Popen(argv, **popen_kw)
    finally:
        child.close()
    nproc = 0
    if limits.procs and not cgroup:
        if os.geteuid() == 0:
            _warn_once(
                f"worker process limit ({limits.procs}) not enforced: no pids cgroup could be made here and "
                "RLIMIT_NPROC does not apply to root"
            )
        else:
            nproc = limits.procs
    conn = Connection(parent.detach())
    # the worker's module search path is the caller's: specs name modules the caller can import
    rlimits = (limits.memory_mb, nproc, limits.cpu_s)
    conn.send(([os.path.abspath(p) for p in sys.path], entry, init, rlimits))
    return WorkerProcess(popen, conn, scratch, cgroup)


_warned: set[str] = set()
_cgroup_ids = itertools.count()


def _warn_once(msg: str) -> None:
    import logging

    if msg not in _warned:
        _warned.add(msg)
        logging.getLogger("rl_tpu").warning(msg)


def _pids_bases() -> list[str]:
    """Folders of this process's own pids cgroup (v1 `pids` hierarchy, or v2) where a child may be made."""
    try:
        mounts = open("/proc/self/mountinfo").read().splitlines()
        own = dict(
            (c, path)
            for _, cs, path in (x.split(":", 2) for x in open("/proc/self/cgroup").read().splitlines())
            for c in cs.split(",")
        )
    except OSError:
        return []

    def under(root: str, mount: str, path: str) -> str:  # the mount shows the hierarchy from `root` down
        rel = path[len(root) :] if root != "/" and path.startswith(root) else path
        return mount.rstrip("/") + "/" + rel.lstrip("/")

    bases = []
    for line in mounts:
        fields = line.split()
        root, mount, rest = fields[3], fields[4], fields[fields.index("-") + 1 :]  # fstype, source, options
        if rest[0] == "cgroup" and "pids" in rest[2].split(",") and "pids" in own:
            bases.append(under(root, mount, own["pids"]))
        elif rest[0] == "cgroup2" and "" in own:
            bases.append(under(root, mount, own[""]))
    return [b for b in bases if os.access(b, os.W_OK)]


def _make_pids_cgroup(procs: int) -> str | None:
    for base in _pids_bases():
        path = os.path.join(base, f"rl-tpu-worker-{os.getpid()}-{next(_cgroup_ids)}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(procs))
            return path
        except OSError:  # no pids controller in this v2 subtree
            _remove_cgroup(path)
    return None


def _joiner(cgroup: str | None):
    if cgroup is None:
        return None
    procs = os.path.join(cgroup, "cgroup.procs")

    def join() -> None:  # in the child, between fork and exec: only a write
        with open(procs, "w") as f:
            f.write("0")

    return join


def _kill_cgroup(path: str) -> None:
    """SIGKILL every process in the cgroup `path` until it is empty (at most ~2 s), then remove it."""
    import time

    for _ in range(40):
        try:
            pids = [int(x) for x in open(os.path.join(path, "cgroup.procs")).read().split()]
        except OSError:
            break
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _remove_cgroup(path)


def _remove_cgroup(path: str | None) -> None:
    if path:
        try:
            os.rmdir(path)
        except OSError:  # a zombie not yet reaped by its parent; the kernel frees it when it is
            pass


def _user_tasks() -> int:
    """Tasks (threads) of this process's real user now, for RLIMIT_NPROC, which counts them all."""
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                status = open(f"/proc/{pid}/status").read()
            except OSError:
                continue
            fields = dict(x.split(":", 1) for x in status.splitlines() if ":" in x)
            if int(fields.get("Uid", "-1").split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
    return n


def limit_rlimits(memory_mb: int, nproc: int, cpu_s: float) -> None:
    """RLIMIT_AS, RLIMIT_NPROC (the user's tasks now plus `nproc`) and RLIMIT_CPU of this process, soft
    and hard; 0 leaves one alone. A no-op where `resource` is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return
    if memory_mb:
        limit_memory(memory_mb)
    if nproc:
        n = _user_tasks() + nproc
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    if cpu_s:
        n = max(1, int(cpu_s))
        resource.setrlimit(resource.RLIMIT_CPU, (n, n))


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
        path, entry, init, rlimits = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = path
    limit_rlimits(*rlimits)  # before the user's modules load: their imports count too
    module, _, fn = entry.partition(":")
    getattr(importlib.import_module(module), fn)(conn, init)


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[3]))
