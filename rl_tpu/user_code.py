"""Load the user's code named by a spec string, `module:name` or `path/to/file.py:name`: reward functions
(`reward.functions`), tools (`rollout.tools`) and environment classes (`rollout.env`) all load here.

Invariants:
- A spec without `:` names `compute_score` in that module or file (verl's default name for a reward).
- `path/to/tools.yaml:name` (a verl tool config file) is resolved like a file path; its tools load with
  `rl_tpu.rollout.verl_tools.load_spec`, not here.
- A file path is resolved against the current directory; `resolve_spec` turns it absolute so worker
  processes started elsewhere load the same file. A file is imported once per process under a
  private module name derived from its absolute path (re-loading returns the same function).
- Every failure raises `SpecError` naming the spec's field, the spec and what is wrong: file not found,
  module not importable (with the import error), attribute missing (with the callables that do exist),
  not callable, or (with `timeout_s`: the driver's loads) an import that did not finish in time.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from rl_tpu.errors import UserError

DEFAULT_FUNCTION = "compute_score"
# how long the driver waits for a user module's import (the reward pool's workers wait as long to start)
IMPORT_TIMEOUT_S = 120.0
_FILE_MODULE_PREFIX = "rl_tpu_user_"  # a file's private module name: this, its stem, a digest of its path


class SpecError(UserError, ValueError):
    """A spec string does not lead to a callable; the message says which part is wrong."""


def split_spec(spec: str, label: str = "spec") -> tuple[str, str, bool]:
    """`spec` -> (module or path, function name, is_file). Pure string logic, no imports."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(
            f"{label} {spec!r} must be a non-empty string like 'pkg.module:function' "
            "or 'path/to/file.py:function'"
        )
    spec = spec.strip()
    target, sep, fn = spec.rpartition(":")
    # `C:\x.py` style drive letters or a spec without ':' leave no usable module part on the left.
    if not sep or not target or fn.endswith(".py") or "/" in fn or "\\" in fn:
        target, fn = spec, DEFAULT_FUNCTION
    if not fn.isidentifier():
        raise SpecError(f"{label} {spec!r}: {fn!r} is not a valid function name")
    is_file = target.endswith((".py", ".yaml", ".yml")) or "/" in target or "\\" in target
    return target, fn, is_file


def resolve_spec(spec: str) -> str:
    """The spec with a file path made absolute (so it means the same in any working directory)."""
    target, fn, is_file = split_spec(spec)
    if is_file:
        target = str(Path(target).expanduser().resolve())
    return f"{target}:{fn}"


def _import_file(path: Path, spec: str, label: str = "spec") -> ModuleType:
    if not path.is_file():
        raise SpecError(
            f"{label} {spec!r}: file {str(path)!r} not found (relative paths are "
            f"resolved against the current directory {str(Path.cwd())!r})"
        )
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"{_FILE_MODULE_PREFIX}{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    mspec = importlib.util.spec_from_file_location(name, path)
    if mspec is None or mspec.loader is None:
        raise SpecError(f"{label} {spec!r}: {str(path)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        mspec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(name, None)
        raise SpecError(f"{label} {spec!r}: importing {str(path)!r} raised {type(e).__name__}: {e}") from e
    return module


def _import_module(name: str, spec: str, label: str = "spec") -> ModuleType:
    try:
        return importlib.import_module(name)
    except BaseException as e:  # SyntaxError, SystemExit in user code, ...: all mean "not importable"
        raise SpecError(
            f"{label} {spec!r}: module {name!r} is not importable: {type(e).__name__}: {e}"
        ) from e


def _callables(module: ModuleType) -> list[str]:
    own = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__
    ]
    return sorted(own) or sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v))


def load_callable(spec: str, label: str = "spec", timeout_s: float | None = None) -> Callable:
    """Import and return the function or class named by `spec` (see module docstring); `label` names the
    spec's field in errors ("reward spec", "rollout.tools", ...). With `timeout_s`, an import that has not
    finished by then (a module that blocks or loops at import time) raises `SpecError` instead of holding
    the caller: the import goes on in a daemon thread, which cannot be stopped, and is abandoned."""
    if timeout_s is None:
        return _load(spec, label)
    done: dict[str, Any] = {}

    def load() -> None:
        try:
            done["fn"] = _load(spec, label)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            done["error"] = e

    before = set(sys.modules)
    worker = threading.Thread(target=load, daemon=True, name="rl_tpu-user-import")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        for name in set(sys.modules) - before:  # a half-run file module: a later load runs the file again
            if name.startswith(_FILE_MODULE_PREFIX):
                sys.modules.pop(name, None)
        raise SpecError(
            f"{label} {spec!r}: importing it did not finish within {timeout_s:.0f} s (does the module block "
            "or loop at import time? move that work into the function)"
        )
    if "error" in done:
        raise done["error"]
    return done["fn"]


def _load(spec: str, label: str) -> Callable:
    target, fn_name, is_file = split_spec(spec, label)
    if is_file:
        module = _import_file(Path(target).expanduser().resolve(), spec, label)
    else:
        module = _import_module(target, spec, label)
    if not hasattr(module, fn_name):
        names = _callables(module)
        raise SpecError(
            f"{label} {spec!r}: {target!r} has no attribute {fn_name!r}; "
            f"callables defined there: {', '.join(names) if names else '(none)'}"
        )
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise SpecError(f"{label} {spec!r}: {target}.{fn_name} is a {type(fn).__name__}, not callable")
    return fn
