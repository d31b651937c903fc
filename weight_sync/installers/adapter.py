"""LoRA (`trainer.lora`): only the adapters move, and the base weights never change, so nothing is
planned. Two ways, by `sync.transport`:

- `AdapterWrite` (every transport but "reload"): each trainer rank hands over its own rows of every
  adapter (FSDP's shards as they are, no gather; `TrainerWorker.adapter_rows`) through Ray's object
  store, and every engine joins them and has each TP rank write them in place into its LoRA slot
  (`RolloutWorker.write_adapter`): no file, no reload, and no shared filesystem needed.
- `AdapterReload` ("reload"): the trainer writes its adapters as a PEFT folder (gathered, rank 0 writes)
  in /dev/shm and every engine reloads it through vLLM's LoRA loader (`RolloutWorker.load_adapter`); the
  engines must share that filesystem with trainer rank 0."""

from __future__ import annotations

import time

from rl_tpu.peft_folder import WEIGHTS

from ..calls import call, get_each
from .base import ExportInstall, Installer, SyncStats


class AdapterWrite(Installer):
    def __init__(self, trainer, receivers: list):
        if trainer is None:
            raise ValueError("weight sync: the adapter sync needs the trainer group (WeightSync.for_run)")
        self.trainer, self.receivers = trainer, receivers

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        import ray

        t0 = time.perf_counter()
        refs = self.trainer.adapter_rows_refs()  # each rank's rows stay in its object store
        methods = [self.receivers[e].write_adapter for e in engines]
        # an engine actor fetches every rank's rows itself (Ray resolves references passed as arguments);
        # a receiver in this process takes the values
        local = None if all(hasattr(m, "remote") for m in methods) else ray.get(refs)
        acks = get_each(
            [call(m, version, *(refs if hasattr(m, "remote") else local)) for m in methods], timeout
        )
        return SyncStats(version, time.perf_counter() - t0, acks[0]["bytes"] if acks else 0, 1, acks)


class AdapterReload(ExportInstall):
    what, prefix, shm = "the adapter sync", "rl_tpu_adapter_", True

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        folder = self.folder()
        t0 = time.perf_counter()
        self.trainer.export_adapter(str(folder))
        acks = get_each(
            [call(self.receivers[e].load_adapter, str(folder), version) for e in engines], timeout
        )
        return SyncStats(version, time.perf_counter() - t0, (folder / WEIGHTS).stat().st_size, 1, acks)
