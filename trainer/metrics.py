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


class MoeStats:
    """Expert load of a model's mixture-of-experts layers over the training forwards since the last
    `read` (`moe/*` metrics; nothing for a dense model).

    A forward hook on each MoE layer's router (TorchTitan's `TokenChoiceTopKRouter`, which returns the
    top-k scores, the top-k expert ids and every expert's probability) counts, in training mode only,
    the tokens routed to each expert and sums each expert's probability, over every position the
    forward ran (padding included). `read` sums them over ranks (collective) and reports:
    - `moe/expert_load_max`: the most loaded expert's token count / the mean count, the max over layers
      (1 = perfectly balanced, `num_experts / top_k` = every token on the same experts);
    - `moe/aux_loss`: the Switch / HF Qwen3-MoE load-balancing loss `E * sum_e f_e * P_e` (f_e: the
      fraction of routed tokens on expert e, summed over the k choices; P_e: its mean probability),
      the mean over layers. Reported only: TorchTitan 0.3.0 adds no auxiliary loss (its balancing is
      the aux-loss-free expert bias, `load_balance_coeff`, which trainer/model.py leaves off because
      it changes routing and HF has none), and neither does the trainer's loss.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = [
            m.router for m in model.modules() if hasattr(m, "router") and hasattr(m, "routed_experts")
        ]
        self.counts: list[torch.Tensor | None] = [None] * len(self.routers)
        self.probs: list[torch.Tensor | None] = [None] * len(self.routers)
        self.tokens = [0] * len(self.routers)
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, out):
            if not module.training:
                return
            _, ids, scores = out
            ids, scores = _local(ids).detach(), _local(scores).detach()
            n = scores.shape[-1]
            counts = torch.bincount(ids.reshape(-1), minlength=n).to(torch.float64)
            probs = scores.reshape(-1, n).sum(0, dtype=torch.float64)
            self.counts[i] = counts if self.counts[i] is None else self.counts[i] + counts
            self.probs[i] = probs if self.probs[i] is None else self.probs[i] + probs
            self.tokens[i] += scores.numel() // n

        return hook

    def read(self, device: torch.device) -> dict[str, float]:
        """The `moe/*` metrics since the last read (all ranks call it: one all-reduce), then a reset."""
        if not self.routers:
            return {}
        n = self.routers[0].gate.weight.shape[0]
        zero = torch.zeros(n, dtype=torch.float64, device=device)
        counts = torch.stack([zero if c is None else c.to(device) for c in self.counts])  # [layers, E]
        probs = torch.stack([zero if p is None else p.to(device) for p in self.probs])
        tokens = torch.tensor(self.tokens, dtype=torch.float64, device=device)[:, None]
        vec = torch.cat([counts, probs, tokens], dim=1)
        if dist.is_initialized():
            dist.all_reduce(vec)
        counts, probs, tokens = vec[:, :n], vec[:, n : 2 * n], vec[:, 2 * n :]
        self.counts, self.probs = [None] * len(self.routers), [None] * len(self.routers)
        self.tokens = [0] * len(self.routers)
        if float(tokens.min()) == 0:
            return {}
        load_max = counts.max(1).values / counts.mean(1)
        f = counts / counts.sum(1, keepdim=True)  # fraction of routed (token, choice) pairs
        aux = n * (f * probs / tokens).sum(1) * self.routers[0].top_k
        return {"moe/expert_load_max": float(load_max.max()), "moe/aux_loss": float(aux.mean())}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
