"""rl_tpu/controller/preflight.py's pure parts: the largest batch a step can bring and the response budget it uses.
The pass itself on a real trainer group: tests/integration/test_trainer.py::test_preflight_changes_nothing."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.config import load_config, response_budget
from rl_tpu.controller.preflight import largest_batch
from rl_tpu.data import check_prompt_lengths, make_synthetic


def test_largest_batch_is_every_row_at_full_length_in_the_loss():
    b = largest_batch(rows=6, prompt_len=5, response_len=7, vocab_size=11, seed=3)
    assert b.input_ids.shape == (6, 12) and b.response_mask.shape == (6, 7)
    assert int(b.input_ids.max()) < 11 and int(b.input_ids.min()) >= 0
    assert bool((b.attention_mask == 1).all()) and bool((b.response_mask == 1).all())
    assert b.prompt_lens.tolist() == [5] * 6
    assert bool((b.advantages != 0).all())  # no row is skipped as all-zero advantage
    # no two rows share a prompt by default, so packing shared prompts cannot make it smaller
    assert len({tuple(r) for r in b.input_ids[:, :5].tolist()}) == 6
    again = largest_batch(rows=6, prompt_len=5, response_len=7, vocab_size=11, seed=3)
    assert torch.equal(b.input_ids, again.input_ids)


def test_largest_batch_shares_prompts_within_groups_only():
    b = largest_batch(rows=6, prompt_len=5, response_len=7, vocab_size=1000, seed=3, group_size=3)
    prompts = [tuple(r) for r in b.input_ids[:, :5].tolist()]
    assert prompts[0] == prompts[1] == prompts[2] and prompts[3] == prompts[4] == prompts[5]
    assert prompts[0] != prompts[3]
    assert len({tuple(r) for r in b.input_ids[:, 5:].tolist()}) == 6  # every response its own


def test_largest_batch_refuses_empty_sizes():
    with pytest.raises(ValueError, match="response_len=0"):
        largest_batch(rows=2, prompt_len=3, response_len=0, vocab_size=10)


def test_response_budget_single_turn_and_multi_turn():
    assert response_budget(load_config(None, ["--rollout.max_tokens=48"])) == 48
    mt = load_config(None, ["--rollout.env=examples/envs/retry.py:Retry", "--rollout.max_total_tokens=300"])
    assert response_budget(mt) == 300
    auto = load_config(
        None,
        [
            "--rollout.env=examples/envs/retry.py:Retry",
            "--rollout.max_model_len=1024",
            "--data.max_prompt_length=200",
        ],
    )
    assert response_budget(auto) == 824  # max_total_tokens 0: whatever the prompt leaves


def test_a_multi_turn_config_that_leaves_no_trajectory_budget_is_named():
    from rl_tpu.config import ConfigError

    with pytest.raises(ConfigError, match=r"max_model_len = 128.*leaves no token.*max_prompt_length = 128"):
        load_config(
            None,
            [
                "--rollout.env=examples/envs/retry.py:Retry",
                "--rollout.max_model_len=128",
                "--data.max_prompt_length=128",
            ],
        )


def test_check_prompt_lengths_returns_the_longest_prompt(tiny_qwen3):
    from rl_tpu.data import encode_prompts
    from rl_tpu.model_folder import load_tokenizer

    tok = load_tokenizer(tiny_qwen3, chat_template=True)
    examples, _ = make_synthetic("arithmetic", 50, 1, seed=0)
    longest = max(map(len, encode_prompts(tok, examples, 512, "error")))
    assert check_prompt_lengths(tok, examples, 512, "error", chunk=7) == longest
    assert check_prompt_lengths(tok, examples, 512, "left") == 512  # not encoded: the configured bound
