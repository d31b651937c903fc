"""TorchTitan -> Hugging Face names and element positions, through TorchTitan's own state-dict adapter.

There is no hand-written name list here: the adapter (`Qwen3StateDictAdapter`, `Llama3StateDictAdapter`,
...) is the one table. To learn not only the names but where every row goes (Llama's adapter permutes
q/k rows for RoPE; MoE adapters split grouped experts), `hf_row_map` feeds the adapter's `to_hf` with
one-column probe tensors holding each row's global TorchTitan row number and reads them back.
The HF -> engine step is vLLM's (see `engine_layout`).

Invariants: every HF row maps to exactly one TorchTitan row with its columns in order; `to_hf` must only
move rows (view, permute rows, split, rename), which is what TorchTitan's Qwen3 / Llama / MoE adapters do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .rows import rows_cols, runs_1d
from .specs import ParamSpec


def hf_row_map(specs: list[ParamSpec], to_hf: Callable[[dict], dict]) -> dict[str, tuple[int, np.ndarray]]:
    """HF name -> (index into `specs`, `[n, 3]` runs of (HF row, TorchTitan row, nrows)); columns map 1:1.

    Rows are those of the 2-D view (`rows.rows_cols`). The adapter runs on one TorchTitan tensor at a
    time, on a probe holding each row's TorchTitan row number: one column wide (one int64 per row), or,
    for adapters that reshape with the full width (Llama's k permutation names the model dim), a stride-0
    view across all columns, read back from column 0 after checking every column agrees. TorchTitan's
    adapters map layer `i` by a template over `i`, so once two layers of a name template gave the same
    map, the other layers reuse it (checked names). An adapter that moves elements across rows and
    columns (a transpose) is refused by name; one that permutes columns within a row is not detected here
    (TorchTitan's adapters do not; the real-stack tests verify bit for bit).
    """
    real = hf_shapes(specs, to_hf)
    out: dict[str, tuple[int, np.ndarray]] = {}
    templates: dict[tuple, list | None] = {}  # (name template, shape) -> [(HF name template, runs)]
    seen: dict[tuple, int] = {}
    for tid, s in enumerate(specs):
        num = re.search(r"\d+", s.name)
        key = (re.sub(r"\d+", "{}", s.name, count=1), tuple(s.shape)) if num else None
        cached = templates.get(key)
        if cached is not None and seen[key] >= 2:
            names = [t.format(num.group(0)) for t, _ in cached]
            if all(n in real for n in names):
                out.update({n: (tid, runs) for n, (_, runs) in zip(names, cached)})
                continue
        got = _probe(s, to_hf, real)
        for hf_name, runs in got:
            out[hf_name] = (tid, runs)
        if key is None:
            continue
        mine = [(re.sub(rf"(?<!\d){num.group(0)}(?!\d)", "{}", n, count=1), r) for n, r in got]
        if key not in templates:
            templates[key], seen[key] = mine, 1
        elif templates[key] is not None:
            same = len(mine) == len(templates[key]) and all(
                a == c and np.array_equal(b, d) for (a, b), (c, d) in zip(mine, templates[key])
            )
            templates[key] = templates[key] if same else None
            seen[key] += 1
    return out


def _probe(s: ParamSpec, to_hf: Callable[[dict], dict], real: dict) -> list[tuple[str, np.ndarray]]:
    """Run the adapter on a row-number probe of one TorchTitan tensor: [(HF name, row runs)]."""
    n = rows_cols(s.shape)[0]
    codes = torch.arange(n, dtype=torch.int64)
    if len(s.shape) >= 2:
        try:
            got = dict(to_hf({s.name: codes.view(*s.shape[:-1], 1)}))
            if any(v.shape[-1] != 1 for v in got.values()):
                raise ValueError("probe widened")
        except (RuntimeError, ValueError):  # the adapter needs the real width: stride-0 columns
            wide = to_hf({s.name: codes.view(*s.shape[:-1], 1).expand(s.shape)})
            got = {
                k: v[..., :1] if tuple(v.shape) == tuple(real[k]) and bool((v == v[..., :1]).all()) else v
                for k, v in wide.items()
            }
    else:
        got = dict(to_hf({s.name: codes.view(s.shape)}))
    out = []
    for hf_name, t in got.items():
        shape = real[hf_name]
        want = (*shape[:-1], 1) if len(shape) >= 2 else tuple(shape)
        if tuple(t.shape) != want:
            raise ValueError(
                f"adapter output {hf_name!r}: probe shape {tuple(t.shape)} != {want}; the adapter "
                f"moves elements across columns, which the row-based plan does not support"
            )
        local = t.reshape(-1).numpy()
        if local.size and (local.min() < 0 or local.max() >= n):
            raise ValueError(f"adapter maps HF tensor {hf_name!r} from more than one TorchTitan tensor")
        if rows_cols(s.shape)[1] != rows_cols(shape)[1]:
            raise ValueError(
                f"adapter output {hf_name!r}: {rows_cols(shape)[1]} columns, but its source "
                f"{s.name!r} has {rows_cols(s.shape)[1]}"
            )
        out.append((hf_name, runs_1d(local)))
    return out


def hf_shapes(specs: list[ParamSpec], to_hf: Callable[[dict], dict]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape, as the adapter produces them (meta tensors: no memory)."""
    meta = {s.name: torch.empty(s.shape, device="meta") for s in specs}
    return {n: tuple(t.shape) for n, t in to_hf(meta).items()}


@dataclass(frozen=True)
class NameMaps:
    """What the plan needs from the adapter: HF name -> shape (`hf_shapes`) and -> rows (`hf_row_map`).
    Computed where TorchTitan is loaded anyway (a trainer rank, `TrainerWorker.ws_name_maps`), so the
    driver plans without importing it."""

    shapes: dict[str, tuple[int, ...]]
    rows: dict[str, tuple[int, np.ndarray]]

    @classmethod
    def from_adapter(cls, specs: list[ParamSpec], to_hf: Callable[[dict], dict]) -> NameMaps:
        return cls(hf_shapes(specs, to_hf), hf_row_map(specs, to_hf))


def header_shapes(header: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape from a parsed safetensors header."""
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return header_shapes(json.loads(fh.read(n)))


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape from the safetensors headers of one file or a model folder (no tensor data read)."""
    path = Path(path)
    if path.is_file():
        return _file_shapes(path)
    if not path.is_dir():
        raise FileNotFoundError(f"weight path {str(path)!r} does not exist")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"folder {str(path)!r} holds no .safetensors file")
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        out.update(_file_shapes(f))
    return out


def titan_to_hf_for(hf_dir: str | Path) -> Callable[[dict], dict]:
    """TorchTitan's `to_hf` for the model in `hf_dir` (qwen3 or llama), for callers without a trainer.

    The trainer owns the real adapter; this builds the same class with just the config fields `to_hf`
    reads, so the weight-sync tests and bench need no TorchTitan model build.
    """
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    model_type = cfg.get("model_type", "")
    tie = bool(cfg.get("tie_word_embeddings", False))
    if model_type == "qwen3":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        adapter = Qwen3StateDictAdapter(SimpleNamespace(enable_weight_tying=tie, layers=[]), None)
        return adapter.to_hf
    raise NotImplementedError(
        f"titan_to_hf_for: model_type {model_type!r} in {hf_dir}; pass the trainer's adapter"
    )
