"""Countdown reward (TinyZero / verl): an equation in `<answer>…</answer>` that reaches the target.

Ground truth: `{"target": int, "numbers": [int, ...]}` (TinyZero's parquet layout), or the same as a
JSON string. The last `<answer>` of the response holds an expression such as `(12 - 3) * 4`, optionally
followed by `= <target>`. Valid: only integers, `+ - * /`, parentheses and unary minus; each given number
used at most once (a multiset check); exact rational arithmetic (`Fraction`), so `/` is true division and
`7/2*2` reaches 7. Evaluation walks a parsed AST whitelist; nothing is ever `eval`-ed, so an answer can
neither run code nor build huge numbers (`**` is not allowed, and the numbers are the given few).

Score (TinyZero's): `score` (1.0) if valid and equal to the target, `format_score` (0.1) if an answer
tag was found but the equation is invalid or wrong, 0.0 if there is no answer tag.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction
from typing import Any

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_EXPR_CHARS = 200

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class InvalidEquation(ValueError):
    pass


def parse_ground_truth(ground_truth) -> tuple[int, list[int]]:
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    try:
        return int(gt["target"]), [int(n) for n in gt["numbers"]]
    except (TypeError, KeyError, ValueError):
        raise ValueError(
            f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, got {ground_truth!r}"
        ) from None


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integers it uses; raises InvalidEquation."""
    if len(expr) > MAX_EXPR_CHARS:
        raise InvalidEquation(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise InvalidEquation(f"not an arithmetic expression: {expr!r}") from None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise InvalidEquation("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise InvalidEquation(f"{type(node).__name__} is not allowed")

    return walk(tree.body), used


def check_equation(answer: str, target: int, numbers: list[int]) -> bool:
    """True if `answer` (an expression, optionally `= target`) uses `numbers` at most once each and equals target."""
    lhs, _, rhs = answer.partition("=")
    try:
        if rhs.strip() and Fraction(rhs.strip()) != target:
            return False
        value, used = evaluate(lhs)
    except (InvalidEquation, ValueError, ZeroDivisionError):
        return False
    return not (Counter(used) - Counter(numbers)) and value == target


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    format_score: float = 0.1,
    score: float = 1.0,
    **kw,
) -> float:
    target, numbers = parse_ground_truth(ground_truth)
    tags = ANSWER_TAG.findall(solution_str)
    if not tags:
        return 0.0
    return score if check_equation(tags[-1], target, numbers) else format_score
