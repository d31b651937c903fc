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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GIB, json_line, load_average, median, process_tree, run_measured, tree_memory  # noqa: E402


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, json.JSONDecodeError):  # not written yet, or a line half written
        return []


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):  # gone
        return -1


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


class Injector(threading.Thread):
    """Watches metrics.jsonl; after each logged step injects the faults due and samples tree memory."""

    def __init__(self, a: argparse.Namespace, run_dir: Path):
        super().__init__(daemon=True)
        self.a, self.run_dir = a, run_dir
        self.driver: int | None = None
        self.faults: list[dict] = []
        self.memory: dict[int, tuple[int, int]] = {}  # step -> (RSS, PSS) of the tree
        self.done = threading.Event()

    def run(self) -> None:
        seen, kills = 0, 0
        while not self.done.is_set():
            steps = [r["step"] for r in _rows(self.run_dir / "metrics.jsonl")]
            for step in (s for s in steps if s > seen):
                seen = step
                if self.driver is not None:
                    rss, pss, _ = tree_memory(self.driver)
                    self.memory[step] = (rss, pss)
                if step >= self.a.steps:
                    continue
                if self.a.engine_kill_every and step % self.a.engine_kill_every == 0:
                    engine = kills % self.a.engines
                    actors = json.loads((self.run_dir / "placement.json").read_text())["actors"]
                    pid = next(x["pid"] for x in actors if x["role"] == "rollout" and x["index"] == engine)
                    self._kill(pid, {"step": step + 1, "kind": "engine", "engine": engine})
                    kills += 1
                if (
                    self.a.reward_kill_every
                    and step % self.a.reward_kill_every == 0
                    and self.driver is not None
                ):
                    workers = _reward_workers(self.driver)
                    if workers:
                        self._kill(workers[0], {"step": step + 1, "kind": "reward worker"})
            time.sleep(0.05)

    def _kill(self, pid: int, what: dict) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
            self.faults.append(what | {"pid": pid})
        except ProcessLookupError:
            self.faults.append(what | {"pid": pid, "missed": True})


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
    a = p.parse_args()

    work = a.workdir or Path(tempfile.mkdtemp(prefix="rl_tpu_soak_"))
    run_dir = work / "run"
    kills = a.steps // a.engine_kill_every if a.engine_kill_every else 0
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.cli",
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
    mem = inj.memory
    early = mem.get(min(5, a.steps)) or (next(iter(mem.values())) if mem else (0, 0))
    last = mem[max(mem)] if mem else (0, 0)
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
        f"{out['tree_rss_gib_end']:.2f} GiB at the end "
        f"(PSS {out['tree_pss_gib_step5']:.2f} -> {out['tree_pss_gib_end']:.2f}); peak RSS "
        + (
            f"{out['peak_rss_gib']:.2f} GiB (sampled every {a.memory_interval:g} s)"
            if a.memory_interval
            else "not sampled"
        )
    )
    print(f"/dev/shm files of ours left after the run: {len(out['shm_files_left'])}; log: {r.log_path}")
    if r.returncode != 0:
        print("\n".join(r.tail[-15:]))
    print(json_line(out))


if __name__ == "__main__":
    main()
