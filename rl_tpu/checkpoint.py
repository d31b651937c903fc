"""Run checkpoints: atomic folders under RUN_DIR/checkpoints, newest N kept, `--resume auto`.

Layout of one checkpoint, `step_000010/`:
  trainer/        the trainer group's torch.distributed.checkpoint (model, optimizer, scheduler, RNG)
  state.json      controller state: step, policy version, data-loader seed and position, rollout call
                  index (the engines' sampling seeds derive from it)
  manifest.json   every other file under the folder: relative path, size in bytes, zlib.crc32
Invariants:
- A folder named `step_<digits>` is complete. It is written as `step_*.tmp` and renamed only after
  everything inside, the manifest last, is written, so a run killed mid-save leaves a `.tmp` that
  resume ignores and the next save removes.
- A checkpoint is used only if it matches its manifest: every listed file present, with the listed size
  and checksum (files the manifest does not list are ignored). That catches what the rename cannot: a
  file truncated or damaged afterwards (a bad copy between machines; bit rot; a disk that lies about
  fsync). Every file and the folder are fsynced before the rename and the root after it, so a machine
  that goes down cannot leave a `step_*` whose contents never reached the disk, and pruning to the newest
  `keep_last` never trades an older good checkpoint for one that is only in the page cache.
  `resume = "auto"` walks checkpoints newest to oldest, warns about each one that does not match
  (naming the file and what is wrong) and takes the first that does; none valid: a warning and a fresh
  start. An explicit `resume = PATH` that does not match raises CheckpointError. A folder without a
  manifest (written before manifests existed) is used with a warning that it could not be checked.
What a resume reproduces:
- `sync` mode: everything but wall-clock timings. The resumed run logs the same metrics and ends with
  the same weights as an uninterrupted run, bit for bit (fp32; tested), because the trainer's state, the
  data-loader position and the engines' sampling seeds (the rollout call index) are all in the checkpoint.
- `async` mode: the step count, policy versions and data order (tested). When a checkpoint is written,
  the next step's prompts are already being sampled with the previous weights; the checkpoint records
  the loader position before that draw, so a resumed run draws the same prompts for every step, but
  samples the first of them anew with the checkpoint's weights (staleness 0 for that step, then 1 as
  before). Completions, rewards and everything trained on them differ from there on: an async resume is
  a valid continuation, not a replay.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_tpu.errors import UserError

STATE = "state.json"
MANIFEST = "manifest.json"
CHECKSUM = "zlib.crc32"
_CHUNK = 4 << 20  # checksum read size: large enough to run at memory speed, small enough to not matter

log = logging.getLogger("rl_tpu")


class CheckpointError(UserError, ValueError):
    """An explicitly named checkpoint is damaged; the message names the file and what is wrong."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    # `step_<digits>` only: a `.tmp` is a save in progress (or a crashed one), and a user may move a
    # damaged checkpoint aside as `step_000004.bad`. With a manifest but no state.json it is damaged,
    # and listed so that resume says so.
    found = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith("step_")
        and p.name[5:].isdigit()
        and ((p / STATE).is_file() or (p / MANIFEST).is_file())
    ]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    write_trainer: Callable[[Path], None],
    keep_last: int,
) -> Path:
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
    write_manifest(tmp)
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(root)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(folder: Path) -> None:
    """Flush every file under `folder` to the disk, then the folders themselves (their entries)."""
    inside = sorted(folder.rglob("*"))
    for p in [*(p for p in inside if p.is_file()), *(p for p in inside if p.is_dir()), folder]:
        _fsync(p)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a folder opens read-only too; its fsync flushes its entries
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> Path:
    """List every file under `folder` (but the manifest) with its size and checksum."""
    files = {}
    for f in sorted(
        p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST
    ):
        files[f.relative_to(folder).as_posix()] = {"bytes": f.stat().st_size, "checksum": _checksum(f)}
    path = folder / MANIFEST
    path.write_text(json.dumps({"checksum": CHECKSUM, "files": files}, indent=1))
    return path


def check_checkpoint(folder: Path) -> list[str] | None:
    """What is wrong with `folder` by its manifest: [] if nothing, None if it has no manifest.
    Each problem reads `step_000004/trainer/x.distcp: 1234 bytes, manifest says 5678`."""
    if not (folder / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        algorithm, files = manifest["checksum"], manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{folder.name}/{MANIFEST}: unreadable ({e})"]
    if algorithm != CHECKSUM:
        return [f"{folder.name}/{MANIFEST}: checksum {algorithm!r}, this version checks {CHECKSUM!r}"]
    # sizes first (a stat each): a damaged checkpoint is usually truncated or incomplete, and then
    # reading every byte to compute checksums would only delay the fallback
    problems = []
    for rel, want in files.items():
        f = folder / rel
        if not f.is_file():
            problems.append(f"{folder.name}/{rel}: missing")
        elif (size := f.stat().st_size) != want["bytes"]:
            problems.append(f"{folder.name}/{rel}: {size} bytes, manifest says {want['bytes']}")
    if problems:
        return problems
    for rel, want in files.items():
        if (got := _checksum(folder / rel)) != want["checksum"]:
            problems.append(f"{folder.name}/{rel}: {CHECKSUM} {got}, manifest says {want['checksum']}")
    return problems


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """'' -> None; 'auto' -> the newest checkpoint that matches its manifest, or None (with a warning for
    each that does not); a path -> that checkpoint, or CheckpointError if it does not match."""
    if not resume:
        return None
    unchecked = (
        f"checkpoint %s has no {MANIFEST} (written by an older version), so it could not be checked: "
        "using it as is"
    )
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        for folder in reversed(found):
            problems = check_checkpoint(folder)
            if problems is None:
                log.warning(unchecked, folder)
                return folder
            if not problems:
                return folder
            log.warning("checkpoint %s is damaged, skipping it: %s", folder, _summary(problems))
        if found:
            log.warning("no valid checkpoint in %s: starting from scratch", checkpoint_root(run_dir))
        return None
    path = Path(resume)
    problems = check_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint.resume = {resume!r} is damaged: {_summary(problems)}")
    if not (path / STATE).is_file():
        raise FileNotFoundError(
            f"checkpoint.resume = {resume!r} is not a complete checkpoint folder (no {STATE})"
        )
    if problems is None:
        log.warning(unchecked, path)
    return path


def load_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE).read_text())


def _checksum(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _summary(problems: list[str], shown: int = 3) -> str:
    """One line: the first few problems (a wiped folder would otherwise list every file)."""
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more
