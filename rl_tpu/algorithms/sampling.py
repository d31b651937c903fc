"""DAPO batch shaping as pure tensor functions: dynamic sampling filter and soft overlong penalty.

Shapes: `[B]` per sample; `group_index` is int64, equal for the samples of one prompt.

Invariants:
- `keep_groups_with_variance` keeps or drops whole groups, never part of one: a group is kept when its
  scores are not all equal, or when it has a single sample (verl's DAPO filter keeps those too). The
  controller refills dropped groups for up to `algorithm.max_refill_rounds` rounds.
- `overlong_penalty` is <= 0, 0 up to `max_tokens - buffer_len` tokens, then falls linearly to `-factor`
  at `max_tokens` (DAPO eq. 13); it is added to the sequence score before advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor


def keep_groups_with_variance(scores: Tensor, group_index: Tensor) -> Tensor:
    """Bool `[B]`: True for the samples of groups whose scores vary (or that have one sample)."""
    if scores.dim() != 1 or group_index.shape != scores.shape:
        raise ValueError(
            f"scores and group_index must both be [B]; got {tuple(scores.shape)} and {tuple(group_index.shape)}"
        )
    _, inverse = torch.unique(group_index.to(scores.device), return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    # max != min is exact in any dtype, unlike std > 0 after floating-point cancellation
    hi = torch.full((n_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    lo = torch.full((n_groups,), torch.inf, dtype=scores.dtype, device=scores.device)
    hi = hi.scatter_reduce(0, inverse, scores, reduce="amax")
    lo = lo.scatter_reduce(0, inverse, scores, reduce="amin")
    count = torch.zeros(n_groups, dtype=torch.int64, device=scores.device).index_add_(
        0, inverse, torch.ones_like(inverse)
    )
    keep_group = (hi > lo) | (count == 1)
    return keep_group[inverse]


def overlong_penalty(response_lengths: Tensor, max_tokens: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO soft overlong punishment `[B]`: min(0, -(len - (max_tokens - buffer_len)) / buffer_len * factor).

    `buffer_len` 0 disables it (all zeros). Needs 0 <= buffer_len <= max_tokens.
    """
    if not 0 <= buffer_len <= max_tokens:
        raise ValueError(f"overlong_buffer_len={buffer_len} must be in [0, max_tokens={max_tokens}]")
    lengths = response_lengths.to(
        torch.get_default_dtype() if not response_lengths.is_floating_point() else response_lengths.dtype
    )
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    exceed = lengths - (max_tokens - buffer_len)
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)
