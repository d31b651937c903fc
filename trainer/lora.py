"""LoRA on the policy (`[trainer.lora]`): TorchTitan's LoRA converter on a copy of the model's config, the
first adapters drawn on the host, and a forward that keeps the adapter path under the CPU kernels.

- TorchTitan's `LoRAConverter` rewrites the config tree: each target `Linear.Config` becomes a `LoRALinear`
  (the base weight frozen, `lora_a.weight` `[rank, in]`, `lora_b.weight` `[out, rank]`, output scaled by
  alpha / rank) and every other module freezes its own parameters when built. It mutates the config it is
  given, so it gets a deep copy: the reference and the checkpoint checks keep the base config.
- Targets are TorchTitan's names of the last config segment; Hugging Face's `k_proj` and `v_proj` are one
  TorchTitan module (`wkv`), so they come together (rl_tpu.config checks it).
- The first adapters are host tensors from one seeded generator (A as TorchTitan initialises it, B zero),
  loaded like the base weights: DTensor random init on CPU differs between world sizes, and every rank
  must start from the same adapters. B = 0 makes the first policy the base model, bit for bit.
- `LoraForward` runs after `CpuMatmuls` (trainer/converters.py), which routes every `nn.Linear` through its
  kernels by replacing `forward`: on a `LoRALinear` that dropped the adapter path. The LoRA forward is the
  base matmul (on the CPU kernel where one was chosen) plus the scaled adapter path, with dropout on the
  adapter's input in train mode only.
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rl_tpu.config import LoraConfig
from rl_tpu.peft_folder import PREFIX

# Hugging Face linear name -> TorchTitan config name (the last segment the converter matches)
TITAN_NAMES = {
    "q_proj": "wq",
    "k_proj": "wkv",
    "v_proj": "wkv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}


def titan_targets(targets: list[str]) -> list[str]:
    return sorted({TITAN_NAMES[t] for t in targets})


def convert(model_config, lc: LoraConfig):
    """A LoRA copy of the TorchTitan model config `model_config` (left unchanged)."""
    from torchtitan.components.lora import LoRAConverter

    conv = LoRAConverter(
        LoRAConverter.Config(rank=lc.rank, alpha=float(lc.alpha), target_modules=titan_targets(lc.targets))
    )
    return conv.convert(copy.deepcopy(model_config))


def adapter_shapes(model_config) -> dict[str, torch.Size]:
    """Name -> shape of every adapter weight of the (converted) config, from a build on the meta device."""
    with torch.device("meta"):
        model = model_config.build()
    return {n: p.shape for n, p in model.named_parameters() if is_adapter(n)}


def is_adapter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


def initial_adapters(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """The first adapters, the same on every rank: A as TorchTitan draws it (Kaiming-uniform, a = sqrt(5)),
    from one generator seeded `seed` in name order, and B zero."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        t = torch.empty(shapes[name])
        if ".lora_a." in name:
            torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        else:
            t.zero_()
        out[name] = t
    return out


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    from rl_tpu.trainer import cpu_matmul

    mm = getattr(self, "rl_matmuls", None)
    if mm is None:
        base = torch.nn.functional.linear(x, self.weight, self.bias)
    else:
        base = cpu_matmul.linear(x, self.weight, self.bias, mm)
    h = self.rl_lora_dropout(x) if self.rl_lora_dropout is not None else x
    return base + self._lora_scaling * self.lora_b(self.lora_a(h))


def lora_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "lora_a") and hasattr(m, "_lora_scaling")]


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model for the span of the context: every LoRA linear's adapter path scaled by 0, which
    leaves base + 0 = base exactly."""
    layers = lora_linears(model)
    saved = [m._lora_scaling for m in layers]
    for m in layers:
        m._lora_scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(layers, saved):
            m._lora_scaling = scaling


@dataclass
class LoraForward:
    """Every LoRA linear computes base + (alpha / rank) B A dropout(x), its base matmul on the kernel
    `CpuMatmuls` chose for it (if any)."""

    dropout: float = 0.0
    name: str = "lora_forward"

    def convert(self, model: torch.nn.Module) -> None:
        layers = lora_linears(model)
        if not layers:
            raise ValueError("trainer.lora: the model has no LoRA linear (no target matched)")
        for m in layers:
            # a module attribute without parameters: train() / eval() switch it with the model
            m.rl_lora_dropout = torch.nn.Dropout(self.dropout) if self.dropout else None
            m.forward = types.MethodType(_forward, m)  # a bound method: `copy.deepcopy` rebinds it


# ---------------------------------------------------------------------------------------------- export


def split(full: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA policy's full state dict -> (base weights, adapters), TorchTitan names."""
    adapters = {n: t for n, t in full.items() if is_adapter(n)}
    return {n: t for n, t in full.items() if n not in adapters}, adapters


def _pairs(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base weight name -> (A, B)."""
    out = {}
    for n, a in adapters.items():
        if ".lora_a." in n:
            prefix = n.split(".lora_a.")[0]
            out[f"{prefix}.weight"] = (a, adapters[f"{prefix}.lora_b.weight"])
    return out


def merged(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scaling: float) -> dict:
    """The base weights with each adapter folded in, W + (B @ A) * scaling (PEFT's order of operations)."""
    out = dict(base)
    for name, (a, b) in _pairs(adapters).items():
        out[name] = base[name] + (b @ a) * scaling
    return out


def peft_layout(spec, adapters: dict[str, torch.Tensor]) -> list[tuple[str, str, torch.Tensor | None]]:
    """Per adapted linear: (TorchTitan prefix, PEFT module name, the row order that puts B's rows in the HF
    weight's order, None where it is the identity). Depends on the model's shapes only: computed once."""
    import functools

    from rl_tpu.trainer import model as tmodel
    from rl_tpu.weight_sync.names import hf_row_map
    from rl_tpu.weight_sync.specs import ParamSpec

    pairs = _pairs(adapters)
    names = sorted(pairs)
    specs = [
        ParamSpec.from_tensor(n, torch.empty(pairs[n][1].shape[0], pairs[n][0].shape[1], device="meta"))
        for n in names
    ]
    out = []
    for hf_name, (tid, runs) in hf_row_map(specs, functools.partial(tmodel.titan_to_hf, spec)).items():
        rows = pairs[names[tid]][1].shape[0]
        hf_row, titan_row, n = torch.tensor(runs, dtype=torch.long).reshape(-1, 3).unbind(1)
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)  # j of each run
        order = torch.empty(rows, dtype=torch.long)
        order[torch.repeat_interleave(hf_row, n) + within] = torch.repeat_interleave(titan_row, n) + within
        identity = bool((order == torch.arange(rows)).all())
        out.append(
            (
                names[tid].removesuffix(".weight"),
                PREFIX + hf_name.removesuffix(".weight"),
                None if identity else order,
            )
        )
    return out


def peft_state(adapters: dict[str, torch.Tensor], layout: list) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (`base_model.model.<HF module>.lora_A.weight` `[rank, in]`,
    `lora_B.weight` `[out, rank]`), B's rows in the HF weight's row order (`peft_layout`): Llama's HF q and
    k rows are TorchTitan's permuted (rotary layout), and A's columns are the input, which no adapter
    moves."""
    out = {}
    for prefix, module, order in layout:
        a, b = adapters[f"{prefix}.lora_a.weight"], adapters[f"{prefix}.lora_b.weight"]
        out[f"{module}.lora_A.weight"] = a.contiguous()
        out[f"{module}.lora_B.weight"] = (b if order is None else b[order]).contiguous()
    return out


def peft_rows(adapters: dict[str, torch.Tensor], layout: list, first: bool) -> dict:
    """This rank's share of `peft_state`, without a collective where FSDP shards an adapter by rows, packed
    into one buffer (one to serialize, not hundreds): `{"rows": [(PEFT name, shape)] of this rank's row
    chunks (TorchTitan row order), "whole": [(PEFT name, shape)] of full tensors, "order": {PEFT name: HF
    row order}, "dtype", "flat": the tensors' elements in that order, as bytes (a numpy uint8 array)}`,
    whole tensors and orders from the `first` rank only. `adapters` are this rank's parameters (DTensors
    or tensors) by TorchTitan name; an adapter sharded any other way is gathered (a collective every rank
    runs, in the same order). `join_peft_rows` of every rank's share in rank order is `peft_state` of the
    full adapters."""
    from torch.distributed.tensor import DTensor

    from rl_tpu.trainer.parallel import row_sharded

    rows, whole, order, parts = [], [], {}, []
    with torch.no_grad():  # no `detach`: a DTensor's costs ~10 us per call, 240 adapters per sync
        for prefix, module, perm in layout:
            for kind, peft in (("a", "A"), ("b", "B")):
                t = adapters[f"{prefix}.lora_{kind}.weight"]
                name = f"{module}.lora_{peft}.weight"
                if isinstance(t, DTensor) and row_sharded(t):
                    local = t.to_local()
                    rows.append((name, tuple(local.shape)))
                    parts.append(local.reshape(-1))
                else:
                    full = t.full_tensor() if isinstance(t, DTensor) else t
                    if first:
                        whole.append((name, tuple(full.shape)))
                        parts.append(full.reshape(-1))
                if kind == "b" and perm is not None and first:
                    order[name] = perm
    if len({p.dtype for p in parts}) > 1:
        raise ValueError(
            f"adapters of several dtypes {sorted({str(p.dtype) for p in parts})}: one is expected"
        )
    with torch.no_grad():
        flat = torch.cat(parts).to("cpu") if parts else torch.empty(0)
    # raw bytes as a numpy array: Ray moves numpy buffers without pickling them (torch tensors it copies)
    return {
        "rows": rows,
        "whole": whole,
        "order": order,
        "dtype": str(flat.dtype),
        "flat": flat.view(torch.uint8).numpy(),
    }


def join_peft_rows(parts: list[dict]) -> dict[str, torch.Tensor]:
    """The full adapters under PEFT's names from every trainer rank's `peft_rows`, in rank order: row
    chunks concatenated, then B's rows put in the HF weight's order."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for p in parts:
        # a copy: the array Ray hands over is read-only, a view of its object store
        dtype = getattr(torch, p["dtype"].removeprefix("torch."))
        flat = (
            torch.from_numpy(p["flat"].copy()).view(dtype) if p["flat"].size else torch.empty(0, dtype=dtype)
        )
        off = 0
        for name, shape in [*p["rows"], *p["whole"]]:
            n = math.prod(shape)
            pieces.setdefault(name, []).append(flat[off : off + n].view(shape))
            off += n
    out = {name: torch.cat(ts) if len(ts) > 1 else ts[0] for name, ts in pieces.items()}
    for name, perm in parts[0]["order"].items():
        out[name] = out[name][perm]
    return {name: out[name].contiguous() for name in sorted(out)}
