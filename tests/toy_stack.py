"""What the real-stack weight-sync tests share: a small config (engines with 1 GB of KV cache, 256-token
contexts, a high learning rate so one step moves the weights) and a toy batch of four sequences with
advantages of both signs over a tiny model's vocabulary."""

from __future__ import annotations

import torch

from rl_tpu.config import Config, load_config
from rl_tpu.types import TrainBatch

TOL = 1e-5  # fp32 log-prob parity, trainer vs engine
# a reward file a randomly initialised tiny model learns within a few GRPO steps: the share of digit
# characters in the response (digits are 10 of the 512 tokens, so groups always have variance)
DIGITS_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    return sum(ch.isdigit() for ch in solution_str[:64]) / 16.0
"""
PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7], [300, 301, 2, 9, 11, 12]]
# metrics that measure time or memory: a resumed run reproduces every metric but these
WALL_CLOCK_METRICS = {
    "time/startup",
    "time/rollout",
    "time/generate",
    "time/reward",
    "time/train",
    "time/sync",
    "time/eval",
    "time/step",
    "time/trainer_idle",
    "time/engine_idle",
    "throughput/tokens_per_s",
    "sync/seconds",
    "perf/train_s",
    "memory/trainer_rss_mb",
    "memory/engine_rss_mb",
    "memory/driver_rss_mb",
}


def small_cfg(*overrides: str) -> Config:
    return load_config(
        None,
        [
            "--trainer.lr=1e-3",
            "--trainer.micro_batch_size=4",
            "--rollout.max_model_len=256",
            "--rollout.kv_cache_gb=1",
            *overrides,
        ],
    )


def toy_batch(seed: int = 0, high: int = 500) -> TrainBatch:
    """Four sequences of token ids in [5, high), prompts of 3/5/2/7 and responses of 4/2/6/3 tokens."""
    g = torch.Generator().manual_seed(seed)
    plens, rlens = [3, 5, 2, 7], [4, 2, 6, 3]
    P = [torch.randint(5, high, (n,), generator=g).tolist() for n in plens]
    R = [torch.randint(5, high, (n,), generator=g).tolist() for n in rlens]
    return TrainBatch.from_sequences(P, R, pad_id=3, advantages=[1.0, -1.0, 0.5, -0.5])


def hf_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    """Per-token log-probs of the response tokens under a transformers model, `[B, T]` (0 past the end);
    differentiable (call it under `torch.no_grad()` where no gradient is wanted)."""
    out = torch.zeros_like(batch.response_mask)
    for i in range(batch.input_ids.shape[0]):
        n, r = int(batch.attention_mask[i].sum()), int(batch.response_mask[i].sum())
        ids = batch.input_ids[i, :n]
        lp = torch.log_softmax(model(ids[None]).logits[0, n - r - 1 : n - 1].float(), dim=-1)
        out[i, :r] = lp.gather(-1, ids[n - r :, None])[:, 0]
    return out
