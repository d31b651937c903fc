"""The one prepared device check: what a lent accelerator machine measures, in one shot, each part in a
process of its own under its own time limit, so nothing can hang the whole (a part that runs over is
killed and reported as timed out). The last line is one JSON object.

On a bare machine with one GPU (Python, torch, transformers, safetensors; no vLLM, Ray or TorchTitan), given
only this repository: the project is imported from a tree of links to its folders (`import_tree`: no pip,
no network), and `--deps DIR` (default `out/device_deps` when present) goes on the path too: what
`--pack-deps DIR` copied from this environment (TorchTitan, pure Python), carried with the run.

Parts (`--parts`, in this order):
- `env`: torch, the GPU, which of the project's imports work.
- `copies`: host -> device and device -> host over pinned memory, and a copy within the device, GB/s at each
  bucket size.
- `sync_ipc`: our weight sync between two processes on one GPU through `cuda_ipc` (bench/gpu_check.py's
  harness: a Qwen3-1.7B-shaped bf16 model planned into vLLM's fused layout), GB/s ÷ the device's copy GB/s
  at each bucket size (`--buckets-mb`, default 64 and 512: the per-bucket overhead shows against the
  larger), every engine tensor checked bit for bit.
- `sync_nccl`: the same through the `collective` transport over NCCL, sender and receiver on GPUs 0 and 1;
  skipped with the reason on one GPU (NCCL refuses two ranks of a group on one device).
- `step`: one optimizer step of our TorchTitan model (FSDP2, bf16 compute) next to transformers' Qwen3 at
  a batch that fits 80 GB (`--batch 4 --seq 1024`): tokens/s and MFU.

`--cpu` runs every part at tiny sizes on the host (`shm` for the IPC route, gloo for the collective one):
the test suite runs it (tests/integration/test_device_check.py) so the script is known to finish before
device time is spent on it. `--tiny` keeps the GPU but takes the tiny sizes: on a machine with CUDA the
suite moves bytes through the `cuda_ipc` route that way (seconds, not the 1.7B model's minutes).

    python bench/device_check.py                      # on the lent GPU
    python bench/device_check.py --cpu                # the same parts, tiny, on CPU
    python bench/device_check.py --pack-deps out/device_deps   # here, before: what to carry
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("env", "copies", "sync_ipc", "sync_nccl", "step")
# seconds per part on the device (~9 minutes in all); --cpu parts get the same limits
LIMITS = {"env": 60, "copies": 60, "sync_ipc": 150, "sync_nccl": 90, "step": 180}
# the project's packages as pyproject.toml maps them (package-dir): rl_tpu.<name> -> <folder>
MAPPED = {"trainer": "trainer", "rollout": "rollout", "weight_sync": "weight_sync"}
PACKED = ("torchtitan",)  # pure-Python packages the bare device image lacks


def import_tree(into: Path) -> Path:
    """A folder from which `import rl_tpu...` works without installing: rl_tpu/ holding links to every
    entry of the repository's rl_tpu/ plus its mapped folders (trainer/ -> rl_tpu.trainer, ...)."""
    pkg = into / "rl_tpu"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "rl_tpu").iterdir():
        if entry.name != "__pycache__" and not (pkg / entry.name).exists():
            (pkg / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        if not (pkg / name).exists():
            (pkg / name).symlink_to(ROOT / folder)
    return into


def pack_deps(out: Path) -> list[str]:
    """Copy the pure-Python packages a bare device image lacks from this environment into `out`."""
    import importlib

    out.mkdir(parents=True, exist_ok=True)
    done = []
    for name in PACKED:
        src = Path(importlib.import_module(name).__file__).parent
        shutil.copytree(src, out / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        done.append(name)
    return done


# ------------------------------------------------------------------------------------------ the parts


def part_env(device: str, a) -> dict:
    import importlib

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "device": device}
    if device == "cuda":
        out |= {"gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0)}
        out["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for mod in ("rl_tpu.weight_sync", "rl_tpu.trainer.model", "torchtitan", "transformers"):
        try:
            importlib.import_module(mod)
            out[mod] = "ok"
        except Exception as e:  # noqa: BLE001 - what the other parts will meet
            out[mod] = f"{type(e).__name__}: {e}"[:200]
    return out


def _copy_gbps(dst, src, sync, repeats: int = 5) -> float:
    """GB/s of `dst.copy_(src)` (uint8 tensors), the best of `repeats` after a warm-up."""
    dst.copy_(src, non_blocking=True)
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - t0)
    return dst.numel() / best / 1e9


def part_copies(device: str, a) -> dict:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for mb in a.buckets_mb:
        n = int(mb * 2**20)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        dev2 = torch.empty_like(dev)
        row = {"device_copy": _copy_gbps(dev2, dev, sync)}
        if device == "cuda":
            row["host_to_device"] = _copy_gbps(dev, host, sync)
            row["device_to_host"] = _copy_gbps(host, dev, sync)
        out[f"{mb:g}MB"] = {k: round(v, 2) for k, v in row.items()}
    return {"gbps": out}


def part_sync(device: str, a, transport: str) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    if transport == "collective" and device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            return {"skipped": "one GPU: NCCL refuses two ranks of one group on one device"}
    m = gpu_check.TINY if a.tiny else gpu_check.QWEN3_1_7B
    dtype = "float32" if device == "cpu" else "bfloat16"
    out = {}
    for mb in a.buckets_mb:
        out[f"{mb:g}MB"] = gpu_check.check_sync(m, device, dtype, mb, a.syncs, transport=transport)
    return out


def part_step(device: str, a) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    m = gpu_check.TINY if a.tiny else gpu_check.QWEN3_1_7B
    return gpu_check.check_step(m, device, a.batch, a.seq, a.steps)


def run_part(name: str, device: str, a) -> dict:
    if os.environ.get("RL_TPU_DEVICE_CHECK_HANG") == name:  # tests/integration/test_device_check.py
        time.sleep(3600)
    if name == "env":
        return part_env(device, a)
    if name == "copies":
        return part_copies(device, a)
    if name == "sync_ipc":
        return part_sync(device, a, "cuda_ipc" if device == "cuda" else "shm")
    if name == "sync_nccl":
        return part_sync(device, a, "collective")
    if name == "step":
        return part_step(device, a)
    raise ValueError(f"unknown part {name!r}; parts: {', '.join(PARTS)}")


# ---------------------------------------------------------------------------------------- orchestration


def _child(name: str, argv: list[str], env: dict, limit: float) -> dict:
    """Run one part in its own process group; kill the group past `limit` seconds."""
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as res:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run-part", name, "--result", res.name, *argv]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"error": f"timed out after {limit:.0f} s (killed)", "seconds": round(limit, 1)}
        text = Path(res.name).read_text()
    seconds = round(time.perf_counter() - t0, 1)
    if rc != 0 or not text:
        return {"error": f"exit code {rc} (its output is above)", "seconds": seconds}
    return json.loads(text) | {"seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="every part at tiny sizes on the host")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the GPU (implied by --cpu)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--buckets-mb", type=float, nargs="+", default=None)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every part's time limit")
    p.add_argument("--limit", action="append", default=[], metavar="PART=S", help="one part's limit, seconds")
    p.add_argument("--deps", type=Path, default=ROOT / "out" / "device_deps")
    p.add_argument("--pack-deps", type=Path, default=None, help="copy TorchTitan here (to carry) and exit")
    p.add_argument("--run-part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.pack_deps:
        print(json.dumps({"packed": pack_deps(a.pack_deps), "into": str(a.pack_deps)}))
        return 0
    device = "cpu" if a.cpu else "cuda"
    a.tiny = a.tiny or a.cpu
    a.buckets_mb = a.buckets_mb or ([0.01, 0.05] if a.tiny else [64.0, 512.0])
    a.batch, a.seq = a.batch or (2 if a.tiny else 4), a.seq or (16 if a.tiny else 1024)
    if a.run_part:  # inside the part's own process
        Path(a.result).write_text(json.dumps(run_part(a.run_part, device, a)))
        return 0
    tree = import_tree(Path(tempfile.mkdtemp(prefix="rl_tpu_device_check_")))
    paths = [str(tree), *([str(a.deps)] if a.deps.is_dir() else []), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in paths if x), TOKENIZERS_PARALLELISM="false")
    passed = sys.argv[1:] if argv is None else list(argv)  # the part's process parses the same options
    out: dict = {"bench": "device_check", "device": device, "date": time.strftime("%Y-%m-%d")}
    limits = {k: v * a.limit_scale for k, v in LIMITS.items()}
    for item in a.limit:
        name, _, seconds = item.partition("=")
        if name not in PARTS:
            raise SystemExit(f"--limit {item!r}: unknown part {name!r}; parts: {', '.join(PARTS)}")
        limits[name] = float(seconds)
    for name in a.parts.split(","):
        if name not in PARTS:
            raise SystemExit(f"--parts: unknown part {name!r}; parts: {', '.join(PARTS)}")
        out[name] = _child(name, passed, env, limits[name])
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    shutil.rmtree(tree, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
