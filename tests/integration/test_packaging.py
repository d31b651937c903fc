"""The installed layout: trainer/, rollout/, weight_sync/ live inside rl_tpu, never at top level."""

import subprocess
import sys


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)


def test_subpackages_import_under_rl_tpu_only(tmp_path):
    ok = _run(
        "import rl_tpu.trainer, rl_tpu.rollout, rl_tpu.weight_sync, rl_tpu.algorithms, rl_tpu.rewards",
        tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    for name in ("trainer", "rollout", "weight_sync"):
        r = _run(f"import {name}", tmp_path)  # cwd is not the repo, so only installed modules count
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, name


def test_console_script_is_installed(tmp_path):
    exe = __import__("pathlib").Path(sys.executable).with_name("rl-tpu")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "make-tiny-model" in r.stdout


def _heavy_imports(modules: str, heavy: tuple[str, ...], tmp_path) -> None:
    """Import `modules` in a fresh interpreter and assert none of `heavy` came with them."""
    code = (
        f"import sys, {modules}\nheavy = [m for m in {heavy!r} if m in sys.modules]\nassert not heavy, heavy"
    )
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stderr


def test_weight_sync_and_algorithms_need_no_heavy_imports(tmp_path):
    # The GPU check machine has torch + safetensors only: these packages must import there.
    _heavy_imports(
        "rl_tpu.weight_sync, rl_tpu.algorithms", ("vllm", "ray", "torchtitan", "transformers"), tmp_path
    )


def test_a_tool_worker_imports_neither_torch_nor_ray(tmp_path):
    # A tool's worker process loads rl_tpu.rollout.tools (its result check) under the tool's address-space
    # limit, counted from the process's start: torch alone would take most of a 256 MB limit.
    heavy = ("torch", "vllm", "ray", "torchtitan", "transformers")
    _heavy_imports("rl_tpu.rollout.tools, rl_tpu.call_pool, rl_tpu.user_code", heavy, tmp_path)
