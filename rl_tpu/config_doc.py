"""docs/configuration.md, rendered from the config dataclasses and the comments on their fields.

The comments in rl_tpu/config.py are the one description of each key; this module turns them into the
reference page, so the page cannot drift from the code (tests/unit/test_configuration_doc.py fails
when the committed page differs from `render()`).

Invariants:
- A field's description is the block of comment lines directly above it plus any comment on its own
  lines (a trailing comment, or one inside a wrapped value); a field with neither raises
  `MissingDescription` naming its dotted key.
- A field whose type is a dataclass is a section (or a nested table): its fields are rendered with
  dotted keys (`trainer.lr`), as TOML tables and `--section.key=value` overrides name them.
- Output depends only on the classes' source and defaults: same code, same bytes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from rl_tpu.config import Config, _toml_value

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = ".venv/bin/python scripts/gen_config_doc.py"
_PRAGMAS = ("noqa", "type:", "pragma", "fmt:")

_INTRO = f"""\
# Configuration reference

<!-- Generated from the field comments in rl_tpu/config.py; do not edit by hand. -->
This page is generated from the field comments in `rl_tpu/config.py`: edit them there, then run
`{REGENERATE}` (with `--check` it only says whether this page is current; a unit test runs the same
check).

A run's configuration is TOML, one table per section below (`[trainer]`, `[rollout]`, ...); a file
names only the keys it changes. The defaults below are the fields' own; `rl-tpu train` without a file
reads the embedded default run, `rl_tpu/configs/tiny_cpu.toml`, which sets a few of them (a tiny Qwen3
on CPU, `trainer.lr = 1e-4`, `rollout.max_tokens = 16`, ...). On the command line
`--section.key=value` overrides a key after the file: the value is parsed as TOML (`--rollout.n=4`,
`--reward.functions='["a.py:f"]'`), a value that is not valid TOML is taken as a string
(`--logging.run_dir=runs/x`), and a list-typed key also takes one value
(`--data.train_files=train.parquet`). `rl-tpu config show [FILE] [overrides]` prints the resolved
config.

A file may start with `extends = "base.toml"` (a top-level key, above the first table; the path is
relative to that file's folder): the base is applied first (it may extend another), then the file key by
key, so a key it sets wins and the base's other keys in the same table stay, then the overrides. The
recipes use it: `examples/recipes/base/<model>.toml` plus one small file per hardware (docs/recipes.md).

An unknown key, a wrong type or a value outside the range in the type column exits with status 2 and
one line naming the key and the file or override it came from, before Ray starts. So does a
combination of keys that cannot run together (for example `algorithm.adv_estimator = "gae"` without
`trainer.critic = true`).
"""


class MissingDescription(ValueError):
    """A config field without a comment: the page would have a row nobody can read."""


@dataclass(frozen=True)
class Row:
    """One table row; kept apart from the markdown so tests can ask for a key's description."""

    key: str
    type: str
    default: str
    description: str


@cache
def _module_comments(module_name: str) -> tuple[ast.Module, dict[int, str], tuple[str, ...]]:
    """The parsed module, its comments by line and its lines (one parse per module)."""
    source = inspect.getsource(sys.modules[module_name])
    comments = {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    return ast.parse(source), comments, tuple(source.splitlines())


def _class_node(tree: ast.Module, qualname: str) -> ast.ClassDef:
    body: list[ast.stmt] = tree.body
    node: ast.ClassDef | None = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            raise LookupError(f"class {qualname} not found in its module's source")
        body = node.body
    assert node is not None
    return node


def _clean(comment: str) -> str:
    text = comment.lstrip("#").strip()
    return "" if text.startswith(_PRAGMAS) else text


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment text, for the fields written in `cls`'s own body."""
    tree, comments, lines = _module_comments(cls.__module__)
    found: dict[str, str] = {}
    for stmt in _class_node(tree, cls.__qualname__).body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        own = [comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments]
        found[stmt.target.id] = " ".join(t for t in map(_clean, above + own) if t)
    return found


def _description(cls: type, name: str, key: str) -> str:
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            text = _field_comments(klass).get(name, "")
            if text:
                return text
            break
    raise MissingDescription(
        f"config field `{key}` ({cls.__module__}.{cls.__qualname__}.{name}) has no comment: "
        "write one above the field or after it, then run " + REGENERATE
    )


def _section_doc(cls: type) -> str:
    tree, _, _ = _module_comments(cls.__module__)
    return " ".join((ast.get_docstring(_class_node(tree, cls.__qualname__)) or "").split())


def type_name(tp: Any) -> str:
    """A type hint as a user writes its values: `int`, `list[str]`, `"a" | "b"`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(_toml_value(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _bounds(meta: Any) -> str:
    signs = (("gt", ">"), ("ge", "≥"), ("le", "≤"))
    return ", ".join(f"{sign} {meta[k]}" for k, sign in signs if meta.get(k) is not None)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def rows(cls: type, prefix: str) -> list[Row]:
    """One row per leaf field of the dataclass `cls`, keys dotted under `prefix`."""
    hints = typing.get_type_hints(cls)
    out: list[Row] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += rows(tp, key)
            continue
        bounds = _bounds(f.metadata)
        out.append(
            Row(
                key=key,
                type=f"`{type_name(tp)}`" + (f" ({bounds})" if bounds else ""),
                default=f"`{_toml_value(_default(f))}`",
                description=_description(cls, f.name, key),
            )
        )
    return out


def _cell(text: str) -> str:
    """Table-safe text: pipes escaped everywhere, `<` escaped outside code spans (no stray HTML)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def sections(root: type) -> list[tuple[str, type]]:
    """(name, class) of each dataclass-typed field of `root`: the TOML tables, in definition order."""
    hints = typing.get_type_hints(root)
    return [
        (f.name, hints[f.name]) for f in dataclasses.fields(root) if dataclasses.is_dataclass(hints[f.name])
    ]


def render(root: type = Config, intro: str = _INTRO) -> str:
    """The whole page for the config tree `root` (each dataclass-typed field of it a section)."""
    parts = [intro, "Sections: " + ", ".join(f"[`{name}`](#{name})" for name, _ in sections(root)) + ".\n"]
    for name, cls in sections(root):
        parts.append(f"## {name}\n")
        doc = _section_doc(cls)
        if doc:
            parts.append(doc + "\n")
        parts.append("| key | type | default | description |\n|---|---|---|---|")
        parts += [
            f"| `{r.key}` | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.description)} |"
            for r in rows(cls, name)
        ]
        parts.append("")
    return "\n".join(parts)


def stale_message(path: Path = DOC_PATH, root: type = Config) -> str | None:
    """None when `path` holds exactly `render(root)`, else what is wrong and the command that fixes it."""
    current = path.read_text() if path.is_file() else None
    if current == render(root):
        return None
    state = "is missing" if current is None else "is out of date with rl_tpu/config.py"
    shown = path.relative_to(DOC_PATH.parent.parent) if path.is_relative_to(DOC_PATH.parent.parent) else path
    return f"{shown} {state}: run `{REGENERATE}` and commit the result"


def write(path: Path = DOC_PATH) -> bool:
    """Write the page; True when it changed."""
    text = render()
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True
