"""bench/device_check.py (the one prepared device check) on CPU: every part at tiny sizes, each in its own
process under its own limit (`shm` for the IPC route, gloo for the collective one), so the script a lent
GPU machine runs is known to finish, and a part that hangs is killed and reported while the others run.
On a machine with CUDA, the same sync at tiny sizes through the `cuda_ipc` route, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _check(*args: str, env: dict | None = None, sizes: str = "--cpu") -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "bench/device_check.py", sizes, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def test_device_check_runs_every_part_on_cpu_bit_exact():
    res, _ = _check("--syncs", "2", "--steps", "1")
    assert res["env"]["rl_tpu.weight_sync"] == "ok" and res["env"]["torchtitan"] == "ok", res["env"]
    assert set(res["copies"]["gbps"]) == {"0.01MB", "0.05MB"}
    assert all(row["device_copy"] > 0 for row in res["copies"]["gbps"].values())
    for part, transport in (("sync_ipc", "shm"), ("sync_nccl", "collective")):
        for size, sync in res[part].items():
            if size == "seconds":
                continue
            assert sync["transport"] == transport and sync["buckets"] > 2, (part, size, sync)
            assert sync["bit_exact"] and sync["mismatched"] == [] and sync["ratio"] > 0, (part, size, sync)
    for side in ("titan", "transformers"):
        assert "error" not in res["step"][side], res["step"][side]
        assert res["step"][side]["tokens_per_s"] > 0 and res["step"][side]["mfu"] is None  # no peak on CPU


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (the cuda_ipc route maps the trainer process's GPU buffer in the engine's)",
)
def test_sync_moves_every_byte_through_cuda_ipc_on_a_gpu():
    """The `cuda_ipc` transport end to end between two processes (torch's CUDA IPC handles as plain
    values, the engine copying out of the mapped buffer, pooled slots reused across syncs): every engine
    tensor bit for bit after the last sync."""
    res, _ = _check("--parts", "sync_ipc", "--syncs", "3", sizes="--tiny")
    assert "error" not in res["sync_ipc"], res["sync_ipc"]
    for size in ("0.01MB", "0.05MB"):
        sync = res["sync_ipc"][size]
        assert sync["transport"] == "cuda_ipc" and sync["buckets"] > 2, (size, sync)
        assert sync["bit_exact"] and sync["mismatched"] == [], (size, sync)


def test_device_check_kills_a_hanging_part_and_goes_on():
    env = dict(os.environ, RL_TPU_DEVICE_CHECK_HANG="copies")
    # only the hanging part's limit is cut: the part after it keeps its own (env's imports can take over
    # 6 s on a loaded box, which a scaled limit for every part once cut short)
    res, _ = _check("--parts", "copies,env", "--limit", "copies=6", env=env)
    assert res["copies"]["error"].startswith("timed out after 6 s"), res["copies"]
    assert res["env"]["torch"] == torch.__version__  # the part after it ran


def test_fingerprint_sees_a_transpose_and_a_single_changed_bit():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import _fingerprint

    t = torch.randn(8, 8).to(torch.bfloat16)
    assert _fingerprint(t) == _fingerprint(t.clone())
    assert _fingerprint(t) != _fingerprint(t.t().contiguous())
    u = t.clone()
    u.view(torch.int16)[3, 5] ^= 1
    assert _fingerprint(t) != _fingerprint(u)
