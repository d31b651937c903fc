"""The real driver and receiver orchestration of the weight sync, with no vLLM: `WeightSync` plans and
syncs, `LocalSender`s pack real buckets over real transports, `EngineReceiver` + `EngineRanks` pull them
in install order and call the engine ranks through `collective_rpc`, exactly as in a run. Only the engine
is a stand-in (`ToyEngine`): its TP ranks answer the worker extension's `rl_ws_*` calls with the hand-built
layouts of tests/toy_layouts.py and copy pieces with the engine side's own `apply_bucket`. What a real
vLLM engine does with the pieces is tests/integration/test_weight_sync.py's."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from toy_layouts import SHAPES, engine_tensors, hand_layout, local_chunk, specs, to_hf

from rl_tpu.rollout.worker_extension import WorkerExtension
from rl_tpu.weight_sync import EngineReceiver, LocalSender, PlanError, WeightSync
from rl_tpu.weight_sync.engine_side import PIECE_FIELDS, apply_bucket
from rl_tpu.weight_sync.installers import receiver_tables
from rl_tpu.weight_sync.rows import rows_cols
from rl_tpu.weight_sync.transports import get_transport


class ToyRank:
    """One TP rank of a toy engine, answering the worker extension's weight-sync calls."""

    def __init__(self, tp: int, rank: int):
        self.tp, self.rank = tp, rank
        self.params: dict[str, torch.Tensor] = {}
        self.received: list[int] = []  # bucket ids, in the order they were installed
        self.session: dict | None = None

    def rl_ws_derive(self, hf_specs: list) -> dict:
        return hand_layout([(n, tuple(s)) for n, s in hf_specs], self.tp, self.rank).to_wire()

    def rl_ws_setup(self, tables: dict) -> int:
        t = tables[str(self.rank)]
        self.names, self.numel = list(t["names"]), {n: int(v) for n, v in t["numel"].items()}
        self.buckets = {
            int(b): np.frombuffer(p, dtype=np.int64).reshape(-1, PIECE_FIELDS)
            for b, p in t["buckets"].items()
        }
        self.params = {n: torch.zeros(tuple(s)) for n, s in t["shapes"].items()}  # padding reads 0
        return len(self.buckets)

    def rl_ws_region(self, max_bytes: int, direct: bool | None) -> dict:
        return {"rank": self.rank, "why": "a toy engine takes bucket files"}

    def rl_ws_install(self, direct: bool | None) -> dict:
        return {
            "rank": self.rank,
            "install": "direct",
            "probed": "direct",
            "forced": direct is not None,
            "layers": len({n.rpartition(".")[0] for n in self.names}),
            "processed": {},
        }

    def rl_ws_begin(self, version: int, keep: bool, direct: bool | None) -> int:
        self.session = {"version": version, "remaining": dict(self.numel), "bytes": 0}
        return self.rank

    def rl_ws_receive(self, handles: dict) -> int:
        s, n_bytes = self.session, 0

        def done(name: str, n: int) -> None:
            s["remaining"][name] -= n

        for bid, handle, transport in handles.get(str(self.rank), []):
            buf = handle if isinstance(handle, (bytes, bytearray)) else get_transport(transport).open(handle)
            n_bytes += apply_bucket(buf, self.buckets[int(bid)], self.names, self._dst, done, bucket=int(bid))
            self.received.append(int(bid))
        s["bytes"] += n_bytes
        return n_bytes

    def _dst(self, name: str) -> torch.Tensor:
        return self.params[name].view(rows_cols(tuple(self.params[name].shape)))

    def rl_ws_finish(self) -> dict:
        s, self.session = self.session, None
        missing = {n: r for n, r in s["remaining"].items() if r != 0}
        assert not missing, f"rank {self.rank} did not receive every element: {missing}"
        return {"rank": self.rank, "version": s["version"], "bytes": s["bytes"]}

    def rl_ws_close(self) -> None:
        pass


class ToyEngine:
    """Stands in for `vllm.LLM`: `collective_rpc` calls each TP rank's method by name, as vLLM does."""

    def __init__(self, tp: int):
        self.ranks = [ToyRank(tp, r) for r in range(tp)]
        self.resets = 0

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(rank, method)(*args) for rank in self.ranks]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        assert reset_running_requests  # held partial rollouts must be recomputed under the new weights
        self.resets += 1
        return True


def toy_sync(full: dict, world: int, tps: list[int], transport: str, crosses: bool, bucket_bytes: int):
    senders = [
        LocalSender(lambda r=r: {n: local_chunk(t, world, r) for n, t in full.items()}) for r in range(world)
    ]
    receivers = [EngineReceiver(ToyEngine(tp), crosses_process=crosses) for tp in tps]
    ws = WeightSync(
        specs(world), to_hf, senders, receivers, transport=transport, bucket_mb=bucket_bytes / 2**20
    )
    return ws, receivers


def installed(receiver: EngineReceiver) -> list[dict]:
    return [{n: t.clone() for n, t in rank.params.items()} for rank in receiver.llm.ranks]


def assert_serves(receiver: EngineReceiver, full: dict) -> None:
    tp = len(receiver.llm.ranks)
    for r, got in enumerate(installed(receiver)):
        want = engine_tensors(full, tp, r)
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n]), (tp, r, n)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def test_toy_ranks_answer_the_worker_extensions_calls_with_its_signatures():
    """The stand-in cannot drift from the real extension: same names, same parameters."""
    for name, fn in inspect.getmembers(ToyRank, inspect.isfunction):
        if name.startswith("rl_"):
            real = getattr(WorkerExtension, name)
            assert list(inspect.signature(fn).parameters) == list(inspect.signature(real).parameters), name


@pytest.mark.parametrize(
    "transport,crosses", [("inprocess", False), ("inprocess", True), ("shm", False), ("shm", True)]
)
def test_every_engine_serves_the_trainers_weights_after_each_sync(transport, crosses):
    """Two engines (TP 2 and TP 1) from three senders, buckets of 40 bytes (many rounds): after each
    version every rank holds exactly its shard, installed in the plan's order, the prefix cache was reset
    once per install, the plan is built once and the bytes counted are the plan's."""
    full = weights(0)
    ws, receivers = toy_sync(full, world=3, tps=[2, 1], transport=transport, crosses=crosses, bucket_bytes=40)
    plan = ws.build()
    assert len(plan.buckets) > 10
    stats = ws.sync(3)
    assert stats.bytes == plan.nbytes and stats.buckets == len(plan.buckets)
    assert sorted((a["version"], a["rank"]) for a in stats.acks) == [(3, 0), (3, 0), (3, 1)]
    for e, rcv in enumerate(receivers):
        assert_serves(rcv, full)
        assert rcv.version == 3 and rcv.llm.resets == 1
        _, rounds = receiver_tables(plan, e)
        for rank in rcv.llm.ranks:  # in install order, each bucket once
            assert rank.received == [rnd[rank.rank][0] for rnd in rounds if rank.rank in rnd]
    for t in full.values():  # the trainer steps: the senders' shards are views of these
        t.mul_(-2).add_(1)
    stats = ws.sync(4)
    assert ws.plan is plan and [rcv.version for rcv in receivers] == [4, 4]
    for rcv in receivers:
        assert_serves(rcv, full)
        assert rcv.llm.resets == 2
    ws.close()


def test_a_restarted_engine_is_planned_into_and_synced_alone():
    full = weights(1)
    ws, receivers = toy_sync(full, world=2, tps=[2, 2], transport="inprocess", crosses=False, bucket_bytes=64)
    ws.sync(1)
    before = installed(receivers[0])
    for t in full.values():
        t.add_(10)
    new = EngineReceiver(ToyEngine(2))
    ws.replace_receiver(1, new)
    stats = ws.sync(2, engines=[1])
    assert_serves(new, full) and new.version == 2
    assert receivers[0].version == 1  # the other engine was not touched
    assert all(torch.equal(a[n], b[n]) for a, b in zip(before, installed(receivers[0])) for n in a)
    assert stats.bytes == ws.plan.nbytes // 2  # one engine's shard of the bytes
    ws.close()


def test_a_restarted_engine_that_lays_weights_out_differently_is_refused():
    ws, _ = toy_sync(weights(2), world=2, tps=[2], transport="inprocess", crosses=False, bucket_bytes=64)
    ws.build()
    with pytest.raises(PlanError, match="restarted engine 0 lays out its weights differently"):
        ws.replace_receiver(0, EngineReceiver(ToyEngine(1)))  # TP 1 where the plan has TP 2
    ws.close()


def test_a_bucket_the_plan_does_not_account_for_fails_the_install_by_name(monkeypatch):
    """A sender that packs the wrong bucket is caught on arrival, before a byte is copied."""
    full = weights(3)
    ws, receivers = toy_sync(full, world=1, tps=[1], transport="inprocess", crosses=False, bucket_bytes=64)
    plan = ws.build()
    sender = ws.installer.senders[0]
    real = type(sender).ws_pack
    monkeypatch.setattr(sender, "ws_pack", lambda b, *a: real(sender, (b + 1) % len(plan.buckets), *a))
    with pytest.raises(RuntimeError, match="expected bucket 0, the transport delivered 1"):
        ws.sync(1)
    ws.close()
