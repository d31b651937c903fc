"""`WeightSync`: the one owner of the weight sync on the driver. It plans once, then per policy version
moves each engine exactly its shard's bytes, verifies them when asked, and takes back restarted engines.

Who does what (each side is one class that its actor takes on whole):
- driver (`WeightSync`, here): owns the policy version a sync installs, verify, and engine restarts; how
  the bytes get there is its installer's (`installers/`, one file per strategy): `PlannedInstall` checks
  names and shapes against the engine's checkpoint, derives the engines' layouts by running vLLM's own
  loaders on index codes, builds the plan (`plan.build_plan`), hands every sender its buckets and every
  receiver its bucket tables and install order, and per sync starts every receiver at once and collects
  their acknowledgements; `ReloadInstall` has the engines reload the trainer's HF export. The driver
  never touches bytes.
- sender = a trainer rank (`sender.SyncSender`, a mixin of `TrainerWorker`): packs a bucket from the
  rank's local DTensor shards into the transport and returns a small handle.
- receiver = one engine's host (`receiver.SyncReceiver`, a mixin of `RolloutWorker`): pulls its buckets
  from the senders in install order and hands each round to its engine's TP ranks, where our vLLM worker
  extension (`rl_tpu.rollout.worker_extension`, its `rl_ws_*` methods mixed in from
  `engine_side.EngineSide`) copies the pieces and runs vLLM's per-layer processing.

Transports (`sync.transport`): `inprocess`, `shm` (/dev/shm files, or straight into a receiver region),
`ray` (object store), `collective` (one torch.distributed group over senders and engine ranks), `auto`
(shm on the same node, ray across nodes), and `reload`: the full-tensor reference path, where the
trainer exports HF safetensors and every engine reloads them through vLLM's own loader (no plan).

Policy version: the trainer group owns it (`TrainerGroup.policy_version`, advanced by each update); a
sync reads it once and every engine records what it serves (`RolloutWorker.version`), which stamps its
completions. Nothing else holds a copy.

Sync protocol for policy version v, per receiver: `begin` -> for each round (at most one bucket per TP
rank): senders pack, engine ranks copy their pieces and process every layer that became complete ->
`finish` (the rest of vLLM's post-processing) -> `reset_kv` (prefix cache reset, held sequences recomputed)
-> the receiver records v.

Receiver regions (shm routes into a CPU engine, under `receiver_buffer_mb` per engine rank): at setup
each engine rank creates one /dev/shm file holding its loaded-layout parameters and the driver hands
every sender the region table and, per bucket, where its pieces go; `ws_pack` then copies pieces
straight into the engine's parameters (casting to the engine dtype). Above the cap, or with
`receiver_buffers=False`, shm routes carry bucket files.

Install path, per engine rank: "direct" (pieces straight into the kernel tensors) only where the engine's
own per-layer processing is the identity, probed at setup; else "layerwise" (pieces into the loaded
layout, then vLLM's processing). `routes()` says which, per route.

Verify (`sync.verify`): the engines compare the tensors they serve bit for bit with what vLLM's own
loaders and per-layer processing make of the trainer's full HF tensors (in the loaded layout where the
processed kernel is no tensor: vLLM-CPU's packed linears).

Nothing is half-installed on bad input: name and shape checks run at plan time, before any bytes move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .calls import ReceiverLost, call, get
from .installers import AdapterReload, AdapterWrite, Installer, PlannedInstall, ReloadInstall, SyncStats
from .plan import SyncPlan
from .specs import ParamSpec

if TYPE_CHECKING:
    from rl_tpu.config import SyncConfig
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup

    from .names import NameMaps

log = logging.getLogger("rl_tpu")

__all__ = ["ReceiverLost", "SyncStats", "WeightSync"]


class WeightSync:
    """Resharding from trainer ranks (senders) into vLLM engines (receivers), planned once.

    `senders[r]` is trainer rank r and `receivers[e]` engine e: Ray actor handles (`TrainerWorker`,
    `RolloutWorker`) or local objects with the same `ws_*` methods (`SyncSender`, `SyncReceiver`), or a
    `RolloutGroup` (its workers; the group then knows its engines hold synced weights, which it cannot
    give an engine it restarts: such a restart is an error until `on_restart` is set, see
    `replace_receiver`). `to_hf` is TorchTitan's `StateDictAdapter.to_hf`, or the `NameMaps` a trainer
    rank computed with it. `trainer` (a `TrainerGroup`, as the loop passes through `for_run`): the
    owner of the policy version, of the full HF tensors verify compares with and of the export the
    `reload` transport installs; `push` and `engine_restarted` need it.

    `lock` is held while an update changes the trainer's weights and its version, so a restarted engine
    is never synced mid-update (async mode restarts an engine from the generation thread while the
    trainer trains).
    """

    def __init__(
        self,
        specs: list[ParamSpec],
        to_hf: Callable[[dict], dict] | NameMaps | None,
        senders: list,
        receivers: list | RolloutGroup,
        *,
        transport: str = "shm",
        bucket_mb: float = 64.0,
        engine_model_dir: str | None = None,
        direct: bool | None = None,
        receiver_buffers: bool = True,
        receiver_buffer_mb: float = 4096.0,
        verify: bool = False,
        trainer: TrainerGroup | None = None,
        lora: bool = False,
    ):
        self.group = None if isinstance(receivers, (list, tuple)) else receivers
        if self.group is not None:
            receivers = self.group.workers  # the group's own list: a restart replaces its entry in place
        self.receivers = receivers
        self.verify_each, self.trainer, self.lora = verify, trainer, lora
        self.lock = threading.Lock()
        self.installer: Installer = (
            (AdapterReload if transport == "reload" else AdapterWrite)(trainer, receivers)
            if lora
            else ReloadInstall(trainer, receivers)
            if transport == "reload"
            else PlannedInstall(
                specs,
                to_hf,
                senders,
                receivers,
                transport=transport,
                bucket_bytes=int(bucket_mb * 2**20),
                # shm routes into a CPU engine rank write straight into its receiver region, up to this size
                region_bytes=int(receiver_buffer_mb * 2**20) if receiver_buffers else 0,
                engine_model_dir=engine_model_dir,
                direct=direct,
            )
        )

    @classmethod
    def for_run(cls, sync: SyncConfig, trainer: TrainerGroup, rollout: RolloutGroup, model_path: str):
        """The loop's weight sync between its trainer group and its engines (`sync.*` config); under
        `trainer.lora` only the adapters move (`AdapterWrite` into the engines' LoRA slots, or
        `AdapterReload` through a PEFT folder with `sync.transport = "reload"`)."""
        lora = bool(trainer.cfg.trainer.lora.rank)
        planned = sync.transport != "reload" and not lora
        return cls(
            trainer.param_specs() if planned else [],
            # names and rows from rank 0's own adapter: the driver needs no TorchTitan of its own
            trainer.name_maps() if planned else None,
            trainer.actors,
            rollout,
            transport=sync.transport,
            bucket_mb=sync.bucket_mb,
            receiver_buffer_mb=sync.receiver_buffer_mb,
            engine_model_dir=model_path,
            verify=sync.verify,
            trainer=trainer,
            lora=lora,
        )

    @property
    def plan(self) -> SyncPlan | None:
        """The plan a planned install moves bytes by (None before `build`, and for `reload`)."""
        return getattr(self.installer, "plan", None)

    @property
    def plan_seconds(self) -> float:
        return getattr(self.installer, "plan_seconds", 0.0)

    # -- the loop's calls ---------------------------------------------------------------------------
    def push(self) -> dict[str, float]:
        """Every engine gets the trainer's weights as its current policy version; returns the metrics.
        An engine that dies during the sync is restarted and synced alone (the others are done)."""
        version = self.trainer.policy_version
        t = time.perf_counter()
        try:
            nbytes, verified = self._sync_and_verify(version)
        except ReceiverLost as e:
            for engine in e.engines:  # restart_worker calls engine_restarted, which syncs it
                self.group.restart_worker(engine, f"{e.what} of version {version}")
            nbytes, verified = 0, None
        except Exception:
            self.trainer.check_alive()  # a dead trainer rank fails every engine's sync: name it
            raise
        out = {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t}
        if verified is not None:
            out["sync/verified_params"] = float(verified)  # engine parameters found bit-identical
        return out

    def engine_restarted(self, engine: int) -> None:
        """`RolloutGroup.on_restart`: the new engine takes its slot and gets the current policy."""
        with self.lock:
            self.replace_receiver(engine, self.group.workers[engine])
            version = self.trainer.policy_version
            self._sync_and_verify(version, engines=[engine])
            log.info("rollout worker %d restarted and synced to policy version %d", engine, version)

    def _sync_and_verify(self, version: int, engines: list[int] | None = None) -> tuple[int, int | None]:
        """Sync `version` into `engines` (all by default) and, with `verify`, compare every engine
        parameter with vLLM's own loader fed with the trainer's tensors. Returns (bytes, parameters
        verified or None)."""
        stats = self.sync(version, keep_for_verify=self.verify_each, engines=engines)
        if not self.verify_each:
            return stats.bytes, None
        if self.lora:
            diffs = self.verify_adapter(sorted(self.trainer.adapter_state().items()), engines)
        else:
            diffs = self.verify(sorted(self.trainer.hf_state_dict().items()), engines)
        bad = {f"engine {e} {n}": d for (e, n), d in diffs.items() if d != 0.0}
        if bad:
            raise RuntimeError(f"weight sync verify: engine weights differ from the trainer's: {bad}")
        return stats.bytes, len(diffs)

    def build(self) -> SyncPlan | None:
        """Plan before the first sync (`PlannedInstall.build`: names and shapes checked, engine layouts
        derived, tables handed out); None for `reload` (each engine checks the names of what it reloads)."""
        return self.installer.build()

    def sync(
        self, version: int, keep_for_verify: bool = False, engines: list[int] | None = None
    ) -> SyncStats:
        """Every receiver (or those in `engines`) installs `version`, in parallel across engines; returns
        timings and acks. Raises `ReceiverLost` naming engines whose actor died, once the others are done.
        Each engine records `version` as the policy it serves once its install is complete."""
        engines = list(range(len(self.receivers))) if engines is None else engines
        if self.group is not None:  # from here the engines may hold weights no file holds
            self.group.keep_for_restart(None)
        return self.installer.sync(version, keep_for_verify, engines, self._timeout())

    def _timeout(self) -> float | None:
        """How long an engine may take to install a version before it counts as hung (and is restarted
        like a dead one): the engine group's call timeout (`rollout.timeout_s`); no limit without one."""
        return self.group.timeout_s if self.group is not None else None

    def replace_receiver(self, engine: int, receiver) -> None:
        """A restarted engine (same model folder and config) takes slot `engine`: for a planned install
        its loaders must lay weights out exactly as the plan says (`PlanError` otherwise). It holds the
        weights it started with until `sync(version, engines=[engine])`."""
        self.receivers[engine] = receiver
        self.installer.replace(engine)

    def routes(self) -> list[dict]:
        """One entry per (sender rank, receiver) pair the plan moves bytes over, with its transport and
        the receiving rank's install path (`install`: "direct" into the kernel tensors, or "layerwise"
        through vLLM's per-layer processing); [] for `reload`."""
        return self.installer.routes()

    def close(self) -> None:
        """Free the senders' pooled shared-memory slots and any export folder (before killing trainer
        actors)."""
        self.installer.close()

    def verify_adapter(self, tensors, engines: list[int] | None = None) -> dict[tuple[int, str], float]:
        """Under `trainer.lora`: max |diff| per (engine, LoRA slot tensor) between what each engine serves
        and the trainer's adapters `tensors` (PEFT names; `RolloutWorker.verify_adapter`)."""
        engines = list(range(len(self.receivers))) if engines is None else engines
        return self._max_per_name(engines, [call(self.receivers[e].verify_adapter, tensors) for e in engines])

    def verify(self, hf_weights, engines: list[int] | None = None) -> dict[tuple[int, str], float]:
        """After `sync(v, keep_for_verify=True)`: max |diff| per (engine, engine param) against vLLM's own
        loaders fed with `hf_weights` (the trainer's full HF tensors: (name, tensor) pairs, or a
        safetensors file path where the engine runs vLLM workers in other processes). The engines keep
        serving what the sync installed."""
        engines = list(range(len(self.receivers))) if engines is None else engines
        return self._max_per_name(engines, [call(self.receivers[e].ws_verify, hf_weights) for e in engines])

    @staticmethod
    def _max_per_name(engines: list[int], calls: list) -> dict[tuple[int, str], float]:
        """Per (engine, name), the largest difference any TP rank of that engine reported."""
        out = {}
        for e, per_rank in zip(engines, get(calls)):
            for res in per_rank:
                for name, d in res.items():
                    out[(e, name)] = max(out.get((e, name), 0.0), d)
        return out
