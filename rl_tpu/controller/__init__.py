"""The controller: the RL loop (`loop.train`), the roles it starts, the producer of rollout batches, held-out
evaluation, checkpoints, the pre-run checks and supervised fine-tuning. Imports the roles and the foundation,
never the commands."""
