"""Helpers shared by the bench scripts: memory of a process tree, medians, the final JSON line.

Invariants:
- Memory is measured on a whole process tree (the root and every descendant found through
  `/proc/*/stat`), sampled every `interval` seconds while the root runs. Ray actors, the raylet and the
  GCS are descendants of the driver that called `ray.init`, so a run of this project is measured
  with all its actors. Two sums are kept per sample: RSS (what `top` shows; pages shared between
  processes, such as the torch libraries every actor maps, count once per process, so it overstates a
  multi-process tree) and PSS (each shared page divided among the processes that map it, from
  `/proc/PID/smaps_rollup`; the sum is the tree's real share of memory). The peak of each sum is reported.
  Sampling can miss a peak shorter than `interval`.
- `json_line` writes one line (no newlines inside), NaN/inf become null, so the last line of a bench
  script's output parses with `json.loads`.
Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30


def _parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # the command name (field 2) may hold spaces and parentheses: split after its last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(entry.name)] = int(fields[1])
    return out


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants that are alive now (root first)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parent_pids().items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def process_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in bytes; (0, 0) if it is gone or unreadable."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return rss, pss


def tree_memory(root: int) -> tuple[int, int, int]:
    """(summed RSS, summed PSS, number of processes) of the tree under `root`."""
    rss = pss = n = 0
    for pid in process_tree(root):
        r, p = process_memory(pid)
        if r or p:
            rss, pss, n = rss + r, pss + p, n + 1
    return rss, pss, n


@dataclass
class MemoryPeak:
    rss: int = 0  # bytes, peak of the summed RSS
    pss: int = 0  # bytes, peak of the summed PSS
    processes: int = 0  # most processes seen in the tree at once
    samples: int = 0


class TreeMemoryMonitor:
    """Samples `tree_memory(root)` on a thread until `stop()`; `peak` holds the maxima."""

    def __init__(self, root: int, interval: float = 1.0):
        self.root, self.interval, self.peak = root, interval, MemoryPeak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            rss, pss, n = tree_memory(self.root)
            p = self.peak
            p.rss, p.pss, p.processes, p.samples = (
                max(p.rss, rss),
                max(p.pss, pss),
                max(p.processes, n),
                p.samples + 1,
            )
            if self._stop.wait(self.interval):
                return

    def stop(self) -> MemoryPeak:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    seconds: float
    memory: MemoryPeak
    log_path: Path
    timed_out: bool = False
    tail: list[str] = field(default_factory=list)  # last lines of the log


def run_measured(
    cmd: Sequence[str],
    log_path: str | Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    interval: float | None = 1.0,
    cwd: str | Path | None = None,
) -> RunResult:
    """Run `cmd` with stdout+stderr to `log_path`, measuring the peak memory of its process tree every
    `interval` seconds; `interval=None`: no memory sampling (it is not free: walking /proc and reading
    every process's smaps_rollup costs ~0.1 core with Ray's dozen processes, and locks each one's memory
    map while it reads; `memory` is then all zeros).

    On timeout the whole tree is killed (each process we find under the child, by pid)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        monitor = TreeMemoryMonitor(proc.pid, interval) if interval is not None else None
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for pid in reversed(process_tree(proc.pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        finally:
            memory = monitor.stop() if monitor is not None else MemoryPeak()
    seconds = time.perf_counter() - t0
    tail = log_path.read_text(errors="replace").splitlines()[-40:]
    return RunResult(list(cmd), proc.returncode, seconds, memory, log_path, timed_out, tail)


def median(xs: Sequence[float]) -> float:
    """Median, or NaN for an empty sequence (a bench that got no steps reports null, not a crash)."""
    return statistics.median(xs) if xs else math.nan


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def json_line(obj: dict[str, Any]) -> str:
    """One line of JSON (NaN and inf as null): the machine-readable last line of a bench script."""
    return json.dumps(_finite(obj), allow_nan=False, separators=(", ", ": "))


def load_average() -> float:
    """1-minute load average: other work on the machine skews timings; scripts print it beside them."""
    return os.getloadavg()[0]


def add_workload_args(p: argparse.ArgumentParser, *, threads_help: str, engine_help: str) -> None:
    """The GRPO workload flags bench/vs_trl.py and bench/overhead.py share: one place, so the two
    scripts' defaults (and so their numbers) cannot drift apart."""
    from rl_tpu.tiny_model import SIZES

    p.add_argument(
        "--size",
        choices=list(SIZES),
        default="small",
        help=f"make_tiny_model size: {', '.join(SIZES)} (default small, ~13M; medium ~100M)",
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (data.batch_size)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (rollout.n = num_generations)")
    p.add_argument("--max-tokens", type=int, default=64, help="max completion tokens (rollout.max_tokens)")
    p.add_argument("--steps", type=int, default=6, help="RL steps per side; step 1 is warm-up")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help=threads_help)
    p.add_argument("--world-size", type=int, default=2, help="our trainer ranks (FSDP2 over gloo)")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward (both sides)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=["compiled", "eager"], default="compiled", help=engine_help)
    p.add_argument("--train-size", type=int, default=2048, help="synthetic arithmetic train set size")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per side before it is killed")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where model, logs and run folders go (default: a new temp dir)",
    )


def check_workload_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject counts below 1 through the parser (exit 2, naming the flag)."""
    for name in ("prompts", "n", "max_tokens", "steps", "threads", "world_size", "micro_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")


# ---------------------------------------------------------------------------------------------------
# per-process figures (bench/soak.py): open fds, the command line, /dev/shm, a fitted slope


def arithmetic_chat_prompts(tok: Any, n: int) -> list[list[int]]:
    """Token ids of `n` prompts of the synthetic arithmetic task, rendered with the model's chat template
    (the generation benches' shared workload)."""
    from rl_tpu.data import make_synthetic

    train, _ = make_synthetic("arithmetic", n, 1, 0)
    return [
        list(
            tok.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for ex in train[:n]
    ]


def process_rss_pages(pid: int) -> int:
    """Resident pages of `pid` from /proc/PID/statm (constant time, unlike smaps: cheap to poll); -1 if
    it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def object_store_bytes(pid: int) -> int:
    """Bytes of /dev/shm that Ray's object store holds, if `pid` is a raylet: the pages allocated in the
    (unlinked) plasma file it keeps open; 0 otherwise. Ray's arena, bounded by its
    `object_store_memory`, grows its touched pages as objects land in new parts of it."""
    total, seen = 0, set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            if "/dev/shm/plasma" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
        except OSError:
            pass
    return total


def process_fds(pid: int) -> int:
    """Open file descriptors of `pid` (entries of /proc/PID/fd); -1 if it is gone or unreadable."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def process_cmdline(pid: int) -> str:
    """`pid`'s command line, arguments joined by spaces (Ray rewrites an actor's to `ray::Class.method`,
    padded with spaces); "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def process_comm(pid: int) -> str:
    """`pid`'s short name (/proc/PID/comm, 15 characters at most); "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def parent_pid(pid: int) -> int:
    """`pid`'s parent, -1 if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def shm_used_bytes(path: str = "/dev/shm") -> int:
    """Bytes in use on the /dev/shm filesystem (all files, also unlinked ones still mapped, such as Ray's
    object store); 0 where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, its standard error) of the least-squares line through the points; (NaN, NaN) with fewer
    than 2 distinct xs, standard error NaN with exactly 2 points."""
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"{n} xs but {len(ys)} ys")
    if n < 2:
        return math.nan, math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan, math.nan
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if n == 2:
        return slope, math.nan
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, math.sqrt(resid / (n - 2) / sxx)
