"""Advantage estimators and DAPO sampling helpers against independent loop references (fp64)."""

import dataclasses
import math
import statistics

import pytest
import torch

from rl_tpu.algorithms.advantages import ADV_ESTIMATORS, compute_advantages
from rl_tpu.algorithms.sampling import keep_groups_with_variance, overlong_penalty
from rl_tpu.config import AlgorithmConfig

# 3 groups with non-contiguous ids (one a singleton) and ragged response lengths
GROUPS = [7, 3, 7, 3, 7, 11, 3, 7]
LENGTHS = [4, 6, 1, 3, 5, 2, 6, 6]
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 1.0, 1.0]
T = 6


def outcome_batch():
    """Outcome rewards placed on each sequence's last valid token, as the controller does."""
    B = len(GROUPS)
    rewards = torch.zeros(B, T, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, (n, s) in enumerate(zip(LENGTHS, SCORES)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask, torch.tensor(GROUPS)


def cfg(**kw) -> AlgorithmConfig:
    return dataclasses.replace(AlgorithmConfig(), **kw)


def assert_broadcast(adv, mask, per_seq):
    for i, a in enumerate(per_seq):
        for t in range(T):
            want = a if mask[i, t] > 0 else 0.0
            assert adv[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-12), (i, t)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_group_statistics(norm):
    rewards, mask, gidx = outcome_batch()
    adv, ret = compute_advantages(
        cfg(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm), rewards, mask, gidx
    )
    want = []
    for i, g in enumerate(GROUPS):
        members = [SCORES[j] for j in range(len(GROUPS)) if GROUPS[j] == g]
        if len(members) == 1:  # verl: a lone sample has mean 0, std 1
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.mean(members), statistics.stdev(members)
        want.append((SCORES[i] - mean) / (std + 1e-6) if norm else SCORES[i] - mean)
    assert_broadcast(adv, mask, want)
    assert torch.equal(adv, ret)


def test_dr_grpo_is_grpo_without_std():
    rewards, mask, gidx = outcome_batch()
    dr, _ = compute_advantages(
        cfg(adv_estimator="dr_grpo", norm_adv_by_std_in_grpo=True), rewards, mask, gidx
    )
    nostd, _ = compute_advantages(
        cfg(adv_estimator="grpo", norm_adv_by_std_in_grpo=False), rewards, mask, gidx
    )
    withstd, _ = compute_advantages(cfg(adv_estimator="grpo"), rewards, mask, gidx)
    assert torch.equal(dr, nostd)
    assert not torch.allclose(dr, withstd)


def test_rloo_leave_one_out():
    rewards, mask, gidx = outcome_batch()
    adv, ret = compute_advantages(cfg(adv_estimator="rloo"), rewards, mask, gidx)
    want = []
    for i, g in enumerate(GROUPS):
        others = [SCORES[j] for j in range(len(GROUPS)) if GROUPS[j] == g and j != i]
        want.append(SCORES[i] - sum(others) / len(others) if others else SCORES[i])
    assert_broadcast(adv, mask, want)
    assert torch.equal(adv, ret)


def ref_whiten(vals: list[float]) -> tuple[float, float]:
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var + 1e-8)


def dense_batch(seed: int, holes: bool):
    g = torch.Generator().manual_seed(seed)
    B = 5
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate([6, 3, 1, 5, 4]):
        mask[i, :n] = 1
    if holes:  # multi-turn: observation tokens inside the response are masked out
        mask[0, 2] = 0
        mask[3, 1] = 0
        mask[3, 2] = 0
    return rewards, values, mask


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_matches_loop(holes):
    rewards, _, mask = dense_batch(1, holes)
    gamma = 0.9
    adv, ret = compute_advantages(
        cfg(adv_estimator="reinforce_plus_plus", gamma=gamma), rewards, mask, torch.arange(5)
    )
    B = rewards.shape[0]
    want_ret = [[0.0] * T for _ in range(B)]
    for i in range(B):
        g = 0.0
        for t in reversed(range(T)):  # masked tokens neither add reward nor discount
            if mask[i, t] > 0:
                g = rewards[i, t].item() + gamma * g
                want_ret[i][t] = g
    flat = [want_ret[i][t] for i in range(B) for t in range(T) if mask[i, t] > 0]
    mean, sd = ref_whiten(flat)
    for i in range(B):
        for t in range(T):
            assert ret[i, t].item() == pytest.approx(want_ret[i][t], rel=1e-12, abs=1e-12)
            want = (want_ret[i][t] - mean) / sd if mask[i, t] > 0 else 0.0
            assert adv[i, t].item() == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_backward_recursion(holes):
    rewards, values, mask = dense_batch(2, holes)
    gamma, lam = 0.95, 0.8
    adv, ret = compute_advantages(
        cfg(adv_estimator="gae", gamma=gamma, lam=lam), rewards, mask, torch.arange(5), values=values
    )
    B = rewards.shape[0]
    raw = [[0.0] * T for _ in range(B)]
    for i in range(B):
        steps = [t for t in range(T) if mask[i, t] > 0]  # the recursion runs over valid tokens only
        a_next, v_next = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[i, t].item() + gamma * v_next - values[i, t].item()
            a_next = delta + gamma * lam * a_next
            v_next = values[i, t].item()
            raw[i][t] = a_next
    flat = [raw[i][t] for i in range(B) for t in range(T) if mask[i, t] > 0]
    mean, sd = ref_whiten(flat)
    for i in range(B):
        for t in range(T):
            if mask[i, t] > 0:
                assert ret[i, t].item() == pytest.approx(raw[i][t] + values[i, t].item(), rel=1e-12)
                assert adv[i, t].item() == pytest.approx((raw[i][t] - mean) / sd, rel=1e-9, abs=1e-12)
            else:
                assert adv[i, t].item() == 0.0


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards, values, mask = dense_batch(3, holes=False)
    _, ret = compute_advantages(
        cfg(adv_estimator="gae", gamma=1.0, lam=1.0), rewards, mask, torch.arange(5), values=values
    )
    mc = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])  # undiscounted reward-to-go
    torch.testing.assert_close(ret * mask, mc * mask, rtol=1e-12, atol=1e-12)


def test_estimator_errors():
    rewards, mask, gidx = outcome_batch()
    assert sorted(ADV_ESTIMATORS) == ["dr_grpo", "gae", "grpo", "reinforce_plus_plus", "rloo"]
    bad = AlgorithmConfig()
    bad.adv_estimator = "remax"
    with pytest.raises(ValueError, match=r"'remax'.*dr_grpo, gae, grpo, reinforce_plus_plus, rloo"):
        compute_advantages(bad, rewards, mask, gidx)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(cfg(adv_estimator="gae"), rewards, mask, gidx)
    with pytest.raises(ValueError, match="group_index has shape"):
        compute_advantages(cfg(), rewards, mask, gidx[:3])
    with pytest.raises(ValueError, match="response_mask has shape"):
        compute_advantages(cfg(), rewards, mask[:, :2], gidx)


def test_keep_groups_with_variance_matches_loop():
    scores = torch.tensor([1.0, 1.0, 0.3, 0.3, 0.3, 0.0, 1.0, 0.7, 0.2, 0.2])
    gidx = torch.tensor([4, 4, 9, 9, 9, 2, 2, 5, 8, 8])
    keep = keep_groups_with_variance(scores, gidx)
    for i in range(len(scores)):
        members = [scores[j].item() for j in range(len(scores)) if gidx[j] == gidx[i]]
        want = len(members) == 1 or max(members) != min(members)
        assert bool(keep[i]) == want, i
    assert keep.tolist() == [False, False, False, False, False, True, True, True, False, False]
    with pytest.raises(ValueError, match="group_index"):
        keep_groups_with_variance(scores, gidx[:4])


def test_overlong_penalty_matches_formula():
    lengths = torch.tensor([0, 10, 12, 13, 15, 16])
    got = overlong_penalty(lengths, max_tokens=16, buffer_len=4, factor=0.5)
    for n, p in zip(lengths.tolist(), got.tolist()):
        expected_len = 16 - 4
        want = 0.0 if n <= expected_len else -(n - expected_len) / 4 * 0.5
        assert p == pytest.approx(want)
    assert got[-1].item() == pytest.approx(-0.5)
    assert torch.equal(overlong_penalty(lengths, 16, 0, 1.0), torch.zeros(6))
    with pytest.raises(ValueError, match="overlong_buffer_len=20"):
        overlong_penalty(lengths, 16, 20, 1.0)
