"""Completions + scores -> TrainBatch: layout, score placement, grouping (pure logic)."""

import pytest
import torch

from rl_tpu.batching import build_rollout_batch
from rl_tpu.types import Completion


def _c(p, s, prompt, resp, version=3):
    return Completion(
        prompt_index=p,
        sample_index=s,
        prompt_ids=prompt,
        response_ids=resp,
        logprobs=[-0.1 * (k + 1) for k in range(len(resp))],
        finish_reason="stop",
        text="",
        policy_version=version,
    )


def test_layout_scores_on_last_token_and_groups():
    groups = [[_c(0, 0, [5, 6], [7, 8, 9]), _c(0, 1, [5, 6], [10])], [_c(1, 0, [4], [11, 12], version=2)]]
    rb = build_rollout_batch(groups, [1.0, 0.0, 0.5], pad_id=99)
    b = rb.batch
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 99, 99], [4, 11, 12, 99, 99]]
    assert b.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert b.prompt_lens.tolist() == [2, 2, 1]
    assert b.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert rb.token_level_scores.tolist() == [[0, 0, 1.0], [0, 0, 0], [0, 0.5, 0]]
    assert rb.group_index.tolist() == [0, 0, 1]
    assert rb.policy_versions.tolist() == [3, 3, 2]
    assert torch.allclose(b.rollout_log_probs[0], torch.tensor([-0.1, -0.2, -0.3]))
    assert b.rollout_log_probs[1].tolist()[1:] == [0.0, 0.0]


def test_completions_without_engine_logprobs_give_no_rollout_log_probs():
    bare = [[Completion(**{**_c(0, s, [5], [7, 8]).__dict__, "logprobs": []}) for s in range(2)]]
    assert build_rollout_batch(bare, [1.0, 0.0], pad_id=0).batch.rollout_log_probs is None


def test_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 completions but 1 scores"):
        build_rollout_batch([[_c(0, 0, [1], [2]), _c(0, 1, [1], [3])]], [1.0], pad_id=0)
