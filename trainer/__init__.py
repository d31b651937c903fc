"""TorchTitan policy / reference / critic trainer on DTensor (FSDP2), one Ray actor per rank.

`TrainerGroup` (group.py) is the public entry point; `TrainerWorker` (worker.py) is one rank;
model.py builds TorchTitan models from HF folders; parallel.py holds mesh/FSDP setup; ops.py the
pure math (chunked log-probs, LR schedule, row splits).
"""

from rl_tpu.trainer.group import TrainerError, TrainerGroup

__all__ = ["TrainerError", "TrainerGroup"]
