"""TorchTitan models built from a Hugging Face `config.json`, loaded from and exported to HF safetensors.

No model code lives here: the modules are TorchTitan's `Qwen3Model` / `Llama3Model` (dense), assembled
from TorchTitan's own config helpers (`make_gqa_config`, `make_ffn_config`), and every HF <-> TorchTitan
name and layout change goes through TorchTitan's state-dict adapters (`Qwen3StateDictAdapter`,
`Llama3StateDictAdapter`, which also (un)permutes Llama's q/k for its complex RoPE).

Invariants and decisions:
- Attention is `SharedPromptSDPA` (trainer/attention.py): TorchTitan's causal SDPA, plus one packed row
  holding each prompt once with its group's responses; or, `trainer.attention = "flex"` where it can
  train (CUDA; FlexAttention has no backward on CPU), `SharedPromptFlex`, TorchTitan's FlexAttention
  with the same rows as block masks. Other batches are right-padded, one sequence per row, starting at
  position 0.
- q/k/v stay unfused (`fuse_qkv=False`): parameter names then match the adapter's table one to one
  (`layers.{i}.attention.qkv_linear.wq.weight`), which is what weight sync and DCP read.
- `hf_to_titan(load_hf_state_dict(dir))` then `titan_to_hf(...)` reproduces the HF tensors bit for bit
  (the adapters only rename, reshape and permute).

Qwen3-MoE (`model_type: "qwen3_moe"`, Qwen3MoeForCausalLM): TorchTitan's Qwen3 with `moe` blocks
(`make_moe_config`) where HF has sparse layers (`decoder_sparse_step`, `mlp_only_layers`), dense
`feed_forward` elsewhere. HF -> TorchTitan: `num_experts` (written as
`num_local_experts` by transformers 5) -> `num_experts`, `num_experts_per_tok` -> `top_k`,
`moe_intermediate_size` -> the experts' `hidden_dim`, `norm_topk_prob` -> `route_norm`; routing is
HF's: softmax over all experts in fp32, top-k, optional renormalisation (`score_func="softmax"`,
`route_scale=1`), no load-balancing expert bias (`load_balance_coeff=None`: HF has none, and the
bias would change routing), scores applied to the expert outputs. Qwen3StateDictAdapter stacks
`mlp.experts.{j}.{gate,up,down}_proj.weight` into `moe.routed_experts.inner_experts.{w1_EFD,w3_EFD,
w2_EDF}` (E, out, in) and `mlp.gate.weight` is `moe.router.gate.weight`. One change to TorchTitan's
computation: its `GroupedExperts.forward` casts activations and expert weights to bf16
(torchtitan/models/common/moe.py, the `.bfloat16()` calls in `GroupedExperts.forward`), so the experts
here are `ParamDtypeGroupedExperts`, the same grouped matmuls in the parameters' dtype (fp32 on CPU:
logits equal HF's to ~1e-6; under FSDP2 mixed precision the parameters arrive in bf16 and so does the
math). Same parameter names, so the adapter and DCP see TorchTitan's layout.
Training: FSDP2 alone or with TorchTitan's expert parallelism (`trainer.expert_parallel`,
trainer/parallel.py), weight sync of the grouped experts into vLLM's fused w13 / w2 (docs/moe.md).
Routing replay and `moe/router_agreement`: trainer/metrics.MoeStats (`check_routing_replay`,
rl_tpu/hf_config.py, refuses it before the run starts where it cannot work). Not covered yet: TorchTitan
0.2.0 (`titan_compat`), shared experts (Qwen2-MoE style).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_tpu.errors import ModelError
from rl_tpu.hf_config import MOE_MODEL_TYPES, check_hf_config, moe_settings, read_hf_config, rope_theta

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

    arch: str  # "qwen3" | "llama" | "qwen3_moe"
    config: Any  # Qwen3Model.Config | Llama3Model.Config
    parallelize_fn: Any
    adapter_cls: Any
    hf_config: dict
    shares_prompts: bool = False  # its attention runs shared-prompt rows (trainer/attention.py)
    attention: str = "sdpa"  # its inner attention (trainer.attention, resolved by rl_tpu/devices/kernels.py)


def build_model_spec(
    model_path: str | Path, max_seq_len: int | None = None, attention: str = "sdpa"
) -> ModelSpec:
    """Translate an HF `config.json` (Qwen3ForCausalLM / LlamaForCausalLM) into a TorchTitan config whose
    inner attention is `attention` ("sdpa" or "flex", trainer/attention.py).
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
        if attention != "sdpa":
            raise ModelError(
                f"trainer.attention = {attention!r} needs TorchTitan >= 0.3.0 (titan_compat: SDPA)"
            )
        if model_type in MOE_MODEL_TYPES:
            raise ModelError(
                f"{Path(model_path) / 'config.json'}: model_type {model_type!r} needs TorchTitan's "
                "`models.common` API (TorchTitan >= 0.3.0)"
            )
        return titan_compat.build_model_spec(
            hf, seq, head_dim, rope_theta(hf), Path(model_path) / "config.json"
        )

    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.config_utils import make_gqa_config

    from rl_tpu.trainer.attention import SharedPromptFlex, SharedPromptSDPA

    inner = {"sdpa": SharedPromptSDPA, "flex": SharedPromptFlex}[attention]

    # Init functions only matter for parameters the HF checkpoint does not cover (none for the policy).
    lin_init = {"weight": torch.nn.init.zeros_}
    norm_init = {"weight": torch.nn.init.ones_}

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=eps, param_init=norm_init)

    if model_type in ("qwen3", "qwen3_moe"):
        from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
        from torchtitan.models.qwen3.model import Qwen3TransformerBlock as Block
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as Adapter

        model_cls, parallelize_fn = Qwen3Model, parallelize_qwen3
        rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=rope_theta(hf))
        qk_norm = norm(head_dim)
    else:
        from torchtitan.models.llama3 import Llama3Model, parallelize_llama
        from torchtitan.models.llama3.model import Llama3TransformerBlock as Block
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as Adapter

        model_cls, parallelize_fn = Llama3Model, parallelize_llama
        rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=seq, theta=rope_theta(hf))
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
                inner_attention=inner.Config(),
                fuse_qkv=False,
                rope=rope,
                **({"qk_norm": qk_norm} if qk_norm is not None else {}),
            ),
            **_mlp(hf, i, dim, lin_init),
        )
        for i in range(hf["num_hidden_layers"])
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
        attention=attention,
    )


def _mlp(hf: dict, layer: int, dim: int, lin_init: dict) -> dict:
    """The block's MLP: `feed_forward` (dense SwiGLU) or, on an MoE model's sparse layer, `moe`."""
    from torchtitan.models.common.config_utils import make_ffn_config

    if hf["model_type"] not in MOE_MODEL_TYPES or not moe_settings(hf)["sparse"][layer]:
        return {
            "feed_forward": make_ffn_config(
                dim=dim, hidden_dim=hf["intermediate_size"], w1_param_init=lin_init, w2w3_param_init=lin_init
            )
        }
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_router_config,
        make_token_dispatcher_config,
    )
    from torchtitan.models.common.moe import RoutedExperts

    m = moe_settings(hf)
    n, k = m["num_experts"], m["top_k"]
    experts_init = {name: torch.nn.init.zeros_ for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    return {
        "moe": make_moe_config(
            num_experts=n,
            router=make_router_config(
                dim=dim,
                num_experts=n,
                gate_param_init=lin_init,
                top_k=k,
                score_func="softmax",
                route_norm=m["route_norm"],
                route_scale=1.0,
            ),
            routed_experts=RoutedExperts.Config(
                inner_experts=_param_dtype_grouped_experts().Config(
                    dim=dim, hidden_dim=m["hidden_dim"], num_experts=n, param_init=experts_init
                ),
                # "standard": all-to-all under expert parallelism, local reordering without it (EP = 1, here)
                token_dispatcher=make_token_dispatcher_config(
                    num_experts=n, top_k=k, comm_backend="standard", hidden_dim=dim
                ),
            ),
            load_balance_coeff=None,
        )
    }


def _param_dtype_grouped_experts() -> type:
    """TorchTitan's `GroupedExperts` computing in its parameters' dtype instead of always bf16.

    Built on first use (TorchTitan is imported lazily) and published as this module's
    `ParamDtypeGroupedExperts`, so configs holding it pickle by name."""
    cls = globals().get("ParamDtypeGroupedExperts")
    if cls is not None:
        return cls
    from dataclasses import dataclass as _dataclass

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    class ParamDtypeGroupedExperts(GroupedExperts):
        @_dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = (
                w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
            )
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            x = x_RD.to(w1.dtype)
            h = F.silu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offs))
            h = h * self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offs)
            return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offs).type_as(x_RD)

    ParamDtypeGroupedExperts.__module__ = __name__
    ParamDtypeGroupedExperts.__qualname__ = "ParamDtypeGroupedExperts"
    ParamDtypeGroupedExperts.Config.__qualname__ = "ParamDtypeGroupedExperts.Config"
    globals()["ParamDtypeGroupedExperts"] = ParamDtypeGroupedExperts
    return ParamDtypeGroupedExperts


def __getattr__(name: str) -> Any:
    """`ParamDtypeGroupedExperts` on first access (a pickled config names it before anything built it)."""
    if name == "ParamDtypeGroupedExperts":
        return _param_dtype_grouped_experts()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """TorchTitan names and layouts of an HF state dict. With tied embeddings the model holds one
    parameter for both uses, which `named_parameters()` names after its first owner,
    `tok_embeddings.weight`: the adapter's copy under `lm_head.weight` is dropped."""
    titan = spec.adapter_cls(spec.config, None).from_hf(dict(hf_sd))
    if tied_embeddings(spec):
        titan.pop("lm_head.weight", None)
    return titan


def tied_embeddings(spec: ModelSpec) -> bool:
    return bool(getattr(spec.config, "enable_weight_tying", False))


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
