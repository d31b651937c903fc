"""A PEFT LoRA adapter folder: `adapter_config.json` and `adapter_model.safetensors`, what PEFT's
`from_pretrained` and vLLM's LoRA loader read. The trainer writes one for export and every weight sync
(trainer/lora.py); an engine serves one (rollout/adapter.py).

Tensor names are PEFT's: `base_model.model.<HF module>.lora_A.weight` `[rank, in]` and `.lora_B.weight`
`[out, rank]`, with `<HF module>` the Hugging Face name of the adapted linear (`model.layers.3.self_attn.q_proj`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from rl_tpu.config import ConfigError, LoraConfig

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def config(lc: LoraConfig) -> dict[str, Any]:
    """PEFT's LoRA config of `lc`: the keys PEFT and vLLM's LoRA loader need (verl hands this to its rollout)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lc.rank,
        "lora_alpha": lc.alpha,
        "lora_dropout": lc.dropout,
        "target_modules": sorted(lc.targets),
        "bias": "none",
    }


def save(out: str | Path, tensors: dict[str, torch.Tensor], lc: LoraConfig, base_model: str) -> Path:
    """Write `tensors` (PEFT names) and the adapter's config into the folder `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    full = {
        **config(lc),
        "base_model_name_or_path": str(base_model),
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / CONFIG).write_text(json.dumps(full, indent=2) + "\n")
    return out


def read_config(folder: str, max_rank: int) -> dict[str, Any]:
    """The folder's `adapter_config.json`, checked as far as vLLM's LoRA loader reads it (rank `r` in
    1..`max_rank`, `target_modules` a list); a bad folder is one `ConfigError` naming it."""
    cfg_file = Path(folder) / CONFIG
    if not cfg_file.is_file() or not any(
        (Path(folder) / f).is_file() for f in (WEIGHTS, "adapter_model.bin")
    ):
        raise ConfigError(
            f"--lora {folder!r}: not a PEFT adapter folder (it needs {CONFIG} and {WEIGHTS}, as "
            "`rl-tpu sft --trainer.lora.rank=N` writes into RUN/adapter)"
        )
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--lora {folder!r}: {CONFIG} is not JSON ({e})") from None
    rank = config.get("r")
    if not isinstance(rank, int) or not 0 < rank <= max_rank:
        raise ConfigError(
            f"--lora {folder!r}: {CONFIG}'s rank r = {rank!r} is not one vLLM serves (1..{max_rank})"
        )
    if not isinstance(config.get("target_modules"), list):
        raise ConfigError(f"--lora {folder!r}: {CONFIG}'s target_modules must be a list of module names")
    return config


def zero_adapter(hf_shapes: dict[str, tuple[int, ...]], lc: LoraConfig) -> dict[str, torch.Tensor]:
    """An adapter that changes nothing (A = 0, B = 0) on each decoder linear named in `lc.targets` of a
    model whose HF weights have `hf_shapes`: what an engine serves before its first sync. MoE experts
    (`mlp.experts.*`) and routers never get adapters, as in the trainer."""
    names = "|".join(re.escape(t) for t in lc.targets)
    pattern = re.compile(rf"^(model\.layers\.\d+\.(?:self_attn|mlp)\.(?:{names}))\.weight$")
    out = {}
    for name, shape in sorted(hf_shapes.items()):
        m = pattern.match(name)
        if m:
            out[f"{PREFIX}{m.group(1)}.lora_A.weight"] = torch.zeros(lc.rank, shape[1])
            out[f"{PREFIX}{m.group(1)}.lora_B.weight"] = torch.zeros(shape[0], lc.rank)
    if not out:
        raise ValueError(f"trainer.lora.targets {lc.targets} name no decoder linear of this model")
    return out
