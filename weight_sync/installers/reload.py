"""The `reload` transport: the full-tensor reference path. The trainer exports its HF safetensors
(gathered from its shards) and every engine reloads them through vLLM's own loader; nothing is planned."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..calls import call, get_each
from .base import Installer, SyncStats

if TYPE_CHECKING:
    from rl_tpu.trainer import TrainerGroup


class ReloadInstall(Installer):
    def __init__(self, trainer: TrainerGroup | None, receivers: list):
        self.trainer, self.receivers = trainer, receivers
        self._tmp: Path | None = None  # the export folder, reused by every sync

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        if self.trainer is None:
            raise ValueError("weight sync: the reload transport needs the trainer group (WeightSync.for_run)")
        t0 = time.perf_counter()
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="rl_tpu_sync_"))
        self.trainer.export_hf(str(self._tmp))
        path = self._tmp / "model.safetensors"
        acks = get_each(
            [call(self.receivers[e].load_weights, str(path), version, True, keep) for e in engines], timeout
        )
        return SyncStats(version, time.perf_counter() - t0, path.stat().st_size, 1, acks)

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
