"""Reward for the synthetic arithmetic task (`rl_tpu.data.synthetic.arithmetic`): exact integer match.

The answer is the content of the LAST `<answer>…</answer>` if the response has one (it must then be an
integer, else the answer is missing), otherwise the LAST integer anywhere in the response. So a bare
"82" — the shortest response a tiny model can learn — and "37+45=82" and "<answer>82</answer>" all count;
an echo of the question ("What is 37+45") yields 45 and scores 0. A minus sign belongs to a number only
when it does not follow a digit or `)`, so "12-5" reads as 12 and 5, not -5.

Score: 1.0 if the answer equals `ground_truth` (an int, or a string holding one), else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
INTEGER = re.compile(r"(?:(?<![\d)])-)?\d+")
_CLIP_CHARS = 300  # only the tail can hold the final answer; bounds regex time on runaway outputs


def extract_answer(text: str) -> int | None:
    """The response's integer answer (see module docstring), or None."""
    tags = ANSWER_TAG.findall(text)
    if tags:
        content = tags[-1].strip()
        return int(content) if re.fullmatch(r"-?\d+", content) else None
    found = INTEGER.findall(text[-_CLIP_CHARS:])
    return int(found[-1]) if found else None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kw
) -> float:
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"arithmetic ground_truth must be an integer, got {ground_truth!r}") from None
    return 1.0 if extract_answer(solution_str) == expected else 0.0
