"""Soak: a long `rl-tpu train` run with faults injected from outside, as an operator or the OOM killer
would inject them, to show the run survives them without losing data or leaking.

    .venv/bin/python bench/soak.py                        # 30 steps, 2 engines, faults every few steps
    .venv/bin/python bench/soak.py --steps 12 --engine-kill-every 4 --reward-kill-every 5

Faults, each right after a step is logged (so they land in the next step's generation):
- every `--engine-kill-every` steps, SIGKILL of one engine's actor process (alternating engines; the pid
  comes from RUN_DIR/placement.json, which the loop rewrites after each restart);
- every `--reward-kill-every` steps, SIGKILL of one reward worker process (a spawn child of the driver).

Reported: steps completed; engine restarts (`rollout/restarts`); completions per step (`rollout/samples`,
each must equal data.batch_size x rollout.n); the median seconds of a faulted step and of a clean one;
the process tree's summed RSS and PSS after step 5 and at the end (growth shows a leak: engines restarted,
buffers not freed); peak RSS/PSS (sampled every `--memory-interval` s, 5 by default: sampling taxes the
step times, see bench/_common.py); and /dev/shm files of ours left after the run. Last line: one JSON object.

Per process (leaks): every `--sample-every` steps (5) each process of the run's tree is read: the driver
(`rl-tpu train`) and everything under it (Ray's gcs_server, raylet, dashboard head and agent, runtime-env
agent, log and autoscaler monitors, every Ray worker: the trainer ranks and engines, named from
RUN_DIR/placement.json's pids where it has them, else from the `ray::Class` process title; the reward
pool's spawn children). Each sample: RSS and PSS (/proc/PID/smaps_rollup), open fds (/proc/PID/fd), and
the bytes in use on /dev/shm (machine-wide) and, of those, Ray's object store's (the pages of the
plasma file the raylet holds open: an arena bounded by its size whose touched pages grow as objects land
in new parts of it; `shm_growth_mb` is the rest, the files the run and its libraries make), taken at the process's
floor: its RSS polled `--reads` times `--read-spacing` s apart (10 x 0.05 s: two steps of the default
workload), the figures read at the lowest poll (an engine's heap is ~10 MB above its floor while it
generates and back at it after every generation's trim; single reads landing on either made a restarted
engine's short life fit slopes of +-1-8 MB per 100 steps). No sample at the last
step (the run is shutting down then). Reported per process: the least-squares slope of RSS and of PSS in
MB (2^20 bytes) per 100 steps over its samples after a warm-up (`--warmup-steps`, 50: steps <= 50, or for
a process started later, e.g. a restarted engine, its first 50 steps; an engine's floor climbs ~1.2 MB
over its first ~40 steps and then stays within ~0.3 MB, in every one of 11 lives measured: bench/RESULTS.md,
session 34), with its standard error, and the
PSS slope over the later half of those samples alone (a cache filling up flattens there, a leak does
not); its RSS change over its life (the median of its last 5 samples less that of its first 5: a
restarted engine lives ~20 samples, too few for a steady slope); fds at the first and last sample after
the warm-up, and the most it had; and for the tree: fd growth (sum over processes) and /dev/shm growth
from the start to the end of the run, each end the median over a tenth of the samples after the warm-up
(at least 3: Ray's log monitor holds 0-2 worker logs open, moving with the workers it reads, which is no
growth; a leak of one fd per restart or per 100 steps is), the same between the first and the last sample
alone, and the tree's largest fd sum over the samples less its first. The JSON line carries the largest RSS and PSS
slopes with their processes (`rss_slope_mb_per_100_steps`, `rss_slope_role`, `pss_...`), `fd_growth`,
`shm_growth_mb` and `per_process`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    GIB,
    json_line,
    least_squares_slope,
    load_average,
    median,
    object_store_bytes,
    parent_pid,
    process_cmdline,
    process_comm,
    process_fds,
    process_memory,
    process_rss_pages,
    process_tree,
    run_measured,
    shm_used_bytes,
)

MB = 2**20


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, json.JSONDecodeError):  # not written yet, or a line half written
        return []


class _StepTail:
    """The steps logged to metrics.jsonl so far, read incrementally (the file grows ~1 KB a step: reading
    it whole every 50 ms would cost a core's worth of parsing by step 1000)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def new_steps(self) -> list[int]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:  # not written yet
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):  # not a step row
                continue
        return out


_ppid = parent_pid


def _reward_workers(driver: int) -> list[int]:
    """The driver's reward worker processes: spawn children running multiprocessing's spawn_main."""
    out = []
    for pid in process_tree(driver)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if _ppid(pid) == driver and b"spawn_main" in cmd:
            out.append(pid)
    return out


def _shm_files() -> set[str]:
    d = Path("/dev/shm")
    return {p.name for p in d.glob("rl_tpu*")} if d.is_dir() else set()


# ---------------------------------------------------------------------------------------------------
# naming the processes of a run

# Ray titles a worker process `ray::<actor class>[.<method running>]`
_RAY_CLASSES = {
    "TrainerWorker": "trainer",
    "RolloutWorker": "engine",
    "DashboardAgent": "dashboard agent",
    "RuntimeEnvAgent": "runtime env agent",
    "IDLE": "idle Ray worker",
}
# (text in the command line, kind), first match wins
_CMDLINE_KINDS = (
    ("rl_tpu.commands.cli", "driver"),
    ("dashboard/dashboard.py", "dashboard head"),
    ("log_monitor.py", "log monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler monitor"),
    ("multiprocessing.resource_tracker", "resource tracker"),
    ("spawn_main", "spawn child"),
    ("workers/default_worker.py", "Ray worker (starting)"),
)


def process_kind(cmdline: str, comm: str = "") -> str:
    """What a process is, from its command line (`comm` where the command line says nothing): "trainer",
    "engine", "gcs_server", "raylet", "dashboard agent", "driver", "spawn child", ...; an actor class we do
    not know gives "Ray worker <Class>"."""
    c = cmdline.strip()
    if c.startswith("ray::"):
        title = c[len("ray::") :].split()
        cls = title[0].split(".")[0] if title else ""
        return _RAY_CLASSES.get(cls, f"Ray worker {cls}".rstrip())
    argv = c.split()
    exe = os.path.basename(argv[0]) if argv else ""
    if exe in ("gcs_server", "raylet"):
        return exe
    for needle, kind in _CMDLINE_KINDS:
        if needle in c:
            return kind
    return exe or comm or "?"


def placement_pids(run_dir: Path) -> dict[int, str]:
    """pid -> "trainer rank k" / "engine k" for the actors RUN_DIR/placement.json gives a pid (the loop
    rewrites it after an engine restart); {} before it exists."""
    try:
        actors = json.loads((run_dir / "placement.json").read_text())["actors"]
    except (OSError, ValueError, KeyError):
        return {}
    label = {"trainer": "trainer rank {}", "rollout": "engine {}"}
    return {
        int(a["pid"]): label.get(a["role"], a["role"] + " {}").format(a["index"])
        for a in actors
        if a.get("pid") is not None
    }


def name_processes(
    procs: list[tuple[int, int, str, str]], driver: int, known: dict[int, str]
) -> dict[int, str]:
    """A role name for each process: `procs` holds (pid, parent pid, command line, comm), `known` the
    names placement.json gives (pid -> "engine 0"). Trainer ranks and engines placement.json does not
    name are numbered by pid ("trainer #0 by pid"); the driver's spawn children are its reward workers;
    another process under a trainer or engine is "<parent's name> child <comm>". Names left the same for
    two processes get " (pid N)" appended."""
    kind = {pid: process_kind(cmd, comm) for pid, _, cmd, comm in procs}
    parent = {pid: ppid for pid, ppid, _, _ in procs}
    comm = {pid: c for pid, _, _, c in procs}
    names: dict[int, str] = {}
    counters: dict[str, int] = {}

    def numbered(k: str, fmt: str) -> str:
        counters[k] = counters.get(k, 0) + 1
        return fmt.format(counters[k] - 1)

    for pid in sorted(kind):
        k = kind[pid]
        if pid == driver:
            names[pid] = "driver"
        elif pid in known:
            names[pid] = known[pid]
        elif k in ("trainer", "engine"):
            names[pid] = numbered(k, k + " #{} by pid")
        elif k == "spawn child" and parent[pid] == driver:
            names[pid] = numbered("reward worker", "reward worker {}")
    for pid in sorted(kind):
        if pid in names:
            continue
        up = names.get(parent[pid], "")
        if up.startswith(("trainer", "engine")):
            names[pid] = f"{up} child {comm[pid] or kind[pid]}"
        else:
            names[pid] = kind[pid]
    seen: dict[str, int] = {}
    for n in names.values():
        seen[n] = seen.get(n, 0) + 1
    return {pid: (f"{n} (pid {pid})" if seen[n] > 1 else n) for pid, n in names.items()}


# ---------------------------------------------------------------------------------------------------
# per-process samples and their slopes


@dataclass
class Sample:
    step: int
    shm: int  # bytes used on /dev/shm
    procs: dict[int, tuple[str, int, int, int]]  # pid -> (name, RSS, PSS, fds)
    store: int = 0  # of `shm`, the bytes Ray's object store holds


def sample_tree(
    driver: int,
    step: int,
    run_dir: Path,
    reads: int = 1,
    spacing_s: float = 0.0,
    skip: frozenset = frozenset(),
) -> Sample:
    """Every process of the tree at its floor over `reads` polls `spacing_s` apart: RSS polled from statm
    (cheap), and RSS, PSS and fds from smaps at the poll with the lowest RSS so far. A process's RSS moves
    within a step: an engine's heap grows ~10 MB while it generates and goes back to the same floor at the
    trim that ends each generation (bench/RESULTS.md, session 34), so a single read lands on either, and a
    short life's fitted slope was noise. Polls spanning two steps find every engine's floor; a leak
    raises the floor. `skip`: pids just SIGKILLed (a dying engine never gets back to its floor)."""
    pids = process_tree(driver)
    procs = [(pid, parent_pid(pid), process_cmdline(pid), process_comm(pid)) for pid in pids]
    names = name_processes(
        [p for p in procs if p[1] >= 0 and p[0] not in skip], driver, placement_pids(run_dir)
    )
    low: dict[int, int] = {}
    out: dict[int, tuple[str, int, int, int]] = {}
    for i in range(max(1, reads)):
        if i:
            time.sleep(spacing_s)
        for pid, name in names.items():
            pages = process_rss_pages(pid)
            if pages < 0 or pages >= low.get(pid, 1 << 62):
                continue
            rss, pss = process_memory(pid)
            fds = process_fds(pid)
            if (rss or pss) and fds >= 0:  # not gone meanwhile, nor a kernel-side zombie
                low[pid] = pages
                out[pid] = (name, rss, pss, fds)
    store = sum(object_store_bytes(pid) for pid, name in names.items() if name == "raylet")
    return Sample(step, shm_used_bytes(), out, store)


@dataclass
class Series:
    """One process over the run: (step, RSS, PSS, fds) at each sample that saw it."""

    pid: int
    name: str
    points: list[tuple[int, int, int, int]] = field(default_factory=list)


def fit_series(series: Series, warmup: int, first_step: int) -> dict:
    """Slopes (MB per 100 steps) of one process's RSS and PSS over its samples after the warm-up: steps <=
    `warmup` for a process there from the run's first sample (`first_step`), its first `warmup` steps for
    one started later."""
    born = series.points[0][0]
    skip_to = warmup if born <= first_step else born + warmup
    pts = [p for p in series.points if p[0] > skip_to]
    xs = [p[0] for p in pts]
    rss, rss_se = least_squares_slope(xs, [p[1] for p in pts]) if len(pts) >= 3 else (math.nan, math.nan)
    pss, pss_se = least_squares_slope(xs, [p[2] for p in pts]) if len(pts) >= 3 else (math.nan, math.nan)
    per100 = 100 / MB
    late = pts[len(pts) // 2 :]  # the later half: a cache that fills up slows down there, a leak does not
    pss_late = (
        least_squares_slope([p[0] for p in late], [p[2] for p in late])[0] if len(late) >= 3 else math.nan
    )
    return {
        "role": series.name,
        "pid": series.pid,
        "samples": len(pts),
        "steps": [xs[0], xs[-1]] if xs else None,
        "rss_mb": [pts[0][1] / MB, pts[-1][1] / MB] if pts else None,
        "pss_mb": [pts[0][2] / MB, pts[-1][2] / MB] if pts else None,
        "rss_slope": rss * per100,
        "rss_slope_se": rss_se * per100,
        "pss_slope": pss * per100,
        "pss_slope_se": pss_se * per100,
        "pss_slope_late": pss_late * per100,
        "rss_life_mb": (statistics.median(p[1] for p in pts[-5:]) - statistics.median(p[1] for p in pts[:5]))
        / MB
        if len(pts) >= 10
        else math.nan,
        "fds": [pts[0][3], pts[-1][3]] if pts else None,
        "fds_max": max(p[3] for p in pts) if pts else None,
    }


def summarize(samples: list[Sample], warmup: int) -> dict:
    """Per-process slopes and the tree's fd and /dev/shm growth from the samples (see the module doc)."""
    series: dict[int, Series] = {}
    for s in samples:
        for pid, (name, rss, pss, fds) in s.procs.items():
            ser = series.setdefault(pid, Series(pid, name))
            ser.name = name  # the latest: placement.json may name it only after its first sample
            ser.points.append((s.step, rss, pss, fds))
    first_step = samples[0].step if samples else 0
    names: dict[str, int] = {}
    for ser in series.values():
        names[ser.name] = names.get(ser.name, 0) + 1
    for ser in series.values():  # a restarted engine: the old and the new process, told apart by pid
        if names[ser.name] > 1 and "(pid " not in ser.name:
            ser.name = f"{ser.name} (pid {ser.pid})"
    per = [fit_series(ser, warmup, first_step) for ser in series.values()]
    per.sort(key=lambda r: -r["pss_slope"] if math.isfinite(r["pss_slope"]) else math.inf)
    after = [s for s in samples if s.step > warmup]

    def largest(key: str) -> tuple[float, str | None]:
        fitted = [r for r in per if math.isfinite(r[key])]
        if not fitted:
            return math.nan, None
        top = max(fitted, key=lambda r: r[key])
        return top[key], top["role"]

    fd_sums = [sum(p[3] for p in s.procs.values()) for s in after]
    # start and end: the median over the first and the last tenth of the samples (at least 3), so a count
    # a process moves within its bound (Ray's log monitor holds 0-2 worker logs open) is no growth, while a
    # leak (one fd per restart, per 100 steps) is
    k = max(3, len(after) // 10)
    fd_start = statistics.median(fd_sums[:k]) if after else None
    fd_end = statistics.median(fd_sums[-k:]) if after else None
    shm_start = statistics.median(s.shm - s.store for s in after[:k]) if after else None
    shm_end = statistics.median(s.shm - s.store for s in after[-k:]) if after else None
    store_start = statistics.median(s.store for s in after[:k]) if after else None
    store_end = statistics.median(s.store for s in after[-k:]) if after else None
    rss, rss_role = largest("rss_slope")
    pss, pss_role = largest("pss_slope")
    return {
        "warmup_steps": warmup,
        "sampled_steps": [after[0].step, after[-1].step] if after else None,
        "rss_slope_mb_per_100_steps": rss,
        "rss_slope_role": rss_role,
        "pss_slope_mb_per_100_steps": pss,
        "pss_slope_role": pss_role,
        "end_window_samples": k if after else None,
        "fd_start": fd_start,
        "fd_end": fd_end,
        "fd_growth": fd_end - fd_start if after else None,
        "fd_growth_first_last": fd_sums[-1] - fd_sums[0] if after else None,
        "fd_max_growth": max(fd_sums) - fd_sums[0] if after else None,
        "shm_mb_start": shm_start / MB if after else None,
        "shm_mb_end": shm_end / MB if after else None,
        "shm_growth_mb": (shm_end - shm_start) / MB if after else None,
        "shm_growth_mb_first_last": ((after[-1].shm - after[-1].store) - (after[0].shm - after[0].store)) / MB
        if after
        else None,
        "object_store_mb_start": store_start / MB if after else None,
        "object_store_mb_end": store_end / MB if after else None,
        "per_process": per,
    }


def _pm(x: float, se: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:+7.2f}" + (f" ±{se:.2f}" if math.isfinite(se) else "")


def format_table(summary: dict) -> str:
    lines = [
        f"{'process':<34} {'pid':>7} {'n':>3}  {'RSS MB first->last':>19} {'RSS MB/100 steps':>17}  "
        f"{'PSS MB first->last':>19} {'PSS MB/100 steps':>17} {'late':>6}  {'RSS life':>8}  {'fds':>9} {'max':>4}"
    ]
    for r in summary["per_process"]:
        rss = f"{r['rss_mb'][0]:8.1f}->{r['rss_mb'][1]:8.1f}" if r["rss_mb"] else "-"
        pss = f"{r['pss_mb'][0]:8.1f}->{r['pss_mb'][1]:8.1f}" if r["pss_mb"] else "-"
        fds = f"{r['fds'][0]}->{r['fds'][1]}" if r["fds"] else "-"
        life = f"{r['rss_life_mb']:+8.1f}" if math.isfinite(r["rss_life_mb"]) else "-"
        lines.append(
            f"{r['role'][:34]:<34} {r['pid']:>7} {r['samples']:>3}  {rss:>19} "
            f"{_pm(r['rss_slope'], r['rss_slope_se']):>17}  {pss:>19} "
            f"{_pm(r['pss_slope'], r['pss_slope_se']):>17} {_pm(r['pss_slope_late'], math.nan):>6}  "
            f"{life:>8}  {fds:>9} {r['fds_max'] if r['fds_max'] is not None else '-':>4}"
        )
    return "\n".join(lines)


class Injector(threading.Thread):
    """Watches metrics.jsonl; after each logged step injects the faults due and, every `sample_every`
    steps, samples every process of the tree."""

    def __init__(self, a: argparse.Namespace, run_dir: Path):
        super().__init__(daemon=True)
        self.a, self.run_dir = a, run_dir
        self.driver: int | None = None
        self.faults: list[dict] = []
        self.samples: list[Sample] = []
        self.engine_kills = 0
        self.done = threading.Event()

    def _due(self, step: int) -> bool:
        every = self.a.sample_every
        return bool(every) and step < self.a.steps and (step % every == 0 or step == min(5, self.a.steps - 1))

    def run(self) -> None:
        tail = _StepTail(self.run_dir / "metrics.jsonl")
        while not self.done.is_set():
            for step in tail.new_steps():
                if step < self.a.steps:
                    self._inject(step)  # before the sample, whose reads take a few tenths of a second
                if self.driver is not None and self._due(step):
                    killed = frozenset(f["pid"] for f in self.faults if f["step"] == step + 1)
                    self.samples.append(
                        sample_tree(
                            self.driver, step, self.run_dir, self.a.reads, self.a.read_spacing, killed
                        )
                    )
            time.sleep(0.05)

    def _inject(self, step: int) -> None:
        if self.a.engine_kill_every and step % self.a.engine_kill_every == 0:
            engine = self.engine_kills % self.a.engines
            actors = json.loads((self.run_dir / "placement.json").read_text())["actors"]
            pid = next(x["pid"] for x in actors if x["role"] == "rollout" and x["index"] == engine)
            self._kill(pid, {"step": step + 1, "kind": "engine", "engine": engine})
            self.engine_kills += 1
        if self.a.reward_kill_every and step % self.a.reward_kill_every == 0 and self.driver is not None:
            workers = _reward_workers(self.driver)
            if workers:
                self._kill(workers[0], {"step": step + 1, "kind": "reward worker"})

    def _kill(self, pid: int, what: dict) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
            self.faults.append(what | {"pid": pid})
        except ProcessLookupError:
            self.faults.append(what | {"pid": pid, "missed": True})


def _tree_sums(s: Sample | None) -> tuple[int, int]:
    if s is None:
        return 0, 0
    return sum(p[1] for p in s.procs.values()), sum(p[2] for p in s.procs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--engine-kill-every", type=int, default=10)
    p.add_argument("--reward-kill-every", type=int, default=7)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--verify", action="store_true", help="sync.verify after every sync (slower)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument(
        "--memory-interval",
        type=float,
        default=5.0,
        help="seconds between peak-memory samples of the process tree (0: none); each sample reads "
        "every Ray process's smaps, ~0.1 core at 1 s, which the step times would carry",
    )
    p.add_argument(
        "--sample-every",
        type=int,
        default=5,
        help="steps between per-process samples (RSS, PSS, fds, /dev/shm; 0: none); also step 5",
    )
    p.add_argument(
        "--reads",
        type=int,
        default=10,
        help="polls per process at each per-process sample, --read-spacing apart; the sample is the "
        "process at its lowest RSS among them (span them over two steps: an engine is ~10 MB above its "
        "floor while it generates)",
    )
    p.add_argument("--read-spacing", type=float, default=0.05, help="seconds between a sample's polls")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=50,
        help="samples at steps <= this (a later-started process: its first this many steps) are left out "
        "of the slopes",
    )
    p.add_argument(
        "--samples-out",
        type=Path,
        default=None,
        help="write every per-process sample here as JSON lines (step, /dev/shm bytes, pid -> [name, RSS, "
        "PSS, fds]) for plotting or a second look",
    )
    p.add_argument(
        "--train-arg",
        action="append",
        default=[],
        help="extra `rl-tpu train` argument, e.g. --train-arg=--rollout.max_tokens=16 (repeatable)",
    )
    a = p.parse_args()

    work = a.workdir or Path(tempfile.mkdtemp(prefix="rl_tpu_soak_"))
    run_dir = work / "run"
    kills = a.steps // a.engine_kill_every if a.engine_kill_every else 0
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.commands.cli",
        "train",
        f"--logging.run_dir={run_dir}",
        "--logging.progress=false",
        "--logging.tensorboard=false",
        f"--trainer.total_steps={a.steps}",
        f"--rollout.engines={a.engines}",
        f"--rollout.max_restarts={kills + 1}",
        f"--data.batch_size={a.batch}",
        f"--rollout.n={a.n}",
        f"--rollout.max_tokens={a.max_tokens}",
        "--checkpoint.every=0",
        f"--sync.verify={str(a.verify).lower()}",
        *a.train_arg,
    ]
    shm_before = _shm_files()
    load_before = load_average()
    inj = Injector(a, run_dir)
    inj.start()
    result: dict = {}
    runner = threading.Thread(
        target=lambda: result.update(
            r=run_measured(cmd, work / "train.log", timeout=a.timeout, interval=a.memory_interval or None)
        )
    )
    runner.start()
    while runner.is_alive() and inj.driver is None:  # the driver is this process's only child
        inj.driver = next((pid for pid in process_tree(os.getpid())[1:] if _ppid(pid) == os.getpid()), None)
        time.sleep(0.05)
    runner.join()
    inj.done.set()
    inj.join()
    r = result["r"]
    rows = _rows(run_dir / "metrics.jsonl")
    expected = a.batch * a.n
    faulted = {f["step"] for f in inj.faults if not f.get("missed")}
    by_kind = {
        k: {f["step"] for f in inj.faults if f["kind"] == k and not f.get("missed")}
        for k in ("engine", "reward worker")
    }
    t_engine = [x["time/step"] for x in rows if x["step"] in by_kind["engine"]]
    t_reward = [x["time/step"] for x in rows if x["step"] in by_kind["reward worker"]]
    t_clean = [x["time/step"] for x in rows if x["step"] not in faulted and x["step"] > 1]
    samples = inj.samples
    early = _tree_sums(
        next((s for s in samples if s.step >= min(5, a.steps - 1)), samples[0] if samples else None)
    )
    last = _tree_sums(samples[-1] if samples else None)
    leak = summarize(samples, a.warmup_steps)
    if a.samples_out:
        a.samples_out.write_text(
            "".join(
                json.dumps({"step": x.step, "shm": x.shm, "store": x.store, "procs": x.procs}) + "\n"
                for x in samples
            )
        )
    out = {
        "steps": len(rows),
        "steps_requested": a.steps,
        "returncode": r.returncode,
        "faults": inj.faults,
        "engine_restarts": rows[-1].get("rollout/restarts") if rows else None,
        "samples_per_step_all_whole": all(x.get("rollout/samples") == expected for x in rows)
        and len(rows) == a.steps,
        "reward_errors": sum(x.get("reward/errors", 0) for x in rows),
        "median_step_s_engine_killed": median(t_engine),
        "median_step_s_reward_worker_killed": median(t_reward),
        "median_step_s_clean": median(t_clean),
        "tree_rss_gib_step5": early[0] / GIB,
        "tree_rss_gib_end": last[0] / GIB,
        "tree_pss_gib_step5": early[1] / GIB,
        "tree_pss_gib_end": last[1] / GIB,
        "peak_rss_gib": r.memory.rss / GIB,
        "peak_pss_gib": r.memory.pss / GIB,
        "shm_files_left": sorted(_shm_files() - shm_before),
        "wall_s": r.seconds,
        "load_before": load_before,
        "load_after": load_average(),
        "sample_every": a.sample_every,
        **leak,
    }
    print(
        f"soak: {out['steps']}/{a.steps} steps, return code {r.returncode}, {len(inj.faults)} faults injected "
        f"({sum(f['kind'] == 'engine' for f in inj.faults)} engine, {sum(f['kind'] != 'engine' for f in inj.faults)} "
        f"reward worker), engine restarts {out['engine_restarts']}"
    )
    print(
        f"every step trained on {expected} completions: {out['samples_per_step_all_whole']}; "
        f"reward errors {out['reward_errors']:.0f}"
    )
    print(
        f"median step: {out['median_step_s_engine_killed']:.2f} s with an engine killed, "
        f"{out['median_step_s_reward_worker_killed']:.2f} s with a reward worker killed, "
        f"{out['median_step_s_clean']:.2f} s without a fault"
    )
    print(
        f"process tree RSS {out['tree_rss_gib_step5']:.2f} GiB after step 5, "
        f"{out['tree_rss_gib_end']:.2f} GiB at the last sample "
        f"(PSS {out['tree_pss_gib_step5']:.2f} -> {out['tree_pss_gib_end']:.2f}); peak RSS "
        + (
            f"{out['peak_rss_gib']:.2f} GiB (sampled every {a.memory_interval:g} s)"
            if a.memory_interval
            else "not sampled"
        )
    )
    if leak["sampled_steps"]:
        print(
            f"\nper process, sampled every {a.sample_every} steps, slopes fitted by least squares over steps "
            f"{leak['sampled_steps'][0]}-{leak['sampled_steps'][1]} (warm-up: steps <= {a.warmup_steps} "
            f"left out); MB = 2^20 bytes, ± one standard error; late: the PSS slope over the later half of "
            "the samples alone; RSS life: median of the last 5 samples less the first 5 (MB); fds: first->last, max:"
        )
        print(format_table(leak))
        print(
            f"largest slopes: RSS {leak['rss_slope_mb_per_100_steps']:+.2f} MB/100 steps ({leak['rss_slope_role']}), "
            f"PSS {leak['pss_slope_mb_per_100_steps']:+.2f} MB/100 steps ({leak['pss_slope_role']}); "
            f"fds {leak['fd_start']:g} -> {leak['fd_end']:g} (medians of the first and last "
            f"{leak['end_window_samples']} samples: growth {leak['fd_growth']:+g}; first -> last sample "
            f"{leak['fd_growth_first_last']:+d}, at most {leak['fd_max_growth']:+d} between); /dev/shm in use "
            f"{leak['shm_mb_start']:.1f} -> {leak['shm_mb_end']:.1f} MB outside Ray's object store (growth "
            f"{leak['shm_growth_mb']:+.2f}), the object store's {leak['object_store_mb_start']:.2f} -> "
            f"{leak['object_store_mb_end']:.2f} MB\n"
        )
    else:
        print("per process: no samples after the warm-up (run more steps, or lower --warmup-steps)")
    print(f"/dev/shm files of ours left after the run: {len(out['shm_files_left'])}; log: {r.log_path}")
    if r.returncode != 0:
        print("\n".join(r.tail[-15:]))
    print(json_line(out))


if __name__ == "__main__":
    main()
