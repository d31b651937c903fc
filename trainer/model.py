"""TorchTitan models built from a Hugging Face `config.json`, loaded from and exported to HF safetensors.

No model code lives here: the modules are TorchTitan's `Qwen3Model` / `Llama3Model` (dense), assembled
from TorchTitan's own config helpers (`make_gqa_config`, `make_ffn_config`), and every HF <-> TorchTitan
name and layout change goes through TorchTitan's state-dict adapters (`Qwen3StateDictAdapter`,
`Llama3StateDictAdapter`, which also (un)permutes Llama's q/k for its complex RoPE).

Invariants and decisions:
- Attention is `SharedPromptSDPA` (trainer/attention.py): TorchTitan's causal SDPA, plus one packed row
  holding each prompt once with its group's responses; FlexAttention has no backward on CPU. Other
  batches are right-padded, one sequence per row, starting at position 0.
- q/k/v stay unfused (`fuse_qkv=False`): parameter names then match the adapter's table one to one
  (`layers.{i}.attention.qkv_linear.wq.weight`), which is what weight sync and DCP read.
- `hf_to_titan(load_hf_state_dict(dir))` then `titan_to_hf(...)` reproduces the HF tensors bit for bit
  (the adapters only rename, reshape and permute).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_tpu.errors import ModelError

# Files copied next to exported weights so the folder loads in transformers and vLLM as-is.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the trainer needs to build one architecture: TorchTitan config, parallelize fn, adapter."""

    arch: str  # "qwen3" | "llama"
    config: Any  # Qwen3Model.Config | Llama3Model.Config
    parallelize_fn: Any
    adapter_cls: Any
    hf_config: dict
    shares_prompts: bool = False  # its attention runs shared-prompt rows (trainer/attention.py)


def read_hf_config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model folder {str(model_path)!r} has no config.json")
    return json.loads(path.read_text())


MODEL_TYPES = ("qwen3", "llama")  # what build_model_spec builds
_REQUIRED_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
)


def check_hf_config(hf: dict, where: str | Path) -> None:
    """Raise `ModelError` naming `where` (the config.json) if `build_model_spec` cannot build this model.
    Pure (no TorchTitan import): the driver runs it before any trainer actor starts, since an error
    raised inside an actor's constructor reaches the user as a Ray traceback."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        archs = f" (architectures {hf['architectures']})" if hf.get("architectures") else ""
        raise ModelError(
            f"{where}: model_type {model_type!r}{archs} is not supported; the trainer builds "
            f"dense {' and '.join(map(repr, MODEL_TYPES))} models"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ModelError(f"{where}: `{key}: true` is not supported")
    missing = [k for k in _REQUIRED_KEYS if type(hf.get(k)) is not int]
    if missing:
        raise ModelError(f"{where}: {', '.join(f'`{k}`' for k in missing)} missing or not an integer")
    _rope_theta(hf, where)


def _rope_theta(hf: dict, where: str | Path = "config.json") -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelError(f"{where}: rope_type {rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def build_model_spec(model_path: str | Path, max_seq_len: int | None = None) -> ModelSpec:
    """Translate an HF `config.json` (Qwen3ForCausalLM / LlamaForCausalLM) into a TorchTitan config.
    On a TorchTitan without the `models.common` API (0.2.0, the newest on torch 2.9 / torch_xla),
    `titan_compat` builds the same Qwen3 under the same parameter names."""
    from rl_tpu.trainer import titan_compat

    hf = read_hf_config(model_path)
    check_hf_config(hf, Path(model_path) / "config.json")
    model_type = hf["model_type"]
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    n_kv = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or dim // n_heads
    vocab, eps = hf["vocab_size"], float(hf.get("rms_norm_eps", 1e-6))
    seq = int(max_seq_len or hf.get("max_position_embeddings", 4096))
    if not titan_compat.has_common_api():
        return titan_compat.build_model_spec(
            hf, seq, head_dim, _rope_theta(hf), Path(model_path) / "config.json"
        )

    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    from rl_tpu.trainer.attention import SharedPromptSDPA

    # Init functions only matter for parameters the HF checkpoint does not cover (none for the policy).
    lin_init = {"weight": torch.nn.init.zeros_}
    norm_init = {"weight": torch.nn.init.ones_}

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=eps, param_init=norm_init)

    if model_type == "qwen3":
        from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
        from torchtitan.models.qwen3.model import Qwen3TransformerBlock as Block
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as Adapter

        model_cls, parallelize_fn = Qwen3Model, parallelize_qwen3
        rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=_rope_theta(hf))
        qk_norm = norm(head_dim)
    else:
        from torchtitan.models.llama3 import Llama3Model, parallelize_llama
        from torchtitan.models.llama3.model import Llama3TransformerBlock as Block
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as Adapter

        model_cls, parallelize_fn = Llama3Model, parallelize_llama
        rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=seq, theta=_rope_theta(hf))
        qk_norm = None

    layers = [
        Block.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                wqkv_param_init=lin_init,
                wo_param_init=lin_init,
                inner_attention=SharedPromptSDPA.Config(),
                fuse_qkv=False,
                rope=rope,
                **({"qk_norm": qk_norm} if qk_norm is not None else {}),
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=hf["intermediate_size"], w1_param_init=lin_init, w2w3_param_init=lin_init
            ),
        )
        for _ in range(hf["num_hidden_layers"])
    ]
    config = model_cls.Config(
        dim=dim,
        vocab_size=vocab,
        norm=norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init={"weight": torch.nn.init.zeros_}
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=lin_init),
        layers=layers,
    )
    return ModelSpec(
        arch=model_type,
        config=config,
        parallelize_fn=parallelize_fn,
        adapter_cls=Adapter,
        hf_config=hf,
        shares_prompts=True,
    )


def load_hf_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files (single file or sharded with an index)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {str(model_path)!r} has no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def hf_to_titan(spec: ModelSpec, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return spec.adapter_cls(spec.config, None).from_hf(dict(hf_sd))


def titan_to_hf(spec: ModelSpec, titan_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return spec.adapter_cls(spec.config, None).to_hf(dict(titan_sd))


def save_hf(spec: ModelSpec, titan_sd: dict[str, torch.Tensor], out: str | Path, src: str | Path) -> Path:
    """Write `model.safetensors` (HF names) plus config/tokenizer files copied from the source folder."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_sd = {k: v.detach().to("cpu").contiguous() for k, v in titan_to_hf(spec, titan_sd).items()}
    save_file(hf_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in _SIDE_FILES:
        if (Path(src) / name).is_file() and Path(src).resolve() != out.resolve():
            shutil.copy(Path(src) / name, out / name)
    return out
