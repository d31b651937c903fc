"""The collective transport's exchange order, between two real processes over its own group.

NCCL matches point-to-point operations by posting order and ignores tags, and it connects a pair inside
the pair's first operation, blocking until the peer is in one too; so the transport posts every receive
before the sender is asked for the bucket, connects every pair while all members are in `join_group`, and
each side's waits are bounded and name the peer. gloo runs the same code path (it matches by tag = bucket
id as well); `PairConnectingGroup` is a gloo group that behaves as NCCL does on a pair's first operation
(blocks for the peer; here it raises after a few seconds instead of hanging), under which the `nccl`
tests run the transport as the sync runs it: the sender packs a bucket only once the receiver has posted
its receive and asked for it. The end-to-end syncs into one and two vLLM engines are in
tests/integration/test_weight_sync.py (`collective`).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import threading
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


def _spawn(target, *args) -> list[tuple[str, object]]:
    """Ranks 0 and 1 as `target(rank, port, *args, out)` in spawned processes; what each put on `out`."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results


def _run(mode: str) -> dict:
    return dict(_spawn(_member, mode))


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


CONNECT_WAIT_S = 5.0  # how long PairConnectingGroup lets a pair's first operation wait for the peer


class PairConnectingGroup:
    """A process group that behaves as NCCL does on a pair's first point-to-point operation: the operation
    (or the coalesced group holding it) connects the pair and blocks until the peer is in an operation
    on that pair too; where NCCL would then hang for good, this raises after CONNECT_WAIT_S. Later
    operations on a connected pair are posted and return at once. Bytes move over gloo."""

    def __init__(self, store, rank: int, world: int, timeout):
        import torch.distributed as dist

        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world, timeout)
        self.store = dist.PrefixStore("connect", store)
        self.rank, self.connected, self.batch = rank, set(), None

    def size(self) -> int:
        return self.gloo.size()

    def eager_connect_single_device(self, device) -> None:
        """NCCL builds the communicator here; its pairs still connect on their first operation."""

    def _start_coalescing(self, device) -> None:
        self.batch = []

    def _end_coalescing(self, device):
        batch, self.batch = self.batch, None
        return self._launch(batch)

    def send(self, tensors, peer: int, tag: int):
        return self._post("send", tensors, peer, tag)

    def recv(self, tensors, peer: int, tag: int):
        return self._post("recv", tensors, peer, tag)

    def _post(self, op, tensors, peer, tag):
        if self.batch is not None:
            self.batch.append((op, tensors, peer, tag))
            return None
        return self._launch([(op, tensors, peer, tag)])

    def _launch(self, batch):
        new = sorted({peer for _, _, peer, _ in batch} - self.connected)
        for peer in new:  # in an operation with `peer`, blocked until it is in one with us
            self.store.set(f"{self.rank}->{peer}", "1")
        for peer in new:
            try:
                self.store.wait([f"{peer}->{self.rank}"], datetime.timedelta(seconds=CONNECT_WAIT_S))
            except Exception:  # noqa: BLE001 - the store's timeout, reported as what NCCL would do
                raise RuntimeError(
                    f"NCCL would hang here: rank {self.rank}'s first operation with rank {peer} waited "
                    f"{CONNECT_WAIT_S:.0f} s for that rank to post one"
                ) from None
            self.connected.add(peer)
        return _Work([getattr(self.gloo, op)(t, peer, tag) for op, t, peer, tag in batch])


class _Work:
    """NCCL's Work as the transport polls it (`is_completed`, then `wait`), over gloo works."""

    def __init__(self, works: list):
        self.done, self.error = threading.Event(), None
        threading.Thread(target=self._run, args=(works,), daemon=True).start()

    def _run(self, works) -> None:
        try:
            for w in works:
                w.wait()
        except Exception as e:  # noqa: BLE001 - re-raised by wait
            self.error = e
        self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout=None) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True


def _nccl_member(rank: int, port: int, connect: bool, asked, out) -> None:
    """One member of a 2-rank `nccl` sync group under PairConnectingGroup, ordered as the sync orders it:
    the receiver posts a bucket's receive, then asks for it (`asked`); only then does the sender pack
    and send it. `connect`: join_group's pair exchange (False: the order before it existed)."""
    import torch.distributed as dist

    from rl_tpu.weight_sync.transports import collective

    collective.nccl_group = lambda store, r, world, timeout, device: (
        PairConnectingGroup(store, r, world, timeout),
        torch.device("cpu"),
    )
    if not connect:
        collective._connect_pairs = lambda: None
    try:
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
        join_group("127.0.0.1", port, 2, rank, senders=1, backend="nccl", timeout_s=20.0)
        tr = Collective()
        if rank == 0:
            for k, (b, n) in enumerate(BUCKETS.items()):
                if not asked.wait(timeout=15):
                    raise TimeoutError(f"the receiver never asked for bucket {b}")
                asked.clear()
                state, buf = tr.alloc(bucket_nbytes(torch.float32, n, 3, b), slot=(0, k % 2))
                begin_pack(buf, "data", torch.float32, n, bucket_meta(3, b)).copy_(_values(b, n))
                tr.publish(state, peer=0, bucket=b)
            out.put(("sent", len(BUCKETS)))
        else:
            got = {}
            for k, (b, n) in enumerate(BUCKETS.items()):
                size = bucket_nbytes(torch.float32, n, 3, b)
                Collective.post(0, b, size, (0, k % 2))
                asked.set()
                views, meta = unpack(tr.open((0, b, size)))
                got[b] = (meta["bucket"], bool(torch.equal(views["data"], _values(b, n))))
                del views
            out.put(("got", got))
        leave_group()
    except Exception as e:  # reported to the test, which names it
        out.put(("error", f"{type(e).__name__}: {e}"))


def _run_nccl(connect: bool) -> list:
    return _spawn(_nccl_member, connect, mp.get_context("spawn").Event())


def test_nccl_order_with_pairs_connected_at_join_delivers_every_bucket():
    results = dict(_run_nccl(connect=True))
    assert "error" not in results, results
    assert results == {"sent": len(BUCKETS), "got": {b: (str(b), True) for b in BUCKETS}}


def test_nccl_first_receive_posted_alone_would_hang_without_the_pair_exchange():
    """The same exchange without join_group's pair exchange (the transport before it): the receiver's
    first receive waits for a sender that waits to be asked, which NCCL never resolves."""
    errors = [v for k, v in _run_nccl(connect=False) if k == "error"]
    assert any("NCCL would hang here: rank 1's first operation with rank 0" in e for e in errors), errors
