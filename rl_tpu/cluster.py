"""Ray at the edges: starting or joining it for a run, starting it on a busy machine, and saying why an
actor died.

Ray 2.60's raylet waits a fixed 30 s for its agents; a loaded 2-core box misses that deadline now and
then, and starting again succeeds. Every place that starts Ray (the loop, tests, benches) goes through
`init_ray` so the retry rule lives in one place. `actor_death_summary` shortens Ray's actor-death text
and adds what only the dead worker's own log says (a fatal signal), for the engine and trainer groups.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_tpu.config import Config

log = logging.getLogger("rl_tpu")


def init_ray(*, attempts: int = 3, retry_if: str | None = None, **kwargs) -> bool:
    """`ray.init(**kwargs)`, retried up to `attempts` times (only on errors whose text contains
    `retry_if`, when given). Returns True if this call started Ray, False if it was already running."""
    import ray

    if ray.is_initialized():
        return False
    if "address" not in kwargs:
        # A new Ray prestarts idle default workers for the driver; our actors each ask for their own
        # environment (threads, devices), so none would ever be used: two processes importing Ray for
        # nothing (~3 CPU s) while the roles start on a 2-core box.
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        # Ray records every task's state changes and profile events in each worker and sends them to the
        # GCS every second, which keeps up to 100,000 tasks (`ray list tasks`, the dashboard's timeline):
        # ~3 KB of GCS memory per task, so the GCS grew ~4.5 MB per 100 steps of `bench/soak.py`, linearly,
        # toward ~330 MB (bench/RESULTS.md). Nothing here reads them; 0 turns the recording off
        # in every process of a cluster we start (set the variable, e.g. to 1000, to have them back).
        os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
        # Ray's log monitor (ray/_private/log_monitor.py), which streams the workers' stdout/stderr files
        # to the driver, keeps a file open once it has had lines and learns that a worker died only when it
        # closes all of its files, which it does only when RAY_LOG_MONITOR_MAX_OPEN_FILES (200) are open:
        # every engine restart kept the dead worker's two files (worker-*.out/.err) open, +2 fds a restart
        # up to 200 (bench/RESULTS.md). With 2 it closes them as soon as a second file has new lines (a
        # dead worker's are then moved to logs/old), so it holds at most 2 log files. Each is read to its
        # end before it is closed; a worker's lines written in the few ms between that read and its death
        # can stay in its file unsent (as at Ray's 200). The monitor reads at most
        # RAY_LOG_MONITOR_NUM_LINES_TO_READ lines of a file per pass (1000) and reopens a closed file only
        # once it grows, so a longer burst's rest would wait for the worker's next line: 100,000.
        os.environ.setdefault("RAY_LOG_MONITOR_MAX_OPEN_FILES", "2")
        os.environ.setdefault("RAY_LOG_MONITOR_NUM_LINES_TO_READ", "100000")
        # Ray starts its workers (every actor: trainer ranks, engines) at nice 15 (the raylet's
        # `worker_niceness`), so any other work at the default priority, the driver and its reward and tool
        # workers included, takes the CPU from them first: with three busy processes on a 2-core box the
        # actors got ~1 % of it and a run stalled for minutes in its first steps. Ray's job submission runs
        # jobs' workers at 0 (ray/dashboard/modules/job/job_manager.py); so do the clusters we start.
        os.environ.setdefault("RAY_worker_niceness", "0")
    for attempt in range(attempts):
        try:
            ray.init(**kwargs)
            return True
        except Exception as e:  # noqa: BLE001 - Ray raises several types for a missed deadline
            ray.shutdown()
            if attempt == attempts - 1 or (retry_if is not None and retry_if not in str(e)):
                raise
            log.warning("ray.init failed (%s); retrying", e)
    return False  # attempts < 1: nothing started


_RAY_CAUSES = ("Some common causes include", "There are some potential root causes")
_CRASH = re.compile(r"Fatal Python error: .*|\*\*\* SIG[A-Z]+ received")

# faulthandler's dump of the crashing thread (most recent call first), and one frame of it
_STACK = re.compile(r"Current thread 0x[0-9a-f]+ \(most recent call first\):\n((?:[ \t]+File .*\n?)+)")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def actor_death_summary(e: BaseException, logs_dir: str | None = None) -> str:
    """Ray's actor-death message, short: its sentences without the indented details (ids, namespace) and
    without Ray's generic list of causes, then the dead worker's log and the crash line in it (SIGILL,
    SIGSEGV: only the worker's own log says which). `logs_dir`: this Ray session's (default: asked)."""
    text = str(e)
    short = " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("\t"))
    for marker in _RAY_CAUSES:
        if marker in short:
            short = short.split(marker)[0].rstrip() + " (out of memory, `ray stop --force` or a crash)"
    pid = re.search(r"^\tpid: (\d+)$", text, re.M)
    worker_log = _worker_log(int(pid.group(1)), logs_dir or _ray_logs_dir()) if pid else None
    if worker_log is not None:
        crash = _crash_line(worker_log)
        short += f"; its log: {worker_log}" + (f" ({crash})" if crash else "")
    return short


def _ray_logs_dir() -> str | None:
    try:  # Ray keeps no public call for it; the worker's log is on this node only in a local cluster
        from ray._private.worker import _global_node

        return _global_node.get_logs_dir_path() if _global_node is not None else None
    except Exception:
        return None


def _worker_log(pid: int, logs_dir: str | None) -> Path | None:
    """The stderr log Ray keeps for worker process `pid` (`worker-<id>-<job>-<pid>.err`), if on this node;
    in `old/` once Ray's log monitor has closed a dead worker's files (init_ray: promptly)."""
    name = f"worker-*-{pid}.err"
    logs = sorted(Path(logs_dir).glob(name)) + sorted(Path(logs_dir).glob(f"old/{name}")) if logs_dir else []
    return logs[-1] if logs else None


def _crash_line(log: Path, tail_bytes: int = 65536) -> str | None:
    """The last line in the log's tail saying how the process died (a fatal signal, Python's fatal error),
    with the innermost Python frame of faulthandler's dump after it when there is one (where it died)."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - tail_bytes))
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    found = list(_CRASH.finditer(text))
    if not found:
        return None
    crash = found[-1].group(0).strip()
    stack = _STACK.search(text, found[-1].end())
    frames = [m.groupdict() for m in _FRAME.finditer(stack.group(1))] if stack else []
    if not frames:
        return crash
    # the innermost frame, and the innermost outside the libraries (ours, or a user's) if it is another
    where = [frames[0]]
    if _library(frames[0]["file"]):
        where += [f for f in frames[1:] if not _library(f["file"])][:1]
    return crash + " in " + ", called from ".join(f"{f['fn']}() at {f['file']}:{f['line']}" for f in where)


def _library(path: str) -> bool:
    return "site-packages" in path or "/lib/python3." in path or path.startswith("<")


def start_ray(cfg: Config, plan=None) -> bool:
    """Join `cluster.address`, or start a local Ray advertising `cluster.num_cpus` CPUs (0: all cores,
    and at least what the placement bundles reserve: sync mode runs the roles in turn). True if this
    call started or joined it (False: this process was already connected)."""
    import ray

    if ray.is_initialized():
        return False
    from rl_tpu.devices import get_device, rollout_device

    get_device(cfg.trainer.device).apply_env()  # actors inherit the driver's environment
    rollout_device(cfg).apply_env()
    # The console shows our progress and results; Ray's and vLLM's logs (and every actor's output) come
    # back with `logging.verbose` (`--verbose`). Actor logs are always in Ray's session folder.
    verbose = cfg.logging.verbose
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=verbose,
        logging_level=logging.INFO if verbose else logging.ERROR,
        runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}},
    )
    if cfg.cluster.address:
        kwargs["address"] = cfg.cluster.address
    else:
        # actors mostly wait on each other: advertise more CPUs than cores so they can all be placed
        need = math.ceil(plan.totals().get("CPU", 0)) if plan is not None else 0
        kwargs["num_cpus"] = cfg.cluster.num_cpus or max(8, os.cpu_count() or 1, need)
    try:
        return init_ray(attempts=1 if cfg.cluster.address else 3, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"could not start or join Ray ({e}); is the machine overloaded?") from e
