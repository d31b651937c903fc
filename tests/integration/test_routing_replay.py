"""Routing replay (R3) and `moe/router_agreement` on the tiny Qwen3-MoE (#43), in one process: a real
vLLM-CPU engine records the experts of every token it runs, and TorchTitan's model (fp32) replays them.

What is checked:
- the engine's records (`Completion.routed_experts`): with `rollout.routing_replay` every position of
  every sequence but the last sampled token has one; its expert ids are what vLLM's own router picks;
- replay: with its router moved off the engine's (a perturbed gate), the trainer's forward sends every
  token to exactly the engine's experts, in padded rows and in shared-prompt packed rows alike (the two
  layouts then give the same log-probs), and the router still gets a gradient;
- without replay the same forward reports `moe/router_agreement` < 1, and 1 with the engine's weights;
- `rollout.routing_replay` on a dense model stops `rl-tpu train` before Ray starts, naming the field.
The loop with expert parallelism is tests/integration/test_routing_replay_loop.py.
"""

from __future__ import annotations

import pytest
import torch

from rl_tpu.config import TrainerConfig, engine_config, load_config

PROMPTS = [[1, 17, 42, 99, 7, 8, 9, 10], [5, 6, 7, 300, 301], [300, 301, 2, 9, 11, 12]]


def _cfg(*overrides: str):
    return load_config(
        None,
        ["--rollout.max_model_len=128", "--rollout.kv_cache_gb=1", "--rollout.max_tokens=6", *overrides],
    )


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from rl_tpu.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("r3") / "moe", arch="qwen3_moe", size="tiny", seed=1))


@pytest.fixture(scope="module")
def sampled(tiny_moe):
    """Completions of an in-process engine with routing replay on (4 samples of each prompt), as a batch."""
    from rl_tpu.batching import build_rollout_batch
    from rl_tpu.rollout.engine import build_engine, rollout_device, sampling_params, to_completions
    from rl_tpu.weight_sync import vllm_compat

    cfg = _cfg("--rollout.routing_replay=true", "--model.dtype=float32")
    device = rollout_device(cfg)
    llm = build_engine(engine_config(cfg), device, tiny_moe)
    try:
        layers = llm.collective_rpc("rl_routing_start")[0]
        sp = sampling_params(engine_config(cfg), device, n=4, temperature=1.0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        routing = llm.collective_rpc("rl_routing_take")[0]
        groups = to_completions(outs, range(len(PROMPTS)), 0, routing=routing)
    finally:
        vllm_compat.release_engine(llm)
    rb = build_rollout_batch(groups, [0.0] * sum(map(len, groups)), pad_id=0)
    return layers, groups, rb.batch


def _titan(path: str, perturb: float = 0.0):
    """TorchTitan's build of the model with the log-prob head, unparallelised, fp32; `perturb` adds noise
    of that scale to every router's gate so its own top-k moves off the engine's."""
    from rl_tpu.trainer.converters import install_logprob_head
    from rl_tpu.trainer.model import build_model_spec, hf_to_titan, load_hf_state_dict

    spec = build_model_spec(path)
    model = spec.config.build()
    model.load_state_dict(hf_to_titan(spec, load_hf_state_dict(path)), strict=True)
    install_logprob_head(model.lm_head, chunk=64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.layers.values():
            w = block.moe.router.gate.weight
            w += perturb * w.abs().mean() * torch.randn(w.shape, generator=g)
    return spec, model


def _forward(spec, model, batch, share_prompts: bool):
    from rl_tpu.trainer.forward import Forward

    fwd = Forward(
        rank=0,
        world_size=1,
        local=torch.device("cpu"),
        pad_id=0,
        max_len=128,
        buckets=[],
        can_share_prompts=True,
    )
    return fwd.policy(model, batch, TrainerConfig(share_prompts=share_prompts))[0]


def _routed_ids(model) -> list:
    """Hooks recording the expert ids each MoE layer's experts are sent (what the router handed on)."""
    seen: list = []
    for block in model.layers.values():
        block.moe.routed_experts.register_forward_pre_hook(
            lambda m, args: seen.append(args[2].detach().clone())
        )
    return seen


def test_engine_records_every_position_of_every_sample(sampled, tiny_moe):
    from rl_tpu.hf_config import read_hf_config

    layers, groups, batch = sampled
    hf = read_hf_config(tiny_moe)
    assert layers == hf["num_hidden_layers"]  # every layer of the tiny model is sparse
    for c in (c for g in groups for c in g):
        n = len(c.prompt_ids) + len(c.response_ids) - 1
        assert c.routed_experts.shape == (n, layers, hf["num_experts_per_tok"])
        assert bool((c.routed_experts > 0).all())  # no prefix-cache hit left a position unrecorded
        assert int(c.routed_experts.max()) <= hf.get("num_experts", hf.get("num_local_experts"))
        for pos in c.routed_experts:  # k distinct experts per token and layer
            assert all(len(set(e.tolist())) == len(e) for e in pos)
    assert batch.routed_experts.shape[:2] == batch.input_ids.shape


def test_engine_experts_are_the_routers_choice(sampled, tiny_moe):
    """With the engine's own weights the trainer's router agrees with the recorded experts (fp32 routers
    of the same weights; a near-tie could flip one, so: all but at most one token per layer)."""
    from rl_tpu.trainer.metrics import MoeStats

    _, _, batch = sampled
    spec, model = _titan(tiny_moe)
    stats = MoeStats(model, replay=False)
    with torch.no_grad():
        _forward(spec, model.eval(), batch, share_prompts=False)
    agreement = stats.read(torch.device("cpu"))["moe/router_agreement"]
    sampled_tokens = int((batch.response_mask.sum(1) - 1).sum())
    assert agreement >= 1 - 1 / sampled_tokens, agreement


def test_replay_sends_every_token_to_the_engines_experts(sampled, tiny_moe):
    from rl_tpu.trainer.metrics import MoeStats

    _, groups, batch = sampled
    spec, model = _titan(tiny_moe, perturb=3.0)
    stats = MoeStats(model, replay=True)
    seen = _routed_ids(model)
    lp_rows = _forward(spec, model.train(), batch, share_prompts=False)
    read = stats.read(torch.device("cpu"))
    assert read["moe/router_agreement"] < 0.9, read  # the perturbed router alone would pick other experts
    assert read["moe/replayed_fraction"] == 1.0, read
    engine = batch.routed_experts.long() - 1  # [B, L, layers, k]
    lengths = batch.attention_mask.sum(1)
    for layer, ids in enumerate(seen):  # [B, L, k] the experts each position was sent to
        for i in range(batch.num_seqs):
            n = int(lengths[i]) - 1  # every position but the last sampled token
            assert torch.equal(ids[i, :n].sort(-1).values, engine[i, :n, layer].sort(-1).values), (layer, i)
    # R3: the router's probabilities of the replayed experts carry the gradient
    (lp_rows * batch.response_mask).sum().backward()
    for block in model.layers.values():
        grad = block.moe.router.gate.weight.grad
        assert grad is not None and bool(grad.abs().sum() > 0) and bool(grad.isfinite().all())
    # the shared-prompt packed layout replays the same experts: the same log-probs
    model.zero_grad()
    seen.clear()
    lp_packed = _forward(spec, model, batch, share_prompts=True)
    assert seen[0].shape[0] == 1  # it did run one packed row
    mask = batch.response_mask > 0
    torch.testing.assert_close(lp_packed[mask], lp_rows[mask], rtol=0, atol=1e-5)
    # without replay the same perturbed model computes other log-probs
    stats.replay = False
    with torch.no_grad():
        lp_own = _forward(spec, model, batch, share_prompts=False)
    assert (lp_own[mask] - lp_rows[mask]).abs().max() > 1e-3


def test_routing_replay_on_a_dense_model_stops_before_ray(tmp_path):
    import ray

    from rl_tpu.controller.loop import train
    from rl_tpu.errors import ModelError

    cfg = load_config(
        None,
        ["--rollout.routing_replay=true", f"--logging.run_dir={tmp_path / 'run'}", "--trainer.total_steps=1"],
    )
    was = ray.is_initialized()
    with pytest.raises(ModelError, match=r"rollout\.routing_replay"):
        train(cfg)
    assert ray.is_initialized() == was


def test_batch_lays_engine_experts_out_like_input_ids():
    """Pure layout: completions' records -> `TrainBatch.routed_experts` [B, L, layers, k], padded with 0
    (no record) by `pad_to`; a completion without a record of its whole sequence drops them all."""
    from rl_tpu.batching import build_rollout_batch
    from rl_tpu.types import Completion

    def comp(prompt, response, experts):
        return Completion(
            prompt_index=0,
            sample_index=0,
            prompt_ids=prompt,
            response_ids=response,
            logprobs=[],
            finish_reason="stop",
            text="",
            policy_version=0,
            routed_experts=experts,
        )

    a = torch.arange(1, 1 + 4 * 2 * 2, dtype=torch.int16).reshape(4, 2, 2)  # 3 prompt + 2 response - 1
    b = torch.full((2, 2, 2), 7, dtype=torch.int16)  # 1 prompt + 2 response - 1
    batch = build_rollout_batch([[comp([1, 2, 3], [4, 5], a), comp([9], [8, 7], b)]], [0.0, 1.0], 0).batch
    assert batch.routed_experts.shape == (2, 5, 2, 2) and batch.routed_experts.dtype == torch.int16
    assert torch.equal(batch.routed_experts[0, :4], a) and not bool(batch.routed_experts[0, 4:].any())
    assert torch.equal(batch.routed_experts[1, :2], b) and not bool(batch.routed_experts[1, 2:].any())
    padded = batch.pad_to(8, 4, pad_id=0)
    assert padded.routed_experts.shape == (2, 8, 2, 2)
    assert torch.equal(padded.routed_experts[:, :5], batch.routed_experts)
    assert not bool(padded.routed_experts[:, 5:].any())
    assert torch.equal(batch.select([1]).routed_experts, batch.routed_experts[1:])
    short = comp([9], [8, 7], b[:1])  # a record of part of its sequence (a stitched completion)
    assert (
        build_rollout_batch([[comp([1, 2, 3], [4, 5], a), short]], [0.0, 1.0], 0).batch.routed_experts is None
    )
