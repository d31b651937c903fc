"""Synthetic tasks for tests and the demo, with train/test splits: `arithmetic` and `countdown`.

Invariants:
- Deterministic for (task, sizes, seed, task options); the same seed gives the same examples on any
  machine (only `random.Random`, no hash-randomised sets in the order).
- Disjoint: no test problem appears in train. Problems are drawn one stream per seed, duplicates
  skipped, the TEST split first: so the test set does not change when `train_size` changes.
- Arithmetic problem identity is the prompt ("What is 37+45?"; 45+37 is another problem). Countdown
  problem identity is (sorted numbers, target), so reordered numbers never leak across splits.
- Answers match the built-in rewards: arithmetic ground truth is the integer result as a string
  (`rl_tpu.rewards.arithmetic`); countdown ground truth is {"target", "numbers"} (TinyZero's layout,
  `rl_tpu.rewards.countdown`) and `extra_info["solution"]` holds one equation that reaches the target.

CLI: `python -m rl_tpu.data arithmetic --out data/arith [--train-size N --test-size M --seed S --format jsonl]`
writes train.parquet and test.parquet (`dump_synthetic` from Python).
"""

from __future__ import annotations

import argparse
import inspect
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from rl_tpu.data.files import write_jsonl, write_parquet
from rl_tpu.data.schema import DataError, Example

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def _draw_unique(
    next_problem: Callable[[], tuple], key: Callable[[tuple], object], n: int, task: str
) -> list[tuple]:
    seen, out = set(), []
    attempts, max_attempts = 0, 50 * n + 1000
    while len(out) < n:
        attempts += 1
        if attempts > max_attempts:
            raise DataError(
                f"synthetic {task}: found only {len(out)} distinct problems of the {n} asked "
                "for; ask for fewer or widen the task's ranges"
            )
        p = next_problem()
        if key(p) not in seen:
            seen.add(key(p))
            out.append(p)
    return out


def arithmetic(
    train_size: int, test_size: int, seed: int = 0, digits: int = 2, ops: str = "+"
) -> tuple[list[Example], list[Example]]:
    """ "What is a<op>b?" with `digits`-digit operands; ground truth is the integer result as a string."""
    if digits < 1 or any(op not in _OPS for op in ops) or not ops:
        raise DataError(
            f"synthetic arithmetic: digits must be >= 1 and ops a non-empty subset of "
            f"{''.join(_OPS)!r}, got digits={digits}, ops={ops!r}"
        )
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    space = (hi - lo + 1) ** 2 * len(ops)
    if train_size + test_size > space:
        raise DataError(
            f"synthetic arithmetic: digits={digits}, ops={ops!r} has only {space} distinct "
            f"problems; asked for {train_size} train + {test_size} test"
        )
    rng = random.Random(seed)
    problems = _draw_unique(
        lambda: (rng.randint(lo, hi), rng.choice(ops), rng.randint(lo, hi)),
        lambda p: p,
        test_size + train_size,
        "arithmetic",
    )

    def example(p: tuple, split: str, i: int) -> Example:
        a, op, b = p
        return Example(
            data_source="arithmetic",
            messages=[{"role": "user", "content": f"What is {a}{op}{b}?"}],
            ground_truth=str(_OPS[op](a, b)),
            ability="math",
            extra_info={"split": split, "index": i},
            uid=f"arithmetic-{split}-{i}",
        )

    test = [example(p, "test", i) for i, p in enumerate(problems[:test_size])]
    train = [example(p, "train", i) for i, p in enumerate(problems[test_size:])]
    return train, test


def _random_solution(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction]:
    """Combine all `numbers` in random order with random + - * / into (equation, value); / only if exact."""
    order = rng.sample(numbers, len(numbers))
    expr, value = str(order[0]), Fraction(order[0])
    for n in order[1:]:
        op = rng.choice("+-*/" if n != 0 and value % n == 0 else "+-*")
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
        expr = f"({expr}){op}{n}" if op in "*/" and ("+" in expr or "-" in expr) else f"{expr}{op}{n}"
    return expr, value


def countdown(
    train_size: int,
    test_size: int,
    seed: int = 0,
    count: int = 3,
    max_number: int = 20,
    max_target: int = 100,
) -> tuple[list[Example], list[Example]]:
    """`count` numbers in 1..max_number and a target in 1..max_target reachable with all of them."""
    if count < 2 or max_number < 1 or max_target < 1:
        raise DataError(
            f"synthetic countdown: need count >= 2, max_number >= 1, max_target >= 1, got "
            f"count={count}, max_number={max_number}, max_target={max_target}"
        )
    rng = random.Random(seed)

    def problem() -> tuple:
        while True:
            numbers = [rng.randint(1, max_number) for _ in range(count)]
            expr, value = _random_solution(rng, numbers)
            if value.denominator == 1 and 1 <= value <= max_target:
                return tuple(numbers), int(value), expr

    problems = _draw_unique(
        problem, lambda p: (tuple(sorted(p[0])), p[1]), test_size + train_size, "countdown"
    )

    def example(p: tuple, split: str, i: int) -> Example:
        numbers, target, expr = p
        listed = ", ".join(map(str, numbers))
        content = (
            f"Use the numbers {listed} to make {target} with + - * /, each number at most once. "
            "Answer as <answer>equation</answer>."
        )
        return Example(
            data_source="countdown",
            messages=[{"role": "user", "content": content}],
            ground_truth={"target": target, "numbers": list(numbers)},
            ability="math",
            extra_info={"split": split, "index": i, "solution": expr},
            uid=f"countdown-{split}-{i}",
        )

    test = [example(p, "test", i) for i, p in enumerate(problems[:test_size])]
    train = [example(p, "train", i) for i, p in enumerate(problems[test_size:])]
    return train, test


TASKS: dict[str, Callable[..., tuple[list[Example], list[Example]]]] = {
    "arithmetic": arithmetic,
    "countdown": countdown,
}


def make_synthetic(
    task: str, train_size: int, test_size: int, seed: int = 0, **options
) -> tuple[list[Example], list[Example]]:
    """(train, test) of a synthetic task by name; `options` go to the task (digits, ops, count, ...)."""
    if task not in TASKS:
        raise DataError(f"unknown synthetic task {task!r}; choose one of {sorted(TASKS)}")
    known = list(inspect.signature(TASKS[task]).parameters)[3:]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise DataError(f"synthetic {task}: unknown option(s) {unknown}; its options: {known}")
    return TASKS[task](train_size, test_size, seed, **options)


def dump_synthetic(
    task: str,
    out_dir: str | Path,
    train_size: int = 2048,
    test_size: int = 128,
    seed: int = 0,
    fmt: str = "parquet",
    **options,
) -> list[Path]:
    """Write `<out_dir>/train.<fmt>` and `test.<fmt>` in verl's schema; returns the two paths."""
    writers = {"parquet": write_parquet, "jsonl": write_jsonl}
    if fmt not in writers:
        raise DataError(f"unknown format {fmt!r}; choose parquet or jsonl")
    train, test = make_synthetic(task, train_size, test_size, seed, **options)
    out = Path(out_dir)
    return [writers[fmt](train, out / f"train.{fmt}"), writers[fmt](test, out / f"test.{fmt}")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl_tpu.data", description=__doc__.split("\n")[0])
    ap.add_argument("task", choices=sorted(TASKS))
    ap.add_argument("--out", required=True, help="folder for train.<fmt> and test.<fmt>")
    ap.add_argument("--train-size", type=int, default=2048)
    ap.add_argument("--test-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", dest="fmt", choices=["parquet", "jsonl"], default="parquet")
    args = ap.parse_args(argv)
    for path in dump_synthetic(args.task, args.out, args.train_size, args.test_size, args.seed, args.fmt):
        print(f"wrote {path}")
    return 0
