"""Run checkpoints: atomic folders under RUN_DIR/checkpoints, newest N kept, `--resume auto`.

Layout of one checkpoint, `step_000010/`:
  trainer/        the trainer group's torch.distributed.checkpoint (model, optimizer, scheduler, RNG)
  state.json      controller state: step, policy version, data-loader position, RNG seeds
Invariant: a folder named `step_*` is complete. It is written as `step_*.tmp` and renamed only after
everything inside is on disk, so a run killed mid-save leaves a `.tmp` that resume ignores and the
next save removes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

STATE = "state.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
             and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any],
                    write_trainer: Callable[[Path], None], keep_last: int) -> Path:
    """Write a checkpoint atomically; `write_trainer(folder)` saves the trainer's sharded state."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    tmp.mkdir()
    write_trainer(tmp / "trainer")
    (tmp / STATE).write_text(json.dumps(state | {"step": step}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """'' -> None; 'auto' -> newest complete checkpoint or None; a path -> that checkpoint (checked)."""
    if not resume:
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE).is_file():
        raise FileNotFoundError(f"checkpoint.resume = {resume!r} is not a complete checkpoint folder (no {STATE})")
    return path


def load_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE).read_text())
