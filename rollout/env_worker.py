"""The worker side of `EnvPool` (rollout/env_pool.py): a contained process holding environment instances by
trajectory id, each call on a thread of its own (an `async` method on the worker's event loop), every
answer in JSON.

Messages from the pool: `["reset", call_id, tid, sample]`, `["step", call_id, tid, messages]`,
`["release", tid]` (the instance is dropped, after its `close()` where it has one).
Answers: `["ready", pid]`, `["load_error", text]`, `["ok", call_id, value]`,
`["err", call_id, "Type: message", traceback]`, `["bad", call_id, text]` (a return value of the wrong shape).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
import traceback
from typing import Any

from rl_tpu.rollout import verl_interactions
from rl_tpu.rollout.multi_turn import EnvError, check_answer, check_opening
from rl_tpu.user_code import load_callable

# a worker's call threads' stack (the default is 8 MiB of address space each, so a few hundred calls at once
# would reach `memory_mb`); 2 MiB holds Python's recursion limit through C calls (repr, json, map)
THREAD_STACK = 2 * 2**20


async def _awaited(value: Any) -> Any:
    return await value


def _resolve(value: Any, loop: asyncio.AbstractEventLoop) -> Any:
    """`value`, or what it resolves to on `loop` (running in another thread) when it is awaitable."""
    if not inspect.isawaitable(value):
        return value
    return asyncio.run_coroutine_threadsafe(_awaited(value), loop).result()


def worker_main(conn, init: tuple[str, str]) -> None:
    """A worker's life (`containment.start` entry): load the class, then run calls as they come."""
    spec, label = init
    try:
        if verl_interactions.is_interaction_config(spec):
            cls = verl_interactions.env_class(spec, label)
            cls.build()  # imports and constructs the interactions: a failure is this worker's load error
        else:
            cls = load_callable(spec, label)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, in one line
        conn.send_bytes(json.dumps(["load_error", " ".join(str(e).split())]).encode())
        return
    _Host(conn, cls).serve()


def _few_malloc_arenas() -> None:
    """glibc gives threads malloc arenas of 64 MiB of address space each (up to 8 per core), which count
    against `memory_mb`; two are plenty where the GIL serializes most allocation. A no-op off glibc."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


class _Host:
    """The worker side: the instances, by trajectory id, and one thread per call."""

    def __init__(self, conn, cls: type):
        self.conn, self.cls = conn, cls
        self.instances: dict[int, Any] = {}
        self._sending = threading.Lock()  # answers come from many threads
        threading.stack_size(THREAD_STACK)
        _few_malloc_arenas()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rl_tpu-env-async", daemon=True).start()

    def send(self, msg: list) -> None:
        data = json.dumps(msg).encode()  # TypeError, ValueError: JSON cannot write it
        with self._sending:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the parent is gone: so is this process, in a moment
                pass

    def serve(self) -> None:
        self.send(["ready", os.getpid()])
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone
                msg = None
            if msg is None:
                os._exit(0)  # calls still running (hung ones) must not keep the process alive
            if msg[0] == "release":
                self._close(self.instances.pop(msg[1], None))
                continue
            try:
                threading.Thread(target=self.call, args=msg, name="rl_tpu-env-call", daemon=True).start()
            except BaseException as e:  # noqa: BLE001 - "can't start new thread" at the memory limit
                self.send(["err", msg[1], f"{type(e).__name__}: {e}", ""])

    def _close(self, env: Any) -> None:
        """An ended trajectory's instance's `close()`, if it has one, on a thread of its own (nobody waits
        for it: what it raises is printed to the worker's stderr, and the trajectory is already scored)."""
        if env is None or not callable(getattr(env, "close", None)):
            return

        def run() -> None:
            try:
                _resolve(env.close(), self.loop)
            except BaseException:  # noqa: BLE001 - user code; the trajectory has ended either way
                traceback.print_exc()

        try:
            threading.Thread(target=run, name="rl_tpu-env-close", daemon=True).start()
        except RuntimeError:  # no thread to spare at the memory limit: the instance is dropped unclosed
            pass

    def call(self, kind: str, call_id: int, tid: int, arg: Any) -> None:
        where = f"{self.cls.__name__}.{kind}"
        try:
            if kind == "reset":
                env = self.instances[tid] = self.cls()
                out = _resolve(env.reset(arg), self.loop)
            else:
                out = _resolve(self.instances[tid].step(arg), self.loop)
        except BaseException as e:  # noqa: BLE001 - user code, even SystemExit: it ends its trajectory only
            self.send(["err", call_id, f"{type(e).__name__}: {e}", traceback.format_exc()])
            return
        try:
            value = check_opening(out, where) if kind == "reset" else list(check_answer(out, where))
        except EnvError as e:
            self.send(["bad", call_id, str(e)])
            return
        try:
            self.send(["ok", call_id, value])
        except (TypeError, ValueError) as e:  # JSON cannot write it
            self.send(["bad", call_id, f"{where} returned messages JSON cannot write ({e}): {value!r:.200}"])
