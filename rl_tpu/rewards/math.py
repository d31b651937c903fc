"""Competition-math reward: `math_verify` decides equivalence of the response and the ground truth.

The ground truth is parsed as `\\boxed{<ground_truth>}` (as verl's math_verify reward does); the response
is parsed with math_verify's default LaTeX + expression extraction. Only if math_verify itself raises
(parser bug, timeout signal outside the main thread, ...) does this fall back to comparing normalized
strings: the last `\\boxed{…}` of the response (or its last line) against the ground truth, with spaces,
`$`, `\\left`/`\\right` and a trailing period removed. math_verify is imported on first use (it takes
seconds to import, and only workers that score math should pay that).
Score: 1.0 if equivalent, else 0.0.
"""

from __future__ import annotations

import re


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{…}` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def normalize(answer: str) -> str:
    answer = answer.replace("\\left", "").replace("\\right", "").replace("$", "")
    return re.sub(r"\s+", "", answer).rstrip(".")


def _fallback(solution_str: str, ground_truth: str) -> float:
    boxed = last_boxed(solution_str)
    answer = boxed if boxed is not None else (solution_str.strip().splitlines() or [""])[-1]
    return 1.0 if normalize(answer) == normalize(ground_truth) else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw) -> float:
    ground_truth = str(ground_truth)
    try:
        from math_verify import parse, verify

        gold = parse(f"\\boxed{{{ground_truth}}}", raise_on_error=True)
        pred = parse(solution_str, raise_on_error=True)
        return 1.0 if verify(gold, pred, raise_on_error=True) else 0.0
    except Exception:  # noqa: BLE001 - math_verify failures of any kind fall back to string compare
        return _fallback(solution_str, ground_truth)
