"""The verl plugin on a model with tied input/output embeddings (the layout of SmolLM2, Qwen3 0.6B,
Llama 3.2 1B): tests/integration/test_verl.py's two end-to-end checks, on a tied tiny Qwen3. verl's TrainingWorker on
our engine gives our trainer's log-probs, gradients and update (one parameter for both uses); our
checkpoint backend syncs it into vLLM-CPU with greedy outputs equal, exactly, to those of vLLM's own load
of the same weights (a stale output head would differ)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="the `verl` extra is not installed (make test installs it)")

import test_verl  # noqa: E402  tests/: the checks themselves, run here on the tied model
from test_verl import verl_ranks  # noqa: E402, F401  its fixture, built here on the tied model


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """A tied tiny Qwen3 in place of conftest's untied one, for the imported tests and fixture."""
    from rl_tpu.tiny_model import make_tiny_model

    return str(
        make_tiny_model(tmp_path_factory.mktemp("tied_qwen3"), "qwen3", "tiny", 0, tie_embeddings=True)
    )


# in test_verl's order: the first compares verl's update with ours from the same start, the second
# updates verl's ranks further
def test_verl_training_worker_drives_our_engine_like_our_trainer(verl_ranks, ray_session, tiny_qwen3):  # noqa: F811
    test_verl.test_verl_training_worker_drives_our_engine_like_our_trainer(
        verl_ranks, ray_session, tiny_qwen3
    )


def test_rl_tpu_checkpoint_backend_syncs_shards_into_vllm_through_verls_interface(
    verl_ranks,  # noqa: F811  the fixture imported above
    ray_session,
    tiny_qwen3,
):
    test_verl.test_rl_tpu_checkpoint_backend_syncs_shards_into_vllm_through_verls_interface(
        verl_ranks, ray_session, tiny_qwen3
    )
