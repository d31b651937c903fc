"""Policy, value and KL losses as pure tensor functions (names and defaults as verl 0.9.1 `core_algos.py`).

Shapes: `[B, T]` is batch x response tokens; every mask is float or bool with 1 on valid response tokens.

Invariants:
- Micro-batch additivity. The trainer splits one global mini-batch over R ranks x M micro-batches, calls
  `compute_policy_loss` on each, backpropagates each and SUMS gradients. When `global_tokens` (token-mean)
  or `global_seqs` (seq-mean-*) are given, every aggregate returned here is this micro-batch's share of the
  global aggregate, so the sum over all micro-batches equals the loss (and gradient) of the whole batch at
  once. When they are None, the micro-batch's own counts are used (whole batch = one micro-batch).
- `seq-mean-token-sum-norm` divides by a constant `horizon` (Dr.GRPO); it defaults to T of the batch,
  which is only additive across micro-batches when they share T: pass `cfg.loss_scale_factor` (> 0) when
  micro-batches are padded to different lengths.
- Metrics: `loss/*` values are this micro-batch's share (sum them over micro-batches and ranks);
  `actor/*` and `mismatch/*` values are micro-batch-local means (average them), except those in
  `MAX_METRICS`, micro-batch-local maxima (take the max over micro-batches, ranks and updates; a mean of
  them is only a lower bound of the step's max). They are detached 0-dim
  tensors on the loss's device, not floats: reading one (`float(v)`) waits for the device, which on
  XLA/TPU ends the traced graph, so the trainer reads them all at once per optimizer step.
- Importance weights (truncated IS between the inference engine and the trainer) are detached and
  multiply only the per-token policy loss, never the KL or entropy terms.
- Only torch is imported: this module must run where Ray, vLLM and TorchTitan are absent.

Departures from verl: the ratio log is clamped to [-20, 20] as verl does, but fully masked sequences
and empty micro-batches give 0 rather than NaN (counts are clamped to >= 1); GSPO has its own clip
bounds (`gspo_clip_ratio_low/high`, verl's recipe values 3e-4 / 4e-4) instead of sharing PPO's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rl_tpu.config import AlgorithmConfig

# metrics that are a max over the micro-batch's tokens: reduce them with max, not a (token-weighted) mean
MAX_METRICS = frozenset({"mismatch/max_abs_logprob_diff"})
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
ROLLOUT_IS_MODES = ("none", "token", "sequence")


def _unknown(kind: str, name: str, known) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(known))}")


def _check_shapes(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} like {ref_name}"
            )


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over `mask` (any shape); 0 when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_max_abs(x: Tensor, mask: Tensor) -> Tensor:
    """max |x| over `mask` (any shape), detached; 0 when the mask is empty. A masked position never
    counts, whatever it holds (inf or NaN included)."""
    x = x.detach()
    if x.numel() == 0:  # an empty micro-batch (a static shape: no device sync)
        return x.new_zeros(())
    # .max(), not .amax(): torch_xla 2.9 lowers amax() without dims as no reduction at all
    return torch.where(mask != 0, x.abs(), torch.zeros_like(x)).max()


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate, `[B, T]` -> `[B, T]` (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = low_var_kl = exp(-log r) + log r - 1 with log r = log_prob - ref,
    its input clamped to [-20, 20] and its output to [-10, 10] as verl does.
    """
    if kind not in KL_KINDS:
        raise _unknown("kl_loss_type", kind, KL_KINDS)
    log_ratio = log_prob - ref_log_prob
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    neg = torch.clamp(-log_ratio, min=-20.0, max=20.0)  # log(pi_ref / pi)
    # expm1, not exp(x) - 1: for the |x| ~ 1e-5 of two policies that nearly agree, exp(x) in fp32 rounds to
    # 1 +- 6e-8 and the difference (x^2 / 2 ~ 5e-11) was lost: mismatch/k3_kl read exactly 0.0
    return torch.clamp(torch.expm1(neg) - neg, min=-10.0, max=10.0)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    horizon: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss `[B, T]` into a scalar.

    - token-mean: sum(loss * mask) / tokens
    - seq-mean-token-mean: sum over non-empty sequences of (token mean of the sequence) / seqs
    - seq-mean-token-sum-norm: sum over sequences of (token sum of the sequence) / seqs / horizon
    `tokens` / `seqs` are `global_tokens` / `global_seqs` when given (this micro-batch's share of the
    global aggregate), else this batch's valid tokens / non-empty sequences. `horizon` defaults to T.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        tokens = mask.sum().clamp(min=1) if global_tokens is None else global_tokens
        return (loss_mat * mask).sum() / tokens
    if mode not in AGG_MODES:
        raise _unknown("loss_agg_mode", mode, AGG_MODES)
    token_counts = mask.sum(dim=-1)
    seq_sums = (loss_mat * mask).sum(dim=-1)
    seqs = (token_counts > 0).sum().clamp(min=1) if global_seqs is None else global_seqs
    if mode == "seq-mean-token-mean":
        # an empty sequence has sum 0, so dividing by a clamped count leaves it out of the numerator
        return (seq_sums / token_counts.clamp(min=1)).sum() / seqs
    horizon = loss_mat.shape[-1] if horizon is None else horizon
    return seq_sums.sum() / seqs / horizon


def rollout_is_weights(
    old_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, mode: str, threshold: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights pi_old / pi_rollout for the inference/trainer mismatch, `[B, T]`.

    token: w_t = min(exp(old_t - rollout_t), threshold). sequence: w = min(prod_t exp(old_t - rollout_t),
    threshold) over the valid tokens of the sequence, broadcast to its tokens. Masked positions get 1.
    The weights are detached. Metrics: mismatch/kl (k1 estimate of KL(rollout || old), sampled from the
    rollout policy), mismatch/k3_kl, mismatch/max_abs_logprob_diff (max |old - rollout| over the valid
    tokens: per-token parity, which a signed mean can hide), mismatch/is_mean (mean weight before
    truncation, over tokens or sequences) and mismatch/is_clipfrac (fraction truncated).
    """
    if mode not in ROLLOUT_IS_MODES or mode == "none":
        raise _unknown("rollout_is mode", mode, ("token", "sequence"))
    _check_shapes("old_log_prob", old_log_prob, rollout_log_prob=rollout_log_prob, mask=mask)
    with torch.no_grad():
        fmask = mask.to(old_log_prob.dtype)
        log_w = (old_log_prob - rollout_log_prob) * fmask
        metrics = {
            "mismatch/kl": masked_mean(-log_w, fmask).detach(),
            "mismatch/k3_kl": masked_mean(kl_penalty(rollout_log_prob, old_log_prob, "k3"), fmask).detach(),
            "mismatch/max_abs_logprob_diff": masked_max_abs(old_log_prob - rollout_log_prob, fmask),
        }
        if mode == "token":
            raw = torch.exp(torch.clamp(log_w, min=-20.0, max=20.0))
            weights = torch.clamp(raw, max=threshold)
            metrics["mismatch/is_mean"] = masked_mean(raw, fmask).detach()
            metrics["mismatch/is_clipfrac"] = masked_mean((raw > threshold).to(fmask.dtype), fmask).detach()
            weights = torch.where(fmask > 0, weights, torch.ones_like(weights))
        else:
            seq_raw = torch.exp(torch.clamp(log_w.sum(dim=-1), min=-20.0, max=20.0))  # [B]
            seq_valid = (fmask.sum(dim=-1) > 0).to(fmask.dtype)
            metrics["mismatch/is_mean"] = masked_mean(seq_raw, seq_valid).detach()
            metrics["mismatch/is_clipfrac"] = masked_mean(
                (seq_raw > threshold).to(fmask.dtype), seq_valid
            ).detach()
            weights = torch.clamp(seq_raw, max=threshold).unsqueeze(-1).expand_as(log_w).clone()
            weights = torch.where(fmask > 0, weights, torch.ones_like(weights))
    return weights, metrics


def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO-clip surrogate `[B, T]` with asymmetric clip (clip-higher) and dual-clip.

    r = exp(log_prob - old); l = max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0, l = min(l, -A c).
    Metrics: actor/clipfrac (the clipped branch won), actor/clipfrac_lower (dual-clip bound active).
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_c}")
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual = -advantages * clip_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(clip_loss, dual), clip_loss)
    with torch.no_grad():
        metrics = {
            "actor/clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
            "actor/clipfrac_lower": masked_mean(((clip_loss > dual) & negative).float(), mask).detach(),
        }
    return loss, metrics


def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GSPO surrogate `[B, T]` (arXiv 2507.18071): a sequence-level ratio.

    s_i = exp(mean_t (log_prob - old)) is the geometric mean of the token ratios of sequence i; the token
    ratio is s_i,t = sg[s_i] * pi_t / sg[pi_t] (value s_i, gradient through each token), log clamped at 10;
    l = max(-A s_i,t, -A clip(s_i,t, 1 - low, 1 + high)). No dual-clip. Metric: actor/clipfrac.
    """
    fmask = mask.to(log_prob.dtype)
    seq_log_ratio = ((log_prob - old_log_prob) * fmask).sum(-1) / fmask.sum(-1).clamp(min=1)
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        metrics = {"actor/clipfrac": masked_mean((clipped > unclipped).float(), mask).detach()}
    return torch.maximum(unclipped, clipped), metrics


def _vanilla(cfg: AlgorithmConfig, log_prob, old_log_prob, advantages, mask):
    return ppo_clip_loss(
        log_prob, old_log_prob, advantages, mask, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c
    )


def _gspo(cfg: AlgorithmConfig, log_prob, old_log_prob, advantages, mask):
    return gspo_loss(
        log_prob, old_log_prob, advantages, mask, cfg.gspo_clip_ratio_low, cfg.gspo_clip_ratio_high
    )


def _sft(cfg: AlgorithmConfig, log_prob, old_log_prob, advantages, mask):
    """Supervised fine-tuning through the same trainer path: per-token negative log-likelihood of the
    response; `old_log_prob` and `advantages` are ignored (`rl-tpu sft` and the demo's control use it)."""
    return -log_prob, {}


# name -> (cfg, log_prob, old_log_prob, advantages, mask) -> (per-token loss [B, T], metrics)
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "vanilla": _vanilla,
    "gspo": _gspo,
    "sft": _sft,
}

# policy losses whose per-token value is -A x f(ratio): exactly zero wherever the advantage is zero
ADVANTAGE_SCALED = frozenset({"vanilla", "gspo"})


def zero_advantage_inert(cfg: AlgorithmConfig) -> bool:
    """True when a sequence whose advantages are all zero adds exactly nothing to the actor loss or its
    gradient: an advantage-scaled policy loss (times IS weights, also advantage-scaled), no KL loss, no
    entropy bonus. Its tokens still count in the loss's normalisers (`global_tokens`, `global_seqs`)."""
    return cfg.policy_loss in ADVANTAGE_SCALED and not cfg.use_kl_loss and cfg.entropy_coeff == 0


def rows_with_advantage(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """`[B]` bool: the sequences with a nonzero advantage on at least one response token."""
    return ((advantages != 0) & (response_mask != 0)).any(dim=1)


def rows_to_run(advantages: Tensor, response_mask: Tensor, world_size: int) -> Tensor:
    """Indices of the sequences one optimizer step runs when zero-advantage ones are skipped: those with
    an advantage; when none has one, the first `world_size` (one per rank; exactly zero gradient too),
    so the step's token metrics keep a sample instead of vanishing."""
    run = rows_with_advantage(advantages, response_mask).nonzero().squeeze(1)
    return run if len(run) else torch.arange(min(world_size, advantages.shape[0]))


def mini_batch_rows(num_seqs: int, mini_batches: int) -> tuple[Tensor, ...]:
    """Row indices of each of the update's mini-batches (consecutive, sizes differing by at most one)."""
    return torch.arange(num_seqs).tensor_split(mini_batches)


def update_rows(advantages: Tensor, response_mask: Tensor, mini_batches: int, world_size: int) -> Tensor:
    """`rows_to_run` of each of the update's mini-batches (`mini_batch_rows`, as the trainer splits the
    batch), as indices into the whole batch: the rows whose old log-probs the update reads."""
    parts = [
        rows[rows_to_run(advantages[rows], response_mask[rows], world_size)]
        for rows in mini_batch_rows(advantages.shape[0], mini_batches)
    ]
    return torch.cat(parts)


def compute_policy_loss(
    cfg: AlgorithmConfig,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    ref_log_prob: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor loss of one micro-batch: policy surrogate [x IS weight] + KL loss - entropy bonus.

    All tensors are `[B, T]`. `log_prob` (and `entropy`) carry the graph; the others are treated as
    constants. loss = agg(pg * w) + kl_loss_coef * agg(kl_penalty(log_prob, ref)) [if use_kl_loss]
    - entropy_coeff * agg(entropy) [if entropy_coeff > 0], each agg with `cfg.loss_agg_mode` and the
    global normalisers (see the module docstring). Metrics: loss/policy, loss/kl, loss/entropy,
    loss/total, actor/entropy, actor/clipfrac, actor/clipfrac_lower (vanilla), actor/ppo_kl, and
    mismatch/* when `rollout_log_prob` is given (kl, k3_kl, max_abs_logprob_diff; the IS weights' metrics
    too when `cfg.rollout_is` is on).
    """
    if cfg.policy_loss not in POLICY_LOSSES:
        raise _unknown("policy_loss", cfg.policy_loss, POLICY_LOSSES)
    _check_shapes(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        ref_log_prob=ref_log_prob,
        entropy=entropy,
        rollout_log_prob=rollout_log_prob,
    )
    horizon = cfg.loss_scale_factor or None

    def agg(x: Tensor) -> Tensor:
        return agg_loss(
            x,
            response_mask,
            cfg.loss_agg_mode,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            horizon=horizon,
        )

    old_log_prob, advantages = old_log_prob.detach(), advantages.detach()
    pg_mat, metrics = POLICY_LOSSES[cfg.policy_loss](cfg, log_prob, old_log_prob, advantages, response_mask)
    with torch.no_grad():
        metrics["actor/ppo_kl"] = masked_mean(old_log_prob - log_prob, response_mask).detach()
    if cfg.rollout_is != "none":
        if rollout_log_prob is None:
            raise ValueError(f"algorithm.rollout_is={cfg.rollout_is!r} needs rollout_log_prob")
        weights, is_metrics = rollout_is_weights(
            old_log_prob, rollout_log_prob.detach(), response_mask, cfg.rollout_is, cfg.rollout_is_threshold
        )
        pg_mat = pg_mat * weights
        metrics.update(is_metrics)
    elif rollout_log_prob is not None:  # measure the inference/trainer gap even when not correcting it
        with torch.no_grad():
            fmask = response_mask.to(old_log_prob.dtype)
            metrics["mismatch/kl"] = masked_mean(
                (rollout_log_prob.detach() - old_log_prob) * fmask, fmask
            ).detach()
            metrics["mismatch/k3_kl"] = masked_mean(
                kl_penalty(rollout_log_prob.detach(), old_log_prob, "k3"), fmask
            ).detach()
            metrics["mismatch/max_abs_logprob_diff"] = masked_max_abs(
                rollout_log_prob.detach() - old_log_prob, fmask
            )
    loss = agg(pg_mat)
    metrics["loss/policy"] = loss.detach()
    if cfg.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("algorithm.use_kl_loss=true needs ref_log_prob (enable trainer.reference)")
        kl = agg(kl_penalty(log_prob, ref_log_prob.detach(), cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl
        metrics["loss/kl"] = kl.detach()
    if entropy is not None:
        with torch.no_grad():
            metrics["actor/entropy"] = masked_mean(entropy, response_mask).detach()
    if cfg.entropy_coeff > 0:
        if entropy is None:
            raise ValueError(f"algorithm.entropy_coeff={cfg.entropy_coeff} needs the token entropy")
        ent = agg(entropy)
        loss = loss - cfg.entropy_coeff * ent
        metrics["loss/entropy"] = ent.detach()
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def compute_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    *,
    global_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, token-mean: 0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)).

    `values` `[B, T]` carries the graph; `old_values` and `returns` are constants. Metrics: loss/value
    (this micro-batch's share), critic/vf_clipfrac, critic/vpred_mean.
    """
    _check_shapes("values", values, old_values=old_values, returns=returns, response_mask=response_mask)
    old_values, returns = old_values.detach(), returns.detach()
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    l1 = (values - returns).square()
    l2 = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), response_mask, "token-mean", global_tokens=global_tokens)
    with torch.no_grad():
        metrics = {
            "loss/value": loss.detach(),
            "critic/vf_clipfrac": masked_mean((l2 > l1).float(), response_mask).detach(),
            "critic/vpred_mean": masked_mean(values, response_mask).detach(),
        }
    return loss, metrics


def apply_kl_in_reward(
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    mask: Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[Tensor, dict[str, float]]:
    """Token rewards with an in-reward KL penalty: scores - kl_coef * kl_penalty(log_prob, ref) * mask.

    All `[B, T]`; `log_prob` is the rollout-time (old) policy. Returns (token_level_rewards, metrics) with
    actor/reward_kl_penalty (mean over sequences of each sequence's token-mean KL) and its coefficient.
    """
    _check_shapes(
        "token_level_scores", token_level_scores, log_prob=log_prob, ref_log_prob=ref_log_prob, mask=mask
    )
    with torch.no_grad():
        fmask = mask.to(token_level_scores.dtype)
        kld = kl_penalty(log_prob, ref_log_prob, kind) * fmask
        seq_kl = kld.sum(-1) / fmask.sum(-1).clamp(min=1)
        metrics = {"actor/reward_kl_penalty": seq_kl.mean().item(), "actor/reward_kl_penalty_coeff": kl_coef}
        return token_level_scores - kl_coef * kld, metrics
