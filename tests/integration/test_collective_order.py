"""The collective transport's exchange order, between two real processes over its own gloo group.

NCCL matches point-to-point operations by posting order and ignores tags, and a send on a lazily built
communicator blocks until the peer joins; so the transport posts every receive before the sender is asked
for the bucket, and each side's waits are bounded and name the peer. gloo runs the same code path (it
matches by tag = bucket id as well), which is what these tests drive: the end-to-end syncs into one and
two vLLM engines are in tests/integration/test_weight_sync.py (`collective`).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest
import torch

from rl_tpu.weight_sync import transports
from rl_tpu.weight_sync.transports import Collective, join_group, leave_group
from rl_tpu.weight_sync.wire import begin_pack, bucket_meta, bucket_nbytes, unpack

BUCKETS = {5: 1000, 9: 37, 2: 4096}  # bucket id -> elements, in the order the receiver installs them


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _values(bucket: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 0.5 + bucket


def _member(rank: int, port: int, mode: str, out) -> None:
    import torch.distributed as dist

    try:
        if rank == 0:  # the driver's store, as WeightSync._form_group hosts it
            store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
        join_group("127.0.0.1", port, 2, rank, senders=1, backend="gloo", timeout_s=3.0)
        tr = Collective()
        if rank == 0:  # the sender: packs each bucket into one of two reused slots and sends it
            sent = []
            for k, (b, n) in enumerate(BUCKETS.items()):
                if mode != "normal" and k == 1:
                    if mode == "silent_sender":  # alive but silent, past the receiver's timeout
                        time.sleep(6)
                    break
                state, buf = tr.alloc(bucket_nbytes(torch.float32, n, 3, b), slot=(0, k % 2))
                begin_pack(buf, "data", torch.float32, n, bucket_meta(3, b)).copy_(_values(b, n))
                sent.append(tr.publish(state, peer=0, bucket=b))
            out.put(("sent", sent))
        else:  # the receiver, as SyncReceiver.ws_sync runs it: two receives posted ahead, in install order
            items = list(BUCKETS.items())
            size = {b: bucket_nbytes(torch.float32, n, 3, b) for b, n in items}
            for k, (b, _) in enumerate(items[:2]):
                Collective.post(0, b, size[b], (0, k % 2))
            got = {}
            for k, (b, n) in enumerate(items):
                buf = tr.open((0, b, size[b]))
                views, meta = unpack(buf)
                got[b] = (meta["bucket"], bool(torch.equal(views["data"], _values(b, n))))
                del views, buf
                if k + 2 < len(items):  # its slot is free again: the receive two rounds ahead
                    Collective.post(0, items[k + 2][0], size[items[k + 2][0]], (0, k % 2))
            out.put(("got", got))
        leave_group()
    except Exception as e:  # reported to the test, which names it
        out.put(("error", f"{type(e).__name__}: {e}"))


def _run(mode: str) -> dict:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_member, args=(r, port, mode, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return dict(results) if mode == "normal" else {k: v for k, v in results}


def test_collective_receives_posted_first_deliver_every_bucket_bit_exact():
    res = _run("normal")
    assert "error" not in res, res
    assert [h[1] for h in res["sent"]] == list(BUCKETS)  # handles carry the bucket id, not a counter
    assert res["got"] == {b: (str(b), True) for b in BUCKETS}


@pytest.mark.parametrize("mode", ["silent_sender", "dead_sender"])
def test_collective_wait_is_bounded_and_names_the_peer(mode):
    res = _run(mode)  # the sender sends bucket 5 only, then stays silent or exits
    assert "error" in res, res
    assert "bucket 9 from trainer rank 0" in res["error"], res["error"]
    if mode == "silent_sender":
        assert res["error"].startswith("TimeoutError") and "within 3 s" in res["error"], res["error"]


def test_collective_receive_into_a_busy_slot_is_refused():
    class _Work:  # a posted receive that has not completed
        pass

    transports.Collective._group.update(device=torch.device("cpu"), timeout_s=1.0)
    transports.Collective._posted[(0, 5)] = (_Work(), torch.empty(8, dtype=torch.uint8), (0, 0))
    try:
        with pytest.raises(RuntimeError, match="still open"):
            Collective.post(0, 2, 16, (0, 0))
    finally:
        transports.Collective._posted.clear()
        transports.Collective._group.clear()


def test_collective_open_without_a_posted_receive_is_an_error_not_a_hang():
    transports.Collective._group.update(timeout_s=1.0)
    try:
        with pytest.raises(RuntimeError, match="no receive posted"):
            Collective().open((0, 4, 128))
    finally:
        transports.Collective._group.clear()


def test_group_backend_is_one_for_all_members():
    from rl_tpu.weight_sync.transports import group_backend

    assert group_backend(["cuda:0", "cuda:1"]) == "nccl"
    assert group_backend(["cuda:0", "cpu"]) == "gloo"  # a CPU engine: every member on gloo
    assert group_backend(["cpu", "cpu"]) == "gloo"
