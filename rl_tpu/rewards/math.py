"""Competition-math reward: `math_verify` decides equivalence of the response and the ground truth.

The ground truth is parsed as `\\boxed{<ground_truth>}` (as verl's math_verify reward does); the response
is parsed with math_verify's default LaTeX + expression extraction. Only if math_verify itself raises
(parser bug, timeout signal outside the main thread, ...) does this fall back to comparing normalized
strings: the last `\\boxed{…}` of the response (or its last line) against the ground truth, with spaces,
`$`, `\\left`/`\\right` and a trailing period removed. math_verify is imported with this module (about
3 s): reward workers import their modules at startup, outside the per-call timeout, so the first call
does not pay for it (a lazy import there timed out under load and every replacement worker repeated it).
Score: 1.0 if equivalent, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from math_verify import parse, verify

from rl_tpu.rewards.format import last_boxed


def normalize(answer: str) -> str:
    answer = answer.replace("\\left", "").replace("\\right", "").replace("$", "")
    return re.sub(r"\s+", "", answer).rstrip(".")


def _fallback(solution_str: str, ground_truth: str) -> float:
    boxed = last_boxed(solution_str)
    answer = boxed if boxed is not None else (solution_str.strip().splitlines() or [""])[-1]
    return 1.0 if normalize(answer) == normalize(ground_truth) else 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kw
) -> float:
    ground_truth = str(ground_truth)
    try:
        gold = parse(f"\\boxed{{{ground_truth}}}", raise_on_error=True)
        pred = parse(solution_str, raise_on_error=True)
        return 1.0 if verify(gold, pred, raise_on_error=True) else 0.0
    except Exception:  # noqa: BLE001 - math_verify failures of any kind fall back to string compare
        return _fallback(solution_str, ground_truth)
