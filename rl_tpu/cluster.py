"""Starting Ray on a busy machine.

Ray 2.60's raylet waits a fixed 30 s for its agents; a loaded 2-core box misses that deadline now and
then, and starting again succeeds. Every place that starts Ray (the loop, tests, benches) goes through
`init_ray` so the retry rule lives in one place.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rl_tpu")


def init_ray(*, attempts: int = 3, retry_if: str | None = None, **kwargs) -> bool:
    """`ray.init(**kwargs)`, retried up to `attempts` times (only on errors whose text contains
    `retry_if`, when given). Returns True if this call started Ray, False if it was already running."""
    import ray

    if ray.is_initialized():
        return False
    if "address" not in kwargs:
        # A new Ray prestarts idle default workers for the driver; our actors each ask for their own
        # environment (threads, devices), so none would ever be used: two processes importing Ray for
        # nothing (~3 CPU s) while the roles start on a 2-core box.
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    for attempt in range(attempts):
        try:
            ray.init(**kwargs)
            return True
        except Exception as e:  # noqa: BLE001 - Ray raises several types for a missed deadline
            ray.shutdown()
            if attempt == attempts - 1 or (retry_if is not None and retry_if not in str(e)):
                raise
            log.warning("ray.init failed (%s); retrying", e)
    return False  # attempts < 1: nothing started
