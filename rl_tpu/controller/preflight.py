"""Preflight: the trainer runs the largest batch a step can bring once, before step 1.

Why: a step's memory follows its longest batch, and RL batches change length every step, so the largest
may come hundreds of steps into a run. An out-of-memory there costs the run; on CPU each new largest
batch also raises the trainer's heap high-water mark (glibc keeps memory a step frees for the next one,
`rl_tpu.devices._init_cpu`), which a long run reads as a slow leak. Run first, the worst case is paid at
once: an out-of-memory stops the run before step 1, and the trainer's memory stays flat afterwards
(docs/decisions.md; the soaks that measured it are in bench/RESULTS.md).

The batch: `data.batch_size x rollout.n` rows, each the data set's longest prompt followed by the whole
response budget, random token ids, each prompt shared by the `rollout.n` rows of its group as in every
step's batch (where the trainer packs shared prompts, a group's prompt runs once) and by no other row;
a multi-turn run's prompts differ between turns, so there no row shares its prompt. It runs the passes
a step runs: the pre-update log-probs (and the reference's, the critic's values where configured), then
the update's forward and backward over every row in its micro-batches. No optimizer step is taken and
the gradients are dropped (`TrainerWorker.preflight`): weights, optimizer state, step counters and
metrics are as they were. The loop runs it while the engines start (`start_shared_roles`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rl_tpu.config import Config, response_budget
from rl_tpu.types import TrainBatch

log = logging.getLogger(__name__)


def largest_batch(
    rows: int, prompt_len: int, response_len: int, vocab_size: int, seed: int = 0, group_size: int = 1
) -> TrainBatch:
    """A TrainBatch of `rows` full-length rows: `prompt_len` prompt tokens, `response_len` response tokens
    (all in the loss), random ids below `vocab_size`, random advantages (non-zero, so no row is skipped).
    Consecutive rows share their prompt in groups of `group_size` (a GRPO group); no two groups do."""
    if min(rows, prompt_len, response_len, vocab_size, group_size) < 1:
        raise ValueError(
            f"preflight batch needs positive sizes, got rows={rows}, prompt_len={prompt_len}, "
            f"response_len={response_len}, vocab_size={vocab_size}, group_size={group_size}"
        )
    g = torch.Generator().manual_seed(seed)
    length = prompt_len + response_len
    zeros = torch.zeros(rows, response_len)
    log_probs = torch.full((rows, response_len), -1.0)
    ids = torch.randint(0, vocab_size, (rows, length), generator=g)
    ids[:, :prompt_len] = ids[torch.arange(rows) // group_size * group_size, :prompt_len]
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        prompt_lens=torch.full((rows,), prompt_len, dtype=torch.long),
        response_mask=torch.ones(rows, response_len),
        old_log_probs=log_probs,
        rollout_log_probs=log_probs.clone(),
        policy_versions=zeros.clone(),
        advantages=torch.randn(rows, response_len, generator=g).add_(0.5),
        returns=zeros.clone(),
        values=zeros.clone(),
    )


def run_preflight(cfg: Config, trainer: Any, longest_prompt: int, vocab_size: int) -> float:
    """Run the largest batch through `trainer` (a TrainerGroup) as a step would, changing nothing;
    returns the seconds it took. An out-of-memory surfaces here as the trainer's error. Its prompts are
    `longest_prompt` tokens, the data set's longest; a multi-turn run's prompts come from its environment,
    so their bound is `data.max_prompt_length`."""
    t0 = time.perf_counter()
    multi_turn = bool(cfg.rollout.env or cfg.rollout.tools)
    prompt_len = cfg.data.max_prompt_length if multi_turn else longest_prompt
    rows, response_len = cfg.data.batch_size * cfg.rollout.n, response_budget(cfg)
    batch = largest_batch(
        rows, prompt_len, response_len, vocab_size, group_size=1 if multi_turn else cfg.rollout.n
    )
    trainer.compute_log_probs(batch)
    if cfg.trainer.reference:
        trainer.compute_ref_log_probs(batch)
    if cfg.trainer.critic:
        trainer.compute_values(batch)
    trainer.preflight(batch, cfg.algorithm)
    seconds = time.perf_counter() - t0
    log.info(
        "preflight: %d rows of %d + %d tokens through the trainer in %.1f s",
        rows,
        prompt_len,
        response_len,
        seconds,
    )
    return seconds
