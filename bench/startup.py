"""Start-up benchmark: time until `rl-tpu train` is ready for its first step, next to the CPU floor of
what start-up must do anyway, measured in the same run.

Ours: `rl-tpu train` (the embedded default: 2 trainer ranks, 1 engine, the tiny model) for one step,
run twice: first in a fresh run folder (the tiny model is built), then again in the same folder (the
model exists: what every later run of a user pays). "ready" is the `time/startup` the loop logs: from
the start of `train()` to the first step (Ray, reward workers, trainer ranks, engine, weight-sync plan).
`wall` is the whole command, process start to exit, one step included.

Floor: each process start-up needs imports, measured here as CPU seconds in fresh interpreters:
- a trainer rank: torch, TorchTitan's model code and ours;
- an engine: vLLM and `vllm.LLM`;
- the driver: our loop (torch, transformers).
`floor` = (driver + ranks x trainer + engines x engine) CPU seconds / cores: the wall time those imports
take even if every process overlapped perfectly, before Ray starts its own daemons, any model is
built or a byte of weights moves. `ratio` = ready (model exists) / floor.

    python bench/startup.py
    python bench/startup.py --model smollm2-135m-instruct   # a real model
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import json_line, load_average  # noqa: E402

IMPORTS = {
    "driver": "import rl_tpu.controller.loop",
    "trainer": "import rl_tpu.trainer.worker, torchtitan.models.common, torchtitan.models.common.attention",
    "engine": "import vllm; from vllm import LLM; import rl_tpu.rollout.worker",
}


def import_cpu(code: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of a fresh interpreter running `code`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def train_once(run_dir: Path, extra: list[str], env: dict | None = None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.commands.cli",
        "train",
        f"--logging.run_dir={run_dir}",
        "--trainer.total_steps=1",
        "--logging.tensorboard=false",
        "--checkpoint.every=0",
        *extra,
    ]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else os.environ | env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"rl-tpu train failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"ready": rows[-1]["time/startup"], "wall": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=2, help="runs with the model present (the median is kept)")
    p.add_argument(
        "--model",
        default="",
        help="a model.path (folder, Hub id, GGUF file, smollm2-135m-instruct): its first run starts from an "
        "empty RL_TPU_CACHE_DIR (conversion and layout derivation included), later runs reuse that cache",
    )
    a = p.parse_args(argv)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="rl_tpu_startup_"))
    extra = [f"--model.path={a.model}"] if a.model else []
    env = {"RL_TPU_CACHE_DIR": str(work / "cache")} if a.model else None
    cores = os.cpu_count() or 1
    load0 = load_average()

    from rl_tpu.config import DEFAULT_CONFIG, load_config

    cfg = load_config(DEFAULT_CONFIG, [])
    ranks, engines = cfg.trainer.world_size, cfg.rollout.engines

    cpu = {}
    for role, code in IMPORTS.items():
        cpu[role] = min(import_cpu(code)[0] for _ in range(2))  # the second run has warm file caches
    floor = (cpu["driver"] + ranks * cpu["trainer"] + engines * cpu["engine"]) / cores

    first = train_once(work / "run", extra, env)
    again = [train_once(work / "run", extra, env) for _ in range(a.repeats)]
    ready = statistics.median(r["ready"] for r in again)
    load1 = load_average()

    print(
        f"imports, CPU s in a fresh interpreter: driver {cpu['driver']:.1f}, trainer rank {cpu['trainer']:.1f}, "
        f"engine {cpu['engine']:.1f}"
    )
    print(
        f"floor: ({cpu['driver']:.1f} + {ranks} x {cpu['trainer']:.1f} + {engines} x {cpu['engine']:.1f}) / "
        f"{cores} cores = {floor:.1f} s"
    )
    print(
        f"ready for step 1: fresh run folder (model built or converted) {first['ready']:.1f} s; model present "
        f"{', '.join(format(r['ready'], '.1f') for r in again)} s (median {ready:.1f})"
    )
    print(
        f"whole command, one step: {first['wall']:.1f} s fresh, "
        f"{', '.join(format(r['wall'], '.1f') for r in again)} s again"
    )
    print(f"ratio (ready / floor): {ready / floor:.2f}")
    print(
        f"load average (1 min) before/after: {load0:.1f}/{load1:.1f}"
        + ("  WARNING: above the core count, timings skewed" if max(load0, load1) > cores else "")
    )
    print(
        json_line(
            {
                "bench": "startup",
                "model": a.model or "tiny (built)",
                "ready_fresh_s": round(first["ready"], 2),
                "ready_s": round(ready, 2),
                "floor_s": round(floor, 2),
                "ratio": round(ready / floor, 3),
                "import_cpu_s": {k: round(v, 2) for k, v in cpu.items()},
                "cores": cores,
                "load_avg": [load0, load1],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
