"""Generation and weight updates taking turns on the engines, and partial rollouts (`rollout.partial`).

Invariants:
- `EngineTurns`: one thing at a time runs on the engines: a generation call, or an exclusive turn (a
  weight sync, an evaluation). An exclusive turn that is waiting goes before the next generation call, so
  with chunked generation an update waits for at most one chunk, never for a whole batch. Weights never
  change during a generation call, so never in the middle of a token's forward.
- `generate_in_chunks`: a group's first chunk is one request with `n` samples (they share the prompt's
  KV blocks); each later chunk continues every unfinished sequence as its own request whose prompt is
  the original prompt plus the tokens sampled so far, prefilled again under the weights the engine holds
  then (the engine resets its prefix cache at every install, so no KV computed under older weights is
  reused). Each token keeps the log-prob and the policy version of the call that sampled it. A sequence
  is unfinished when its chunk ended on the token budget (`length`) below `max_tokens`; since every
  continued sequence gets the same budget, one call per chunk serves them all.

Where this departs from vLLM's own pause (`AsyncLLM.pause_generation(mode="keep")`, vLLM >= 0.11): that
keeps requests and their KV cache inside the engine across the update (the prefix's KV stays the old
policy's) but needs the async engine and a concurrent actor; here the engines stay synchronous
`LLM.generate` calls in a single-threaded actor (see `RolloutGroup`), and the cost is one extra prefill
per chunk.
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


Generate = Callable[..., list[list[Completion]]]  # RolloutGroup.generate's signature


def generate_in_chunks(
    generate: Generate,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    chunk: int,
    tokenizer: Any = None,
) -> list[list[Completion]]:
    """Per prompt, its `n` completions, sampled `chunk` tokens per `generate` call (each call a chance
    for a weight update between chunks). With `tokenizer`, a continued completion's text is decoded from
    its whole response (as `rollout.engine.response_texts`: chunk texts do not simply concatenate)."""
    groups = generate(prompts, n=n, max_tokens=min(chunk, max_tokens))
    done = min(chunk, max_tokens)
    active = [c for g in groups for c in g if _unfinished(c, min(chunk, max_tokens))]
    continued: set[int] = set()
    while active and done < max_tokens:
        budget = min(chunk, max_tokens - done)
        more = generate([c.prompt_ids + c.response_ids for c in active], n=1, max_tokens=budget)
        still = []
        for c, (k,) in zip(active, more, strict=True):
            c.token_versions = c.versions() + k.versions()
            c.response_ids += k.response_ids
            c.logprobs += k.logprobs
            c.finish_reason = k.finish_reason
            c.extra["stop_reason"] = k.extra.get("stop_reason")
            c.extra["generate_s"] = c.extra.get("generate_s", 0.0) + k.extra.get("generate_s", 0.0)
            continued.add(id(c))
            if _unfinished(k, budget):
                still.append(c)
        active, done = still, done + budget
    if tokenizer is not None:
        from rl_tpu.rollout.engine import response_texts

        for g in groups:
            for c in g:
                if id(c) in continued:
                    out = SimpleNamespace(token_ids=c.response_ids, finish_reason=c.finish_reason)
                    (c.text,) = response_texts(tokenizer, c.prompt_ids, [out])
    return groups


def _unfinished(c: Completion, budget: int) -> bool:
    return c.finish_reason == "length" and len(c.response_ids) >= budget
