"""`Example`: one prompt of a dataset in verl's schema, and the row <-> Example conversion with checks.

verl row (parquet or JSONL):
    {"data_source": str, "prompt": [{"role": str, "content": str}, ...], "ability": str,
     "reward_model": {"style": str, "ground_truth": any}, "extra_info": {"index": int, "split": str, ...}}

Invariants:
- `data_source`, a non-empty `prompt` list of {role, content} string messages (not all contents empty),
  and `reward_model.ground_truth` (not null) are required; `ability`, `reward_model.style` and
  `extra_info` are optional ("", "rule", {}). Anything else raises `DataError` naming where (file and
  row/line) and what is wrong.
- `uid` identifies the prompt within a run: `extra_info["uid"]` if the row has one, else the location
  ("train.parquet:17"); synthetic data sets use "<task>-<split>-<index>". `write_*` does not store it.
- Extra message keys (e.g. "name") are kept; null ones (parquet fills absent struct fields with nulls)
  are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl_tpu.errors import UserError


class DataError(UserError, ValueError):
    """A data set problem a user can fix; the message names the file, the row and the field."""


@dataclass(kw_only=True)
class Example:
    data_source: str  # selects the reward in verl's default dispatch; passed to every reward function
    messages: list[dict[str, Any]]  # chat messages, each at least {"role": str, "content": str}
    ground_truth: Any  # reward_model.ground_truth: str for most tasks, a dict for countdown
    ability: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    reward_style: str = "rule"  # reward_model.style
    uid: str = ""


def example_from_row(row: Any, where: str, default_uid: str) -> Example:
    """Validate one verl row; `where` ("file.parquet row 3") prefixes every error message."""

    def bad(msg: str) -> DataError:
        return DataError(f"{where}: {msg}")

    if not isinstance(row, dict):
        raise bad(f"a row must be an object with verl's fields, got {type(row).__name__}")
    for key in ("data_source", "prompt", "reward_model"):
        if row.get(key) is None:
            raise bad(
                f"missing field `{key}` (verl schema: data_source, prompt, ability, reward_model, extra_info)"
            )
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise bad(f"`data_source` must be a non-empty string, got {data_source!r}")
    messages = _messages(row["prompt"], bad)
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict):
        raise bad(f"`reward_model` must be an object with `ground_truth`, got {type(reward_model).__name__}")
    if reward_model.get("ground_truth") is None:
        raise bad("missing field `reward_model.ground_truth`")
    style = reward_model.get("style") or "rule"
    if not isinstance(style, str):
        raise bad(f"`reward_model.style` must be a string, got {style!r}")
    ability = row.get("ability") or ""
    if not isinstance(ability, str):
        raise bad(f"`ability` must be a string, got {ability!r}")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise bad(f"`extra_info` must be an object, got {type(extra_info).__name__}")
    uid = extra_info.get("uid")
    return Example(
        data_source=data_source,
        messages=messages,
        ground_truth=reward_model["ground_truth"],
        ability=ability,
        extra_info=extra_info,
        reward_style=style,
        uid=str(uid) if uid is not None else default_uid,
    )


def _messages(prompt: Any, bad) -> list[dict[str, Any]]:
    if not isinstance(prompt, (list, tuple)):
        raise bad(
            f"`prompt` must be a list of chat messages {{role, content}}, got {type(prompt).__name__}"
            + (
                ' (wrap a plain string as [{"role": "user", "content": ...}])'
                if isinstance(prompt, str)
                else ""
            )
        )
    if not prompt:
        raise bad("`prompt` is empty")
    messages = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise bad(f"`prompt[{i}]` must be an object {{role, content}}, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise bad(f"`prompt[{i}].{key}` must be a string, got {m.get(key)!r}")
        if not m["role"]:
            raise bad(f"`prompt[{i}].role` is empty")
        messages.append({k: v for k, v in m.items() if v is not None})
    if not any(m["content"].strip() for m in messages):
        raise bad("`prompt` is empty (every message has empty content)")
    return messages


def example_to_row(ex: Example) -> dict[str, Any]:
    """The verl row of an example (uid is not stored; see module docstring)."""
    return {
        "data_source": ex.data_source,
        "prompt": [dict(m) for m in ex.messages],
        "ability": ex.ability,
        "reward_model": {"style": ex.reward_style, "ground_truth": ex.ground_truth},
        "extra_info": dict(ex.extra_info),
    }
