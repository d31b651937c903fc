"""Optimizer and LR schedule of a trained model (the policy, the critic).

Invariants:
- AdamW over the parameters that require a gradient; the LR schedule (`ops.lr_factor`: warmup, then
  constant or cosine) advances once per optimizer step, over
  `total_steps x ppo_epochs x ppo_mini_batches` steps.
- Lazy-tensor devices (XLA): the optimizer state exists (zeros) before the first step, so the first
  step traces the same program as every later one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rl_tpu.config import TrainerConfig
from rl_tpu.trainer import ops


class Trained(NamedTuple):
    """A model that trains, with its optimizer and LR schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build_optimizer(
    model: torch.nn.Module, lr: float, tc: TrainerConfig, lazy_tensors: bool = False
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW at `lr` with `tc`'s betas and weight decay, and its LR schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay, eps=1e-8)
    if lazy_tensors:
        zero_adamw_state(opt)
    total = max(tc.total_steps * tc.ppo_epochs * tc.ppo_mini_batches, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: ops.lr_factor(
            s,
            warmup_steps=tc.warmup_steps,
            total_steps=total,
            schedule=tc.lr_schedule,
            min_lr_ratio=tc.min_lr_ratio,
        ),
    )
    return opt, sched


def zero_adamw_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter the AdamW state its first step would create (step 0, zero moments), through
    `load_state_dict`: the first step then traces the same program as every later one. Same values as
    a fresh state, so the same update."""
    sd = opt.state_dict()
    ids = [i for g in sd["param_groups"] for i in g["params"]]  # state_dict's indices, in param order
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {
        i: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        for i, p in zip(ids, params)
    }
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
