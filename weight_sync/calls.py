"""How the driver and the receivers call the other side of the weight sync: the same code serves Ray
actors (calls return ObjectRefs) and local objects (calls return values), so tests and benches can run
the protocol in one process. Every call names its method (`call(sender.ws_pack, ...)`), never a string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def call(method: Callable, *args) -> Any:
    """`method(*args)`: asynchronously (an ObjectRef) on a Ray actor's method, directly on a local one."""
    return method.remote(*args) if hasattr(method, "remote") else method(*args)


def _is_ref(x: Any) -> bool:
    return type(x).__name__ == "ObjectRef"


def get(x: Any) -> Any:
    """The value of one call, or of a list of calls (local values pass through)."""
    if _is_ref(x) or (isinstance(x, list) and x and _is_ref(x[0])):
        import ray

        return ray.get(x)
    return x


def ready(refs: list) -> bool:
    """Whether every call in `refs` has finished (local calls always have)."""
    refs = [r for r in refs if _is_ref(r)]
    if not refs:
        return True
    import ray

    return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)


class ReceiverLost(RuntimeError):
    """Engines whose actor died, or that did not answer in time, during a sync (the others finished
    theirs): restart them, then `WeightSync.replace_receiver` and sync them alone."""

    def __init__(self, engines: list[int], why: str, what: str = "died during the weight sync"):
        super().__init__(f"weight sync: engine(s) {engines} {what} ({why})")
        self.engines, self.why, self.what = engines, why, what


def get_each(xs: list, timeout: float | None = None) -> list:
    """Like `get` over a list of calls, but an engine whose Ray actor died, or that has not answered
    within `timeout` seconds (None: no limit), does not stop the wait for the others: those are raised
    together as `ReceiverLost` once the rest finished. A call that raised (the engine is alive) is raised."""
    if not xs or not _is_ref(xs[0]):
        return xs
    import ray

    late = set(ray.wait(xs, num_returns=len(xs), timeout=timeout)[1]) if timeout is not None else set()
    out, lost, why = [], [], ""
    for i, ref in enumerate(xs):
        if ref in late:  # a hung engine: its restart kills it
            out.append(None)
            lost.append(i)
            continue
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayTaskError:  # the engine's call failed (e.g. a sender died): it is alive
            raise
        except ray.exceptions.RayActorError as e:
            out.append(None)
            lost.append(i)
            why = why or str(e).splitlines()[0]
    if lost and not why:
        raise ReceiverLost(lost, f"no answer within {timeout:g} s", "did not finish the weight sync")
    if lost:
        raise ReceiverLost(lost, why if not late else f"{why}; others: no answer within {timeout:g} s")
    return out


def node_id() -> str:
    """This process's Ray node id ("local" outside Ray): where shared memory is reachable."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return "local"


def route(transport: str, region: bool) -> str:
    """The route a (sender, engine rank) pair takes: `shm` into an engine rank that offers a receiver
    region becomes `shm_region`. Driver and receiver apply this one rule."""
    return "shm_region" if transport == "shm" and region else transport
