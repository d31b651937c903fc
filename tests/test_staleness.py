"""Per-token policy versions and the staleness metrics (pure logic, no Ray)."""

import torch

from rl_tpu.batching import build_rollout_batch, staleness_metrics
from rl_tpu.types import Completion


def _c(p, s, resp, version, token_versions=()):
    return Completion(
        prompt_index=p,
        sample_index=s,
        prompt_ids=[1, 2],
        response_ids=resp,
        logprobs=[-0.5] * len(resp),
        finish_reason="stop",
        text="",
        policy_version=version,
        token_versions=list(token_versions),
    )


def test_every_token_carries_its_version_into_the_batch_and_the_metrics():
    groups = [
        [_c(0, 0, [5, 6, 7, 8], 2, [2, 2, 3, 4]), _c(0, 1, [9], 3)],  # a partial rollout; a whole one
        [_c(1, 0, [10, 11], 4, [4, 4])],
    ]
    rb = build_rollout_batch(groups, [1.0, 0.0, 0.5], pad_id=0)
    b = rb.batch
    assert b.policy_versions.shape == b.response_mask.shape == b.rollout_log_probs.shape
    assert b.policy_versions.tolist() == [[2, 2, 3, 4], [3, 0, 0, 0], [4, 4, 0, 0]]
    assert rb.policy_versions.tolist() == [2, 3, 4]  # the oldest token of each row
    m = staleness_metrics(b, trainer_version=5)
    # tokens behind version 5: 3 3 2 1 | 2 | 1 1 -> mean 13/7, max 3; 2 of 7 sampled after an update
    assert m["rollout/staleness_max"] == 3.0
    assert abs(m["rollout/staleness_mean"] - 13 / 7) < 1e-6
    assert abs(m["rollout/partial_fraction"] - 2 / 7) < 1e-6
    # padding survives the trainer's reshaping: new positions get version 0 and mask 0
    padded = b.pad_to(b.input_ids.shape[1] + 2, 6, pad_id=0)
    assert padded.policy_versions[0].tolist() == [2, 2, 3, 4, 0, 0]
    assert staleness_metrics(padded, 5) == m


def test_whole_rollouts_have_no_partial_tokens():
    rb = build_rollout_batch([[_c(0, 0, [5, 6], 1), _c(0, 1, [7], 1)]], [0.0, 1.0], pad_id=0)
    m = staleness_metrics(rb.batch, trainer_version=1)
    assert m == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/partial_fraction": 0.0}
    assert torch.equal(rb.batch.policy_versions, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
