"""How a version's weights reach the engines, one strategy per file behind `base.Installer`: `planned`
(every engine rank pulls exactly its shard's bytes over the chosen transports) and `reload` (the engines
reload the trainer's HF export) and `adapter` (trainer.lora: the engines serve the trainer's LoRA adapters)."""

from .adapter import AdapterReload, AdapterWrite
from .base import Installer, SyncStats
from .planned import PlannedInstall, auto_route, engine_layouts, receiver_tables
from .reload import ReloadInstall

__all__ = [
    "AdapterReload",
    "AdapterWrite",
    "Installer",
    "PlannedInstall",
    "ReloadInstall",
    "SyncStats",
    "auto_route",
    "engine_layouts",
    "receiver_tables",
]
