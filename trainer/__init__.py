"""TorchTitan policy / reference / critic trainer on DTensor (FSDP2), one Ray actor per rank.

`TrainerGroup` (group.py) is the public entry point; `TrainerWorker` (worker.py) is one rank and
composes one component per file, TorchTitan style: build.py (policy / reference / critic, with the
declared model converters of converters.py: CPU matmul kernels, the log-prob head), forward.py
(micro-batches and forward passes), update.py (the PPO/GRPO and critic updates), optim.py (AdamW and
the LR schedule), metrics.py (reduction over ranks), checkpoint.py (DCP checkpoints, restart),
lora.py (LoRA adapters: conversion, forward, merge, PEFT names). model.py builds TorchTitan models from HF
folders and writes them back; parallel.py holds mesh/FSDP setup; ops.py
the pure math (chunked log-probs, LR schedule, row splits); the weight sync's sender side is the
`SyncSender` mixin (rl_tpu.weight_sync.sender).
"""

from rl_tpu.trainer.group import TrainerError, TrainerGroup

__all__ = ["TrainerError", "TrainerGroup"]
