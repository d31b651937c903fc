"""Pure glue between the rollout and the trainer: completions + scores -> a padded TrainBatch.

Invariants: rows are ordered prompt-major (all samples of prompt 0, then prompt 1, ...); `group_index[i]`
is the prompt's position in the step, so advantage estimators group a prompt's samples; a sequence's
scalar score sits on its last response token (`token_level_scores`), as verl places it. Every response
token carries the policy version that sampled it (`TrainBatch.policy_versions`) beside its behaviour
log-prob (`rollout_log_probs`): a partial rollout's row mixes versions. An MoE model's engine experts
(`Completion.routed_experts`) become `TrainBatch.routed_experts`, laid out like `input_ids`, where every
completion has them for its whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_tpu.types import Completion, TrainBatch


@dataclass(kw_only=True)
class RolloutBatch:
    batch: TrainBatch  # input_ids, masks, rollout_log_probs
    group_index: torch.Tensor  # [B] int64
    scores: torch.Tensor  # [B] sequence-level reward
    token_level_scores: torch.Tensor  # [B, T] the score on each sequence's last response token
    response_lengths: torch.Tensor  # [B]
    policy_versions: torch.Tensor  # [B] version that sampled each row's first token (its oldest)


def flatten(groups: list[list[Completion]]) -> list[Completion]:
    return [c for group in groups for c in group]


def build_rollout_batch(groups: list[list[Completion]], scores: list[float], pad_id: int) -> RolloutBatch:
    flat = flatten(groups)
    if len(flat) != len(scores):
        raise ValueError(f"{len(flat)} completions but {len(scores)} scores")
    # an empty response (immediate EOS trimmed by the engine) still needs one token for the loss
    # mask to be meaningful; vLLM returns the EOS token itself, so this only guards odd engines.
    responses = [c.response_ids for c in flat]
    # the engine's log-probs where it was asked for them (`rollout.calculate_log_probs`)
    with_lp = all(len(c.logprobs) == len(c.response_ids) for c in flat)
    per_token = {"rollout_log_probs": [list(c.logprobs) for c in flat]} if with_lp else {}
    per_token["policy_versions"] = [c.versions() for c in flat]
    if any(c.loss_mask for c in flat):  # multi-turn: inserted tokens carry no loss
        per_token["response_mask"] = [list(c.loss_mask) or [1] * len(c.response_ids) for c in flat]
    batch = TrainBatch.from_sequences([c.prompt_ids for c in flat], responses, pad_id, **per_token)
    batch = batch.replace(routed_experts=routed_experts(flat, batch.input_ids.shape[1]))
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    score_t = torch.tensor(scores, dtype=torch.float32)
    token_scores = torch.zeros_like(batch.response_mask)
    rows = torch.arange(len(flat))
    last = (lengths - 1).clamp(min=0)
    token_scores[rows, last] = score_t * (lengths > 0)
    group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g], dtype=torch.long)
    versions = torch.tensor([c.policy_version for c in flat], dtype=torch.long)
    return RolloutBatch(
        batch=batch,
        group_index=group_index,
        scores=score_t,
        token_level_scores=token_scores,
        response_lengths=lengths,
        policy_versions=versions,
    )


def routed_experts(flat: list[Completion], L: int) -> torch.Tensor | None:
    """`[B, L, layers, k]` int16 from each completion's `routed_experts` (`[prompt + response - 1, layers,
    k]`), zero-padded (0 = no record); None unless every completion carries them for its whole sequence
    (a dense model; completions stitched from several engine calls, as partial rollouts are)."""
    recs = [c.routed_experts for c in flat]
    if any(
        r is None or r.shape[0] != len(c.prompt_ids) + len(c.response_ids) - 1 for r, c in zip(recs, flat)
    ):
        return None
    if len({tuple(r.shape[1:]) for r in recs}) != 1:
        shapes = sorted({tuple(r.shape[1:]) for r in recs})
        raise ValueError(f"completions carry routed experts of different shapes: {shapes}")
    out = torch.zeros(len(recs), L, *recs[0].shape[1:], dtype=torch.int16)
    for i, r in enumerate(recs):
        out[i, : r.shape[0]] = r
    return out


def staleness_metrics(batch: TrainBatch, trainer_version: int) -> dict[str, float]:
    """Over the response tokens of `batch` (`policy_versions` set): `rollout/staleness_mean` and
    `rollout/staleness_max`, in versions behind `trainer_version` (the version the update starts from),
    and `rollout/partial_fraction`: the share of tokens sampled by a newer version than their sequence's
    first token (generated after a weight update of their own sequence)."""
    mask = batch.response_mask > 0
    versions = batch.policy_versions
    if versions is None or not bool(mask.any()):
        return {}
    behind = (trainer_version - versions)[mask]
    first = versions[:, :1].expand_as(versions)
    return {
        "rollout/staleness_mean": behind.float().mean().item(),
        "rollout/staleness_max": behind.max().item(),
        "rollout/partial_fraction": (versions > first)[mask].float().mean().item(),
    }
