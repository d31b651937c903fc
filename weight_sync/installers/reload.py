"""The `reload` transport: the full-tensor reference path. The trainer exports its HF safetensors
(gathered from its shards) and every engine reloads them through vLLM's own loader; nothing is planned."""

from __future__ import annotations

import time

from ..calls import call, get_each
from .base import ExportInstall, SyncStats


class ReloadInstall(ExportInstall):
    what = "the reload transport"

    def sync(self, version: int, keep: bool, engines: list[int], timeout: float | None) -> SyncStats:
        folder = self.folder()
        t0 = time.perf_counter()
        self.trainer.export_hf(str(folder))
        path = folder / "model.safetensors"
        acks = get_each(
            [call(self.receivers[e].load_weights, str(path), version, True, keep) for e in engines], timeout
        )
        return SyncStats(version, time.perf_counter() - t0, path.stat().st_size, 1, acks)
