"""Device rows: `Device.init()` in this environment (cpu works; the others name what is missing), and the
trainer's math on `xla:0` inside the xla role environment (.venv-xla, `scripts/setup.sh --role-env xla`):
the `xla` process group, static-shape buckets with no recompilation after warm-up, one device-to-host
read per step, values equal to the same steps on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from rl_tpu.devices import get_device

ROOT = Path(__file__).resolve().parents[1]
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"


def test_init_cpu_and_clear_errors_for_absent_devices():
    import torch.distributed as dist

    get_device("cpu").init()
    assert dist.is_backend_available("gloo")
    with pytest.raises(RuntimeError, match=r"trainer.device = 'cuda' uses the torch.distributed backend 'nccl'.*CPU-only"):
        get_device("cuda").init()  # this env's torch is 2.13.0+cpu
    with pytest.raises(RuntimeError, match=r"trainer.device = 'tpu' needs the Python module 'torch_tpu'"):
        get_device("tpu").init()
    with pytest.raises(RuntimeError, match=r"trainer.device = 'xla' needs the Python module 'torch_xla'.*--role-env xla"):
        get_device("xla").init()


@pytest.mark.timeout(600)
@pytest.mark.skipif(not XLA_PYTHON.exists(), reason="no .venv-xla (scripts/setup.sh --role-env xla creates it)")
def test_trainer_math_on_xla_static_shapes_no_recompilation():
    env = dict(os.environ, PJRT_DEVICE="CPU")
    r = subprocess.run([str(XLA_PYTHON), str(ROOT / "tests" / "xla_trainer_math.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["backend"] == "xla" and got["device"] == "xla:0" and got["torch_xla"].startswith("2.9")
    # (B, T, L) per step: two buckets alternating, each step with other real lengths
    assert [tuple(s) for s in got["shapes"]] == [(4, 16, 16), (4, 32, 32)] * 3
    # compilations: bucket A, bucket B, and A once more because AdamW creates its state inside the first
    # step (with SGD it is exactly one per bucket); none after that, whatever the real lengths
    assert got["compiles_after_step"] == [1, 2, 3, 3, 3, 3], got["compiles_after_step"]
    assert got["compiles_final"] == 3
    # one device-to-host transfer per step (the metrics vector), counted at the next step's sync
    assert got["transfers_after_step"] == [0, 1, 2, 3, 4, 5], got["transfers_after_step"]
    # fp32 on XLA's CPU backend vs eager CPU: XLA fuses and reorders sums, so not bit-exact (measured
    # 3.6e-7 on parameters, 7.2e-7 on metrics)
    assert got["param_max_diff"] <= 1e-5 and got["metric_max_diff"] <= 1e-5, got
    assert all(math.isfinite(v) for v in got["metrics_last"].values())
    assert got["metrics_last"]["mismatch/kl"] > 0  # the engine log-probs are random: a real gap
