"""RewardPool: score completions with a weighted sum of reward functions in worker processes.

The worker processes, per-call timeouts and the replacement of hung or dead workers are
`rl_tpu.call_pool.CallPool`'s (see its docstring); this module adds what makes the calls rewards.

Invariants:
- One call = one (sample, function) pair. A sample's score is `sum(weight_j * score_j)`; a failed call
  scores 0.0 under `on_error = "zero"` and raises `RewardError` (naming function, sample id and
  exception) under `"raise"`.
- Errors (exception, bad return value, dead worker) and timeouts are counted separately; the first
  traceback and the first timeout of the pool's life are logged once each, later ones only counted.
- Results come back in input order; the pool is reusable across steps until `close()`. One `score`
  at a time (not thread-safe). Three worker deaths in a row before a worker reports ready (a crash
  while importing the functions) raise `RewardError`; a spec that does not load, `RewardSpecError`.
- A reward returns a finite number or a dict with a finite "score"; other numeric dict entries are
  logged as `reward/<name>/<key>`, non-numeric ones are ignored.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

from rl_tpu.call_pool import MAX_CHUNK, CallPool, CallResult
from rl_tpu.config import RewardConfig
from rl_tpu.rewards.loader import RewardError, RewardSpecError, reward_name

logger = logging.getLogger(__name__)

__all__ = ["MAX_CHUNK", "RewardInput", "RewardPool", "RewardResult", "normalize_output"]


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


class RewardPool(CallPool):
    """Score `RewardInput`s with `cfg.functions` (weighted by `cfg.weights`) in `cfg.workers` processes."""

    spec_error = RewardSpecError

    def __init__(self, cfg: RewardConfig, *, startup_timeout_s: float = 120.0):
        if not cfg.functions:
            raise RewardSpecError("reward.functions is empty; name at least one 'module:function'")
        if cfg.weights and len(cfg.weights) != len(cfg.functions):
            raise RewardSpecError(
                f"reward.weights has {len(cfg.weights)} entries but reward.functions has {len(cfg.functions)}"
            )
        if cfg.on_error not in ("zero", "raise"):
            raise RewardSpecError(f"reward.on_error must be 'zero' or 'raise', got {cfg.on_error!r}")
        self.names = _unique([reward_name(s) for s in cfg.functions])
        self.weights = list(cfg.weights) if cfg.weights else [1.0] * len(cfg.functions)
        self.on_error = cfg.on_error
        self._logged_error = self._logged_timeout = False
        super().__init__(
            cfg.functions,
            workers=cfg.workers,
            timeout_s=cfg.timeout_s,
            name="reward",
            error_type=RewardError,
            check=normalize_output,
            startup_timeout_s=startup_timeout_s,
        )

    def __enter__(self) -> RewardPool:
        return self

    def score(self, samples: list[RewardInput]) -> RewardResult:
        """Score every sample with every function; see the module docstring for failure handling."""
        if not self._finalizer.alive:
            raise RewardError("RewardPool.score called after close()")
        n_fn = len(self.specs)
        calls = [
            (
                j,
                dict(
                    data_source=s.data_source,
                    solution_str=s.solution_str,
                    ground_truth=s.ground_truth,
                    extra_info=s.extra_info,
                ),
            )
            for s in samples
            for j in range(n_fn)
        ]
        first_error: list[str] = []

        def on_failure(k: int, r: CallResult) -> None:  # call k = sample k // n_fn, function k % n_fn
            name, sample_id = self.names[k % n_fn], samples[k // n_fn].sample_id
            what = f"reward function {name!r} ({self.specs[k % n_fn]}) on sample {sample_id!r}"
            if self.on_error == "raise":
                detail = f"\nworker traceback:\n{r.traceback}" if r.traceback else ""
                raise RewardError(f"{what}: {r.error}{detail}")
            first_error[:] = first_error or [f"{name} on {sample_id}: {r.error}"]
            if r.timeout and not self._logged_timeout:
                self._logged_timeout = True
                logger.warning(
                    "%s: %s; scored 0.0 (later timeouts are only counted in reward/timeouts)", what, r.error
                )
            elif not r.timeout and not self._logged_error:
                self._logged_error = True
                logger.warning(
                    "%s raised %s; scored 0.0 (later errors are only counted in reward/errors)\n%s",
                    what,
                    r.error,
                    r.traceback or "",
                )

        results = self.run(calls, on_failure)
        return _result(results, self.names, self.weights, first_error[0] if first_error else None)


def _result(results: list[CallResult], names: list[str], weights: list[float], first_error: str | None):
    """Per-call results (sample-major) -> the batch's `RewardResult`."""
    n_fn = len(names)
    n_s = len(results) // n_fn
    values = [r.value[0] if r.ok else 0.0 for r in results]
    extras = [r.value[1] if r.ok else {} for r in results]
    per_fn = {name: [values[i * n_fn + j] for i in range(n_s)] for j, name in enumerate(names)}
    scores = [sum(weights[j] * values[i * n_fn + j] for j in range(n_fn)) for i in range(n_s)]
    keys = sorted({(k % n_fn, key) for k, e in enumerate(extras) for key in e})
    extra = {
        f"{names[j]}/{key}": [extras[i * n_fn + j].get(key, float("nan")) for i in range(n_s)]
        for j, key in keys
    }
    return RewardResult(
        scores=scores,
        function_scores=per_fn,
        extra=extra,
        failed=[any(not r.ok for r in results[i * n_fn : (i + 1) * n_fn]) for i in range(n_s)],
        errors=sum(not r.ok and not r.timeout for r in results),
        timeouts=sum(r.timeout for r in results),
        first_error=first_error,
    )


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n] - 1}")
    return out
