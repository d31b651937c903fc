"""What the real-stack weight-sync tests share: a small config (engines with 1 GB of KV cache, 256-token
contexts, a high learning rate so one step moves the weights) and a toy batch of four sequences with
advantages of both signs over a tiny model's vocabulary."""

from __future__ import annotations

import torch

from rl_tpu.config import Config, load_config
from rl_tpu.types import TrainBatch

TOL = 1e-5  # fp32 log-prob parity, trainer vs engine
PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7], [300, 301, 2, 9, 11, 12]]


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
