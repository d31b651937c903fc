"""Pure-logic tests of weight sync: wire format, plan composition and bucketing, name checks, transports.

No vLLM, Ray or TorchTitan here: engine layouts are built by hand in the shape vLLM's loaders produce
(q/k/v fused and narrowed per TP rank), which is fair for testing the plan's arithmetic; the real
layouts are derived from vLLM in tests/test_weight_sync.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rl_tpu.weight_sync.engine_layout import EngineLayout
from rl_tpu.weight_sync.names import hf_element_map, hf_shapes
from rl_tpu.weight_sync.plan import PlanError, build_plan, check_names
from rl_tpu.weight_sync.specs import ParamSpec
from rl_tpu.weight_sync.sync import apply_bucket, sender_pack, sender_setup
from rl_tpu.weight_sync.transports import get_transport
from rl_tpu.weight_sync.wire import pack, pack_into, unpack

# A toy "model": TorchTitan names, HF names by a rename + (for wq) a row permutation, like Llama's adapter.
SHAPES = {"wq": (6, 4), "wk": (5, 4), "wv": (5, 4), "norm": (4,)}
PERM = torch.tensor([1, 0, 3, 2, 5, 4])  # HF row i = TorchTitan row PERM[i]


def to_hf(sd: dict) -> dict:
    out = {"q": sd["wq"][PERM] if sd["wq"].device.type != "meta" else sd["wq"], "k": sd["wk"], "v": sd["wv"]}
    out["norm"] = sd["norm"]
    return out


def specs(world: int = 2, placement: str = "S(0)") -> list[ParamSpec]:
    return [ParamSpec(name=n, shape=s, dtype="float32", mesh_shape=(world,), mesh_dim_names=("fsdp",),
                      placements=(placement,)) for n, s in SHAPES.items()]


def hand_layout(hf_order, tp: int, rank: int) -> EngineLayout:
    """qkv = cat(q, k, v) narrowed to this rank's rows (vLLM's QKVParallelLinear), norm replicated."""
    off, o = {}, 0
    for n, s in hf_order:
        off[n] = o
        o += math.prod(s)
    def rows(n):
        t = torch.arange(off[n], off[n] + math.prod(dict(hf_order)[n])).view(dict(hf_order)[n])
        return t.chunk(tp)[rank] if n != "norm" else t
    qkv = torch.cat([rows("q"), rows("k"), rows("v")])
    qkv = torch.cat([qkv, torch.full((1, 4), -1)])  # one padding row nothing loads into
    norm = rows("norm")
    return EngineLayout(tp_rank=rank, tp_size=tp, dtype="float32",
                        shapes={"qkv": tuple(qkv.shape), "norm": tuple(norm.shape)},
                        codes={"qkv": qkv.reshape(-1).numpy(), "norm": norm.reshape(-1).numpy()})


def local_chunk(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank's Shard(0) piece as DTensor/FSDP2 lay it out (torch.chunk sizes; trailing ranks may be empty)."""
    cs = math.ceil(t.shape[0] / world)
    return t[rank * cs: (rank + 1) * cs].contiguous()


def run_plan(tp: int, world: int, bucket_bytes: int, transport: str = "inprocess"):
    torch.manual_seed(0)
    full = {n: torch.randn(s) for n, s in SHAPES.items()}
    sp = specs(world)
    hf_order = sorted(hf_shapes(sp, to_hf).items())
    layouts = [((0, r), hand_layout(hf_order, tp, r)) for r in range(tp)]
    plan = build_plan(sp, hf_element_map(sp, to_hf), hf_order, layouts, bucket_bytes)
    senders = [SimpleNamespace(shards={n: local_chunk(t, world, r) for n, t in full.items()}) for r in range(world)]
    for r, s in enumerate(senders):
        sender_setup(s, plan.for_sender(r))
    got = [{n: torch.zeros(sh) for n, sh in plan.dst_shapes[i].items()} for i in range(tp)]
    tr = get_transport(transport)
    per_receiver_bytes = [0] * tp
    for r, s in enumerate(senders):
        for k, b in enumerate(plan.for_sender(r)):
            handle = sender_pack(s, k, transport, 7)
            written = apply_bucket(tr.open(handle), lambda n, d, i=b.receiver: got[i][n])
            per_receiver_bytes[b.receiver] += 4 * sum(written.values())
            tr.release(handle)
    hf = to_hf(full)
    want = []
    for r in range(tp):
        qkv = torch.cat([hf["q"].chunk(tp)[r], hf["k"].chunk(tp)[r], hf["v"].chunk(tp)[r], torch.zeros(1, 4)])
        want.append({"qkv": qkv, "norm": hf["norm"]})
    return plan, got, want, per_receiver_bytes


@pytest.mark.parametrize("tp,world,bucket", [(1, 2, 1 << 20), (2, 2, 24), (2, 3, 40), (1, 1, 4)])
def test_plan_reassembles_engine_shards_exactly(tp, world, bucket):
    plan, got, want, per_receiver_bytes = run_plan(tp, world, bucket)
    for r in range(tp):
        for n in want[r]:
            assert torch.equal(got[r][n], want[r][n]), (r, n)
        # each receiver gets exactly the bytes of its shard: loaded elements only, nothing twice
        assert per_receiver_bytes[r] == 4 * sum(plan.dst_numel[r].values())
    assert all(b.nbytes <= max(bucket, 4) for b in plan.buckets)


def test_plan_sends_each_rank_only_its_rows():
    plan, *_ = run_plan(tp=1, world=2, bucket_bytes=1 << 20)
    for b in plan.buckets:
        for c in b.copies:  # offsets stay inside the sender's local shard (chunk of dim 0)
            rows = SHAPES[c.src][0]
            local_rows = len(range(rows)[b.sender * math.ceil(rows / 2):][: math.ceil(rows / 2)])
            assert c.src_offset + c.numel <= local_rows * math.prod(SHAPES[c.src][1:])


def test_runs_are_merged_into_few_copies():
    plan, *_ = run_plan(tp=1, world=1, bucket_bytes=1 << 20)
    copies = [c for b in plan.buckets for c in b.copies]
    # q is row-permuted (6 single-row runs), k and v contiguous, norm one run
    assert len(copies) == 6 + 1 + 1 + 1


def test_shm_and_inprocess_transports_give_the_same_result():
    _, got_shm, want, _ = run_plan(2, 2, 64, transport="shm")
    for r in range(2):
        for n in want[r]:
            assert torch.equal(got_shm[r][n], want[r][n])


def test_shm_release_unlinks_file_and_pooled_slots_are_reused():
    import os

    tr = get_transport("shm")
    state, mv = tr.alloc(16)
    mv[:4] = b"abcd"
    mv.release()
    handle = tr.publish(state)
    assert bytes(tr.open(handle)[:4]) == b"abcd"
    tr.release(handle)
    assert not os.path.exists(handle[0])
    paths = []
    for payload in (b"1234", b"56"):
        state, mv = tr.alloc(len(payload), slot="s")
        mv[:] = payload
        mv.release()
        handle = tr.publish(state)
        assert bytes(tr.open(handle)) == payload  # readers map exactly nbytes
        tr.release(handle)
        paths.append(handle[0])
    assert paths[0] == paths[1] and os.path.exists(paths[0])  # same pre-faulted file, kept for reuse


def test_unknown_transport_and_unjoined_collective_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="'carrier-pigeon'"):
        get_transport("carrier-pigeon")
    with pytest.raises(RuntimeError, match="has not joined the sync group"):
        get_transport("collective").alloc(16, slot=0)


def test_wire_packs_into_and_reads_from_tensor_buffers_like_host_buffers():
    tensors = [("a@0", torch.arange(6, dtype=torch.float32)), ("b@3", torch.arange(3, dtype=torch.int64)),
               ("c@0", torch.empty(0, dtype=torch.float32))]
    meta = {"version": "4"}
    host = pack(tensors, meta)
    dev = torch.full((len(host),), 255, dtype=torch.uint8)  # the collective transport's buffer kind
    assert pack_into(dev, tensors, meta) == len(host)
    assert bytes(dev.numpy()) == bytes(host)  # byte-identical: receivers cannot tell them apart
    views, got_meta = unpack(dev)
    assert got_meta == meta and list(views) == ["a@0", "b@3", "c@0"]
    for name, t in tensors:
        assert torch.equal(views[name], t)
    assert views["a@0"].untyped_storage().data_ptr() == dev.untyped_storage().data_ptr()  # zero copy


def test_wire_is_safetensors_and_unpack_is_zero_copy():
    from safetensors.torch import load

    tensors = [("a@0", torch.arange(5, dtype=torch.float32)), ("b@3", torch.ones(3, dtype=torch.bfloat16))]
    buf = pack(tensors, {"version": "3"})
    loaded = load(bytes(buf))
    assert torch.equal(loaded["a@0"], tensors[0][1]) and torch.equal(loaded["b@3"], tensors[1][1])
    views, meta = unpack(buf)
    assert meta == {"version": "3"}
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert base <= views["a@0"].data_ptr() < base + len(buf)  # a view into the buffer, not a copy
    assert views["a@0"].data_ptr() % 8 == base % 8  # 8-byte aligned data


def test_check_names_lists_every_problem_at_once():
    trainer = {"a": (2, 2), "b": (3,), "extra": (1,)}
    engine = {"a": (2, 3), "b": (3,), "missing1": (1,), "missing2": (2,)}
    with pytest.raises(PlanError) as e:
        check_names(trainer, engine)
    msg = str(e.value)
    for needle in ("missing1", "missing2", "extra", "a: trainer [2, 2] vs engine [2, 3]", "2 missing, 1 unexpected, 1 mis-shaped"):
        assert needle in msg
    check_names(engine, engine)  # no error when they agree


def test_hf_element_map_follows_adapter_permutation():
    m = hf_element_map(specs(), to_hf)
    src, idx = m["q"]
    assert src == "wq"
    assert torch.equal(idx.view(6, 4)[:, 0], PERM * 4)
    assert torch.equal(m["k"][1], torch.arange(20))


def test_unsupported_placement_is_named():
    sp = [ParamSpec(name="wq", shape=(6, 4), dtype="float32", mesh_shape=(2,), mesh_dim_names=("tp",),
                    placements=("S(1)",))]
    hf_order = [("q", (6, 4))]
    lay = EngineLayout(tp_rank=0, tp_size=1, dtype="float32", shapes={"q": (6, 4)},
                       codes={"q": torch.arange(24).numpy()})
    with pytest.raises(NotImplementedError, match="wq: placement S\\(1\\)"):
        build_plan(sp, {"q": ("wq", torch.arange(24))}, hf_order, [((0, 0), lay)], 1 << 20)
