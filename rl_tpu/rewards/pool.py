"""RewardPool: score completions with a weighted sum of reward functions in worker processes.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot cancel a running call, so one hung reward
would stall the run forever. Here each worker is a spawn-context process with its own pipe; the parent
sends chunks of calls and the worker answers each call as it finishes, so the parent always knows which
call a worker is on and since when. A call running longer than `timeout_s` gets its worker killed
(SIGKILL: works on sleeping, spinning or deadlocked code alike) and replaced; the rest of its chunk is
re-queued. A worker that dies (segfault, `os._exit`) is treated the same way, as an error.

Invariants:
- Functions are loaded by spec string inside each worker (never pickled), so user files only have to
  be importable there; load errors surface in the constructor, which waits for every worker. Workers
  do not re-import the parent's `__main__` (no `if __name__ == "__main__"` guard is needed).
  A reward module's top-level imports run there, at startup, outside the per-call timeout: a reward
  that imports something heavy lazily in its first call can time out, and so can every replacement.
- One call = one (sample, function) pair; its clock starts when the worker begins it. A sample's score
  is `sum(weight_j * score_j)`; a failed call scores 0.0 under `on_error = "zero"` and raises
  `RewardError` (naming function, sample id and exception) under `"raise"`.
- Errors (exception, bad return value, dead worker) and timeouts are counted separately; the first
  traceback and the first timeout of the pool's life are logged once each, later ones only counted.
- Results come back in input order; the pool is reusable across steps until `close()`. One `score`
  at a time (not thread-safe). A worker killed from outside is replaced; three deaths in a row before
  a worker reports ready (a crash while importing the functions) raise `RewardError`.
- A reward returns a finite number or a dict with a finite "score"; other numeric dict entries are
  logged as `reward/<name>/<key>`, non-numeric ones are ignored.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing as mp
import numbers
import os
import signal
import sys
import time
import traceback
import types
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_conns
from typing import Any

from rl_tpu.config import RewardConfig
from rl_tpu.rewards.loader import RewardError, RewardSpecError, load_reward_fn, resolve_spec, reward_name

logger = logging.getLogger(__name__)

MAX_CHUNK = 64  # calls per message to one worker: amortises pipe latency, keeps re-queues small
MAX_STARTUP_DEATHS = 3  # consecutive worker deaths before "ready" that make the pool give up


@dataclass(kw_only=True)
class RewardInput:
    """One completion to score, in verl's terms."""

    sample_id: str  # named in error messages and logs (e.g. "<example uid>#<sample index>")
    data_source: str
    solution_str: str  # the decoded response
    ground_truth: Any
    extra_info: dict | None = None

    @classmethod
    def for_example(cls, example: Any, solution_str: str, sample_index: int = 0) -> RewardInput:
        """The input for one completion of a `rl_tpu.data.Example`; sample id "<uid>#<sample_index>"."""
        return cls(
            sample_id=f"{example.uid}#{sample_index}",
            data_source=example.data_source,
            solution_str=solution_str,
            ground_truth=example.ground_truth,
            extra_info=example.extra_info,
        )


@dataclass(kw_only=True)
class RewardResult:
    scores: list[float]  # weighted sum per sample, input order
    function_scores: dict[str, list[float]]  # reward name -> unweighted score per sample (0.0 on failure)
    extra: dict[str, list[float]]  # "<name>/<key>" -> per-sample value of a dict return (NaN where absent)
    failed: list[bool]  # a call for this sample raised or timed out
    errors: int = 0
    timeouts: int = 0
    first_error: str | None = None  # "<name> on <sample id>: <exception>" of the first failure in this batch

    def metrics(self) -> dict[str, float]:
        """Scalars to log: reward/mean, reward/errors, reward/timeouts, reward/<name>/mean, reward/<name>/<key>."""
        out = {
            "reward/mean": _mean(self.scores),
            "reward/errors": float(self.errors),
            "reward/timeouts": float(self.timeouts),
        }
        for name, values in self.function_scores.items():
            out[f"reward/{name}/mean"] = _mean(values)
        for key, values in self.extra.items():
            out[f"reward/{key}"] = _mean(values)
        return out


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


# ---------------------------------------------------------------------------------------------------
# worker process


def normalize_output(out: Any) -> tuple[float, dict[str, float]]:
    """A reward's return value -> (score, numeric extras); raises TypeError/ValueError on junk."""
    extras: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"returned a dict without 'score' (keys: {sorted(out)})")
        extras = {str(k): float(v) for k, v in out.items() if k != "score" and isinstance(v, numbers.Real)}
        out = out["score"]
    if not isinstance(out, numbers.Real):
        raise TypeError(
            f"returned {type(out).__name__} {out!r:.80}; expected a number or a dict with 'score'"
        )
    score = float(out)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score, extras


def _worker_main(conn, specs: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills us
    try:
        fns = [load_reward_fn(s) for s in specs]
    except BaseException as e:  # noqa: BLE001 - reported to the parent verbatim
        conn.send(("load_error", str(e), traceback.format_exc()))
        return
    loop = asyncio.new_event_loop()  # one loop per worker: async rewards cost no loop setup per call
    conn.send(("ready", os.getpid()))
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
                score, extras = normalize_output(out)
                msg = ("ok", call_id, score, extras)
            except BaseException as e:  # noqa: BLE001 - user code may even raise SystemExit
                msg = ("err", call_id, f"{type(e).__name__}: {e}", traceback.format_exc())
            conn.send(msg)


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
    if worker.proc.is_alive():
        worker.proc.kill()
    worker.proc.join(timeout=5)
    worker.conn.close()


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


class RewardPool:
    """Score `RewardInput`s with `cfg.functions` (weighted by `cfg.weights`) in `cfg.workers` processes."""

    def __init__(self, cfg: RewardConfig, *, startup_timeout_s: float = 120.0):
        if not cfg.functions:
            raise RewardSpecError("reward.functions is empty; name at least one 'module:function'")
        if cfg.weights and len(cfg.weights) != len(cfg.functions):
            raise RewardSpecError(
                f"reward.weights has {len(cfg.weights)} entries but reward.functions has {len(cfg.functions)}"
            )
        if cfg.on_error not in ("zero", "raise"):
            raise RewardSpecError(f"reward.on_error must be 'zero' or 'raise', got {cfg.on_error!r}")
        self.specs = [resolve_spec(s) for s in cfg.functions]
        self.names = _unique([reward_name(s) for s in cfg.functions])
        self.weights = list(cfg.weights) if cfg.weights else [1.0] * len(self.specs)
        self.on_error = cfg.on_error
        self.timeout_s = float(cfg.timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self._next_call = 0
        self._logged_error = self._logged_timeout = False
        self._startup_deaths = 0  # consecutive workers that died before reporting ready
        for _ in range(max(1, cfg.workers)):
            self._workers.append(self._spawn())
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # -- lifecycle -----------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self.specs), daemon=True, name="rl-tpu-reward-worker"
        )
        # Spawn re-runs the parent's __main__ in the child unless __main__ has no file: hide it, since
        # workers load everything by spec. This makes the pool work from stdin, notebooks, Ray workers
        # and unguarded scripts, and saves the child a re-import of the driver.
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            proc.start()
        finally:
            sys.modules["__main__"] = main
        child.close()
        return _Worker(proc=proc, conn=parent)

    def _wait_ready(self) -> None:
        while not all(w.ready for w in self._workers):
            waiting = [w for w in self._workers if not w.ready]
            left = min(w.since for w in waiting) + self.startup_timeout_s - time.monotonic()
            if left <= 0:
                raise RewardError(
                    f"reward workers did not start within {self.startup_timeout_s:.0f} s "
                    f"(loading {self.specs})"
                )
            for conn in wait_conns([w.conn for w in waiting], timeout=left):
                self._on_message(self._by_conn(conn), None)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # -- scoring -------------------------------------------------------------------------------------

    def score(self, samples: list[RewardInput]) -> RewardResult:
        """Score every sample with every function; see the module docstring for failure handling."""
        if not self._finalizer.alive:
            raise RewardError("RewardPool.score called after close()")
        n_fn = len(self.specs)
        base = self._next_call
        self._next_call += len(samples) * n_fn
        batch = _Batch(base=base, n_fn=n_fn, samples=samples, names=self.names)
        queue = deque(range(base, base + len(samples) * n_fn))
        chunk_cap = max(1, min(MAX_CHUNK, -(-len(queue) // (2 * len(self._workers)))))
        try:
            while batch.remaining:
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and not w.pending and queue:
                        ids = [queue.popleft() for _ in range(min(chunk_cap, len(queue)))]
                        try:
                            w.conn.send([(cid, (cid - base) % n_fn, batch.kwargs(cid)) for cid in ids])
                        except OSError:  # it died while idle: nothing of this batch was lost
                            queue.extendleft(reversed(ids))
                            self._replace(w, None, None, failure=None)
                            continue
                        w.pending.extend(ids)
                        w.since = now
                for conn in wait_conns([w.conn for w in self._workers], timeout=self._next_deadline()):
                    if (w := self._by_conn(conn)) is not None:
                        self._on_message(w, batch, queue)
                self._check_deadlines(batch, queue)
        except BaseException:
            self._abort()
            raise
        return batch.result(self.weights)

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

    def _on_message(self, w: _Worker, batch: _Batch | None, queue: deque | None = None) -> None:
        while True:
            try:
                if not w.conn.poll():
                    return
                msg = w.conn.recv()
            except (EOFError, OSError):
                w.proc.join(timeout=1)
                if not w.ready:
                    # Killed from outside (OOM, a test), or a crash while importing the functions,
                    # which would repeat in every replacement: retry a few times, then give up.
                    self._startup_deaths += 1
                    if self._startup_deaths >= MAX_STARTUP_DEATHS:
                        raise RewardError(
                            f"reward workers exited during startup {self._startup_deaths} times in "
                            f"a row (last exit code {w.proc.exitcode}) while loading {self.specs}"
                        ) from None
                self._replace(w, batch, queue, failure=f"worker process died (exit code {w.proc.exitcode})")
                return
            kind = msg[0]
            if kind == "ready":
                w.ready, w.since = True, time.monotonic()
                self._startup_deaths = 0
            elif kind == "load_error":
                raise RewardSpecError(msg[1])
            elif w.pending and w.pending[0] == msg[1]:
                w.pending.popleft()
                w.since = time.monotonic()
                if batch is not None and batch.owns(msg[1]):
                    if kind == "ok":
                        batch.record(msg[1], msg[2], msg[3])
                    else:
                        self._fail(batch, msg[1], msg[2], msg[3], timeout=False)

    def _check_deadlines(self, batch: _Batch, queue: deque) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now - w.since > self.startup_timeout_s:
                raise RewardError(
                    f"a replacement reward worker did not start within {self.startup_timeout_s:.0f} s"
                )
            if w.pending and now - w.since > self.timeout_s:
                self._on_message(w, batch, queue)  # it may have answered at the last moment
                if w in self._workers and w.pending and time.monotonic() - w.since > self.timeout_s:
                    self._replace(w, batch, queue, failure=None)

    def _replace(self, w: _Worker, batch: _Batch | None, queue: deque | None, failure: str | None) -> None:
        """Kill `w`, start a fresh worker in its slot; its current call fails, the rest are re-queued."""
        _kill(w)
        self._workers[self._workers.index(w)] = self._spawn()
        if not w.pending:
            return
        head, rest = w.pending[0], list(w.pending)[1:]
        if queue is not None:
            queue.extendleft(reversed(rest))
        if batch is not None and batch.owns(head):
            if failure is None:
                self._fail(batch, head, f"timed out after {self.timeout_s:g} s", None, timeout=True)
            else:
                self._fail(batch, head, failure, None, timeout=False)

    def _fail(self, batch: _Batch, call_id: int, message: str, tb: str | None, *, timeout: bool) -> None:
        name, sample_id = batch.describe(call_id)
        what = f"reward function {name!r} ({self.specs[(call_id - batch.base) % batch.n_fn]}) on sample {sample_id!r}"
        if self.on_error == "raise":
            detail = f"\nworker traceback:\n{tb}" if tb else ""
            raise RewardError(f"{what}: {message}{detail}")
        batch.record_failure(call_id, f"{name} on {sample_id}: {message}", timeout)
        if timeout and not self._logged_timeout:
            self._logged_timeout = True
            logger.warning(
                "%s: %s; scored 0.0 (later timeouts are only counted in reward/timeouts)", what, message
            )
        elif not timeout and not self._logged_error:
            self._logged_error = True
            logger.warning(
                "%s raised %s; scored 0.0 (later errors are only counted in reward/errors)\n%s",
                what,
                message,
                tb or "",
            )

    def _abort(self) -> None:
        """After an exception mid-batch: no worker may keep working on (or answering) that batch."""
        for w in list(self._workers):
            if w.pending and w in self._workers:
                w.pending.clear()
                self._replace(w, None, None, failure=None)


class _Batch:
    """Bookkeeping of one `score` call: call id -> (sample, function) and the results so far."""

    def __init__(self, *, base: int, n_fn: int, samples: list[RewardInput], names: list[str]):
        self.base, self.n_fn, self.samples, self.names = base, n_fn, samples, names
        n = len(samples) * n_fn
        self.values = [0.0] * n
        self.extras: list[dict[str, float]] = [{} for _ in range(n)]
        self.done = [False] * n
        self.failed = [False] * n
        self.remaining = n
        self.errors = self.timeouts = 0
        self.first_error: str | None = None

    def owns(self, call_id: int) -> bool:
        k = call_id - self.base
        return 0 <= k < len(self.done) and not self.done[k]

    def kwargs(self, call_id: int) -> dict:
        s = self.samples[(call_id - self.base) // self.n_fn]
        return dict(
            data_source=s.data_source,
            solution_str=s.solution_str,
            ground_truth=s.ground_truth,
            extra_info=s.extra_info,
        )

    def describe(self, call_id: int) -> tuple[str, str]:
        k = call_id - self.base
        return self.names[k % self.n_fn], self.samples[k // self.n_fn].sample_id

    def record(self, call_id: int, score: float, extras: dict[str, float]) -> None:
        k = call_id - self.base
        self.values[k], self.extras[k], self.done[k] = score, extras, True
        self.remaining -= 1

    def record_failure(self, call_id: int, message: str, timeout: bool) -> None:
        k = call_id - self.base
        self.done[k] = self.failed[k] = True
        self.remaining -= 1
        self.timeouts += timeout
        self.errors += not timeout
        self.first_error = self.first_error or message

    def result(self, weights: list[float]) -> RewardResult:
        n_s, n_fn = len(self.samples), self.n_fn
        per_fn = {name: [self.values[i * n_fn + j] for i in range(n_s)] for j, name in enumerate(self.names)}
        scores = [sum(weights[j] * self.values[i * n_fn + j] for j in range(n_fn)) for i in range(n_s)]
        keys = sorted({(j, key) for k, e in enumerate(self.extras) for key in e for j in [k % n_fn]})
        extra = {
            f"{self.names[j]}/{key}": [self.extras[i * n_fn + j].get(key, float("nan")) for i in range(n_s)]
            for j, key in keys
        }
        failed = [any(self.failed[i * n_fn : (i + 1) * n_fn]) for i in range(n_s)]
        return RewardResult(
            scores=scores,
            function_scores=per_fn,
            extra=extra,
            failed=failed,
            errors=self.errors,
            timeouts=self.timeouts,
            first_error=self.first_error,
        )


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n] - 1}")
    return out
