"""TorchTitan 0.2.0 compatibility: the trainer's Qwen3 where the `torchtitan.models.common` API is absent.

Why: torch_xla 2.9 needs torch 2.9, and the newest TorchTitan that imports on torch 2.9 is 0.2.0
(docs/devices.md), whose model API predates `torchtitan.models.common` (`Qwen3ModelArgs`, `Qwen3Model`
built from args, `parallelize_qwen3(model, parallel_dims, job_config)`). `model.build_model_spec` asks
`has_common_api()` and, where it is False, builds its `ModelSpec` here. Everything else in the trainer
stays on the 0.3.0 contract, so this file is the only place that knows 0.2.0.

What it builds: TorchTitan 0.2.0's own `Qwen3Model` (no model code here), with two module paths moved
to their 0.3.0 names, because weight sync plans, checkpoints and HF export key on 0.3.0 parameter names:
- `layers.{i}.attention.w{q,k,v}` -> `layers.{i}.attention.qkv_linear.w{q,k,v}` (0.3.0 with fuse_qkv=False)
- `output` -> `lm_head`
The moved module is the same object; the old attribute stays as a plain (unregistered) alias, so 0.2.0's
forward (`self.wq(x)`, `self.output(h)`) runs unchanged and `named_parameters()` lists the 0.3.0 names
only. `Qwen3Adapter` wraps 0.2.0's `Qwen3StateDictAdapter` and translates names both ways, so
`hf_to_titan` / `titan_to_hf` give what 0.3.0's adapter gives (the adapters only rename for Qwen3).

Numerics: 0.2.0's Qwen3 is 0.3.0's with `CosSinRoPE` (rotate-half RoPE from a cos/sin cache), q/k
RMSNorm, causal SDPA. The SDPA backend list is set to torch's default order plus MATH: 0.2.0 restricts
it to the CUDA kernels (cuDNN / flash / efficient), which leaves no kernel on an XLA device.

Not covered (each raises `ModelError` naming it): Llama (only Qwen3 is wired to 0.2.0 here), tied
embeddings (0.2.0 ties inside `parallelize_qwen3`, which this path does not run), MoE.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_tpu.errors import ModelError

# 0.2.0 name -> 0.3.0 name (and back), applied to full parameter names
_TO_NEW = (
    (re.compile(r"^(layers\.\d+\.attention)\.(w[qkv])\."), r"\1.qkv_linear.\2."),
    (re.compile(r"^output\."), "lm_head."),
)
_TO_OLD = (
    (re.compile(r"^(layers\.\d+\.attention)\.qkv_linear\.(w[qkv])\."), r"\1.\2."),
    (re.compile(r"^lm_head\."), "output."),
)


@functools.cache
def has_common_api() -> bool:
    """True when the installed TorchTitan has the `torchtitan.models.common` model API (0.3.0 on)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torchtitan.models.common") is not None
    except ModuleNotFoundError:  # no torchtitan at all: the 0.3.0 path names it when it imports
        return True


def torchtitan_version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


def _rename(name: str, table) -> str:
    for pattern, repl in table:
        name = pattern.sub(repl, name)
    return name


def to_new_names(sd: dict[str, Any]) -> dict[str, Any]:
    return {_rename(k, _TO_NEW): v for k, v in sd.items()}


def to_old_names(sd: dict[str, Any]) -> dict[str, Any]:
    return {_rename(k, _TO_OLD): v for k, v in sd.items()}


def _move_module(parent: torch.nn.Module, old: str, new_owner: torch.nn.Module, new: str) -> None:
    """Register `parent.old` as `new_owner.new` (same object) and keep `parent.old` as an unregistered alias."""
    mod = parent._modules.pop(old)
    new_owner.add_module(new, mod)
    object.__setattr__(parent, old, mod)  # plain attribute: found before nn.Module.__getattr__


def _with_new_names(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.layers.values():
        attn = block.attention
        qkv = torch.nn.Module()
        for n in ("wq", "wk", "wv"):
            _move_module(attn, n, qkv, n)
        # 0.3.0's order, so named_parameters() lists the same names in the same order: qkv_linear, wo, norms
        wo = attn._modules.pop("wo")
        attn._modules = {"qkv_linear": qkv, "wo": wo, **attn._modules}
    _move_module(model, "output", model, "lm_head")
    return model


@dataclass(frozen=True)
class Qwen3Config:
    """What the trainer reads of a TorchTitan model config: `build()` (on the current device) and `dim`."""

    args: Any  # torchtitan.models.qwen3.Qwen3ModelArgs (a dataclass: configs compare by value)

    @property
    def dim(self) -> int:
        return self.args.dim

    def build(self) -> torch.nn.Module:
        from torch.nn.attention import SDPBackend
        from torchtitan.models.attention import ScaledDotProductAttentionWrapper
        from torchtitan.models.qwen3 import Qwen3Model

        # 0.2.0 defaults to the CUDA kernels only; the list is a class attribute meant to be set
        ScaledDotProductAttentionWrapper.sdpa_backends = [
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]
        return _with_new_names(Qwen3Model(self.args))


class Qwen3Adapter:
    """0.2.0's `Qwen3StateDictAdapter` under 0.3.0 parameter names (same constructor and methods)."""

    def __init__(self, config: Qwen3Config, hf_assets_path: str | None):
        from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

        self._inner = Qwen3StateDictAdapter(config.args, hf_assets_path)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._inner.to_hf(to_old_names(state_dict))

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return to_new_names(self._inner.from_hf(hf_state_dict))


def build_model_spec(hf: dict, seq: int, head_dim: int, rope_theta: float, where: str | Path):
    """The `ModelSpec` of an HF Qwen3 config on TorchTitan 0.2.0 (`parallelize_fn` None: see parallel.py)."""
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    from rl_tpu.trainer.model import ModelSpec

    why = (
        f"on TorchTitan {torchtitan_version()} (the `torchtitan.models.common` API is missing; "
        "rl_tpu.trainer.titan_compat builds Qwen3 only, untied)"
    )
    if hf["model_type"] != "qwen3":
        raise ModelError(f"{where}: model_type {hf['model_type']!r} is not supported {why}")
    if hf.get("tie_word_embeddings", False):
        raise ModelError(f"{where}: `tie_word_embeddings: true` is not supported {why}")
    n_heads = hf["num_attention_heads"]
    args = Qwen3ModelArgs(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        vocab_size=hf["vocab_size"],
        head_dim=head_dim,
        hidden_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        qk_norm=True,
        max_seq_len=seq,
        use_flex_attn=False,
        attn_mask_type="causal",
        enable_weight_tying=False,
        moe_enabled=False,
    )
    return ModelSpec(
        arch="qwen3", config=Qwen3Config(args), parallelize_fn=None, adapter_cls=Qwen3Adapter, hf_config=hf
    )
