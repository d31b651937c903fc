"""Read and write verl-format data files: parquet (through pyarrow) and JSONL (one row per line).

Invariants:
- The extension decides the format: `.parquet`, or `.jsonl` / `.json` (JSON Lines either way); any other
  extension, a missing file, an undecodable file or a file with no rows raises `DataError` naming the file.
- A directory is a folder of shards (how verl and Spark write large sets): every `*.parquet`, or every
  `*.jsonl`, file directly in it, read in name order (hidden files and anything else are ignored). A
  folder with neither, or with both kinds, raises `DataError` naming it; a shard may be empty, the folder
  may not.
- Row numbers in errors: parquet "row N" counts from 0 (as pandas and verl print them); JSONL "line N"
  counts from 1 (as editors show them). Blank JSONL lines are skipped.
- `write_parquet` then `load_examples` gives back equal examples (uid aside) when the rows of one file
  share their types (one task per file); parquet cannot hold a column that is a string in one row and an
  object in another, and such a write raises `DataError` suggesting JSONL. Keys absent from some rows'
  `extra_info` come back absent (parquet stores them as nulls; nulls are dropped on reading), and so do
  those absent from verl's `extra_info.tools_kwargs` and `interaction_kwargs`, at any depth; an empty
  object there (`"execute_kwargs": {}`, which parquet cannot store) is written as null and comes back
  absent too, which a tool reads the same way (nothing to merge).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rl_tpu.data.schema import DataError, Example, example_from_row, example_to_row

PARQUET = (".parquet",)
JSONL = (".jsonl", ".json")


def load_examples(paths: str | Path | Iterable[str | Path]) -> list[Example]:
    """All examples of `paths` (one path or several: files or directories of shards), in file order then
    row order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    examples: list[Example] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            shards = shard_files(path)
            rows = [ex for shard in shards for ex in _read(shard)]
            if not rows:
                raise DataError(f"{path} is a directory whose {len(shards)} data file(s) have no rows")
        else:
            if path.suffix not in PARQUET + JSONL:
                raise DataError(
                    f"{path}: unknown data file extension {path.suffix!r}; "
                    f"use one of {', '.join(PARQUET + JSONL)} (verl parquet or JSON Lines), "
                    "or a directory of .parquet or .jsonl shards"
                )
            if not path.is_file():
                raise DataError(f"{path}: data file not found")
            rows = _read(path)
            if not rows:  # named here: an empty data set found later cannot say which file was empty
                raise DataError(f"{path}: data file has no rows")
        examples += rows
    return examples


SHARD_KINDS = (".parquet", ".jsonl")  # what a directory of shards may hold (one kind per directory)


def shard_files(folder: Path) -> list[Path]:
    """The shards of a data directory: its `*.parquet` or its `*.jsonl` files, in name order."""
    found = {
        kind: sorted(
            (p for p in folder.iterdir() if p.suffix == kind and p.is_file() and not p.name.startswith(".")),
            key=lambda p: p.name,
        )
        for kind in SHARD_KINDS
    }
    kinds = [kind for kind in SHARD_KINDS if found[kind]]
    if not kinds:
        raise DataError(
            f"{folder} is a directory with no *.parquet or *.jsonl files (a data directory holds the "
            "shards of one data set: all parquet or all JSON Lines)"
        )
    if len(kinds) > 1:
        counts = " and ".join(f"{len(found[k])} *{k}" for k in kinds)
        raise DataError(
            f"{folder} is a directory mixing {counts} files; keep one kind of shard per directory "
            "(or list the files in data.train_files / data.test_files)"
        )
    return found[kinds[0]]


def _read(path: Path) -> list[Example]:
    return _read_parquet(path) if path.suffix in PARQUET else _read_jsonl(path)


def _read_parquet(path: Path) -> list[Example]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file: {type(e).__name__}: {e}") from None
    out = []
    for i, row in enumerate(rows):
        if isinstance(row.get("extra_info"), dict):
            row["extra_info"] = {k: v for k, v in row["extra_info"].items() if v is not None}
            for key in NESTED_KWARGS:
                if key in row["extra_info"]:
                    row["extra_info"][key] = _without_nulls(row["extra_info"][key])
        out.append(example_from_row(row, f"{path} row {i}", f"{path.name}:{i}"))
    return out


# verl's per-row settings for tools and interactions: objects whose keys differ between rows, so parquet
# gives each row every key any row has, null where it had none; nulls are dropped at every depth
NESTED_KWARGS = ("tools_kwargs", "interaction_kwargs")


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _empty_as_null(value):
    if isinstance(value, dict):
        return {k: _empty_as_null(v) for k, v in value.items()} or None
    if isinstance(value, list):
        return [_empty_as_null(v) for v in value]
    return value


def _read_jsonl(path: Path) -> list[Example]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # e.g. a parquet file named .jsonl
        raise DataError(
            f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); is it a JSON Lines file?"
        ) from None
    out = []
    # split on "\n" only: str.splitlines would also split inside strings holding U+2028 (which
    # write_jsonl leaves unescaped)
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: not valid JSON: {e}") from None
        out.append(example_from_row(row, f"{path} line {n}", f"{path.name}:{n}"))
    return out


def write_jsonl(examples: Iterable[Example], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(example_to_row(ex), ensure_ascii=False) + "\n")
    return path


def write_parquet(examples: Iterable[Example], path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    rows = [example_to_row(ex) for ex in examples]
    if not rows:
        raise DataError(f"{path}: refusing to write a parquet file with no rows")
    if not any(r["extra_info"] for r in rows):
        for r in rows:  # parquet cannot store a struct with no fields
            r["extra_info"] = None
    for r in rows:  # nor one deeper down: an empty kwargs object is written as null, read back absent
        for key in NESTED_KWARGS:
            if isinstance(r["extra_info"], dict) and key in r["extra_info"]:
                r["extra_info"][key] = _empty_as_null(r["extra_info"][key])
    columns = {}
    for key in rows[0]:
        try:
            columns[key] = pa.array([r[key] for r in rows])
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise DataError(
                f"{path}: column `{key}` cannot be stored in parquet ({type(e).__name__}: {e}); "
                "its rows probably mix types (e.g. a string ground truth in one row and an "
                "object in another): write one task per file, or use write_jsonl"
            ) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path
