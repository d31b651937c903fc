"""GSM8K reward, verl-style: the answer follows `#### ` (strict) or is the last number (flexible).

Same extraction as verl's `gsm8k.py`: only the last 300 characters are searched; `,` and `$` are
dropped from the number. Where verl compares strings, this compares numbers (so "72.0" equals "72");
non-numeric strings still compare as strings. Score: `score` (1.0) if equal, `format_score` (0.0) if an
answer was found but is wrong, 0.0 if none was found.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_CLIP_CHARS = 300


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(re.findall(r"(\-?[0-9\.\,]+)", text)):
        if candidate not in ("", "."):
            return candidate.replace(",", "").replace("$", "")
    return None


def _same_number(a: str, b: str) -> bool:
    a, b = a.strip().rstrip("."), b.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a == b


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    **kw,
) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, str(ground_truth)) else format_score
