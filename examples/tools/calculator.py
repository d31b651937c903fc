"""A calculator tool for `rollout.tools` (docs/multi_turn.md):

    rl-tpu train CONFIG '--rollout.tools=["examples/tools/calculator.py:calculator"]'

`rl-tpu demo --task tools` uses a narrower one (`rl_tpu.commands.demo_tools:multiply`, two integers);
this one takes an expression. It evaluates integer and decimal arithmetic (+ - * / // % **, parentheses, unary
minus) by walking Python's syntax tree, never `eval`: a model-written expression cannot call anything.
Exponents are bounded so one call cannot spend the worker's time limit on a huge power.
"""

from __future__ import annotations

import ast
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_EXPONENT = 64


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    result = _value(ast.parse(expression, mode="eval").body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)
