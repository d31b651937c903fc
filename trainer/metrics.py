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
    `read` (`moe/*` metrics; nothing for a dense model), the routers' agreement with the engine's, and
    routing replay.

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
      it changes routing and HF has none), and neither does the trainer's loss;
    - `moe/router_agreement`: over the sampled tokens the engine ran (every response token but the
      last, `response_mask` > 0) and every MoE layer, the fraction whose top-k expert set from this
      model's router equals the engine's (`TrainBatch.routed_experts`). Counted in the forward of the
      old log-probs: the no-grad forwards since the last read (`compute_log_probs`), or, where the
      update computed none (one optimizer step per batch: the update's own forward is the old
      log-probs'), the training forwards. With replay it still compares the router's own choice;
    - `moe/replayed_fraction` (replay only): over every position of every sequence but its last token
      and every MoE layer, in all policy forwards, the fraction routed to the engine's experts (those
      with an engine record); 1 when the engine recorded every position (`rollout.routing_replay`).

    Routing replay (`replay`, R3): where the micro-batch carries the engine's experts, each router's
    top-k expert ids are replaced by the engine's and its top-k scores become the router's
    probabilities of those experts (renormalised and scaled as the router does), so the gradient still
    flows through the router's probabilities of the experts the engine used. Positions without a record
    keep the router's own choice.

    Where the engine's experts of a micro-batch come from: `trainer/forward.py` sets the micro-batch on
    `model.rl_micro_batch` beside `model.lm_head.rl_index` (the flat index of the position predicting
    each response token j). A pre-hook on the model lays the experts out over the forward's positions
    from those two alone, for padded rows and shared-prompt packed rows alike: response token m sits at
    the position predicting token m + 1, the prompt's tokens end at the position predicting token 0.
    """

    def __init__(self, model: torch.nn.Module, replay: bool = False):
        self.routers = [
            m.router for m in model.modules() if hasattr(m, "router") and hasattr(m, "routed_experts")
        ]
        self.replay = replay
        self.counts: list[torch.Tensor | None] = [None] * len(self.routers)
        self.probs: list[torch.Tensor | None] = [None] * len(self.routers)
        self.tokens = [0] * len(self.routers)
        # matches, tokens: no-grad forwards, then training; replayed positions, positions
        self.agree = torch.zeros(6, dtype=torch.float64)
        self.layout: tuple[torch.Tensor, ...] | None = None  # this forward's (experts, sampled, real)
        if not self.routers:
            return
        model.register_forward_pre_hook(self._lay_out)
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._routing_hook(i))
            r.register_forward_hook(self._hook(i))

    def _lay_out(self, model, args) -> None:
        """Before each forward: the micro-batch's engine experts over its positions (`layout`), or None."""
        mb = getattr(model, "rl_micro_batch", None)
        index = getattr(getattr(model, "lm_head", None), "rl_index", None)
        self.layout = None
        if mb is None or mb.routed_experts is None or index is None:
            return
        self.layout = routing_layout(mb, index[0].cpu(), int(args[0].numel()))

    def _routing_hook(self, i: int):
        def hook(module, args, out):
            if self.layout is None:
                return None
            scores_k, ids, scores = out
            local_ids = _local(ids)
            k = local_ids.shape[-1]
            engine, sampled, real = self.layout
            if engine.shape[0] * k != local_ids.numel():
                raise RuntimeError(
                    f"routing replay: the router saw {local_ids.numel() // k} positions, the layout has "
                    f"{engine.shape[0]} (sequence-sharded router inputs are not supported)"
                )
            if engine.shape[1] != len(self.routers):
                raise RuntimeError(
                    f"routing replay: the engine recorded {engine.shape[1]} MoE layers, the model has "
                    f"{len(self.routers)}"
                )
            dev = local_ids.device
            eng = engine[:, i].to(dev).long() - 1  # [N, k]; -1 where no record
            have = eng[:, 0] >= 0
            own = local_ids.reshape(-1, k)
            counted = sampled.to(dev) & have
            same = (own.sort(-1).values == eng.sort(-1).values).all(-1) & counted
            j = 2 if module.training else 0
            self.agree[j] += float(same.sum())
            self.agree[j + 1] += float(counted.sum())
            if not self.replay:
                return None
            self.agree[4] += float((have & real.to(dev)).sum())
            self.agree[5] += float(real.sum())
            new_ids = torch.where(have[:, None], eng, own).reshape(local_ids.shape)
            probs = _local(scores)
            top = probs.gather(-1, new_ids)
            if module.route_norm:
                top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
            top = top * module.route_scale
            return _like(scores_k, top.to(_local(scores_k).dtype)), _like(ids, new_ids), scores

        return hook

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
        vec = torch.cat([torch.cat([counts, probs, tokens], dim=1).reshape(-1), self.agree.to(device)])
        if dist.is_initialized():
            dist.all_reduce(vec)
        agree = vec[-6:].tolist()
        vec = vec[:-6].reshape(len(self.routers), 2 * n + 1)
        counts, probs, tokens = vec[:, :n], vec[:, n : 2 * n], vec[:, 2 * n :]
        self.counts, self.probs = [None] * len(self.routers), [None] * len(self.routers)
        self.tokens = [0] * len(self.routers)
        self.agree = torch.zeros(6, dtype=torch.float64)
        out = {}
        matched, total = agree[:2] if agree[1] > 0 else agree[2:4]
        if total > 0:
            out["moe/router_agreement"] = matched / total
        if agree[5] > 0:
            out["moe/replayed_fraction"] = agree[4] / agree[5]
        if float(tokens.min()) == 0:
            return out
        load_max = counts.max(1).values / counts.mean(1)
        f = counts / counts.sum(1, keepdim=True)  # fraction of routed (token, choice) pairs
        aux = n * (f * probs / tokens).sum(1) * self.routers[0].top_k
        return out | {"moe/expert_load_max": float(load_max.max()), "moe/aux_loss": float(aux.mean())}


def routing_layout(mb, hidden_index: torch.Tensor, positions: int) -> tuple[torch.Tensor, ...]:
    """The engine's experts of micro-batch `mb` over a forward's `positions` (flattened `[rows, L]` of
    its input): `(experts [positions, layers, k] int16, expert + 1 or 0; sampled [positions] bool: a
    sampled token with a record; real [positions] bool: a position of a sequence but its last token)`.
    `hidden_index[i, j]`: the flat position predicting response token j of row i (`lm_head.rl_index`).
    Row i's prompt (p tokens) ends at `hidden_index[i, 0]`; its response token m at
    `hidden_index[i, m + 1]` (the last response token predicts nothing and has no record). Rows that
    share a position (one packed prompt) all write it; a position without a record is never written;
    rows without a loss token (the pad row) are left out."""
    src = mb.routed_experts
    out = torch.zeros(positions, *src.shape[2:], dtype=src.dtype)
    sampled = torch.zeros(positions, dtype=torch.bool)
    real = torch.zeros(positions, dtype=torch.bool)
    plen = mb.prompt_lens.tolist()
    rlen = (mb.attention_mask.sum(1) - mb.prompt_lens).tolist()
    for i, (p, r) in enumerate(zip(plen, rlen)):
        if r < 1 or not bool(mb.response_mask[i].any()):  # the pad row (forward.with_pad_row): no record
            continue
        h = hidden_index[i]
        dest = torch.cat([h[0] - (p - 1) + torch.arange(p), h[1:r]])  # positions 0 .. p + r - 2 of the row
        rows = src[i, : p + r - 1]
        have = rows[:, 0, 0] > 0
        out[dest[have]] = rows[have]
        real[dest] = True
        sampled[dest[p:][(mb.response_mask[i, : r - 1] > 0) & have[p:]]] = True
    return out, sampled, real


def _like(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (a local tensor) as `ref` is: a DTensor with `ref`'s mesh and placements, or plain."""
    from torch.distributed.tensor import DTensor

    if isinstance(ref, DTensor):
        return DTensor.from_local(t, ref.device_mesh, ref.placements, run_check=False)
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
