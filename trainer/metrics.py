"""Metrics of an optimizer step, reduced across the trainer's ranks.

Invariants:
- A step's metrics come in two kinds: `loss/*` keys are shares of the whole mini-batch loss, which add
  up across micro-batches and ranks; every other key is a token-weighted mean, accumulated as
  `weight x value` sums plus the total weight.
- Until the reduction they stay device tensors (float64, as exact as Python-float sums), so
  accumulating them never waits for the device; ONE all-reduce carries every metric of a step, and its
  result is the step's only read of them from the device (float64: untested on TPU, which lacks it).
- A token mean over no token is left out, not reported as 0.
- All ranks call the reduction with the same keys (collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def metric_vector(
    sums: dict[str, torch.Tensor], weighted: dict[str, torch.Tensor], weight: float, device: torch.device
) -> tuple[list[str], torch.Tensor]:
    """The keys, and every metric plus the total weight in one vector summed over ranks (all-reduce)."""
    keys = sorted(sums) + sorted(weighted)
    w = torch.tensor(weight, dtype=torch.float64, device=device)
    vec = torch.stack([sums[k] if k in sums else weighted[k] for k in keys] + [w])
    dist.all_reduce(vec)
    return keys, vec


def read_metrics(sums: dict[str, torch.Tensor], keys: list[str], vec: torch.Tensor) -> dict[str, float]:
    """Loss shares as summed; token means only when some token was run (a mean over none is no 0)."""
    vec = vec.cpu().tolist()
    total_w = vec[-1]
    return {k: (v if k in sums else v / total_w) for k, v in zip(keys, vec[:-1]) if k in sums or total_w > 0}


def reduce(
    sums: dict[str, torch.Tensor], weighted: dict[str, torch.Tensor], weight: float, device: torch.device
) -> dict[str, float]:
    """`metric_vector` then `read_metrics`: loss shares added up, other metrics token-weighted means."""
    keys, vec = metric_vector(sums, weighted, weight, device)
    return read_metrics(sums, keys, vec)


def mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the dicts that have it (a train step's optimizer steps)."""
    keys = sorted({k for d in ds for k in d})
    return {k: sum(d[k] for d in ds if k in d) / sum(1 for d in ds if k in d) for k in keys}
