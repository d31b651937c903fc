"""LoRA (`trainer.lora`): only the adapters move. The trainer writes its adapters as a PEFT folder
(gathered from its shards, rank 0 writes) and every engine serves it from then on
(`RolloutWorker.load_adapter`: its own copy of the folder, one in-place reload through vLLM's LoRA
loader). The base weights never change, so nothing is planned; the folder is read by path, so the
engines must share a filesystem (a node's /dev/shm) with trainer rank 0."""

from __future__ import annotations

import time

from rl_tpu.peft_folder import WEIGHTS

from ..calls import call, get_each
from .base import ExportInstall, SyncStats


class AdapterInstall(ExportInstall):
    what, prefix, shm = "the adapter sync", "rl_tpu_adapter_", True

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        folder = self.folder()
        t0 = time.perf_counter()
        self.trainer.export_adapter(str(folder))
        acks = get_each(
            [call(self.receivers[e].load_adapter, str(folder), version) for e in engines], timeout
        )
        return SyncStats(version, time.perf_counter() - t0, (folder / WEIGHTS).stat().st_size, 1, acks)
