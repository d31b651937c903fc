"""Plan-based weight sync from TorchTitan DTensor shards into vLLM engines (see `sync.WeightSync`).

Importable with torch alone: vLLM, Ray and TorchTitan are imported inside the functions that use them.
"""

from .plan import Plan, PlanError, build_plan
from .specs import ParamSpec
from .sync import ReceiverLost, SyncStats, WeightSync

__all__ = ["ParamSpec", "Plan", "PlanError", "ReceiverLost", "SyncStats", "WeightSync", "build_plan"]
