"""A Hugging Face `config.json`, read and checked without TorchTitan: the model types the trainer builds,
the keys it needs, and the settings (RoPE theta, Qwen3-MoE routing) it derives from them. The driver runs
these checks before any actor starts (an error raised in an actor's constructor reaches the user as a Ray
traceback); trainer/model.py builds the TorchTitan config from the same readings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl_tpu.errors import ModelError


def read_hf_config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model folder {str(model_path)!r} has no config.json")
    return json.loads(path.read_text())


MOE_MODEL_TYPES = ("qwen3_moe",)  # mixture of experts
MODEL_TYPES = ("qwen3", "llama") + MOE_MODEL_TYPES  # what the trainer trains (build_model_spec builds these)
_MOE_KEYS = ("num_experts_per_tok", "moe_intermediate_size")  # plus num_experts / num_local_experts
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
            f"{', '.join(map(repr, MODEL_TYPES))} models"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ModelError(f"{where}: `{key}: true` is not supported")
    missing = [k for k in _REQUIRED_KEYS if type(hf.get(k)) is not int]
    if missing:
        raise ModelError(f"{where}: {', '.join(f'`{k}`' for k in missing)} missing or not an integer")
    rope_theta(hf, where)
    if model_type in MOE_MODEL_TYPES:
        moe_settings(hf, where)


def _moe_model(cfg: Any, setting: str) -> tuple[dict, str]:
    """The HF config of `cfg.model.path` and where it is read from; a `ModelError` naming `setting` when the
    model has no experts (the tiny default is a dense Qwen3)."""
    where = f"{cfg.model.path}/config.json" if cfg.model.path else "the tiny default model"
    hf = read_hf_config(cfg.model.path) if cfg.model.path else {"model_type": "qwen3"}
    if hf.get("model_type") not in MOE_MODEL_TYPES:
        raise ModelError(
            f"`{setting}` needs a mixture-of-experts model ({', '.join(MOE_MODEL_TYPES)}); "
            f"{where} is model_type {hf.get('model_type')!r}, which has no experts"
        )
    return hf, where


def check_routing_replay(cfg: Any) -> None:
    """Raise before any actor starts if `rollout.routing_replay` is set where it cannot work: on a dense
    model (the tiny default included), or with rollouts stitched from several engine calls (partial
    rollouts, multi-turn), whose completions carry no routing of their whole sequence."""
    rc = cfg.rollout
    if not rc.routing_replay:
        return
    _moe_model(cfg, "rollout.routing_replay = true")
    for key, on in (("partial", rc.partial), ("env", rc.env), ("tools", rc.tools)):
        if on:
            raise ModelError(f"`rollout.routing_replay = true` does not support `rollout.{key}` yet")


def check_expert_parallel(cfg: Any) -> None:
    """Raise before any actor starts if `trainer.expert_parallel` > 1 cannot split the model's experts: a
    dense model, or a number of experts it does not divide (a trainer rank would fail in its constructor)."""
    ep = cfg.trainer.expert_parallel
    if ep == 1:
        return
    hf, where = _moe_model(cfg, f"trainer.expert_parallel = {ep}")
    n = moe_settings(hf, where)["num_experts"]
    if n % ep:
        raise ModelError(f"`trainer.expert_parallel = {ep}` must divide the model's {n} experts ({where})")


def moe_settings(hf: dict, where: str | Path = "config.json") -> dict:
    """Qwen3-MoE's HF keys, checked: num_experts, top_k, expert width, renormalisation, sparse layers."""
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    missing = [k for k in _MOE_KEYS if type(hf.get(k)) is not int]
    if type(num_experts) is not int:
        missing.insert(0, "num_experts")
    if missing:
        raise ModelError(f"{where}: {', '.join(f'`{k}`' for k in missing)} missing or not an integer")
    top_k = hf["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise ModelError(f"{where}: `num_experts_per_tok` {top_k} must be in 1..num_experts ({num_experts})")
    if hf.get("shared_expert_intermediate_size"):
        raise ModelError(f"{where}: shared experts (`shared_expert_intermediate_size`) are not supported")
    step = hf.get("decoder_sparse_step", 1)
    mlp_only = hf.get("mlp_only_layers") or []
    if type(step) is not int or step < 1 or not all(type(i) is int for i in mlp_only):
        raise ModelError(f"{where}: `decoder_sparse_step` / `mlp_only_layers` must be integers")
    n_layers = hf["num_hidden_layers"]
    sparse = [i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]
    return dict(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hf["moe_intermediate_size"],
        route_norm=bool(hf.get("norm_topk_prob", False)),
        sparse=sparse,  # per layer, as transformers' Qwen3MoeDecoderLayer decides
    )


def rope_theta(hf: dict, where: str | Path = "config.json") -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelError(f"{where}: rope_type {rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
