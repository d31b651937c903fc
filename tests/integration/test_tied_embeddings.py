"""Tied input and output embeddings (`tie_word_embeddings`, as in most small open models) on the real
stack, for Qwen3 and Llama: TorchTitan FSDP2 over gloo (2 ranks) -> a vLLM-CPU engine.

Checked in fp32:
- the trainer holds one parameter (`tok_embeddings.weight`) and its gradient is transformers' gradient of
  the same loss on the tied model (both uses: input embedding and output head);
- weight sync: verify exact, the engine's log-probs equal the trainer's after an update (vLLM's lm head
  of a tied model is a second layer over the same tensor, with its own processing on CPU);
- export: no `lm_head.weight`, `tie_word_embeddings` kept, transformers loads it tied with the trainer's
  log-probs, a new vLLM engine from it samples what the synced engine samples;
- checkpoint and resume: the resumed trainer's next step equals an uninterrupted one's, bit for bit.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from toy_stack import PROMPTS, TOL, hf_logprobs, toy_batch  # tests/: what the real-stack sync tests share
from toy_stack import small_cfg as _cfg

from rl_tpu.types import TrainBatch


def _batch(seed: int = 0):
    return toy_batch(seed, high=200)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tied(request, tmp_path_factory) -> str:
    from rl_tpu.tiny_model import make_tiny_model

    return str(
        make_tiny_model(tmp_path_factory.mktemp(f"tied_{request.param}"), request.param, tie_embeddings=True)
    )


@pytest.fixture(scope="module")
def trainer(ray_session, tied):
    from rl_tpu.trainer import TrainerGroup

    g = TrainerGroup(_cfg(), tied, world_size=2)
    yield g
    g.shutdown()


def test_folder_is_tied(tied):
    from safetensors import safe_open

    assert json.loads(open(f"{tied}/config.json").read())["tie_word_embeddings"] is True
    with safe_open(f"{tied}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and "model.embed_tokens.weight" in set(f.keys())


def test_one_parameter_with_the_gradient_of_both_uses(trainer, tied):
    from transformers import AutoModelForCausalLM

    names = {s.name for s in trainer.param_specs()}
    assert "tok_embeddings.weight" in names and "lm_head.weight" not in names
    assert "lm_head.weight" not in trainer.hf_state_dict()

    b = _batch()
    b = b.replace(old_log_probs=trainer.compute_log_probs(b))
    grads = trainer.policy_grads(b, _cfg().algorithm)
    assert "lm_head.weight" not in grads
    ours = grads["tok_embeddings.weight"]

    # transformers on the same tied weights: PPO-clip at ratio 1 with token-mean is -sum(A * logp) / tokens
    hf = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    lp = hf_logprobs(hf, b)
    assert ((lp - b.old_log_probs) * b.response_mask).abs().max().item() <= TOL
    (-(b.advantages * lp * b.response_mask).sum() / b.response_mask.sum()).backward()
    ref = hf.model.embed_tokens.weight.grad
    scale = ref.abs().max().item()
    assert scale > 0 and (ours - ref).abs().max().item() <= 1e-4 * scale
    # both uses reach it: rows of tokens absent from the inputs get the head's part alone, and the rows of
    # input tokens differ from the head's part (transformers with the embedding lookup detached)
    inputs = torch.unique(b.input_ids[b.attention_mask.bool()])
    absent = torch.ones(ref.shape[0], dtype=torch.bool)
    absent[inputs] = False
    assert ours[absent].abs().max().item() > 1e-3 * scale
    hf.zero_grad()
    embeds = hf.model.embed_tokens(b.input_ids).detach()
    logits = hf(inputs_embeds=embeds, attention_mask=b.attention_mask).logits.float()
    lp_head = torch.zeros_like(lp)
    for i in range(b.input_ids.shape[0]):
        n, r = int(b.attention_mask[i].sum()), int(b.response_mask[i].sum())
        rows = torch.log_softmax(logits[i, n - r - 1 : n - 1], dim=-1)
        lp_head[i, :r] = rows.gather(-1, b.input_ids[i, n - r : n, None])[:, 0]
    (-(b.advantages * lp_head * b.response_mask).sum() / b.response_mask.sum()).backward()
    head_only = hf.model.embed_tokens.weight.grad
    assert (head_only[absent] - ref[absent]).abs().max().item() <= 1e-5 * scale
    assert (ours[inputs] - head_only[inputs]).abs().max().item() > 1e-2 * scale


def test_sync_verify_and_parity_after_an_update(trainer, tied, ray_session, tmp_path):
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import model as tm
    from rl_tpu.weight_sync import WeightSync

    b = _batch(seed=1)
    trainer.train_step(b.replace(old_log_probs=trainer.compute_log_probs(b)), _cfg().algorithm)
    rollout = RolloutGroup(_cfg(), tied, num_workers=1)
    try:
        ws = WeightSync(
            trainer.param_specs(),
            functools.partial(tm.titan_to_hf, tm.build_model_spec(tied)),
            trainer.actors,
            rollout,
            transport="shm",
            bucket_mb=0.25,
            engine_model_dir=tied,
        )
        ws.sync(1, keep_for_verify=True)
        hf_sd = trainer.hf_state_dict()
        diffs = ws.verify(sorted(hf_sd.items()))
        assert diffs and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
        groups = rollout.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8)
        comps = [c for g in groups for c in g]
        batch = TrainBatch.from_sequences(
            [c.prompt_ids for c in comps], [c.response_ids for c in comps], pad_id=3
        )
        lp = trainer.compute_log_probs(batch)
        for i, c in enumerate(comps):
            assert (lp[i, : len(c.response_ids)] - torch.tensor(c.logprobs)).abs().max().item() <= TOL, i
        greedy = [g[0].response_ids for g in rollout.generate(PROMPTS, n=1, temperature=0.0, max_tokens=10)]
        ws.close()
    finally:
        rollout.shutdown()

    # export: tied stays tied, transformers and a fresh vLLM engine serve the trained weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = trainer.export_hf(str(tmp_path / "hf"))
    assert json.loads(open(f"{out}/config.json").read())["tie_word_embeddings"] is True
    with safe_open(f"{out}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), hf_sd["model.embed_tokens.weight"])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert ((hf_logprobs(hf, batch) - lp) * batch.response_mask).abs().max().item() <= TOL
    fresh = RolloutGroup(_cfg(), out, num_workers=1)
    try:
        again = [g[0].response_ids for g in fresh.generate(PROMPTS, n=1, temperature=0.0, max_tokens=10)]
    finally:
        fresh.shutdown()
    assert again == greedy


def test_checkpoint_resume_continues_bit_for_bit(trainer, tied, tmp_path):
    from rl_tpu.trainer import TrainerGroup

    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = TrainerGroup(_cfg(), tied, world_size=2)
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        a, b = trainer.hf_state_dict(), resumed.hf_state_dict()
        assert sorted(a) == sorted(b) and "lm_head.weight" not in a
        assert all(torch.equal(a[k], b[k]) for k in a)
        before, step = a, _batch(seed=2)
        for g in (trainer, resumed):
            g.train_step(step.replace(old_log_probs=g.compute_log_probs(step)), _cfg().algorithm)
        a, b = trainer.hf_state_dict(), resumed.hf_state_dict()
        assert not torch.equal(a["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    finally:
        resumed.shutdown()
