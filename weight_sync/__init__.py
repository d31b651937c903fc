"""Plan-based weight sync from TorchTitan DTensor shards into vLLM engines (see `sync.WeightSync`).

Importable with torch alone: vLLM, Ray and TorchTitan are imported inside the functions that use them.
"""

from .calls import ReceiverLost
from .plan import PlanError, SyncPlan, build_plan
from .receiver import EngineReceiver, SyncReceiver
from .sender import LocalSender, SyncSender
from .specs import ParamSpec
from .sync import SyncStats, WeightSync

__all__ = [
    "EngineReceiver",
    "LocalSender",
    "ParamSpec",
    "PlanError",
    "ReceiverLost",
    "SyncPlan",
    "SyncReceiver",
    "SyncSender",
    "SyncStats",
    "WeightSync",
    "build_plan",
]
