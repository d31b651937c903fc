"""TorchTitan -> Hugging Face names and element positions, through TorchTitan's own state-dict adapter.

There is no hand-written name list here: the adapter (`Qwen3StateDictAdapter`, `Llama3StateDictAdapter`,
...) is the one table. To learn not only the names but where every element goes (Llama's adapter permutes
q/k rows for RoPE; MoE adapters split grouped experts), `hf_element_map` feeds the adapter's `to_hf`
with index-coded int64 tensors (element value = its global TorchTitan position) and reads the codes back.
The HF -> engine step is vLLM's (see `engine_layout`).

Invariants: every HF element maps to exactly one TorchTitan element; `to_hf` must only move elements
(view, permute, split, rename), which is what TorchTitan's adapters do.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from .specs import ParamSpec


def hf_element_map(
    specs: list[ParamSpec], to_hf: Callable[[dict], dict]
) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> (TorchTitan name, int64 [numel] flat TorchTitan index of each HF element, row-major)."""
    offsets, total = {}, 0
    for s in specs:
        offsets[s.name] = total
        total += math.prod(s.shape)
    coded = {s.name: torch.arange(offsets[s.name], offsets[s.name] + math.prod(s.shape)).view(s.shape) for s in specs}
    names = [s.name for s in specs]
    starts = torch.tensor([offsets[n] for n in names])
    out = {}
    for hf_name, t in to_hf(coded).items():
        flat = t.reshape(-1)
        tid = int(torch.searchsorted(starts, flat[:1], right=True)[0]) - 1
        src = names[tid]
        local = flat - offsets[src]
        if flat.numel() and (int(local.min()) < 0 or int(local.max()) >= math.prod(specs[tid].shape)):
            raise ValueError(f"adapter maps HF tensor {hf_name!r} from more than one TorchTitan tensor")
        out[hf_name] = (src, local)
    return out


def hf_shapes(specs: list[ParamSpec], to_hf: Callable[[dict], dict]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape, as the adapter produces them (meta tensors: no memory)."""
    meta = {s.name: torch.empty(s.shape, device="meta") for s in specs}
    return {n: tuple(t.shape) for n, t in to_hf(meta).items()}


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape from the safetensors headers of a model folder (reads headers only)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(model_dir)!r}")
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        out.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
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
    raise NotImplementedError(f"titan_to_hf_for: model_type {model_type!r} in {hf_dir}; pass the trainer's adapter")
