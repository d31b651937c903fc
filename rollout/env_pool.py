"""EnvPool: multi-turn environments (`rollout.env`) in contained worker processes, an instance per trajectory.

An environment instance keeps state between its trajectory's turns, so every call of a trajectory must reach
the process holding its instance, and killing a process loses every instance in it. Hence:

- `workers` processes, each started by `rl_tpu.containment.start` (a fresh interpreter in a process group
  of its own, an address-space limit, an environment-variable allow-list, bubblewrap if asked), as tools
  are. Each holds many instances, keyed by a trajectory id: `reset` makes one on the live worker holding
  the fewest, `step` goes to the worker holding it, `release` deletes it (its trajectory ended).
- In a worker (rollout/env_worker.py), each call runs on a thread of its own (an `async` method on the
  worker's event loop, its thread waiting), so a slow call of one instance holds up no other instance there.
- A call running past `timeout_s` (its clock starts once its worker is ready) is given up: its future
  answers a timeout, and its worker is drained: it takes no new instance, a fresh worker takes its place,
  and it is killed (its whole process group) once its other instances are released, or at `close`. A
  hang ends its own trajectory, nothing else.
- A worker that dies (a segfault, `os._exit`, a kill at its memory limit) answers its calls, and every
  later call of its instances, with an error naming its exit code; a fresh worker takes its place.
- A return value of the wrong shape (`check_opening`, `check_answer`: the checks run in the worker, for
  the message, and again on what reaches the driver) is an `EnvError` raised by the call's future: a bug
  in the class, which stops the run.
- The class is loaded by spec string in each worker (never pickled), and in the driver too (`load_env`:
  the early checks). A worker that fails to load it or does not start within `startup_timeout_s` is a
  one-line `EnvError` naming the spec: from the constructor, or from `reset` once three replacements in
  a row have failed to start.
- Workers answer in JSON: the driver unpickles nothing a worker sends, so an environment cannot run code
  in the driver through its answers. Messages therefore hold what JSON can write.

Data flow (who does what, waits on what, and what unblocks it):

- the caller (`MultiTurn`'s run thread): `reset` and `step` (a future each), `release`; waits on the
  futures, which the pump settles;
- the pump (one thread per pool): reads answers, enforces deadlines, replaces and kills workers; waits on
  the workers' connections and a wake-up socket (an answer, a death, a new call) or the next deadline;
- a sender (one thread per worker): writes the calls queued for its worker; waits on the worker reading
  (unblocked by the worker, or its kill), so a worker slow to read never blocks the caller or the pump;
- a worker: runs each call on a thread of its own and answers each as it finishes; waits on its
  connection.
"""

from __future__ import annotations

import itertools
import json
import logging
import pickle
import queue
import socket
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_conns
from typing import Any

from rl_tpu.call_pool import CallResult
from rl_tpu.containment import DEFAULT_ENV_ALLOW, Limits, WorkerProcess, start, worker_limits
from rl_tpu.rollout import verl_interactions
from rl_tpu.rollout.multi_turn import EnvError, load_env
from rl_tpu.user_code import IMPORT_TIMEOUT_S, resolve_spec

log = logging.getLogger(__name__)

MAX_FAILED_STARTS = 3  # replacement workers in a row that fail to start before `reset` raises
POLL_S = 1.0  # the pump checks its workers are alive at least this often


# ---------------------------------------------------------------------------------------------------
# parent side


@dataclass(eq=False)
class _Call:
    id: int
    tid: int
    kind: str  # "reset" or "step"
    future: Future
    since: float | None = None  # when its clock started (its worker ready); None: not yet


@dataclass(eq=False)
class _Worker:
    proc: WorkerProcess
    outbox: queue.SimpleQueue  # pickled calls for the sender thread; None stops it
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    draining: bool = False  # gave up on a call: no new instances, killed once `homes` is empty
    homes: set[int] = field(default_factory=set)  # trajectories whose instance lives here
    calls: dict[int, _Call] = field(default_factory=dict)  # sent and neither answered nor given up


def _send_loop(conn, outbox: queue.SimpleQueue) -> None:
    """A worker's sender thread: a worker slow to read blocks this thread, never the caller or the pump."""
    while (data := outbox.get()) is not None:
        try:
            conn.send_bytes(data)
        except (OSError, ValueError):  # the worker died or was killed: the pump answers its calls
            return


def _kill_all(workers: list[_Worker], lock: threading.Lock) -> None:
    with lock:
        for w in workers:
            w.outbox.put(None)
            w.proc.kill()
        workers.clear()


def _settle(done: list[tuple[Future, Any]]) -> None:
    for fut, value in done:
        try:
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)
        except InvalidStateError:  # cancelled by `release` meanwhile
            pass


# a pool's limits when not given (`from_config` takes the run's)
ENV_LIMITS = Limits(memory_mb=4096, env_allow=DEFAULT_ENV_ALLOW)


class EnvPool:
    """Instances of the environment class `spec` names, in `workers` contained processes (see the module
    docstring). `reset`, `step` and `release` may be called from any thread; `close` kills every worker."""

    def __init__(
        self,
        spec: str,
        *,
        workers: int = 2,
        timeout_s: float = 30.0,
        limits: Limits = ENV_LIMITS,
        startup_timeout_s: float = IMPORT_TIMEOUT_S,
        field_name: str = "rollout.env",
    ):
        # `limits`: each worker's (memory, processes, CPU time, environment, sandbox: rl_tpu/containment.py)
        self.cls = load_env(spec, field_name)  # the driver's checks: a bad spec fails here, in one line
        self.name = self.cls.__name__
        self.spec = (
            verl_interactions.resolve(spec)
            if verl_interactions.is_interaction_config(spec)
            else resolve_spec(spec)
        )
        self.field_name = field_name
        self.timeout_s, self.startup_timeout_s = float(timeout_s), float(startup_timeout_s)
        self.size = max(1, workers)
        self.limits = limits
        self.timeouts = self.deaths = 0  # calls given up, workers lost
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []  # started and not killed, draining ones included
        # trajectory id -> the worker holding its instance, or why that is gone
        self._homes: dict[int, _Worker | str] = {}
        self._ids, self._call_ids = itertools.count(), itertools.count()
        self._failed_starts = 0  # replacement workers in a row that did not start
        self._broken: str | None = None  # why no worker can be started any more
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        # kills the workers on `close`, or at exit if it never came
        self._finalizer = weakref.finalize(self, _kill_all, self._workers, self._lock)
        self._pump_thread: threading.Thread | None = None
        try:
            for _ in range(self.size):
                self._workers.append(self._spawn())
            self._wait_started()
        except BaseException:
            self.close()
            raise
        self._pump_thread = threading.Thread(target=self._pump, name="rl_tpu-env-pump", daemon=True)
        self._pump_thread.start()

    @classmethod
    def from_config(cls, rc) -> EnvPool:
        """The environment of a run's `rollout` section (`RolloutConfig`), with its limits."""
        return cls(
            rc.env,
            workers=rc.env_workers,
            timeout_s=rc.env_timeout_s,
            limits=worker_limits(rc, rc.env_memory_mb),
        )

    @property
    def worker_pids(self) -> list[int]:
        """The workers taking new instances (not the draining ones)."""
        with self._lock:
            return [w.proc.pid for w in self._workers if not w.draining]

    # -- calls ---------------------------------------------------------------------------------------

    def reset(self, sample: dict) -> tuple[int, Future]:
        """A new instance for a trajectory, on the live worker holding the fewest, and its `reset(sample)`:
        the trajectory's id and a future of a `CallResult` (the opening messages, or the error or timeout
        that ended it), which raises `EnvError` when they break the interface."""
        with self._lock:
            self._check_open()
            live = [w for w in self._workers if not w.draining]
            if not live:
                raise EnvError(self._broken or f"{self.field_name} {self.spec!r}: no environment worker")
            w = min(live, key=lambda w: (len(w.homes), not w.ready))
            tid = next(self._ids)
            self._homes[tid] = w
            w.homes.add(tid)
            fut = self._send(w, "reset", tid, sample)
        self._wake()
        return tid, fut

    def step(self, tid: int, messages: list[dict]) -> Future:
        """The instance's `step(messages)`: a future of a `CallResult` holding `(new_messages, reward,
        done, info)` (`info` `{}` where `step` gave none), or the error or timeout that ended it; it
        raises `EnvError` when they break the interface."""
        with self._lock:
            self._check_open()
            home = self._homes[tid]
            if isinstance(home, str):  # its worker died
                fut: Future = Future()
                fut.set_result(CallResult(error=home))
                return fut
            fut = self._send(home, "step", tid, messages)
        self._wake()
        return fut

    def release(self, tid: int) -> None:
        """Delete the trajectory's instance (idempotent); a call of it still running is given up."""
        with self._lock:
            home = self._homes.pop(tid, None)
            if not isinstance(home, _Worker) or home not in self._workers:
                return
            home.homes.discard(tid)
            for c in [c for c in home.calls.values() if c.tid == tid]:
                del home.calls[c.id]
                c.future.cancel()
            home.outbox.put(pickle.dumps(("release", tid)))
        self._wake()  # a drained worker may now be empty

    def close(self) -> None:
        """Kill every worker (idempotent); calls still waiting answer an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            done = [
                (c.future, CallResult(error="the environment pool was closed"))
                for w in self._workers
                for c in w.calls.values()
            ]
        self._wake()
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=10)
        self._finalizer()
        _settle(done)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EnvPool used after close()")

    def _send(self, w: _Worker, kind: str, tid: int, arg: Any) -> Future:
        call = _Call(next(self._call_ids), tid, kind, Future(), since=time.monotonic() if w.ready else None)
        w.outbox.put(pickle.dumps((kind, call.id, tid, arg)))
        w.calls[call.id] = call
        return call.future

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed
            pass

    # -- workers -------------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        proc = start(
            "rl_tpu.rollout.env_worker:worker_main",
            (self.spec, self.field_name),
            self.limits,
            name=f"rl-tpu-env-{self.name}",
        )
        w = _Worker(proc=proc, outbox=queue.SimpleQueue())
        threading.Thread(
            target=_send_loop, args=(proc.conn, w.outbox), name="rl_tpu-env-send", daemon=True
        ).start()
        return w

    def _not_started(self, why: str) -> str:
        return f"{self.field_name} {self.spec!r}: an environment worker {why}"

    def _wait_started(self) -> None:
        """The constructor's wait for its first workers: an `EnvError` unless all start in time."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(w.ready for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise EnvError(
                    self._not_started(
                        f"did not start within {self.startup_timeout_s:g} s (does the module block or loop "
                        "at import time? move that work into reset)"
                    )
                )
            for conn in wait_conns([w.proc.conn for w in self._workers if not w.ready], timeout=left):
                w = next(w for w in self._workers if w.proc.conn is conn)
                msg = self._recv(w)
                if msg is None:
                    w.proc.join(timeout=5)
                    raise EnvError(
                        self._not_started(f"exited while loading it (exit code {w.proc.exitcode})")
                    )
                if msg[0] == "load_error":
                    raise EnvError(str(msg[1]))
                w.ready = msg[0] == "ready"

    def _recv(self, w: _Worker) -> list | None:
        """The worker's next message, or None when it is gone or sent something that is not one."""
        try:
            msg = json.loads(w.proc.conn.recv_bytes())
        except Exception:  # noqa: BLE001 - EOF, a closed connection, bytes that are not our JSON
            return None
        return msg if isinstance(msg, list) and msg and isinstance(msg[0], str) else None

    def _pump(self) -> None:
        try:
            while self._pump_once():
                pass
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave callers waiting forever
            log.exception("the environment pool's pump failed")
            with self._lock:
                self._broken = f"the environment pool failed: {type(e).__name__}: {e}"
                done = [
                    (c.future, RuntimeError(self._broken)) for w in self._workers for c in w.calls.values()
                ]
                for w in self._workers:
                    w.calls.clear()
                    w.draining = True
            _settle(done)

    def _pump_once(self) -> bool:
        """Wait for the next answer, death or deadline and act on it; False once the pool is closed."""
        with self._lock:
            if self._closed:
                return False
            conns = [w.proc.conn for w in self._workers]
            wait_s = self._next_wait()
        ready = wait_conns([*conns, self._wake_r], timeout=wait_s)
        done: list[tuple[Future, Any]] = []
        with self._lock:
            if self._closed:
                return False
            if self._wake_r in ready:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:  # BlockingIOError: nothing more to read
                    pass
            for conn in ready:
                w = next((w for w in self._workers if w.proc.conn is conn), None)
                if w is not None:
                    self._read(w, done)
            self._check(done)
        _settle(done)
        return True

    def _next_wait(self) -> float:
        now, ends = time.monotonic(), [time.monotonic() + POLL_S]
        for w in self._workers:
            if not w.ready:
                ends.append(w.started + self.startup_timeout_s)
            ends += [c.since + self.timeout_s for c in w.calls.values() if c.since is not None]
        return max(0.0, min(ends) - now)

    def _read(self, w: _Worker, done: list) -> None:
        """Every message `w` has sent so far."""
        while w in self._workers:
            try:
                if not w.proc.conn.poll():
                    return
            except (OSError, ValueError):
                pass
            msg = self._recv(w)
            if msg is None:
                w.proc.join(timeout=1)
                self._lost(w, f"its worker process died (exit code {w.proc.exitcode})", done)
                return
            try:
                self._answer(w, msg, done)
            except (IndexError, KeyError, TypeError, ValueError):
                self._lost(w, f"its worker sent a malformed message {msg!r:.100}", done)

    def _answer(self, w: _Worker, msg: list, done: list) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready, self._failed_starts = True, 0
            for c in w.calls.values():
                c.since = time.monotonic()
        elif kind == "load_error":  # a replacement cannot load what its predecessors loaded
            self._lost(w, f"its worker could not load the class: {msg[1]}", done)
        elif kind in ("ok", "err", "bad"):
            call = w.calls.pop(msg[1], None)
            if call is None:  # given up (timed out) or released
                return
            if kind == "ok":
                value = tuple(msg[2]) if call.kind == "step" else msg[2]
                done.append((call.future, CallResult(value=value)))
            elif kind == "err":
                done.append((call.future, CallResult(error=f"raised {msg[2]}", traceback=str(msg[3]))))
            else:
                done.append((call.future, EnvError(str(msg[2]))))
        else:
            raise ValueError(kind)

    def _check(self, done: list) -> None:
        """Deadlines, deaths and drained workers with nothing left in them."""
        now = time.monotonic()
        for w in list(self._workers):
            if w.proc.exitcode is not None:
                self._read(w, done)  # what it answered before it died; then its end of file
                if w in self._workers:  # a process it started holds its connection open
                    self._lost(w, f"its worker process died (exit code {w.proc.exitcode})", done)
            elif not w.ready:
                if now - w.started > self.startup_timeout_s:
                    self._lost(w, f"its worker did not start within {self.startup_timeout_s:g} s", done)
            else:
                late = [c for c in w.calls.values() if c.since is not None and now - c.since > self.timeout_s]
                for c in late:
                    del w.calls[c.id]
                    self.timeouts += 1
                    error = f"timed out after {self.timeout_s:g} s (rollout.env_timeout_s)"
                    done.append((c.future, CallResult(error=error, timeout=True)))
                    self._drain(w)
                if w.draining and not w.homes:
                    self._retire(w)

    def _drain(self, w: _Worker) -> None:
        if w.draining:
            return
        w.draining = True
        log.info(
            "%s: a call ran past rollout.env_timeout_s = %g s; its worker (pid %d) takes no new trajectories "
            "and is killed once its %d others end",
            self.name,
            self.timeout_s,
            w.proc.pid,
            len(w.homes) - 1,
        )
        self._replace()

    def _retire(self, w: _Worker) -> None:
        self._workers.remove(w)
        w.outbox.put(None)
        w.proc.kill()

    def _lost(self, w: _Worker, why: str, done: list) -> None:
        """`w` is dead or unusable: kill it; its calls, and the later calls of its instances, answer `why`;
        a fresh worker takes its place (unless it was draining: its replacement runs already)."""
        self.deaths += 1
        if not w.ready:
            self._failed_starts += 1
        elif not w.draining:
            log.warning(
                "%s: an environment worker (pid %d) is lost: %s; its %d trajectories end with an env error",
                self.name,
                w.proc.pid,
                why,
                len(w.homes),
            )
        self._retire(w)
        for c in w.calls.values():
            done.append((c.future, CallResult(error=why)))
        w.calls.clear()
        for tid in w.homes:
            self._homes[tid] = why
        if not w.draining:
            self._replace()

    def _replace(self) -> None:
        """Start a worker to take new instances, unless too many in a row failed to start."""
        if self._failed_starts >= MAX_FAILED_STARTS:
            self._broken = self._not_started(f"failed to start {self._failed_starts} times in a row")
            return
        if sum(not w.draining for w in self._workers) >= self.size:
            return
        try:
            self._workers.append(self._spawn())
        except Exception as e:  # noqa: BLE001 - bubblewrap gone, say: `reset` raises it once no worker is left
            self._broken = self._not_started(f"could not be started: {type(e).__name__}: {e}")
