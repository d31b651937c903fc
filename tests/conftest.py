"""Shared test setup: CPU engine environment defaults and locally built tiny models (no network)."""

import os

import pytest

from rl_tpu.devices import get_device

get_device("cpu").apply_env()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub download in a test is a bug


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from rl_tpu.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", size="tiny", seed=0))
