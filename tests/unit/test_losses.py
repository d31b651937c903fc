"""Losses, KL estimators, aggregation and truncated IS against independent loop references (fp64)."""

import math

import pytest
import torch

from rl_tpu.algorithms.losses import (
    POLICY_LOSSES,
    agg_loss,
    apply_kl_in_reward,
    compute_policy_loss,
    compute_value_loss,
    kl_penalty,
    rollout_is_weights,
)
from rl_tpu.config import AlgorithmConfig

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def make_batch(seed: int = 0, B: int = 8, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1.0
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    roll = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64)
    lengths = [T, 1, 3, 0, T - 1, 2, 5, 4][:B]  # one empty sequence
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return lp, old, ref, roll, adv, ent, mask


def ref_agg(loss, mask, mode, horizon=None):
    B, T = loss.shape
    rows = [[loss[i, t].item() for t in range(T) if mask[i, t] > 0] for i in range(B)]
    if mode == "token-mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / len(flat)
    nonempty = [r for r in rows if r]
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) for r in nonempty) / len(nonempty) / (horizon or T)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_penalty_matches_formula(kind):
    lp = torch.tensor([[-1.0, -2.0, -0.5, -30.0, -0.1]], dtype=torch.float64)
    rp = torch.tensor([[-1.5, -1.0, -0.5, -0.1, -30.0]], dtype=torch.float64)
    out = kl_penalty(lp, rp, kind)
    for t in range(lp.shape[1]):
        d = lp[0, t].item() - rp[0, t].item()
        if kind == "k1":
            want = d
        elif kind == "k2":
            want = 0.5 * d * d
        else:  # log(pi_ref/pi) clamped to [-20, 20], result clamped to [-10, 10]
            x = max(-20.0, min(20.0, -d))
            want = max(-10.0, min(10.0, math.exp(x) - x - 1))
        assert out[0, t].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    if kind in ("k3", "low_var_kl"):
        assert out[0, 3].item() == 10.0  # clamp engaged
        assert out[0, 2].item() == 0.0


def test_k3_of_nearly_equal_fp32_policies_is_not_rounded_to_zero():
    """Engine and trainer log-probs 1e-5 apart (fp32 parity): k3 ~ d^2 / 2 = 5e-11. exp(x) - x - 1 in fp32
    returned exactly 0.0 (or rounding noise of either sign) there, so `mismatch/k3_kl` read 0."""
    d = torch.tensor([[1e-5, -2e-5, 3e-6]], dtype=torch.float32)
    out = kl_penalty(d, torch.zeros_like(d), "k3")
    want = torch.expm1(-d.double()) + d.double()  # float64 reference
    assert out.dtype == torch.float32 and bool((out > 0).all()), out
    assert torch.allclose(out.double(), want, rtol=5e-2, atol=0), (out, want)  # fp32: one ulp of x is 2e-13


def test_kl_penalty_unknown_kind_lists_known():
    with pytest.raises(ValueError, match=r"'k4'.*k1, k2, k3, low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_loops(mode):
    lp, _, _, _, adv, _, mask = make_batch(1)
    loss = lp * adv
    assert agg_loss(loss, mask, mode).item() == pytest.approx(ref_agg(loss, mask, mode), rel=1e-12)
    if mode == "seq-mean-token-sum-norm":
        got = agg_loss(loss, mask, mode, horizon=32).item()
        assert got == pytest.approx(ref_agg(loss, mask, mode, horizon=32), rel=1e-12)


def test_agg_loss_unknown_mode_and_empty_mask():
    with pytest.raises(ValueError, match=r"'token-sum'.*seq-mean-token-mean"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "token-sum")
    for mode in MODES:  # an all-padding micro-batch contributes 0, not NaN
        assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0


def ref_ppo_token(lp, old, a, lo, hi, c):
    r = math.exp(lp - old)
    l1, l2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    loss = max(l1, l2)
    clipped = l2 > l1
    lower = a < 0 and loss > -a * c
    if a < 0:
        loss = min(loss, -a * c)
    return loss, clipped, lower


def test_ppo_clip_matches_loop_and_metrics():
    lp, old, _, _, adv, _, mask = make_batch(2)
    old = old.clone()
    old[0, 0], adv[0, 0] = lp[0, 0] - 2.0, -1.0  # ratio e^2 > 3 with A < 0: dual-clip bound
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    x = lp.clone().requires_grad_(True)
    loss, m = compute_policy_loss(cfg, x, old, adv, mask)
    B, T = lp.shape
    mats, clipped, lower = torch.zeros(B, T, dtype=torch.float64), [], []
    for i in range(B):
        for t in range(T):
            v, c, lw = ref_ppo_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.28, 3.0)
            mats[i, t] = v
            if mask[i, t] > 0:
                clipped.append(c)
                lower.append(lw)
    assert loss.item() == pytest.approx(ref_agg(mats, mask, "token-mean"), rel=1e-12)
    assert m["loss/policy"] == pytest.approx(loss.item(), rel=1e-12)
    assert m["actor/clipfrac"] == pytest.approx(sum(clipped) / len(clipped))
    assert m["actor/clipfrac_lower"] == pytest.approx(sum(lower) / len(lower)) and sum(lower) >= 1
    want_kl = sum((old[i, t] - lp[i, t]).item() for i in range(B) for t in range(T) if mask[i, t] > 0)
    assert m["actor/ppo_kl"] == pytest.approx(want_kl / mask.sum().item(), rel=1e-9)
    loss.backward()
    assert x.grad[0, 0].item() == 0.0  # the dual-clip constant has no gradient
    assert math.isfinite(loss.item())


def test_dual_clip_and_clip_higher_by_hand():
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    mask = torch.ones(1, 1, dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)

    def one(log_ratio, a):
        return compute_policy_loss(
            cfg,
            torch.full((1, 1), log_ratio, dtype=torch.float64),
            old,
            torch.full((1, 1), a, dtype=torch.float64),
            mask,
        )[0].item()

    assert one(2.0, -1.0) == pytest.approx(3.0)  # dual-clip: -A * c instead of -A * e^2
    assert one(0.5, -1.0) == pytest.approx(math.exp(0.5))  # under c: plain PPO
    assert one(math.log(1.25), 1.0) == pytest.approx(-1.25)  # inside clip-higher 1.28
    assert one(math.log(1.5), 1.0) == pytest.approx(-1.28)  # clipped at 1 + high
    assert one(math.log(0.5), -1.0) == pytest.approx(0.8)  # clipped at 1 - low for A < 0


def test_gspo_matches_loop_and_gradient():
    lp, old, _, _, adv, _, mask = make_batch(3)
    lo, hi = 0.05, 0.08
    cfg = AlgorithmConfig(policy_loss="gspo", gspo_clip_ratio_low=lo, gspo_clip_ratio_high=hi)
    seq_adv = adv[:, :1].expand_as(adv).contiguous()  # GSPO is used with sequence advantages
    x = lp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(cfg, x, old, seq_adv, mask)
    loss.backward()
    B, T = lp.shape
    n = mask.sum().item()
    mats = torch.zeros(B, T, dtype=torch.float64)
    grad = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t] > 0]
        if not valid:
            continue
        s = math.exp(sum(lp[i, t].item() - old[i, t].item() for t in valid) / len(valid))
        a = seq_adv[i, 0].item()
        for t in range(T):
            l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
            mats[i, t] = max(l1, l2)
            if t in valid and l1 >= l2:  # unclipped branch: d(s_i,t)/d(lp_t) = s_i
                grad[i, t] = -a * s / n
    assert loss.item() == pytest.approx(ref_agg(mats, mask, "token-mean"), rel=1e-12)
    torch.testing.assert_close(x.grad, grad, rtol=1e-12, atol=1e-15)


def split_sum(cfg, tensors, mask, chunks, trim=False, **kw):
    """Sum of per-micro-batch losses with global normalisers, and the leaf grad."""
    x = tensors[0].clone().requires_grad_(True)
    ent = tensors[-1].clone().requires_grad_(True)
    g_tokens = mask.sum().item()
    g_seqs = (mask.sum(-1) > 0).sum().item()
    total = 0.0
    for idx in chunks:
        sub = [t[idx] for t in (x, *tensors[1:-1], ent)]
        m = mask[idx]
        if trim:  # micro-batches padded to their own length
            L = max(int(m.sum(-1).max().item()), 1)
            sub, m = [t[:, :L] for t in sub], m[:, :L]
        lp, old, ref, roll, adv, e = sub
        loss, _ = compute_policy_loss(
            cfg,
            lp,
            old,
            adv,
            m,
            ref_log_prob=ref,
            entropy=e,
            rollout_log_prob=roll,
            global_tokens=g_tokens,
            global_seqs=g_seqs,
            **kw,
        )
        loss.backward()
        total += loss.item()
    return total, x.grad, ent.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_microbatch_split_sums_to_whole_batch(mode, policy_loss):
    lp, old, ref, roll, adv, ent, mask = make_batch(4)
    cfg = AlgorithmConfig(
        policy_loss=policy_loss,
        loss_agg_mode=mode,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        rollout_is="token",
        rollout_is_threshold=1.5,
        gspo_clip_ratio_low=0.1,
        gspo_clip_ratio_high=0.1,
        loss_scale_factor=7,
    )
    x = lp.clone().requires_grad_(True)
    e = ent.clone().requires_grad_(True)
    whole, _ = compute_policy_loss(cfg, x, old, adv, mask, ref_log_prob=ref, entropy=e, rollout_log_prob=roll)
    whole.backward()
    tensors = (lp, old, ref, roll, adv, ent)
    # 2 ranks x 2 micro-batches of uneven sizes, and micro-batches trimmed to their own length
    for chunks, trim in [([[0, 1], [2, 3, 4], [5], [6, 7]], False), ([[0, 3], [1, 2, 4, 5, 6, 7]], True)]:
        total, gx, ge = split_sum(cfg, tensors, mask, [torch.tensor(c) for c in chunks], trim=trim)
        assert total == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
        torch.testing.assert_close(gx, x.grad, rtol=1e-10, atol=1e-15)
        torch.testing.assert_close(ge, e.grad, rtol=1e-10, atol=1e-15)
    assert x.grad.abs().sum() > 0


def test_whole_batch_loss_matches_reference_terms():
    lp, old, ref, roll, adv, ent, mask = make_batch(5)
    mode = "seq-mean-token-mean"
    cfg = AlgorithmConfig(
        loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", entropy_coeff=0.01
    )
    loss, m = compute_policy_loss(cfg, lp, old, adv, mask, ref_log_prob=ref, entropy=ent)
    B, T = lp.shape
    pg = torch.tensor(
        [
            [
                ref_ppo_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.2, 3.0)[0]
                for t in range(T)
            ]
            for i in range(B)
        ],
        dtype=torch.float64,
    )
    kl = 0.5 * (lp - ref) ** 2
    want = ref_agg(pg, mask, mode) + 0.1 * ref_agg(kl, mask, mode) - 0.01 * ref_agg(ent, mask, mode)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert m["loss/kl"] == pytest.approx(ref_agg(kl, mask, mode), rel=1e-12)
    assert m["actor/entropy"] == pytest.approx(ref_agg(ent, mask, "token-mean"), rel=1e-12)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_rollout_is_weights_match_loop(mode):
    _, old, _, roll, _, _, mask = make_batch(6)
    roll = roll.clone()
    roll[0, 0] = old[0, 0] - 3.0  # a token weight e^3 > threshold
    thr = 2.0
    w, m = rollout_is_weights(old, roll, mask, mode, thr)
    B, T = old.shape
    kls = []
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t] > 0]
        seq = math.exp(sum(old[i, t].item() - roll[i, t].item() for t in valid))
        for t in range(T):
            if mask[i, t] == 0:
                want = 1.0
            elif mode == "token":
                want = min(math.exp(old[i, t].item() - roll[i, t].item()), thr)
            else:
                want = min(seq, thr)
            assert w[i, t].item() == pytest.approx(want, rel=1e-12)
        kls += [roll[i, t].item() - old[i, t].item() for t in valid]
    assert m["mismatch/kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-9)
    assert 0 < m["mismatch/is_clipfrac"] < 1
    assert not w.requires_grad


def test_policy_loss_applies_is_weights_to_policy_term_only():
    lp, old, ref, roll, adv, _, mask = make_batch(7)
    base = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5)
    with_is = AlgorithmConfig(
        use_kl_loss=True, kl_loss_coef=0.5, rollout_is="sequence", rollout_is_threshold=1.2
    )
    _, m0 = compute_policy_loss(base, lp, old, adv, mask, ref_log_prob=ref)
    loss, m1 = compute_policy_loss(with_is, lp, old, adv, mask, ref_log_prob=ref, rollout_log_prob=roll)
    w, _ = rollout_is_weights(old, roll, mask, "sequence", 1.2)
    B, T = lp.shape
    pg = torch.tensor(
        [
            [
                ref_ppo_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.2, 3.0)[0]
                for t in range(T)
            ]
            for i in range(B)
        ],
        dtype=torch.float64,
    )
    assert m1["loss/policy"] == pytest.approx(ref_agg(pg * w, mask, "token-mean"), rel=1e-12)
    assert m1["loss/policy"] != pytest.approx(m0["loss/policy"])
    assert m1["loss/kl"] == m0["loss/kl"]
    assert "mismatch/kl" in m1 and "mismatch/kl" not in m0


@pytest.mark.parametrize("rollout_is", ["none", "token", "sequence"])
def test_max_abs_logprob_diff_is_the_largest_per_token_gap_over_valid_tokens(rollout_is):
    """mismatch/max_abs_logprob_diff: max |rollout - trainer| over the response tokens, exact in fp32. The
    gaps here cancel in the signed mean (mismatch/kl is 0), and the largest raw gap sits on a padded token,
    which must not count, nor may a NaN there."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -4.0], [-0.25, -3.0, -1.5, -2.0]], dtype=torch.float32)
    roll = torch.tensor([[-1.5, -1.5, -0.5, 9.0], [-0.25, -3.75, -0.75, 7.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.float32)
    lp, adv = old.clone().requires_grad_(), torch.ones_like(old)
    cfg = AlgorithmConfig(rollout_is=rollout_is)
    _, m = compute_policy_loss(cfg, lp, old, adv, mask, rollout_log_prob=roll)
    got = m["mismatch/max_abs_logprob_diff"]
    assert got.dtype == torch.float32 and got.shape == () and not got.requires_grad
    assert got.item() == 0.75  # |-0.75 - (-1.5)| and |-3.75 - (-3.0)|; not |9 - (-4)| = 13 (padding)
    assert m["mismatch/kl"].item() == 0.0  # -0.5 + 0.5 + 0 + 0 - 0.75 + 0.75: the signed mean cancels
    roll[1, 3] = float("nan")  # a NaN on a padded token is not counted either
    _, m = compute_policy_loss(cfg, lp, old, adv, mask, rollout_log_prob=roll)
    assert m["mismatch/max_abs_logprob_diff"].item() == 0.75
    roll[0, 1] = float("nan")  # one on a response token is: the metric is NaN, never a plausible number
    _, m = compute_policy_loss(cfg, lp, old, adv, mask, rollout_log_prob=roll)
    assert math.isnan(m["mismatch/max_abs_logprob_diff"].item())
    # an exact match gives exactly 0; an empty micro-batch gives 0, not an error
    _, m = compute_policy_loss(cfg, lp, old, adv, mask, rollout_log_prob=old.clone())
    assert m["mismatch/max_abs_logprob_diff"].item() == 0.0
    empty = torch.zeros(0, 4)
    _, m = compute_policy_loss(cfg, empty, empty, empty, empty, rollout_log_prob=empty)
    assert m["mismatch/max_abs_logprob_diff"].item() == 0.0


def test_max_abs_logprob_diff_is_reduced_as_a_max():
    from rl_tpu.algorithms.losses import MAX_METRICS

    assert MAX_METRICS == {"mismatch/max_abs_logprob_diff"}


def test_value_loss_matches_loop_and_splits():
    g = torch.Generator().manual_seed(8)
    v = torch.randn(4, 5, generator=g, dtype=torch.float64)
    old_v = v + torch.randn(4, 5, generator=g, dtype=torch.float64)
    ret = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float64
    )
    loss, m = compute_value_loss(v, old_v, ret, mask, 0.5)
    terms, clipped = [], []
    for i in range(4):
        for t in range(5):
            if mask[i, t] > 0:
                vc = min(max(v[i, t].item(), old_v[i, t].item() - 0.5), old_v[i, t].item() + 0.5)
                a, b = (v[i, t].item() - ret[i, t].item()) ** 2, (vc - ret[i, t].item()) ** 2
                terms.append(max(a, b))
                clipped.append(b > a)
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms), rel=1e-12)
    assert m["critic/vf_clipfrac"] == pytest.approx(sum(clipped) / len(clipped))
    parts = sum(
        compute_value_loss(v[s], old_v[s], ret[s], mask[s], 0.5, global_tokens=mask.sum().item())[0].item()
        for s in (slice(0, 1), slice(1, 4))
    )
    assert parts == pytest.approx(loss.item(), rel=1e-12)


def test_apply_kl_in_reward_matches_loop():
    lp, old, ref, _, _, _, mask = make_batch(9)
    scores = torch.zeros_like(lp)
    scores[:, -1] = 1.0
    rewards, m = apply_kl_in_reward(scores, old, ref, mask, 0.05, "k1")
    B, T = lp.shape
    seq_kls = []
    for i in range(B):
        for t in range(T):
            kl = (old[i, t] - ref[i, t]).item() if mask[i, t] > 0 else 0.0
            assert rewards[i, t].item() == pytest.approx(
                scores[i, t].item() - 0.05 * kl, rel=1e-12, abs=1e-15
            )
        n = int(mask[i].sum().item())
        seq_kls.append(sum((old[i, t] - ref[i, t]).item() for t in range(n)) / max(n, 1))
    assert m["actor/reward_kl_penalty"] == pytest.approx(sum(seq_kls) / B, rel=1e-9)


def test_errors_name_the_problem():
    lp, old, ref, roll, adv, ent, mask = make_batch(10)
    assert sorted(POLICY_LOSSES) == ["gspo", "sft", "vanilla"]
    bad = AlgorithmConfig()
    bad.policy_loss = "cispo"
    with pytest.raises(ValueError, match=r"'cispo'.*gspo, sft, vanilla"):
        compute_policy_loss(bad, lp, old, adv, mask)
    with pytest.raises(ValueError, match="ref_log_prob"):
        compute_policy_loss(AlgorithmConfig(use_kl_loss=True), lp, old, adv, mask)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        compute_policy_loss(AlgorithmConfig(rollout_is="token"), lp, old, adv, mask)
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(AlgorithmConfig(entropy_coeff=0.1), lp, old, adv, mask)
    with pytest.raises(ValueError, match=r"advantages has shape \(8, 6\)"):
        compute_policy_loss(AlgorithmConfig(), lp, old, adv[:, :6], mask)
    with pytest.raises(ValueError, match="'none'"):
        rollout_is_weights(old, roll, mask, "none", 2.0)


def test_sft_loss_is_the_token_mean_nll_and_its_gradient():
    from rl_tpu.config import AlgorithmConfig

    torch.manual_seed(0)
    logits = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (3, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    lp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    cfg = AlgorithmConfig(policy_loss="sft")
    loss, _ = compute_policy_loss(cfg, lp, torch.zeros_like(lp), torch.full_like(lp, 5.0), mask)
    (g,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    nll = torch.nn.functional.cross_entropy(
        ref_logits[mask.bool()], targets[mask.bool()]
    )  # mean over valid tokens
    (g_ref,) = torch.autograd.grad(nll, ref_logits)
    assert torch.allclose(loss, nll) and torch.allclose(g, g_ref)
