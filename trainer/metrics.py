"""Metrics of an optimizer step, reduced across the trainer's ranks.

Invariants:
- A step's metrics come in three kinds: `loss/*` keys are shares of the whole mini-batch loss, which add
  up across micro-batches and ranks; keys in `rl_tpu.algorithms.losses.MAX_METRICS` are maxima (the
  max over micro-batches, ranks and optimizer steps); every other key is a token-weighted mean,
  accumulated as `weight x value` sums plus the total weight.
- Until the reduction they stay device tensors (float64, as exact as Python-float sums), so
  accumulating them never waits for the device; one all-reduce (sum) carries the sums and means of a
  step and, where there are maxima, one more (max) carries those; their results are the step's only
  read of metrics from the device (float64: untested on TPU, which lacks it).
- A token mean over no token is left out, not reported as 0.
- All ranks call the reduction with the same keys (collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_tpu.algorithms.losses import MAX_METRICS


def metric_vector(
    sums: dict[str, torch.Tensor],
    weighted: dict[str, torch.Tensor],
    weight: float,
    device: torch.device,
    maxima: dict[str, torch.Tensor] | None = None,
) -> tuple[list[str], torch.Tensor]:
    """The keys, and every metric plus the total weight in one vector reduced over ranks: sums and
    weighted means summed (all-reduce), then the maxima (all-reduce max) appended."""
    keys = sorted(sums) + sorted(weighted)
    w = torch.tensor(weight, dtype=torch.float64, device=device)
    vec = torch.stack([sums[k] if k in sums else weighted[k] for k in keys] + [w])
    dist.all_reduce(vec)
    if maxima:
        mkeys = sorted(maxima)
        mvec = torch.stack([maxima[k] for k in mkeys])
        dist.all_reduce(mvec, op=dist.ReduceOp.MAX)
        keys, vec = keys + mkeys, torch.cat([vec[:-1], mvec, vec[-1:]])
    return keys, vec


def read_metrics(sums: dict[str, torch.Tensor], keys: list[str], vec: torch.Tensor) -> dict[str, float]:
    """Loss shares as summed, maxima as reduced; token means only when some token was run (a mean over
    none is no 0)."""
    vec = vec.cpu().tolist()
    total_w = vec[-1]
    return {
        k: (v if k in sums or k in MAX_METRICS else v / total_w)
        for k, v in zip(keys, vec[:-1])
        if k in sums or k in MAX_METRICS or total_w > 0
    }


def reduce(
    sums: dict[str, torch.Tensor],
    weighted: dict[str, torch.Tensor],
    weight: float,
    device: torch.device,
    maxima: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """`metric_vector` then `read_metrics`."""
    keys, vec = metric_vector(sums, weighted, weight, device, maxima)
    return read_metrics(sums, keys, vec)


def mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the dicts that have it (a train step's optimizer steps); the max for the
    keys in `MAX_METRICS`."""
    keys = sorted({k for d in ds for k in d})
    return {
        k: max(d[k] for d in ds if k in d)
        if k in MAX_METRICS
        else sum(d[k] for d in ds if k in d) / sum(1 for d in ds if k in d)
        for k in keys
    }
