"""bench/gpu_check.py's harness on CPU: the script the lent GPU machine runs (tiny shape, shm instead of
cuda_ipc, fp32), so it is known to work before device time is spent on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_path_syncs_bit_exact_and_times_both_trainer_steps():
    out = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tiny", "--bucket-mb", "0.01"]
        + ["--batch", "2", "--seq", "16", "--steps", "1", "--syncs", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    sync = res["sync"]
    assert sync["bit_exact"] and sync["mismatched"] == [] and sync["buckets"] > 2, sync
    assert sync["transport"] == "shm" and sync["sync_gbps"] > 0 and sync["ratio"] > 0
    for side in ("titan", "transformers"):
        assert "error" not in res["step"][side], res["step"][side]
        assert res["step"][side]["tokens_per_s"] > 0 and res["step"][side]["mfu"] is None  # no peak on CPU


def test_fingerprint_sees_a_transpose_and_a_single_changed_bit():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import _fingerprint

    t = torch.randn(8, 8).to(torch.bfloat16)
    assert _fingerprint(t) == _fingerprint(t.clone())
    assert _fingerprint(t) != _fingerprint(t.t().contiguous())
    u = t.clone()
    u.view(torch.int16)[3, 5] ^= 1
    assert _fingerprint(t) != _fingerprint(u)
