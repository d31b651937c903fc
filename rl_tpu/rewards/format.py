"""Format reward: 1.0 if the response has the answer format its task expects, else 0.0.

Styles (chosen by `style=` keyword, else `extra_info["format_style"]`, else from `data_source`):
- "gsm8k" (data_source containing "gsm8k"): a `#### <number>` line, as verl's strict gsm8k extraction wants.
- "boxed" (data_source containing "math"): a `\\boxed{…}` with balanced braces.
- "answer_tag" (everything else: arithmetic, countdown, ...): exactly one `<answer>…</answer>` with
  non-empty content and nothing but whitespace after it.
It checks the shape only, never correctness; weight it low next to a correctness reward.
"""

from __future__ import annotations

import re
from typing import Any

STYLES = ("answer_tag", "gsm8k", "boxed")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{…}` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def style_for(data_source: str) -> str:
    source = data_source.lower()
    if "gsm8k" in source:
        return "gsm8k"
    if "math" in source:
        return "boxed"
    return "answer_tag"


def has_format(text: str, style: str) -> bool:
    if style == "answer_tag":
        return (
            re.fullmatch(
                r"(?s)(?:(?!<answer>).)*<answer>(?:(?!</?answer>).)*\S(?:(?!</?answer>).)*</answer>\s*", text
            )
            is not None
        )
    if style == "gsm8k":
        return re.search(r"#### \-?[0-9\.\,]*[0-9]", text) is not None
    if style == "boxed":
        return bool((last_boxed(text) or "").strip())
    raise ValueError(f"unknown format style {style!r}; choose one of {STYLES}")


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    style: str | None = None,
    **kw,
) -> float:
    style = style or (extra_info or {}).get("format_style") or style_for(data_source)
    return 1.0 if has_format(solution_str, style) else 0.0
