"""`TrainerGroup`: N `TrainerWorker` Ray actors forming one torch.distributed group, driven by fan-out calls.

Invariants:
- Rank r is actor r; results come back in rank order. Given `placement` (rl_tpu.placement), rank r
  runs in its trainer bundle with the bundle's CPUs and accelerator share. Without one the group
  reserves its own placement group (one bundle of `trainer.num_threads` CPUs and the device's Ray
  accelerator per rank; removed in `shutdown()`), so Ray starts all ranks or none: a rank left pending
  would block the others in the rendezvous until torch.distributed's 600 s timeout. A cluster too small
  fails at once, resources held by live actors after `RESOURCE_WAIT_S` (`PlacementError`, a UserError).
- Rendezvous on 127.0.0.1 and a free port chosen here; when the placement spreads the ranks over
  several nodes, on rank 0's node IP instead (the port is still chosen on the driver's host).
- A batch is put in the object store once and every rank reads the whole batch (see worker.py);
  per-row results (log-probs, values) are reassembled here in batch order.
- `policy_version` is the version of the weights the ranks hold: 0 as loaded from the model folder,
  one more after each `train_step`. It is the run's one policy version: the weight sync stamps the
  engines with it, the loop's staleness and checkpoints read it.
- A dead actor or an exception in one rank raises `TrainerError` naming the rank and the method; the
  group is then unusable (the other ranks may be blocked in a collective): call `shutdown()`.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from rl_tpu.cluster import actor_death_summary
from rl_tpu.config import AlgorithmConfig, Config, TrainerConfig
from rl_tpu.devices import get_device
from rl_tpu.placement import PlacementGroups, plan_trainers
from rl_tpu.types import TrainBatch
from rl_tpu.weight_sync.specs import ParamSpec


class TrainerError(RuntimeError):
    """A trainer rank died or raised; `rank` and `method` say where."""

    def __init__(self, rank: int, method: str, cause: BaseException):
        self.rank, self.method, self.cause = rank, method, cause
        self.died = type(cause).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
        what, detail = ("died", actor_death_summary(cause)) if self.died else ("failed", cause)
        super().__init__(f"trainer rank {rank} {what} in {method}(): {detail}")


_PORT_ATTEMPTS = 3
# after a rank's error, how long the others get to show whether one of them died (the cause to name)
DEATH_GRACE_S = 10.0
RESOURCE_WAIT_S = 60.0  # how long a group outside the loop's placement waits for Ray to reserve its ranks


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerGroup:
    def __init__(
        self,
        cfg: Config,
        model_path: str,
        world_size: int | None = None,
        placement: PlacementGroups | None = None,
    ):
        import ray

        from rl_tpu.trainer.worker import TrainerWorker

        self._worker = TrainerWorker  # the class whose methods `_call` runs on every rank, by reference
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"TrainerGroup: model folder {model_path!r} has no config.json")
        self.cfg, self.model_path = cfg, str(model_path)
        self.policy_version = 0
        self.world_size = int(world_size or cfg.trainer.world_size)
        if self.world_size < 1:
            raise ValueError(f"TrainerGroup: world_size must be >= 1, got {self.world_size}")
        if not ray.is_initialized():
            from rl_tpu.cluster import init_ray

            init_ray(num_cpus=cfg.cluster.num_cpus or None, include_dashboard=False, log_to_driver=False)
        from rl_tpu.devices.roles import add_env_vars, role_options

        env = role_options(cfg.trainer.python, "trainer.python")  # the trainer's own environment, if any
        from rl_tpu.devices import cpu_process_env, torch_tpu_launch_env

        env_vars = cpu_process_env() if cfg.trainer.device == "cpu" else {}  # every rank starts with them
        self._own_placement: PlacementGroups | None = None
        if placement is None:
            placement = self._own_placement = PlacementGroups(
                plan_trainers(
                    accelerator=get_device(cfg.trainer.device).ray_resource,
                    world_size=self.world_size,
                    trainer_threads=cfg.trainer.num_threads,
                    trainer_resources=cfg.cluster.trainer_resources,
                ),
                timeout_s=RESOURCE_WAIT_S,
            )
        cls = ray.remote(TrainerWorker)
        port, addr = _free_port(), "127.0.0.1"
        slots = placement.plan.role("trainer")
        if len(slots) != self.world_size:
            raise ValueError(
                f"TrainerGroup: the placement has {len(slots)} trainer slots, not {self.world_size}"
            )
        options = [placement.options(s) for s in slots]
        nodes = placement.bundle_nodes()
        rank_nodes = [nodes[(s.group, s.bundle)] for s in slots]
        if len(set(rank_nodes)) > 1:
            addr = placement.node_ips[rank_nodes[0]]
        if cfg.trainer.device == "tpu":  # torch-tpu: every rank gets the same launch variables, decided here
            try:
                env_vars.update(
                    torch_tpu_launch_env(
                        cfg.trainer.python or sys.executable,
                        self.world_size,
                        rank_hosts=[placement.node_ips[n] for n in rank_nodes],
                        driver_host=ray.util.get_node_ip_address(),
                    )
                )
            except RuntimeError:
                if self._own_placement is not None:
                    self._own_placement.remove()
                raise
        add_env_vars(env, env_vars)
        for attempt in range(_PORT_ATTEMPTS):
            self.actors = [
                cls.options(**options[r], **env).remote(cfg, self.model_path, r, self.world_size, addr, port)
                for r in range(self.world_size)
            ]
            try:
                self.info = self._call(self._worker.ready)
                break
            except TrainerError as e:
                self._kill_actors()
                # The port was free when picked but another process bound it before rank 0's store did
                # (seen with parallel Ray jobs on one host): start the ranks again on a new port.
                if "EADDRINUSE" not in str(e) or attempt == _PORT_ATTEMPTS - 1:
                    self.shutdown()  # the caller gets no group to shut down
                    raise
                port = _free_port()

    # ------------------------------------------------------------------ fan-out

    def _call(self, method: Callable, *args, ranks: Sequence[int] | None = None, **kwargs) -> list:
        """`method(*args, **kwargs)` (a `TrainerWorker` method) on every rank (or on `ranks`); results in
        rank order. A rank's failure is raised as `TrainerError` naming it."""
        import ray

        ranks = range(len(self.actors)) if ranks is None else ranks
        name = method.__name__
        refs = [getattr(self.actors[r], name).remote(*args, **kwargs) for r in ranks]
        rank_of = {ref.hex(): r for ref, r in zip(refs, ranks)}
        pending, results = list(refs), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                rank = rank_of[ref.hex()]
                try:
                    results[rank] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - re-raised with the rank attached
                    raise self._root_cause(TrainerError(rank, name, e), pending, rank_of) from e
        return [results[r] for r in ranks]

    @staticmethod
    def _root_cause(error: TrainerError, pending: list, rank_of: dict) -> TrainerError:
        """`error`, or a dead rank's when another rank died: a rank whose peer died fails in the collective
        it shared with it, often before Ray reports the death, and the dead rank is what to name."""
        import ray

        if error.died or not pending:
            return error
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - only a death replaces the first error
                died = TrainerError(rank_of[ref.hex()], error.method, e)
                if died.died:
                    return died
        return error

    def _put(self, batch: TrainBatch):
        import ray

        if not isinstance(batch, TrainBatch):
            raise TypeError(f"expected a TrainBatch, got {type(batch).__name__}")
        return ray.put(batch)

    @staticmethod
    def _assemble(batch: TrainBatch, per_rank: list, n_out: int) -> list[torch.Tensor]:
        B, T = batch.num_seqs, batch.response_len
        outs = [torch.zeros(B, T) for _ in range(n_out)]
        for rank_res in per_rank:
            for idx, tensors in rank_res:
                keep = idx < B  # drop the padding row
                for o, t in zip(outs, tensors):
                    o[idx[keep]] = t[keep]
        return outs

    # ------------------------------------------------------------------ public API

    def compute_log_probs(self, batch: TrainBatch, entropy: bool = False, rows: torch.Tensor | None = None):
        """Log-probs `[B, T]` of the response tokens (and entropy `[B, T]` when `entropy=True`).
        Positions outside `response_mask` hold unspecified values. With `rows` (indices) only those
        sequences are run, split over the ranks; the other rows hold zeros."""
        res = self._assemble(
            batch,
            self._call(self._worker.compute_log_probs, self._put(batch), entropy, rows),
            2 if entropy else 1,
        )
        return (res[0], res[1]) if entropy else res[0]

    def compute_ref_log_probs(self, batch: TrainBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The reference model's log-probs, as `compute_log_probs` (`rows`: the same)."""
        return self._assemble(
            batch, self._call(self._worker.compute_ref_log_probs, self._put(batch), rows), 1
        )[0]

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self._assemble(batch, self._call(self._worker.compute_values, self._put(batch)), 1)[0]

    def train_step(self, batch: TrainBatch, algo_cfg: AlgorithmConfig) -> dict[str, float]:
        """One update (PPO epochs over mini-batches); the weights become the next policy version."""
        per_rank = self._call(self._worker.train_step, self._put(batch), algo_cfg)
        metrics = per_rank[0]  # the loss metrics are all-reduced: every rank has the same
        for key in [k for k in metrics if k.startswith("memory/")]:  # each rank its own: the largest
            metrics[key] = max(m[key] for m in per_rank)
        self.policy_version += 1
        return metrics

    def preflight(self, batch: TrainBatch, algo_cfg: AlgorithmConfig) -> None:
        """The update's forward and backward over `batch` on every rank, changing nothing (weights,
        optimizer state, policy version): rl_tpu/controller/preflight.py."""
        self._call(self._worker.preflight, self._put(batch), algo_cfg)

    def policy_grads(self, batch: TrainBatch, algo_cfg: AlgorithmConfig, with_metrics: bool = False):
        """Full policy-loss gradient (TorchTitan names) over the whole batch, without an optimizer step;
        with `with_metrics`, also the loss metrics `train_step` would report: (grads, metrics)."""
        grads, metrics = self._call(self._worker.policy_grads, self._put(batch), algo_cfg)[0]
        return (grads, metrics) if with_metrics else grads

    def save_checkpoint(self, path: str) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        return self._call(self._worker.save_checkpoint, str(path))[0]

    def load_checkpoint(self, path: str, policy_version: int | None = None) -> int:
        """Restore model, optimizer, scheduler, step and RNG; returns the policy's optimizer step. The
        loop passes the `policy_version` the checkpoint was saved at (None: leave it as it is)."""
        step = self._call(self._worker.load_checkpoint, str(path))[0]
        if policy_version is not None:
            self.policy_version = int(policy_version)
        return step

    def restart_from(self, model_path: str, trainer_cfg: TrainerConfig | None = None) -> None:
        """Every rank takes `model_path`'s weights with a fresh optimizer (`TrainerWorker.restart_from`),
        set up from `trainer_cfg` when given (its optimizer, schedule and batching; the fields that shape
        the processes must equal the group's: ValueError naming them otherwise, checked here first)."""
        if trainer_cfg is not None:
            from rl_tpu.trainer.checkpoint import check_restartable

            check_restartable(self.cfg.trainer, trainer_cfg, "TrainerGroup.restart_from")
        self._call(self._worker.restart_from, str(model_path), trainer_cfg)
        self.model_path, self.policy_version = str(model_path), 0
        if trainer_cfg is not None:
            self.cfg = dataclasses.replace(self.cfg, trainer=trainer_cfg)

    def export_hf(self, out_dir: str) -> str:
        return self._call(self._worker.export_hf, str(out_dir))[0]

    def export_adapter(self, out_dir: str) -> str:
        """The LoRA adapters as a PEFT folder (trainer.lora)."""
        return self._call(self._worker.export_adapter, str(out_dir))[0]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters under PEFT's names, full tensors (trainer.lora)."""
        return self._call(self._worker.adapter_state)[0]

    def adapter_rows(self) -> list[dict[str, dict]]:
        """Every rank's share of the LoRA adapters, in rank order (`TrainerWorker.adapter_rows`; joined by
        `trainer.lora.join_peft_rows`)."""
        return self._call(self._worker.adapter_rows)

    def adapter_rows_refs(self) -> list:
        """Every rank's `adapter_rows` as an object-store reference, in rank order (the rows stay with the
        ranks until an engine fetches them)."""
        return [refs[0] for refs in self._call(self._worker.adapter_rows_ref)]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self._call(self._worker.hf_state_dict)[0]

    def param_specs(self) -> list[ParamSpec]:
        return self._call(self._worker.param_specs)[0]

    def policy_tensors(self, trainable: bool) -> dict[str, torch.Tensor]:
        """The policy's trainable (or frozen) parameters, full, under TorchTitan names."""
        return self._call(self._worker.policy_tensors, trainable)[0]

    def optimizer_parameters(self) -> int:
        return self._call(self._worker.optimizer_parameters, ranks=[0])[0]

    def name_maps(self):
        """The weight-sync plan's HF names, shapes and rows, from rank 0's adapter (`NameMaps`)."""
        return self._call(self._worker.ws_name_maps, ranks=[0])[0]

    def check_alive(self) -> None:
        """Raise `TrainerError` naming the first rank that is dead or failing; return if all answer."""
        self._call(self._worker.ping)

    def _kill_actors(self) -> None:
        import ray

        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []

    def shutdown(self) -> None:
        self._kill_actors()
        if getattr(self, "_own_placement", None) is not None:
            self._own_placement.remove()
            self._own_placement = None
