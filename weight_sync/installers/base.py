"""What one install strategy of the weight sync does, and what a sync reports. `WeightSync` owns the
version, the lock, verify and engine restarts; an installer only moves a version's weights into engines."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_tpu.trainer import TrainerGroup


@dataclass
class SyncStats:
    version: int
    seconds: float
    bytes: int
    buckets: int
    acks: list[dict]

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Installer:
    """One way of putting the trainer's weights into the engines (`planned.PlannedInstall`: each engine
    rank gets exactly its shard's bytes by a plan; `reload.ReloadInstall`: every engine reloads an HF
    export). `receivers` is the list `WeightSync` keeps: a restarted engine replaces its entry there
    before `replace` is called."""

    def build(self):
        """Prepare before the first sync (the plan, its tables, routes); None where nothing is planned."""
        return None

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        """Install `version` into `engines` (each records it once complete); `keep`: keep what verify
        compares. An engine that dies or hangs past `timeout` is raised as `calls.ReceiverLost`."""
        raise NotImplementedError

    def replace(self, engine: int) -> None:
        """Engine `engine`'s receiver was restarted: make it ready for `sync(..., engines=[engine])`."""

    def routes(self) -> list[dict]:
        """What moves bytes where (placement.json's `weight_sync.routes`); [] where nothing is planned."""
        return []

    def close(self) -> None:
        """Free what the installer holds (pooled buffers, regions, temporary files)."""


class ExportInstall(Installer):
    """An installer whose engines read what the trainer group exports into one folder, reused by every
    sync (`reload`: an HF folder; `adapter`: a PEFT folder). `what` names it in errors; `shm` puts the
    folder in shared memory."""

    what, prefix, shm = "", "rl_tpu_sync_", False

    def __init__(self, trainer: TrainerGroup | None, receivers: list):
        self.trainer, self.receivers = trainer, receivers
        self._tmp: Path | None = None

    def folder(self) -> Path:
        """The export folder, made on first use."""
        if self.trainer is None:
            raise ValueError(f"weight sync: {self.what} needs the trainer group (WeightSync.for_run)")
        if self._tmp is None:
            from ..transports import SHM_DIR

            self._tmp = Path(tempfile.mkdtemp(prefix=self.prefix, dir=SHM_DIR if self.shm else None))
        return self._tmp

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
