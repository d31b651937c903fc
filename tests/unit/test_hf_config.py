"""Checks of a model's HF config that run on the driver before any actor starts (rl_tpu/hf_config.py):
what a trainer rank would otherwise raise in its constructor, as a Ray traceback."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rl_tpu.errors import ModelError
from rl_tpu.hf_config import check_expert_parallel


def _cfg(path, ep: int):
    return SimpleNamespace(trainer=SimpleNamespace(expert_parallel=ep), model=SimpleNamespace(path=path))


def _model(tmp_path, **hf) -> str:
    base = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 2,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
    }
    (tmp_path / "config.json").write_text(json.dumps(base | hf))
    return str(tmp_path)


def test_expert_parallel_that_divides_the_experts_passes(tmp_path):
    path = _model(tmp_path, num_experts=6)
    for ep in (1, 2, 3, 6):
        check_expert_parallel(_cfg(path, ep))


def test_expert_parallel_that_does_not_divide_the_experts_is_named(tmp_path):
    path = _model(tmp_path, num_experts=6)
    with pytest.raises(ModelError, match=r"`trainer.expert_parallel = 4` must divide the model's 6 experts"):
        check_expert_parallel(_cfg(path, 4))


def test_expert_parallel_on_a_dense_model_is_named(tmp_path):
    path = _model(tmp_path, model_type="qwen3")
    with pytest.raises(ModelError, match=r"needs a mixture-of-experts model .* model_type 'qwen3'"):
        check_expert_parallel(_cfg(path, 2))
    with pytest.raises(ModelError, match="the tiny default model"):
        check_expert_parallel(_cfg(None, 2))
    check_expert_parallel(_cfg(None, 1))
