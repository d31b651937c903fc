"""What one install strategy of the weight sync does, and what a sync reports. `WeightSync` owns the
version, the lock, verify and engine restarts; an installer only moves a version's weights into engines."""

from __future__ import annotations

from dataclasses import dataclass


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
