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
- `rl-tpu train` compares the checkpoint it will resume with the configured model before Ray starts
  (`check_resume_model`): the parameter shapes in the checkpoint's DCP metadata, which every trainer
  checkpoint holds (old ones too), against those the trainer builds from the model folder. A checkpoint
  of another model size is one line naming both, not a size mismatch inside a trainer actor.
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
from typing import TYPE_CHECKING, Any

from rl_tpu.errors import UserError

if TYPE_CHECKING:
    from rl_tpu.config import Config

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


def check_checkpoint(folder: Path, checksums: bool = True) -> list[str] | None:
    """What is wrong with `folder` by its manifest: [] if nothing, None if it has no manifest.
    Each problem reads `step_000004/trainer/x.distcp: 1234 bytes, manifest says 5678`. Without
    `checksums`, only what a stat shows (missing files, sizes): the cheap part."""
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
    if problems or not checksums:
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


def resume_candidate(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint `resolve_resume` will most likely pick, found without reading every byte and
    without a warning: for 'auto', the newest whose files have their manifest sizes (a checkpoint
    damaged without a change of size is told apart only by `resolve_resume`'s checksums)."""
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume)
        return path if (path / STATE).is_file() else None
    for folder in reversed(complete_checkpoints(run_dir)):
        if not check_checkpoint(folder, checksums=False) and (folder / STATE).is_file():
            return folder
    return None


def check_resume_model(cfg: Config) -> None:
    """Raise CheckpointError if the checkpoint `checkpoint.resume` names was written for a model of
    other parameter shapes than the configured one (`model.path`, or the run folder's tiny model), which
    the trainer would find only once every actor has started (a DCP size mismatch and its traceback).
    What is compared: the shapes recorded in the checkpoint's DCP metadata, which every trainer
    checkpoint has, with those the trainer builds from the model folder (config.json and the safetensors
    headers). A checkpoint whose metadata cannot be read is not checked here: resuming reports it."""
    run_dir = Path(cfg.logging.run_dir)
    folder = resume_candidate(run_dir, cfg.checkpoint.resume)
    if folder is None:
        return
    from rl_tpu.trainer.checkpoint import (
        describe_shapes,
        lora_mismatch,
        model_shapes,
        saved_shapes,
        shape_mismatch,
    )

    saved = saved_shapes(folder / "trainer")
    if not saved:
        return
    from rl_tpu.model_folder import ensure_model

    model_path = ensure_model(cfg, run_dir)  # the folder the run will load (the tiny model: built now)
    try:
        current = model_shapes(model_path)
    except Exception as e:  # noqa: BLE001 - an early check only: the trainer's load still compares
        if isinstance(e, UserError):
            raise
        log.warning(
            "could not compare checkpoint %s with the model before starting (%s: %s); the trainer "
            "compares them when it loads the checkpoint",
            folder,
            type(e).__name__,
            e,
        )
        return
    model = f"model.path = {cfg.model.path!r}" if cfg.model.path else f"the run's model {model_path!r}"
    rank = cfg.trainer.lora.rank
    why = lora_mismatch(saved, current, rank)
    if why is not None:
        raise CheckpointError(
            f"checkpoint {folder} does not fit this run's trainer.lora.rank = {rank} over {model}: {why}"
        )
    why = None if rank else shape_mismatch(saved, current)
    if why is None:
        return
    raise CheckpointError(
        f"checkpoint {folder} was written for another model ({describe_shapes(saved)}) than {model} "
        f"({describe_shapes(current)}): {why}; resume with the model it was trained from, or start "
        "over in another --logging.run_dir"
    )


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
