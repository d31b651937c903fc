"""`collective`: torch.distributed point-to-point over one extra process group of trainer ranks and engine
workers (`join_group`), and the bounded wait on its work."""

from __future__ import annotations

from .base import Transport, pooled


class Collective(Transport):
    """Point-to-point sends over the group made by `join_group`. Group ranks: senders first (trainer rank
    r is r), then the plan's receivers in order (receiver i is `senders + i`).

    Order, which NCCL needs (it matches sends to receives by posting order per pair and ignores tags): the
    receiver posts its receive for a bucket (`post`, into a reused buffer of the bucket's known size)
    before it asks the sender to pack it, and the sender's send is posted as soon as the bucket is
    packed, so no send ever waits on a receive that is not there. NCCL connects a pair on its first
    point-to-point operation, inside that operation, and only once both peers are in one: a receive
    posted first would block until the sender posts, while the sender waits to be asked for the bucket.
    So `join_group`, where every member is present, runs one exchange over every (sender, receiver) pair
    (`_connect_pairs`; torch's `batch_isend_irecv` states the same rule: the group's first p2p call needs
    every rank), after which a posted operation returns at once. On NCCL every operation runs as its own
    coalesced group, on the communicator `join_group` connected eagerly. gloo runs the same order and
    matches by tag (the bucket id), so the default CPU suite exercises it; tests/integration/
    test_collective_order.py also runs it over a process group that behaves as NCCL does on a pair's first
    operation. Waits are bounded (`timeout_s` of the group) and name the peer.

    A handle is (source rank, bucket id, nbytes); the receiver checks the bucket id in the header too,
    so a broken order fails loudly instead of installing the wrong bytes. The sender's buffer stays alive
    until its send completes (waited on before the slot is reused, or at `leave_group`)."""

    name = "collective"
    _group: dict = {}  # per process: pg, rank, senders, device, coalesce, timeout_s, store
    _pool: dict = {}  # slot -> uint8 tensor (sender) or ("recv", slot) -> uint8 tensor (receiver)
    _inflight: dict = {}  # slot -> (Work of the last send from that slot, buffer, receiver rank)
    _posted: dict = {}  # (source rank, bucket id) -> (Work of the posted receive, buffer, slot)

    @classmethod
    def _g(cls) -> dict:
        if not cls._group:
            raise RuntimeError(
                "collective weight sync: this process has not joined the sync group "
                "(WeightSync.build() forms it; was the group closed?)"
            )
        return cls._group

    @classmethod
    def _buffer(cls, key, nbytes: int):
        return pooled(cls._pool, key, nbytes, cls._g()["device"])

    @classmethod
    def _p2p(cls, op: str, buf, peer: int, tag: int):
        g = cls._g()
        pg = g["pg"]
        if not g["coalesce"]:
            return getattr(pg, op)([buf], peer, tag)
        pg._start_coalescing(g["device"])
        getattr(pg, op)([buf], peer, tag)
        return pg._end_coalescing(g["device"])

    def alloc(self, nbytes, slot=None):
        if slot is None:  # one-off buffer, kept alive with its send
            buf = pooled(None, None, nbytes, self._g()["device"])
            return (buf, ("once", id(buf))), buf
        prev = self._inflight.pop(slot, None)
        if prev is not None:
            wait_work(prev[0], self._g()["timeout_s"], f"the send to sync group rank {prev[2]}")
        buf = self._buffer(slot, nbytes)
        return (buf, slot), buf

    def publish(self, state, peer=None, bucket=None):
        if peer is None or bucket is None:
            raise ValueError("collective transport: publish needs the receiver index (peer) and the bucket")
        buf, key = state
        g = self._g()
        dst = g["senders"] + peer
        self._inflight[key] = (self._p2p("send", buf, dst, bucket), buf, dst)
        return (g["rank"], bucket, buf.numel())

    @classmethod
    def post(cls, src: int, bucket: int, nbytes: int, slot) -> None:
        """Receiver: post the receive of `bucket` (`nbytes` packed) from sync group rank `src` into the
        reused buffer of `slot`, before the sender is asked for it."""
        if (src, bucket) in cls._posted or any(x[2] == slot for x in cls._posted.values()):
            raise RuntimeError(
                f"collective weight sync: bucket {bucket} from rank {src} posted twice, or into the "
                f"buffer of slot {slot} while a receive into it is still open"
            )
        buf = cls._buffer(("recv", slot), nbytes)
        cls._posted[(src, bucket)] = (cls._p2p("recv", buf, src, bucket), buf, slot)

    def open(self, handle):
        src, bucket, nbytes = handle
        try:
            work, buf, _ = self._posted.pop((src, bucket))
        except KeyError:
            raise RuntimeError(
                f"collective weight sync: bucket {bucket} from trainer rank {src} arrived with no receive "
                "posted for it (Collective.post must come before the sender packs)"
            ) from None
        if buf.numel() != nbytes:
            raise RuntimeError(
                f"collective weight sync: bucket {bucket} from trainer rank {src} is {nbytes} bytes, the "
                f"receive was posted for {buf.numel()} (do sender and receiver hold the same plan?)"
            )
        wait_work(work, self._g()["timeout_s"], f"bucket {bucket} from trainer rank {src}")
        return buf


def wait_work(work, timeout_s: float, what: str) -> None:
    """Wait for a torch.distributed Work at most `timeout_s`, raising a `TimeoutError` that says `what`
    never completed. NCCL's `wait` only orders streams, so its completion is polled; gloo's point-to-point
    work completes only inside `wait`, which takes the timeout itself."""
    import datetime
    import time

    if Collective._group.get("coalesce"):  # nccl
        deadline, delay = time.monotonic() + timeout_s, 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise _timed_out(what, timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if "imed out" in str(e) or "imeout" in str(e):
            raise _timed_out(what, timeout_s) from e
        raise RuntimeError(f"weight sync (collective transport): {what} failed: {e}") from e


def _timed_out(what: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(
        f"weight sync (collective transport): {what} did not complete within {timeout_s:.0f} s; "
        "is that process alive?"
    )


def group_backend(devices: list[str]) -> str:
    """One backend for every member of the sync group: nccl only if every member's parameters are on
    CUDA (members of one group cannot mix backends), else gloo on host buffers (CUDA members stage
    through host memory; TPU/XLA receivers copy into their device parameters)."""
    import torch

    return "nccl" if devices and all(torch.device(d).type == "cuda" for d in devices) else "gloo"


def check_distinct_gpus(members: dict[str, str]) -> None:
    """NCCL refuses a group with two ranks on one GPU ("Duplicate GPU detected"): a ValueError naming the
    first two `members` (label -> GPU UUID) that share one."""
    first: dict[str, str] = {}
    for who, uuid in members.items():
        if uuid in first:
            raise ValueError(
                f"sync.transport = collective: {first[uuid]} and {who} are on one GPU ({uuid}), which NCCL "
                "refuses in one group; use sync.transport = auto (CUDA IPC between them) or give each "
                "its own GPU"
            )
        first[uuid] = who


def join_group(
    host: str,
    port: int,
    world: int,
    rank: int,
    senders: int,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 300.0,
) -> int:
    """Join the weight-sync process group as `rank` of `world` (all members must call it concurrently;
    the TCP store at host:port is the driver's). `backend` is the group's (`group_backend`); with nccl
    the communicator is connected now on `device` (every member is in this call), not at the first op."""
    import datetime

    import torch
    import torch.distributed as dist

    leave_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(
        "rl_tpu_ws", dist.TCPStore(host, port, world + 1, is_master=False, timeout=timeout)
    )
    if backend == "nccl":
        pg, dev = nccl_group(store, rank, world, timeout, device)
    elif backend == "gloo":
        dev = torch.device("cpu")
        pg = dist.ProcessGroupGloo(store, rank, world, timeout)
    else:
        raise ValueError(f"weight sync group backend {backend!r}: choose nccl or gloo")
    Collective._group.update(
        pg=pg,
        rank=rank,
        senders=senders,
        device=dev,
        coalesce=backend == "nccl",
        timeout_s=timeout_s,
        store=store,
    )
    _connect_pairs()
    return rank


def nccl_group(store, rank: int, world: int, timeout, device: str):
    """An NCCL process group with its communicator built now on this member's GPU (every member is in
    `join_group`), and that device."""
    import torch
    import torch.distributed as dist

    dev = torch.device(device)
    dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, world, opts)
    pg.eager_connect_single_device(dev)
    return pg, dev


CONNECT_TAG = 2**31 - 1  # the pair exchange's tag (gloo matches by tag; bucket ids are smaller)


def _connect_pairs() -> None:
    """One byte from every sender to every receiver, each member's operations posted together and waited
    for, while every member is in `join_group`: the pairs a sync uses are connected before any bucket."""
    import torch

    g = Collective._g()
    rank, senders, world = g["rank"], g["senders"], g["pg"].size()
    peers = range(senders, world) if rank < senders else range(senders)
    op = "send" if rank < senders else "recv"
    bufs = {p: torch.full((1,), rank, dtype=torch.uint8, device=g["device"]) for p in peers}
    pg = g["pg"]
    if g["coalesce"]:
        pg._start_coalescing(g["device"])
        for p in peers:
            getattr(pg, op)([bufs[p]], p, CONNECT_TAG)
        works = [pg._end_coalescing(g["device"])]
    else:
        works = [getattr(pg, op)([bufs[p]], p, CONNECT_TAG) for p in peers]
    for w in works:
        wait_work(w, g["timeout_s"], f"sync group rank {rank}'s first exchange with its peers")
    if op == "recv" and any(int(bufs[p].item()) != p for p in peers):
        raise RuntimeError(f"weight sync group: rank {rank}'s first exchange got the wrong bytes")


def leave_group() -> None:
    """Wait for this process's sends, drop its buffers, posted receives and its group membership."""
    timeout = Collective._group.get("timeout_s", 300.0)
    for work, _, dst in Collective._inflight.values():
        wait_work(work, timeout, f"the send to sync group rank {dst}")
    Collective._inflight.clear()
    Collective._posted.clear()
    Collective._pool.clear()
    Collective._group.clear()
