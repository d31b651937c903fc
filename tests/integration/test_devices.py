"""Device rows: `Device.init()` in this environment (cpu works; the others name what is missing), and the
trainer's math on `xla:0` inside the xla role environment (.venv-xla, `scripts/setup.sh --role-env xla`):
the `xla` process group, static-shape buckets with no recompilation after warm-up, one device-to-host
read per step, values equal to the same steps on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_tpu.devices import cpu_process_env, get_device

ROOT = Path(__file__).resolve().parents[2]
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"


def test_init_cpu_and_clear_errors_for_absent_devices():
    import torch.distributed as dist

    get_device("cpu").init()
    assert dist.is_backend_available("gloo")
    with pytest.raises(
        RuntimeError, match=r"trainer.device = 'cuda' uses the torch.distributed backend 'nccl'.*CPU-only"
    ):
        get_device("cuda").init()  # this env's torch is 2.13.0+cpu
    with pytest.raises(RuntimeError, match=r"trainer.device = 'tpu' needs the Python module 'torch_tpu'"):
        get_device("tpu").init()
    with pytest.raises(
        RuntimeError, match=r"trainer.device = 'xla' needs the Python module 'torch_xla'.*--role-env xla"
    ):
        get_device("xla").init()


_REFAULTS = """
import resource, sys, torch
from rl_tpu.devices import get_device
if sys.argv[1] == "init":
    get_device("cpu").init()
t = torch.ones(64 * 2**20); del t  # 256 MB, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.ones(32 * 2**20)  # 128 MB: fits in the freed block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_cpu_trainer_processes_reuse_freed_memory():
    """After `init()` on cpu, memory freed is reused without page faults; glibc's default maps blocks
    over 32 MB afresh (128 MB: 32k new pages). A user's own glibc malloc setting is left alone."""

    def refaults(init: bool, **env):
        out = subprocess.run(
            [sys.executable, "-c", _REFAULTS, "init" if init else "none"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1])

    assert refaults(init=False) > 30000  # glibc's default
    assert refaults(init=True) < 1000
    assert refaults(init=True, MALLOC_MMAP_THRESHOLD_="131072") > 30000  # left alone


_SHAPE_CACHE = """
import ctypes, torch
libc = ctypes.CDLL("libc.so.6")
def mb():
    libc.malloc_trim(0)
    return next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:")) / 1024
torch.set_num_threads(1)
w, a = torch.randn(256, 128), torch.randn(400, 128)
torch.ops.mkldnn._linear_pointwise(a[:1], w, None, "none", [], "")
before = mb()
for m in range(2, 202):  # 200 new row counts, as RL batches bring them
    torch.ops.mkldnn._linear_pointwise(a[:m], w, None, "none", [], "")
print(mb() - before)
"""


def test_cpu_trainer_processes_bound_onednns_shape_caches(monkeypatch):
    """oneDNN keeps ~0.5 MB per new matmul shape in two 1024-entry caches; a CPU trainer process starts
    with both bounded (trainer/group.py passes `cpu_process_env()`), unless the user set them."""

    def growth(env: dict) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _SHAPE_CACHE],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k} | env,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(k, raising=False)
    env = cpu_process_env()
    assert set(env) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"}
    assert growth({}) > 40  # the default caches: ~0.55 MB for each of the 200 shapes
    assert growth(env) < 15
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "4096")
    assert cpu_process_env() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}  # the user's value is kept


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not XLA_PYTHON.exists(), reason="no .venv-xla (scripts/setup.sh --role-env xla creates it)"
)
def test_trainer_math_on_xla_static_shapes_no_recompilation():
    env = dict(os.environ, PJRT_DEVICE="CPU")
    r = subprocess.run(
        [str(XLA_PYTHON), str(ROOT / "tests" / "xla_trainer_math.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
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


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not XLA_PYTHON.exists(), reason="no .venv-xla (scripts/setup.sh --role-env xla creates it)"
)
def test_xla_env_builds_the_trainers_qwen3_equal_to_torchtitan_030(tiny_qwen3, tmp_path):
    """.venv-xla has TorchTitan 0.2.0 (the newest on torch 2.9): `titan_compat` builds its Qwen3 under the
    0.3.0 parameter names; on the CPU its logits equal 0.3.0's here bit for bit, on xla:0 to XLA's rounding."""
    import torch

    from rl_tpu.trainer import model as tm

    out = tmp_path / "xla_model.pt"
    env = dict(os.environ, PJRT_DEVICE="CPU")
    r = subprocess.run(
        [str(XLA_PYTHON), str(ROOT / "tests" / "xla_titan_model.py"), tiny_qwen3, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(out)
    assert got["torchtitan"] == "0.2.0" and got["compat"] and got["roundtrip"]
    spec = tm.build_model_spec(tiny_qwen3)  # TorchTitan 0.3.0, this environment
    sd = tm.hf_to_titan(spec, tm.load_hf_state_dict(tiny_qwen3))
    with torch.device("meta"):
        m = spec.config.build()
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights(buffer_device=torch.device("cpu"))
        for n, p in m.named_parameters():
            p.copy_(sd[n])
        want = m(got["ids"])
    names = [n for n, _ in m.named_parameters()]
    assert got["names"] == got["xla_names"] == names and got["titan_names"] == sorted(sd)
    assert torch.equal(got["cpu_logits"], want)
    assert (got["xla_logits"] - want).abs().max() <= 1e-5  # measured 5.4e-7


def test_cpu_has_no_device_peak_memory():
    """`memory/trainer_device_peak_gb` is CUDA's allocator statistic; on CPU the RSS metrics stand alone."""
    assert get_device("cpu").take_peak_memory() is None
