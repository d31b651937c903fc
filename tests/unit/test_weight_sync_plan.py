"""Pure-logic tests of weight sync: row runs, plan composition and bucketing, name checks, transports, wire.

No vLLM, Ray or TorchTitan here: engine layouts are built by hand in the shape vLLM's loaders produce
(q/k/v fused and narrowed per TP rank, a row-parallel weight narrowed on columns, a padding row),
coded with one full int64 index per element and compressed by `full_code_runs` (tests/toy_layouts.py):
the plain reference decoder, which `test_byte_pass_decoding_equals_full_index_codes` checks the engine's
byte-pass decoder (`rows.Segments`) against; the real layouts are derived from vLLM in
tests/integration/test_weight_sync.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from toy_layouts import PERM, SHAPES, engine_tensors, full_code_runs, hand_layout, local_chunk, specs, to_hf

from rl_tpu.weight_sync.engine_layout import EngineLayout
from rl_tpu.weight_sync.engine_side import apply_bucket
from rl_tpu.weight_sync.installers import receiver_tables
from rl_tpu.weight_sync.names import hf_row_map, hf_shapes
from rl_tpu.weight_sync.plan import PlanError, build_plan, check_names, owners
from rl_tpu.weight_sync.rows import rows_cols, runs_1d, split_at
from rl_tpu.weight_sync.sender import LocalSender
from rl_tpu.weight_sync.specs import ParamSpec
from rl_tpu.weight_sync.transports import get_transport
from rl_tpu.weight_sync.wire import pack, pack_into, unpack


def run_plan(tp: int, world: int, bucket_bytes: int, transport: str = "inprocess"):
    torch.manual_seed(0)
    full = {n: torch.randn(s) for n, s in SHAPES.items()}
    sp = specs(world)
    hf_order = sorted(hf_shapes(sp, to_hf).items())
    layouts = [((0, r), hand_layout(hf_order, tp, r)) for r in range(tp)]
    plan = build_plan(sp, hf_row_map(sp, to_hf), hf_order, layouts, bucket_bytes)
    senders = [
        LocalSender(lambda r=r: {n: local_chunk(t, world, r) for n, t in full.items()}) for r in range(world)
    ]
    for r, s in enumerate(senders):
        s.ws_setup(plan.titan_names, plan.for_sender(r))
    got = [{n: torch.zeros(sh) for n, sh in plan.dst_shapes[i].items()} for i in range(tp)]
    tr = get_transport(transport)
    per_receiver_bytes = [0] * tp
    _, rounds = receiver_tables(plan, 0)
    for rnd in rounds:  # the receiver's install order, as `Receiver.ws_sync` walks it
        for tp_rank, (bid, snd, slot, _) in rnd.items():
            i = plan.engine_ranks.index((0, tp_rank))
            handle = senders[snd].ws_pack(bid, transport, 7, slot)
            pieces = dict((b, p) for b, _, p in plan.for_receiver(i))[bid]
            per_receiver_bytes[i] += apply_bucket(
                tr.open(handle),
                pieces,
                plan.dst_names[i],
                lambda n, i=i: got[i][n].view(rows_cols(tuple(got[i][n].shape))),
            )
            tr.release(handle)
    want = [engine_tensors(full, tp, r) for r in range(tp)]
    return plan, got, want, per_receiver_bytes


@pytest.mark.parametrize("tp,world,bucket", [(1, 2, 1 << 20), (2, 2, 24), (2, 3, 40), (1, 1, 4)])
def test_plan_reassembles_engine_shards_exactly(tp, world, bucket):
    plan, got, want, per_receiver_bytes = run_plan(tp, world, bucket)
    for r in range(tp):
        for n in want[r]:
            assert torch.equal(got[r][n], want[r][n]), (r, n)
        # each receiver gets exactly the bytes of its shard: loaded elements only, nothing twice
        assert per_receiver_bytes[r] == 4 * sum(plan.dst_numel[r].values())
    # a bucket exceeds its size by less than one row (the widest row here is 6 floats)
    assert all(b <= max(bucket, 4) + 4 * 6 for b in plan.buckets[:, 2])


def test_plan_sends_each_rank_only_its_rows():
    plan, *_ = run_plan(tp=1, world=2, bucket_bytes=1 << 20)
    for rank in range(2):
        for pieces in plan.for_sender(rank).values():
            for src, r, c, nr, nc in pieces.tolist():  # rows stay inside the sender's chunk of dim 0
                name = plan.titan_names[src]
                local_rows = rows_cols(tuple(local_chunk(torch.empty(SHAPES[name]), 2, rank).shape))[0]
                assert 0 <= r and r + nr <= local_rows
                assert c + nc <= rows_cols(SHAPES[name])[1]


def test_runs_are_merged_into_few_pieces():
    plan, *_ = run_plan(tp=1, world=1, bucket_bytes=1 << 20)
    # q is row-permuted (6 single-row pieces), k, v, o and norm one piece each
    assert plan.pieces.shape[0] == 6 + 1 + 1 + 1 + 1


def test_row_parallel_narrowing_is_one_multi_row_run():
    hf_order = sorted(hf_shapes(specs(), to_hf).items())
    lay = hand_layout(hf_order, 2, 1)
    (run,) = lay.runs["o_proj"].tolist()  # dst_row, dst_col, nrows, ncols, hf, hf_row, hf_col
    assert run == [0, 0, 4, 3, [n for n, _ in hf_order].index("o"), 0, 3]


def _tricky_loader(hf: dict, tp: int, rank: int) -> dict:
    """Engine params from HF tensors of any dtype, the ways vLLM's loaders move values: rows fused and
    narrowed per rank with a padding row, columns narrowed, 1-D tensors concatenated, rows permuted, a
    column jump of exactly 256 (the low byte of the column code still steps by one across it), vocab
    padding, and a tensor with more rows than two bytes of row code can name."""
    z = lambda n, c: torch.zeros(n, c, dtype=hf["q"].dtype)  # noqa: E731
    return {
        "qkv": torch.cat([hf["q"].chunk(tp)[rank], hf["k"].chunk(tp)[rank], z(1, 4)]),
        "o": hf["o"].chunk(tp, dim=1)[rank],
        "bias": torch.cat([hf["bq"], hf["bk"]]),
        "perm": hf["p"][torch.tensor([3, 1, 2, 0, 4])],
        "jump": torch.cat([hf["w"][:, :100], hf["w"][:, 356:456], hf["w"][:, 100:101]], dim=1),
        "emb": torch.cat([hf["e"], z(3, 8)]),
        "long": hf["long"][1:],
    }


def test_byte_pass_decoding_equals_full_index_codes():
    """The engine's byte-per-pass layout decoding (`rows.Segments`, the inputs vLLM's loaders get in
    `derive_layout`) gives exactly the run tables of one pass with full int64 element codes."""
    from rl_tpu.weight_sync.rows import Segments, Workspace, digit_input, digit_passes

    hf_order = [
        ("bk", (3,)),
        ("bq", (5,)),
        ("e", (7, 8)),
        ("k", (4, 4)),
        ("long", (70_000, 1)),
        ("o", (4, 6)),
        ("p", (5, 3)),
        ("q", (6, 4)),
        ("w", (2, 600)),
    ]
    shapes = dict(hf_order)
    numel = [math.prod(sh) for _, sh in hf_order]
    offsets = np.cumsum([0] + numel)[:-1]
    cols = np.array([rows_cols(sh)[1] for _, sh in hf_order])
    rows = np.array([rows_cols(sh)[0] for _, sh in hf_order])
    row_offsets = np.cumsum(np.append(0, rows))[:-1]
    passes = digit_passes(int(rows.sum()), int(cols.max()))
    assert [k for kind, k in passes if kind == "row"] == [0, 1, 2] and [
        k for kind, k in passes if kind == "col"
    ] == [0, 1]
    for tp, rank in [(1, 0), (2, 1)]:
        coded = {
            n: torch.arange(int(o) + 1, int(o) + 1 + m, dtype=torch.int64).view(shapes[n])
            for (n, _), o, m in zip(hf_order, offsets, numel)
        }
        want = {
            n: full_code_runs(t.reshape(rows_cols(tuple(t.shape))), offsets, cols)
            for n, t in _tricky_loader(coded, tp, rank).items()
        }
        segs = {}
        for kind, k in passes:
            inputs = {n: digit_input(kind, k, int(o), sh) for (n, sh), o in zip(hf_order, row_offsets)}
            for n, t in _tricky_loader(inputs, tp, rank).items():
                d = t.reshape(rows_cols(tuple(t.shape)))
                segs[n] = (segs.get(n) or Segments.whole_rows(*d.shape)).refine(d, kind, k, Workspace(64))
        for n in want:
            assert np.array_equal(segs[n].runs(row_offsets), want[n]), (
                tp,
                n,
                segs[n].runs(row_offsets),
                want[n],
            )
    assert want["jump"].shape[0] == 3 and want["emb"][:, 2].tolist() == [7]  # the jump split; padding dropped


def test_owners_follow_dtensor_chunking_and_replication():
    s = ParamSpec(
        name="w",
        shape=(5, 3),
        dtype="float32",
        mesh_shape=(2, 3),
        mesh_dim_names=("rep", "shard"),
        placements=("Replicate()", "Shard(dim=0)"),
    )
    assert owners(s) == [(0, 0, 2), (1, 2, 4), (2, 4, 5)]  # coordinate 0 of the replicated dim is the source
    nested = ParamSpec(
        name="w",
        shape=(8, 2, 3),
        dtype="float32",
        mesh_shape=(2, 2),
        mesh_dim_names=("a", "b"),
        placements=("S(0)", "S(0)"),
    )
    # dim 0 chunks 4 | 4, then 2 | 2 inside each; 2-D rows are dim0 x 2
    assert owners(nested) == [(0, 0, 4), (1, 4, 8), (2, 8, 12), (3, 12, 16)]


def test_split_at_cuts_intervals_at_segment_starts():
    idx, lo, n = split_at(np.array([0, 5]), np.array([4, 6]), np.array([0, 2, 6, 8]))
    assert list(zip(idx.tolist(), lo.tolist(), n.tolist())) == [
        (0, 0, 2),
        (0, 2, 2),
        (1, 5, 1),
        (1, 6, 2),
        (1, 8, 3),
    ]
    assert runs_1d(np.array([3, 4, 5, 9, 1, 2])).tolist() == [[0, 3, 3], [3, 9, 1], [4, 1, 2]]


def test_plan_size_grows_with_rows_not_elements():
    """A 4096-wide Qwen3-like layer planned from synthetic layouts: pieces per parameter stay O(ranks)."""
    hidden = 4096
    sh = {
        "wq": (hidden, hidden),
        "wk": (1024, hidden),
        "wv": (1024, hidden),
        "wo": (hidden, hidden),
        "norm": (hidden,),
    }
    sp = [
        ParamSpec(
            name=n, shape=s, dtype="float32", mesh_shape=(8,), mesh_dim_names=("fsdp",), placements=("S(0)",)
        )
        for n, s in sh.items()
    ]
    hf = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "norm": "norm"}

    def ident(sd):
        return {h: sd[t] for h, t in hf.items() if t in sd}

    hf_order = sorted(hf_shapes(sp, ident).items())
    idx = {n: i for i, (n, _) in enumerate(hf_order)}
    tp = 4
    layouts = []
    for r in range(tp):
        q, k = hidden // tp, 1024 // tp
        runs = {
            "qkv": np.array(
                [
                    [0, 0, q, hidden, idx["q"], r * q, 0],
                    [q, 0, k, hidden, idx["k"], r * k, 0],
                    [q + k, 0, k, hidden, idx["v"], r * k, 0],
                ]
            ),
            "o_proj": np.array([[0, 0, hidden, hidden // tp, idx["o"], 0, r * hidden // tp]]),
            "norm": np.array([[0, 0, hidden, 1, idx["norm"], 0, 0]]),
        }
        shapes = {"qkv": (q + 2 * k, hidden), "o_proj": (hidden, hidden // tp), "norm": (hidden,)}
        layouts.append(
            ((0, r), EngineLayout(tp_rank=r, tp_size=tp, dtype="float32", shapes=shapes, runs=runs))
        )
    plan = build_plan(sp, hf_row_map(sp, ident), hf_order, layouts, 64 << 20)
    # every element once, none twice; the replicated norm goes to each TP rank
    assert plan.nbytes == 4 * (sum(math.prod(s) for s in sh.values()) + (tp - 1) * hidden)
    assert plan.pieces.shape[0] <= tp * 5 * 8 * 2  # receivers x params x FSDP ranks, with slack


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


def test_stale_pool_and_region_files_of_dead_processes_are_swept(tmp_path):
    """A SIGKILLed sender or receiver leaves its pooled slot / region files in /dev/shm; the next process
    to make one removes those whose PID is gone, and nothing of a live process or of anyone else."""
    import os
    import subprocess
    import sys

    from rl_tpu.weight_sync.transports import sweep_stale_files

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    names = {
        f"rl_tpu_ws_pool_{dead_pid}_0a1b2c3d": False,  # swept
        f"rl_tpu_ws_region_{dead_pid}_0a1b2c3d": False,
        f"rl_tpu_ws_pool_{live_pid}_0a1b2c3d": True,  # kept: its process is alive
        f"rl_tpu_ws_region_{live_pid}_0a1b2c3d": True,
        f"rl_tpu_ws_{dead_pid}": True,  # an unpooled file: its reader unlinks it
        f"other_ws_pool_{dead_pid}_0a1b2c3d": True,
        "rl_tpu_ws_pool_notapid_0a1b2c3d": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = sweep_stale_files(str(tmp_path))
    assert sorted(os.path.basename(r) for r in removed) == sorted(n for n, kept in names.items() if not kept)
    assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}


def test_unknown_transport_and_unjoined_collective_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="'carrier-pigeon'"):
        get_transport("carrier-pigeon")
    with pytest.raises(RuntimeError, match="has not joined the sync group"):
        get_transport("collective").alloc(16, slot=0)


def test_collective_refuses_two_nccl_members_on_one_gpu_before_it_starts():
    """NCCL refuses a group with two ranks on one GPU: colocated GPU roles are refused at config time,
    and the GPUs the members report are checked again when the group forms."""
    from rl_tpu.config import ConfigError, load_config
    from rl_tpu.placement import check_collective_devices, plan_from_config
    from rl_tpu.weight_sync.transports import check_distinct_gpus

    gpu = ["--trainer.device=cuda", "--sync.transport=collective"]
    cfg = load_config(None, gpu)
    with pytest.raises(ConfigError, match="NCCL refuses a trainer rank and an engine on one GPU"):
        check_collective_devices(cfg, plan_from_config(cfg, 8))  # sync mode: colocated
    for ok in (
        [*gpu, "--cluster.placement=disaggregated"],
        [*gpu, "--cluster.mode=async"],  # auto: disaggregated
        ["--trainer.device=cuda"],  # another transport
        ["--sync.transport=collective"],  # CPU roles: gloo
    ):
        cfg = load_config(None, ok)
        check_collective_devices(cfg, plan_from_config(cfg, 8))
    check_distinct_gpus({"trainer rank 0": "GPU-a", "engine 0 rank 0": "GPU-b"})
    with pytest.raises(ValueError, match=r"trainer rank 1 and engine 0 rank 0 are on one GPU \(GPU-b\)"):
        check_distinct_gpus(
            {"trainer rank 0": "GPU-a", "trainer rank 1": "GPU-b", "engine 0 rank 0": "GPU-b"}
        )


def test_wire_packs_into_and_reads_from_tensor_buffers_like_host_buffers():
    tensors = [
        ("a@0", torch.arange(6, dtype=torch.float32)),
        ("b@3", torch.arange(3, dtype=torch.int64)),
        ("c@0", torch.empty(0, dtype=torch.float32)),
    ]
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
    for needle in (
        "missing1",
        "missing2",
        "extra",
        "a: trainer [2, 2] vs engine [2, 3]",
        "2 missing, 1 unexpected, 1 mis-shaped",
    ):
        assert needle in msg
    check_names(engine, engine)  # no error when they agree


def test_hf_row_map_follows_adapter_row_permutation():
    m = hf_row_map(specs(), to_hf)
    tid, runs = m["q"]
    assert specs()[tid].name == "wq"
    assert runs.tolist() == [[i, int(PERM[i]), 1] for i in range(6)]  # every row its own run
    tid, runs = m["k"]
    assert specs()[tid].name == "wk" and runs.tolist() == [[0, 0, 5]]  # one run of all 5 rows
    assert m["norm"][1].tolist() == [[0, 0, 4]]  # 1-D: [4, 1]


def test_adapter_that_transposes_is_refused_by_name():
    def transposing(sd):
        return {"q": sd["wq"].t()}

    with pytest.raises(ValueError, match="'q'.*across columns"):
        hf_row_map(specs()[:1], transposing)


def test_unsupported_placement_is_named():
    sp = [
        ParamSpec(
            name="wq",
            shape=(6, 4),
            dtype="float32",
            mesh_shape=(2,),
            mesh_dim_names=("tp",),
            placements=("S(1)",),
        )
    ]
    hf_order = [("q", (6, 4))]
    lay = EngineLayout(
        tp_rank=0,
        tp_size=1,
        dtype="float32",
        shapes={"q": (6, 4)},
        runs={"q": np.array([[0, 0, 6, 4, 0, 0, 0]])},
    )
    with pytest.raises(NotImplementedError, match="wq: placement S\\(1\\)"):
        build_plan(sp, {"q": (0, np.array([[0, 0, 6]]))}, hf_order, [((0, 0), lay)], 1 << 20)


def test_checkpoint_shapes_reads_headers_of_a_file_or_a_folder(tmp_path):
    from safetensors.torch import save_file

    from rl_tpu.rollout.worker import payload_shapes
    from rl_tpu.weight_sync.names import checkpoint_shapes

    save_file({"a.weight": torch.zeros(3, 2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b.bias": torch.zeros(5)}, str(tmp_path / "model-2.safetensors"))
    assert checkpoint_shapes(tmp_path) == {"a.weight": (3, 2), "b.bias": (5,)}
    assert checkpoint_shapes(tmp_path / "model-2.safetensors") == {"b.bias": (5,)}
    assert payload_shapes((tmp_path / "model-1.safetensors").read_bytes()) == [("a.weight", (3, 2))]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_shapes(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .safetensors"):
        checkpoint_shapes(tmp_path / "empty")


def test_auto_route_takes_cuda_ipc_only_where_every_engine_rank_maps_the_senders_gpu():
    from rl_tpu.weight_sync.installers import auto_route

    assert auto_route(True, "GPU-a", [["GPU-a", "GPU-b"], ["GPU-a"]]) == "cuda_ipc"
    assert auto_route(True, "GPU-a", [["GPU-a"], ["GPU-b"]]) == "shm"  # one TP rank cannot map it
    assert auto_route(True, None, [["GPU-a"]]) == "shm"  # a CPU trainer rank
    assert auto_route(True, "GPU-a", []) == "shm"  # a CPU engine
    assert auto_route(False, "GPU-a", [["GPU-a"]]) == "ray"  # another node: no IPC, no shared memory


def test_cuda_ipc_handle_of_an_invisible_gpu_is_refused_naming_it():
    from rl_tpu.weight_sync.transports import get_transport

    handle = {"uuid": "GPU-not-here", "nbytes": 8, "offset": 0, "storage": [b"", 8, 0], "ref": [b"", 0]}
    with pytest.raises(RuntimeError, match="GPU-not-here is not visible"):
        get_transport("cuda_ipc").open({**handle, "event": [b"", False]})
