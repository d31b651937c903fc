"""CallPool: call user functions, loaded by spec string, in worker processes with a deadline per call.

Rewards (`rl_tpu.rewards.RewardPool`) and tools (`rl_tpu.rollout.tools.Tools`) run user code through it.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot cancel a running call, so one hung function
would stall the run forever. Here each worker is a process of its own (`rl_tpu.containment.start`: a fresh
interpreter, its own process group, the pool's limits) with its own connection; the parent
sends chunks of calls and the worker answers each call as it finishes, so the parent always knows which
call a worker is on and since when. A call running longer than `timeout_s` gets its worker killed
(SIGKILL: works on sleeping, spinning or deadlocked code alike) and replaced; the rest of its chunk is
re-queued. A worker that dies (segfault, `os._exit`) is treated the same way, as an error.

Invariants:
- Functions are loaded by spec string inside each worker (never pickled), so user files only have to
  be importable there; load errors surface in the constructor, which waits for every worker. Workers
  do not re-import the parent's `__main__` (no `if __name__ == "__main__"` guard is needed).
  A module's top-level imports run there, at startup, outside the per-call timeout: a function that
  imports something heavy lazily in its first call can time out, and so can every replacement.
- One call = (function index, kwargs); its clock starts when the worker begins it. Sync and async
  functions alike (one event loop per worker). `check` (a module-level function, run in the worker on
  each return value) turns it into what the caller wants or raises; its exception is the call's error.
- `run` returns one `CallResult` per call, in input order: the value, or the error text ("Type: message",
  "timed out after T s", "worker process died (exit code N)") with a timeout flag. `on_failure(index,
  result)` sees each failure as it happens; if it raises, the busy workers are replaced (none keeps
  working on that batch) and the exception propagates.
- Answers travel as JSON (`_answer`): the parent never unpickles anything a worker sends, so code
  running in a worker cannot run code in the driver through the connection; bytes that are not one of
  our answers cost that worker (replaced) and its call. Calls go to workers pickled (the driver's own).
- The pool is reusable across batches until `close()`. One `run` at a time (not thread-safe). A worker
  killed from outside is replaced; three deaths in a row before a worker reports ready (a crash while
  importing the functions) raise `error_type`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_conns
from typing import Any

from rl_tpu.containment import NO_LIMITS, Limits, start
from rl_tpu.user_code import SpecError, load_callable, resolve_spec

MAX_CHUNK = 64  # calls per message to one worker: amortises pipe latency, keeps re-queues small
MAX_STARTUP_DEATHS = 3  # consecutive worker deaths before "ready" that make the pool give up


@dataclass
class CallResult:
    value: Any = None  # what `check` made of the return value, when the call succeeded
    error: str | None = (
        None  # why it did not: "Type: message", "timed out after T s", "worker process died ..."
    )
    traceback: str | None = None  # the worker's traceback, for an exception
    timeout: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def identity(value: Any) -> Any:
    return value


# ---------------------------------------------------------------------------------------------------
# worker process


def _answer(conn, msg: tuple) -> None:
    """Send `msg` to the parent as JSON: the parent never unpickles what user code produced, so a hostile
    function cannot run code in the driver through its answer. A value JSON cannot write fails its call."""
    try:
        data = json.dumps(msg)
    except (TypeError, ValueError) as e:
        data = json.dumps(("err", msg[1], f"TypeError: the answer cannot be sent as JSON: {e}", ""))
    conn.send_bytes(data.encode())


def _worker_main(conn, init: tuple) -> None:
    """A worker's loop (`containment.start` entry): load the functions, then answer chunks of calls."""
    specs, label, check, load = init
    try:
        fns = [load(s, label) for s in specs]
    except BaseException as e:  # noqa: BLE001 - reported to the parent verbatim
        _answer(conn, ("load_error", str(e), traceback.format_exc()))
        return
    loop = asyncio.new_event_loop()  # one loop per worker: async functions cost no loop setup per call
    _answer(conn, ("ready", os.getpid()))
    while True:
        try:
            tasks = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if tasks is None:
            return
        for call_id, fn_index, kwargs in tasks:
            try:
                out = fns[fn_index](**kwargs)
                if inspect.isawaitable(out):
                    out = loop.run_until_complete(out)
                msg = ("ok", call_id, check(out))
            except BaseException as e:  # noqa: BLE001 - user code may even raise SystemExit
                msg = ("err", call_id, f"{type(e).__name__}: {e}", traceback.format_exc())
            _answer(conn, msg)


# ---------------------------------------------------------------------------------------------------
# parent side


@dataclass
class _Worker:
    proc: Any
    conn: Any
    ready: bool = False
    since: float = field(default_factory=time.monotonic)  # start of the current call (or of startup)
    pending: deque = field(default_factory=deque)  # call ids sent and not yet answered, in order


def _kill(worker: _Worker) -> None:
    """SIGKILL the worker's process group (the worker and every process its calls started that did not
    leave the group), then reap the worker."""
    worker.proc.kill()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill(w)
    workers.clear()


class _Run:
    """Bookkeeping of one `run` call: call id -> (function index, kwargs) and the results so far."""

    def __init__(self, base: int, calls: list[tuple[int, dict]], on_failure: Callable | None):
        self.base, self.calls, self.on_failure = base, calls, on_failure
        self.results: list[CallResult | None] = [None] * len(calls)
        self.remaining = len(calls)

    def owns(self, call_id: int) -> bool:
        k = call_id - self.base
        return 0 <= k < len(self.results) and self.results[k] is None

    def record(self, call_id: int, result: CallResult) -> None:
        k = call_id - self.base
        self.results[k] = result
        self.remaining -= 1
        if not result.ok and self.on_failure is not None:
            self.on_failure(k, result)


class CallPool:
    """Call the functions `specs` names in `workers` processes, each call within `timeout_s` seconds."""

    # raised when a worker cannot load a spec (a subclass may narrow it)
    spec_error: type[Exception] = SpecError

    def __init__(
        self,
        specs: list[str],
        *,
        workers: int = 1,
        timeout_s: float,
        name: str = "function",
        error_type: type[Exception] = RuntimeError,
        check: Callable[[Any], Any] = identity,
        startup_timeout_s: float = 120.0,
        limits: Limits = NO_LIMITS,
        load: Callable[[str, str], Callable] = load_callable,
    ):
        # `name` words messages ("<name> workers did not start") and the loader's label ("<name> spec");
        # `error_type` is what startup failures raise (a spec that does not load, or whose workers do not
        # start in `startup_timeout_s`, raises `spec_error`);
        # `limits`: each worker's (memory, processes, CPU time, environment, sandbox: rl_tpu/containment.py);
        # `load(spec, label)` turns a spec into the function in each worker (a module-level function)
        self.specs = [resolve_spec(s) for s in specs]
        self.name, self.error_type, self.check, self.load = name, error_type, check, load
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self.limits = limits
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self._next_call = 0
        self._startup_deaths = 0  # consecutive workers that died before reporting ready
        for _ in range(max(1, workers)):
            self._workers.append(self._spawn())
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # -- lifecycle -----------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        proc = start(
            "rl_tpu.call_pool:_worker_main",
            (self.specs, f"{self.name} spec", self.check, self.load),
            self.limits,
            name=f"rl-tpu-{self.name}-worker",
        )
        return _Worker(proc=proc, conn=proc.conn)

    def _wait_ready(self) -> None:
        while not all(w.ready for w in self._workers):
            waiting = [w for w in self._workers if not w.ready]
            left = min(w.since for w in waiting) + self.startup_timeout_s - time.monotonic()
            if left <= 0:
                raise self.spec_error(  # the user's module, as a rule: a spec that does not load
                    f"{self.name} workers did not start within {self.startup_timeout_s:.0f} s (loading "
                    f"{', '.join(self.specs)}): does a module block or loop at import time? move that work "
                    "into the function"
                )
            for conn in wait_conns([w.conn for w in waiting], timeout=left):
                self._on_message(self._by_conn(conn), None)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # -- calling -------------------------------------------------------------------------------------

    def run(
        self,
        calls: list[tuple[int, dict]],
        on_failure: Callable[[int, CallResult], None] | None = None,
    ) -> list[CallResult]:
        """Call `specs[i](**kwargs)` for each `(i, kwargs)`; see the module docstring for failures."""
        if not self._finalizer.alive:
            raise self.error_type(f"{type(self).__name__} used after close()")
        base = self._next_call
        self._next_call += len(calls)
        run = _Run(base, calls, on_failure)
        queue = deque(range(base, base + len(calls)))
        chunk_cap = max(1, min(MAX_CHUNK, -(-len(queue) // (2 * len(self._workers)))))
        try:
            while run.remaining:
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and not w.pending and queue:
                        ids = [queue.popleft() for _ in range(min(chunk_cap, len(queue)))]
                        try:
                            w.conn.send([(cid, *calls[cid - base]) for cid in ids])
                        except OSError:  # it died while idle: nothing of this batch was lost
                            queue.extendleft(reversed(ids))
                            self._replace(w, None, None, failure=None)
                            continue
                        w.pending.extend(ids)
                        w.since = now
                for conn in wait_conns([w.conn for w in self._workers], timeout=self._next_deadline()):
                    if (w := self._by_conn(conn)) is not None:
                        self._on_message(w, run, queue)
                self._check_deadlines(run, queue)
        except BaseException:
            self._abort()
            raise
        return run.results  # type: ignore[return-value]

    def _next_deadline(self) -> float:
        now = time.monotonic()
        ends = [
            w.since + (self.timeout_s if w.ready else self.startup_timeout_s)
            for w in self._workers
            if w.pending or not w.ready
        ]
        return max(0.0, min(ends) - now) if ends else 1.0

    def _by_conn(self, conn) -> _Worker | None:
        return next((w for w in self._workers if w.conn is conn), None)

    def _on_message(self, w: _Worker, run: _Run | None, queue: deque | None = None) -> None:
        while True:
            try:
                if not w.conn.poll():
                    return
                raw = w.conn.recv_bytes()
            except (EOFError, OSError):
                w.proc.join(timeout=1)
                if not w.ready:
                    # Killed from outside (OOM, a test), or a crash while importing the functions,
                    # which would repeat in every replacement: retry a few times, then give up.
                    self._startup_deaths += 1
                    if self._startup_deaths >= MAX_STARTUP_DEATHS:
                        raise self.spec_error(  # a module that kills its process at import, as a rule
                            f"{self.name} workers exited during startup {self._startup_deaths} times in "
                            f"a row (last exit code {w.proc.exitcode}) while loading {self.specs}"
                        ) from None
                self._replace(w, run, queue, failure=f"worker process died (exit code {w.proc.exitcode})")
                return
            try:
                msg = json.loads(raw)
                kind = msg[0]
            except (ValueError, TypeError, IndexError, KeyError):  # not what our worker loop sends
                self._replace(w, run, queue, failure="its worker sent an unreadable answer")
                return
            if kind == "ready":
                w.ready, w.since = True, time.monotonic()
                self._startup_deaths = 0
            elif kind == "load_error":
                raise self.spec_error(msg[1])
            elif w.pending and w.pending[0] == msg[1]:
                w.pending.popleft()
                w.since = time.monotonic()
                if run is not None and run.owns(msg[1]):
                    if kind == "ok":
                        run.record(msg[1], CallResult(value=msg[2]))
                    else:
                        run.record(msg[1], CallResult(error=msg[2], traceback=msg[3]))

    def _check_deadlines(self, run: _Run, queue: deque) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now - w.since > self.startup_timeout_s:
                raise self.error_type(
                    f"a replacement {self.name} worker did not start within {self.startup_timeout_s:.0f} s"
                )
            if w.pending and now - w.since > self.timeout_s:
                self._on_message(w, run, queue)  # it may have answered at the last moment
                if w in self._workers and w.pending and time.monotonic() - w.since > self.timeout_s:
                    self._replace(w, run, queue, failure=None)

    def _replace(self, w: _Worker, run: _Run | None, queue: deque | None, failure: str | None) -> None:
        """Kill `w`, start a fresh worker in its slot; its current call fails (`failure`, or a timeout
        when None), the rest are re-queued."""
        _kill(w)
        self._workers[self._workers.index(w)] = self._spawn()
        if not w.pending:
            return
        head, rest = w.pending[0], list(w.pending)[1:]
        if queue is not None:
            queue.extendleft(reversed(rest))
        if run is not None and run.owns(head):
            if failure is None:
                run.record(head, CallResult(error=f"timed out after {self.timeout_s:g} s", timeout=True))
            else:
                run.record(head, CallResult(error=failure))

    def _abort(self) -> None:
        """After an exception mid-batch: no worker may keep working on (or answering) that batch."""
        for w in list(self._workers):
            if w.pending and w in self._workers:
                w.pending.clear()
                self._replace(w, None, None, failure=None)
