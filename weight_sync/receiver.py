"""`SyncReceiver`: one engine's side of the weight sync, taken on whole by the rollout actor (a mixin).

It runs in the process that owns the `vllm.LLM`. The host class provides `ws_engine()` (the LLM) and
`ws_crosses_process()` (whether the engine's workers live in other processes: multiprocess core or
TP > 1, so handles must be plain values), and holds `version`: the policy version its engine serves,
which `ws_sync` sets once every bucket is installed and the prefix cache is reset.

Per sync of version v the receiver pulls its buckets from the senders in install order, at most two
rounds ahead (every round at once on routes into a receiver region: no buffer is reused, so senders
write ahead), and hands each round to its engine's TP ranks through `EngineRanks`:
`begin(v)` -> `receive(round)` ... -> `finish()` -> `reset_kv` (every KV block forgotten, held
partial-rollout sequences recomputed under the new weights). Engines install in parallel
with each other (the driver starts every receiver at once).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from rl_tpu.fault_hooks import fault_hook

from .calls import call, get, node_id, ready, route
from .transports import SHM_DIR, get_transport


def reset_kv(llm) -> None:
    """Forget every KV block of `llm` (a `vllm.LLM`) after a weight install. Sequences a partial rollout
    keeps in the engine between chunk calls (`rl_tpu.rollout.held`) are preempted: their KV is freed and
    recomputed under the new weights when next scheduled, so no KV computed under older weights is
    reused. Plain `reset_prefix_cache()` does nothing (returns False) while a running request owns blocks:
    the old weights' cached blocks would then serve new requests."""
    if not llm.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("vLLM did not reset its prefix cache after a weight install")


class EngineRanks:
    """The engine's TP ranks, reached through vLLM's `collective_rpc`: one method per call of our worker
    extension (`rl_tpu.rollout.worker_extension.WorkerExtension`), each returning one answer per rank.
    vLLM's RPC carries plain values only and calls extension methods by name; this is the one place
    those names appear and the one caller of `collective_rpc` (tests/unit/test_engine_rpc.py checks that
    every name it sends is a method of the extension)."""

    def __init__(self, llm):
        self.llm = llm

    def _all(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method, args=args)

    def derive(self, hf_specs: list) -> list[dict]:
        return self._all("rl_ws_derive", hf_specs)

    def setup(self, tables: dict) -> list[int]:
        return self._all("rl_ws_setup", tables)

    def make_region(self, max_bytes: int, direct: bool | None) -> list[dict]:
        return self._all("rl_ws_region", int(max_bytes), direct)

    def begin(self, version: int, keep: bool, direct: bool | None) -> list[int]:
        return self._all("rl_ws_begin", version, keep, direct)

    def receive(self, handles: dict) -> list[int]:
        return self._all("rl_ws_receive", handles)

    def finish(self) -> list[dict]:
        return self._all("rl_ws_finish")

    def verify(self, hf_weights: Any) -> list[dict]:
        return self._all("rl_ws_verify", hf_weights)

    def install(self, direct: bool | None) -> list[dict]:
        return self._all("rl_ws_install", direct)

    def device(self) -> list[str]:
        return self._all("rl_ws_device")

    def cuda_uuids(self) -> list[list[str]]:
        return self._all("rl_ws_cuda_uuids")

    def post(self, posts: dict) -> list[int]:
        return self._all("rl_ws_post", posts)

    def join(self, host: str, port: int, world: int, ranks: dict, senders: int, backend: str) -> list[int]:
        return self._all("rl_ws_join", host, port, world, ranks, senders, backend)

    def leave(self) -> list:
        return self._all("rl_ws_leave")

    def close(self) -> list:
        return self._all("rl_ws_close")

    def verified(self) -> list[dict]:
        return self._all("rl_ws_verified")

    # not weight sync, but calls into the same ranks (rollout/worker.py)
    def routing_start(self) -> list[int]:
        return self._all("rl_routing_start")

    def routing_take(self) -> list[dict | None]:
        return self._all("rl_routing_take")

    def seed(self, seed: int) -> list[None]:
        return self._all("rl_seed", seed)

    def load_full(self, payload: Any, keep: bool) -> list[list[str]]:
        return self._all("rl_load_full", payload, keep)

    def named_weights(self, names: list[str] | None) -> list[dict]:
        return self._all("rl_named_weights", names)

    def lora_write(self, payload: Any, lora_id: int, scaling: float) -> list[int]:
        return self._all("rl_lora_write", payload, lora_id, scaling)

    def lora_verify(self, payload: Any, lora_id: int, scaling: float) -> list[dict]:
        return self._all("rl_lora_verify", payload, lora_id, scaling)


@dataclass
class _ReceiverState:
    rounds: list[dict[int, tuple]] = field(default_factory=list)  # tp -> (bucket, sender, slot, route)
    senders: list = field(default_factory=list)  # trainer ranks (SyncSender actors or objects)
    set_up: bool = False  # the engine ranks hold bucket tables (their regions need closing at the end)


class SyncReceiver:
    """Mixin for the host of one engine. Needs `ws_engine()`, `ws_crosses_process()` and `version`."""

    version: int = -1

    def ws_engine(self):
        raise NotImplementedError("a SyncReceiver's host class provides ws_engine()")

    def ws_crosses_process(self) -> bool:
        return False

    @property
    def _ws_recv(self) -> _ReceiverState:
        st = self.__dict__.get("_ws_receiver_state")
        if st is None:
            st = self.__dict__["_ws_receiver_state"] = _ReceiverState()
        return st

    def _ws_ranks(self) -> EngineRanks:
        return EngineRanks(self.ws_engine())

    def ws_reset(self) -> None:
        """A new engine holds no bucket tables: forget the old one's (the driver sets this one up again)."""
        self.__dict__.pop("_ws_receiver_state", None)

    def ws_derive(self, hf_specs: list) -> list[dict]:
        """Each TP rank's layout, from running vLLM's own loaders on index codes (`engine_layout`)."""
        return self._ws_ranks().derive([[n, list(s)] for n, s in hf_specs])

    def ws_node(self) -> str:
        return node_id()

    def ws_setup(
        self, tables: dict, rounds: list, senders: list, region_bytes: int = 0, direct: bool | None = None
    ) -> dict:
        """`tables[str(tp)]`: that rank's bucket tables; `rounds`: install order, each a dict
        tp -> (bucket id, sender rank, slot key, transport) with at most one bucket per TP rank.
        `region_bytes` > 0 and a shm route: each rank is asked for a receiver region of at most that many
        bytes; returns {str(tp): region table, or {rank, why} where the rank takes bucket files}."""
        ranks, st = self._ws_ranks(), self._ws_recv
        ranks.setup(tables)
        st.set_up = True
        offered = {}
        if region_bytes > 0 and any(x[3] == "shm" for rnd in rounds for x in rnd.values()):
            offered = {str(d["rank"]): d for d in ranks.make_region(region_bytes, direct)}
        st.rounds = [
            {
                tp: (b, snd, slot, route(tr, "path" in offered.get(str(tp), {})))
                for tp, (b, snd, slot, tr) in rnd.items()
            }
            for rnd in rounds
        ]
        st.senders = senders
        return offered

    def ws_sync(self, version: int, keep: bool = False, direct: bool | None = None) -> list[dict]:
        """Install policy `version`: pull every bucket of this engine's plan and hand it to its ranks."""
        ranks, st = self._ws_ranks(), self._ws_recv
        ranks.begin(version, keep, direct)

        def issue(k: int, region: bool) -> dict:
            posts = {
                str(tp): [bid, snd, slot]
                for tp, (bid, snd, slot, tr) in st.rounds[k].items()
                if tr == "collective" and not region
            }
            if posts:  # the receives first: the senders' sends then always find one (NCCL needs it)
                ranks.post(posts)
            return {
                tp: (bid, tr, call(st.senders[snd].ws_pack, bid, tr, version, slot))
                for tp, (bid, snd, slot, tr) in st.rounds[k].items()
                if (tr == "shm_region") == region
            }

        n = len(st.rounds)
        pending = [issue(k, True) for k in range(n)]  # region routes reuse no buffer: every round now
        for k in range(min(2, n)):  # the others keep two rounds in flight (pooled slots are reused)
            pending[k].update(issue(k, False))
        fault_hook("sync", getattr(self, "index", 0), int(version))
        i = 0
        while i < n:
            # round i, and every later round already packed, go to the engine in one call (in order)
            j = i + 1  # a round past i + 1 whose other routes are not issued yet must wait for them
            while (
                j < n
                and (j <= i + 1 or all(x[3] == "shm_region" for x in st.rounds[j].values()))
                and ready([ref for _, _, ref in pending[j].values()])
            ):
                j += 1
            handles: dict[str, list] = {}
            done = []
            for k in range(i, j):
                for tp, (bid, tr, ref) in pending[k].items():
                    h = get(ref)
                    handles.setdefault(str(tp), []).append([bid, self._ws_plain(h, tr), tr])
                    done.append((tr, h))
                pending[k] = None
            ranks.receive(handles)
            for tr, h in done:
                get_transport(tr).release(h)
            for k in range(max(i + 2, j), min(j + 2, n)):
                pending[k].update(issue(k, False))
            i = j
        acks = ranks.finish()
        reset_kv(self.ws_engine())
        self.version = int(version)
        return acks

    def ws_verify(self, hf_weights) -> list[dict]:
        """Per rank, max |diff| per engine parameter between what the last install kept and vLLM's own
        loaders fed with `hf_weights` ((name, tensor) pairs or a safetensors path)."""
        ranks = self._ws_ranks()
        if self.ws_crosses_process() and not isinstance(hf_weights, str):
            from safetensors.torch import save_file

            fd, path = tempfile.mkstemp(suffix=".safetensors", dir=SHM_DIR)
            os.close(fd)
            try:
                save_file({n: t.contiguous() for n, t in hf_weights}, path)
                return ranks.verify(path)
            finally:
                os.unlink(path)
        return ranks.verify(hf_weights)

    def ws_install(self, direct: bool | None = None) -> list[dict]:
        """Per rank, the install path its engine's own processing calls for (decided at setup, see
        `engine_side.EngineSide._ws_probe_install`) and the one used given the driver's `direct`."""
        return self._ws_ranks().install(direct)

    def ws_device(self) -> list[str]:
        """Each TP rank's parameter device (the collective transport's group picks its backend from it)."""
        return self._ws_ranks().device()

    def ws_cuda_uuids(self) -> list[list[str]]:
        """Per TP rank, the GPUs it can map a CUDA IPC handle of (the `cuda_ipc` route needs the sender's)."""
        return self._ws_ranks().cuda_uuids()

    def ws_join(self, host: str, port: int, world: int, ranks: dict, senders: int, backend: str) -> list:
        return self._ws_ranks().join(host, port, world, ranks, senders, backend)

    def ws_leave(self) -> None:
        self._ws_ranks().leave()

    def ws_close(self) -> None:
        """Free the engine ranks' receiver regions now (else at process exit)."""
        if self._ws_recv.set_up:
            self._ws_ranks().close()
        self.ws_reset()

    def _ws_plain(self, handle: Any, transport: str) -> Any:
        """A handle the engine ranks can open: object-store and in-process buffers become bytes when the
        ranks live in other processes (vLLM's RPC carries plain values only)."""
        if not self.ws_crosses_process():
            return handle
        if transport == "ray":
            import ray

            return bytes(memoryview(ray.get(handle[0])))
        if transport == "inprocess":
            return bytes(handle)
        return handle


class EngineReceiver(SyncReceiver):
    """A receiver around a `vllm.LLM` of this process, outside any actor (benches, tests)."""

    def __init__(self, llm, crosses_process: bool = False, version: int = 0):
        self.llm, self.crosses_process, self.version = llm, crosses_process, version

    def ws_engine(self):
        return self.llm

    def ws_crosses_process(self) -> bool:
        return self.crosses_process

    def load_weights(self, payload: Any, version: int, full: bool = True, keep: bool = False) -> dict:
        """The `reload` transport's install: vLLM's own loader takes every tensor of `payload` (pairs or a
        safetensors path), then the prefix cache is reset (`RolloutWorker.load_weights` without the
        actor's shape checks and engine restart)."""
        loaded = EngineRanks(self.llm).load_full(payload, keep)
        reset_kv(self.llm)
        self.version = version
        return {"version": version, "engine_params": len(loaded[0])}
