"""LoRA (`trainer.lora`): only the adapters move. The trainer writes its adapters as a PEFT folder
(gathered from its shards, rank 0 writes) and every engine serves it from then on
(`RolloutWorker.load_adapter`: its own copy of the folder, one in-place reload through vLLM's LoRA
loader). The base weights never change, so nothing is planned; the folder is read by path, so the
engines must share a filesystem (a node's /dev/shm) with trainer rank 0."""

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

SHM_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else None


class AdapterInstall(Installer):
    def __init__(self, trainer: TrainerGroup | None, receivers: list):
        self.trainer, self.receivers = trainer, receivers
        self._tmp: Path | None = None  # the export folder, rewritten by every sync

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        if self.trainer is None:
            raise ValueError("weight sync: the adapter sync needs the trainer group (WeightSync.for_run)")
        t0 = time.perf_counter()
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="rl_tpu_adapter_", dir=SHM_DIR))
        self.trainer.export_adapter(str(self._tmp))
        acks = get_each(
            [call(self.receivers[e].load_adapter, str(self._tmp), version) for e in engines], timeout
        )
        nbytes = (self._tmp / "adapter_model.safetensors").stat().st_size
        return SyncStats(version, time.perf_counter() - t0, nbytes, 1, acks)

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
