"""Generation and weight updates taking turns on the engines, and partial rollouts (`rollout.partial`).

Invariants:
- `EngineTurns`: one thing at a time runs on the engines: a generation call, or an exclusive turn (a
  weight sync, an evaluation). An exclusive turn that is waiting goes before the next generation call, so
  with chunked generation an update waits for at most one chunk, never for a whole batch. Weights never
  change during a generation call, so never in the middle of a token's forward.
- `generate_held`: a rollout grows by chunk calls (`RolloutGroup.generate_chunk`), each one engine
  turn that takes every unfinished sequence `rollout.partial_chunk_tokens` tokens further (or to its
  end). The engines keep the unfinished sequences, KV included, between calls (`rl_tpu.rollout.held`), so
  a continuation costs no prefill and the `n` samples of a prompt keep sharing its prompt's KV blocks;
  the driver keeps its own copy of every sequence, from which an engine that lost its sequences
  (restarted, or parked for an evaluation) adds them back. A weight install between two calls recomputes
  the held sequences' KV under the new weights (`reset_kv`), so no KV computed under older weights is
  reused, as before. Each token keeps the log-prob and the policy version of the call that sampled it;
  a sequence's `policy_version` is its first token's. `max_tokens` is each sequence's whole budget,
  enforced by the engine; a sequence is unfinished until the engine finishes it.

Where this departs from vLLM's own pause (`AsyncLLM.pause_generation(mode="keep")`, vLLM >= 0.11): that
keeps the prefix's KV computed under the old policy across the update, and needs the async engine and a
concurrent actor; here the engines stay synchronous `LLMEngine.step` loops in a single-threaded actor
(see `RolloutGroup`), and an update costs a full prefill of every held sequence (the recompute). The
first form of partial rollouts (each chunk a new request with prompt + response so far as its prompt)
paid that too, since an install empties the prefix cache its re-prefills read from, and on top of it
a new request and a partial-block prefill per sequence at every chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from rl_tpu.types import Completion


class EngineTurns:
    """Generation calls and exclusive turns (weight syncs, evaluations) on the engines, one at a time;
    waiting exclusive turns first. `busy_s`: the engines' time in generation calls so far."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._busy = False
        self._exclusive_waiting = 0
        self.busy_s = 0.0

    @contextmanager
    def generating(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._busy and self._exclusive_waiting == 0)
            self._busy = True
        t = time.perf_counter()
        try:
            yield
        finally:
            with self._cv:
                self.busy_s += time.perf_counter() - t
                self._busy = False
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            self._exclusive_waiting += 1
            try:
                self._cv.wait_for(lambda: not self._busy)
            finally:
                self._exclusive_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()


ChunkCall = Callable[[list[Completion]], list[Any]]  # RolloutGroup.generate_chunk's: a `held.Piece` each


def generate_held(
    call: ChunkCall, prompts: list[list[int]], *, n: int, tokenizer: Any = None
) -> list[list[Completion]]:
    """Per prompt, its `n` completions, grown by `call(unfinished)` (one engine turn each, each a chance
    for a weight update between two) until every one finished; the engines hold the unfinished ones
    between calls (`rl_tpu.rollout.held`). Each token keeps the version of the call that sampled it;
    `policy_version` is the first token's. With `tokenizer`, texts are decoded from whole responses."""
    groups = [
        [
            Completion(
                prompt_index=i,
                sample_index=j,
                prompt_ids=list(p),
                response_ids=[],
                logprobs=[],
                finish_reason="",
                text="",
                policy_version=-1,
                extra={"generate_s": 0.0},
            )
            for j in range(n)
        ]
        for i, p in enumerate(prompts)
    ]
    active = [c for g in groups for c in g]
    while active:
        pieces = call(active)
        for c, p in zip(active, pieces, strict=True):
            if not c.response_ids:
                c.policy_version = p.policy_version
            c.response_ids += p.token_ids
            c.logprobs += p.logprobs
            c.token_versions += [p.policy_version] * len(p.token_ids)
            c.finish_reason = p.finish_reason or "length"
            c.extra.update(worker=p.worker, stop_reason=p.stop_reason)
            c.extra["generate_s"] += p.generate_s
            c.extra["engine_rss_mb"] = p.engine_rss_mb  # the latest call's
        active = [c for c, p in zip(active, pieces) if p.finish_reason is None]
    if tokenizer is not None:
        from rl_tpu.rollout.engine import response_texts

        for g in groups:
            for c in g:
                out = SimpleNamespace(token_ids=c.response_ids, finish_reason=c.finish_reason)
                (c.text,) = response_texts(tokenizer, c.prompt_ids, [out])
    return groups
