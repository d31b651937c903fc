"""Advantage estimators as pure tensor functions (names and defaults as verl 0.9.1 `core_algos.py`).

Shapes: `token_level_rewards`, `response_mask`, `values` are `[B, T]` (batch x response tokens, mask 1
on valid tokens); `group_index` is `[B]` int64, equal for the samples of one prompt.

Invariants:
- Every estimator returns `(advantages [B, T], returns [B, T])`, zero on masked tokens, computed without
  gradient; the caller passes the whole rollout batch (group and batch statistics need all of it).
- Outcome estimators (grpo, dr_grpo, rloo) use the sequence score `sum_t token_level_rewards` and
  broadcast one advantage over the valid tokens; their `returns` equal the advantages, as in verl.
- Group statistics follow verl: a group of one sample has mean 0 and std 1; std is the unbiased one.
- Batch whitening (gae, reinforce_plus_plus) uses the masked mean and the unbiased masked variance of the
  whole batch, `(x - mean) / sqrt(var + 1e-8)`.

Departures from verl: GAE advantages are zeroed on masked tokens after whitening (verl leaves whitened
garbage there; no loss reads it); `dr_grpo` is its own name here (verl spells it grpo with
`norm_adv_by_std_in_grpo=False`), and `grpo` honours that flag too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rl_tpu.config import AlgorithmConfig

GRPO_EPS = 1e-6  # verl's epsilon in (score - mean) / (std + eps)


def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, mean and unbiased std of `scores` `[B]` over `group_index` `[B]`."""
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index has shape {tuple(group_index.shape)}, expected {tuple(scores.shape)}")
    _, inverse = torch.unique(group_index.to(scores.device), return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (scores - mean[inverse]).square())
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[inverse], mean[inverse], std[inverse]


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the masked mean and unbiased masked variance of all of `x`."""
    mask = mask.to(x.dtype)
    n = mask.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 valid tokens, got {int(n.item())}")
    mean = (x * mask).sum() / n
    var = ((x - mean).square() * mask).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def grpo_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor, *, norm_by_std: bool = True
) -> tuple[Tensor, Tensor]:
    """GRPO: A_i = (s_i - mean_g) / (std_g + 1e-6), or s_i - mean_g without std (Dr.GRPO)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        _, mean, std = _group_stats(scores, group_index)
        adv = scores - mean
        if norm_by_std:
            adv = adv / (std + GRPO_EPS)
        adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


def rloo_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor
) -> tuple[Tensor, Tensor]:
    """RLOO: A_i = s_i - mean of the other samples of the group = n/(n-1) (s_i - mean_g); s_i when n = 1."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        count, mean, _ = _group_stats(scores, group_index)
        scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
        adv = (scores - mean) * scale  # singletons: mean is 0 and the score passes through
        adv = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return adv, adv


def reinforce_plus_plus_advantages(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go G_t (masked tokens carry G through), whitened over the batch."""
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            new = token_level_rewards[:, t] + gamma * running
            returns[:, t] = new * mask[:, t]
            running = torch.where(mask[:, t] > 0, new, running)
        adv = masked_whiten(returns, mask) * mask
    return adv, returns


def gae_advantages(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; returns = A + V.

    Masked tokens are skipped: V_{t+1} and A_{t+1} are those of the next valid token. Advantages are then
    whitened over the batch; returns are not.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        next_value = torch.zeros_like(values[:, 0])
        next_adv = torch.zeros_like(values[:, 0])
        adv = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            a_t = delta + gamma * lam * next_adv
            valid = mask[:, t] > 0
            next_value = torch.where(valid, values[:, t], next_value)
            next_adv = torch.where(valid, a_t, next_adv)
            adv[:, t] = next_adv
        returns = adv + values
        adv = masked_whiten(adv, mask) * mask
    return adv, returns


def _grpo(cfg: AlgorithmConfig, rewards, mask, group_index, values):
    return grpo_advantages(rewards, mask, group_index, norm_by_std=cfg.norm_adv_by_std_in_grpo)


def _dr_grpo(cfg: AlgorithmConfig, rewards, mask, group_index, values):
    return grpo_advantages(rewards, mask, group_index, norm_by_std=False)


def _rloo(cfg: AlgorithmConfig, rewards, mask, group_index, values):
    return rloo_advantages(rewards, mask, group_index)


def _reinforce_pp(cfg: AlgorithmConfig, rewards, mask, group_index, values):
    return reinforce_plus_plus_advantages(rewards, mask, cfg.gamma)


def _gae(cfg: AlgorithmConfig, rewards, mask, group_index, values):
    if values is None:
        raise ValueError("algorithm.adv_estimator='gae' needs values from a critic (trainer.critic=true)")
    return gae_advantages(rewards, values, mask, cfg.gamma, cfg.lam)


# name -> (cfg, token_level_rewards, response_mask, group_index, values) -> (advantages, returns)
ADV_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
    "gae": _gae,
}


def compute_advantages(
    cfg: AlgorithmConfig,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns `[B, T]` with the estimator `cfg.adv_estimator` (see `ADV_ESTIMATORS`)."""
    if cfg.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"unknown adv_estimator {cfg.adv_estimator!r}; known: {', '.join(sorted(ADV_ESTIMATORS))}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)}, expected {tuple(token_level_rewards.shape)}"
        )
    if values is not None and values.shape != token_level_rewards.shape:
        raise ValueError(
            f"values has shape {tuple(values.shape)}, expected {tuple(token_level_rewards.shape)}"
        )
    if group_index.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"group_index has shape {tuple(group_index.shape)}, expected ({token_level_rewards.shape[0]},)"
        )
    return ADV_ESTIMATORS[cfg.adv_estimator](cfg, token_level_rewards, response_mask, group_index, values)
