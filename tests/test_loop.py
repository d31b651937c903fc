"""The RL loop end to end on the real stack: Ray, 2-rank TorchTitan trainer over gloo, vLLM-CPU, rewards
in worker processes. Runs use the tiny model and a reward a tiny model can learn in a few steps."""

import json
import textwrap
from pathlib import Path

import pytest

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


pytestmark = pytest.mark.usefixtures("loop_ray")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reward_rises(mode, tmp_path, reward_files):
    from rl_tpu.loop import train

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
        "throughput/tokens_per_s",
        "response/length_mean",
    ):
        assert key in rows[-1], key
    assert max(r["staleness"] for r in rows) == (1.0 if mode == "async" else 0.0)
    assert (Path(out["hf"]) / "model.safetensors").is_file()
    # cluster.placement = "auto" (default) followed the mode: async cannot share bundles with the trainer
    placement = json.loads((Path(out["run_dir"]) / "placement.json").read_text())
    assert placement["placement"] == ("disaggregated" if mode == "async" else "colocated")
    assert {a["group"] for a in placement["actors"]} == (
        {"trainer", "rollout"} if mode == "async" else {"shared"}
    )


def test_failing_and_hanging_rewards_are_counted_and_raise_policy_stops(tmp_path, reward_files):
    from rl_tpu.loop import train
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


# Wall-clock metrics: they time this machine at that moment (the controller's phases, the trainer's
# update, the sync), not the run's state, so no two runs agree on them. Every other logged metric of a
# resumed sync-mode fp32 run must equal the uninterrupted run's exactly.
WALL_CLOCK_METRICS = {
    "time/startup",
    "time/rollout",
    "time/generate",
    "time/reward",
    "time/train",
    "time/sync",
    "time/step",
    "throughput/tokens_per_s",
    "sync/seconds",
    "perf/train_s",
}


def test_resume_reproduces_an_uninterrupted_run(tmp_path, reward_files):
    from rl_tpu.loop import train

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


def test_a_run_on_shared_roles_reproduces_a_run_that_starts_its_own(tmp_path, reward_files, kill_actor):
    """`train(cfg, roles=...)` on a trainer and an engine that already ran another job (other lr, other
    step count: trained weights, Adam moments, a used call counter, other engine weights) logs exactly what
    a run starting its own actors logs, ends with the same weights, and leaves the roles running (an engine
    restarted after the run gets its policy). A config the roles cannot serve is refused before anything
    runs, naming the key."""
    from rl_tpu.loop import start_shared_roles, train

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


def test_async_resume_continues_with_the_same_prompts_and_versions(tmp_path, reward_files):
    """What an async resume promises (rl_tpu.checkpoint): the step count, policy versions and the data
    order continue as in an uninterrupted run; the completions do not (the first step after the resume
    is sampled with newer weights). The checkpoint at step 2 is written while step 3's prompts are in
    flight: it is the interesting one."""
    import shutil

    from rl_tpu.checkpoint import load_state
    from rl_tpu.loop import train

    opts = [
        "--cluster.mode=async",
        "--cluster.placement=disaggregated",
        "--checkpoint.every=2",
        "--logging.samples_per_step=64",  # every completion of every step (8 prompts x 8): all uids
        f'--reward.functions=["{reward_files / "digits.py"}:compute_score"]',
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
    # policy versions: uninterrupted, step k trains on data sampled with version k-2 (one step stale);
    # resumed, step 3 is sampled again, now with the checkpoint's version 2 (fresh), and step 4 as before
    assert {r["policy_version"] for r in sa[3]} == {1} and {r["policy_version"] for r in sb[3]} == {2}
    assert {r["policy_version"] for r in sa[4]} == {r["policy_version"] for r in sb[4]} == {2}
    assert [r["staleness"] for r in a[2:]] == [1.0, 1.0] and [r["staleness"] for r in b] == [0.0, 1.0]
    assert [r["actor/step"] for r in a[2:]] == [r["actor/step"] for r in b] == [3.0, 4.0]
    # both end at step 4, policy version 4, the loader at the same position
    end_a, end_b = (load_state(tmp_path / run / "checkpoints" / "step_000004") for run in ("full", "cut"))
    assert end_a["step"] == end_b["step"] == 4 and end_a["version"] == end_b["version"] == 4
    assert end_a["data"] == end_b["data"]
    assert (tmp_path / "cut" / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "options, reward, mismatch_tol",
    [
        # on-policy update: old log-probs from the update's forward, the reference inside the same call
        (
            ["--trainer.reference=true", "--algorithm.use_kl_loss=true", "--sync.transport=shm"],
            "compute_score",
            1e-5,
        ),
        # recompute path: two PPO epochs, KL in the reward, truncated IS, RLOO, the object-store transport
        (
            [
                "--trainer.ppo_epochs=2",
                "--trainer.reference=true",
                "--algorithm.use_kl_in_reward=true",
                "--algorithm.rollout_is=token",
                "--algorithm.adv_estimator=rloo",
                "--sync.transport=ray",
            ],
            "compute_score",
            1e-5,
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
            1e-5,
        ),
        # PPO with a critic (GAE) in bf16 (trainer bf16 over fp32 master weights, bf16 engine); auto routes.
        # bf16 parity: |mismatch/kl| <= 1e-3 (measured ~1e-4 on this model; fp32 stays at 1e-5)
        (
            [
                "--trainer.critic=true",
                "--algorithm.adv_estimator=gae",
                "--model.dtype=bfloat16",
                "--sync.transport=auto",
            ],
            "compute_score",
            1e-3,
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
    from rl_tpu.loop import on_policy_update, train

    fn = f'--reward.functions=["{reward_files / "digits.py"}:{reward}"]'
    cfg = _run_cfg(tmp_path, "run", "--trainer.total_steps=2", "--sync.verify=true", fn, *options)
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
            assert "mismatch/kl" not in r
        else:  # engine and trainer agree on the sampled tokens' log-probs (fp32 per-token parity is 1e-5)
            assert abs(r["mismatch/kl"]) <= mismatch_tol, r["mismatch/kl"]
        assert r["loss/policy"] == r["loss/policy"]  # not NaN
        assert r["rollout/samples"] == 8 * 8 and r["rollout/restarts"] == 0
    if "--algorithm.use_kl_loss=true" in options:
        assert all("loss/kl" in r for r in rows)
    if "--algorithm.rollout_is=token" in options:
        assert all("mismatch/is_mean" in r and "actor/reward_kl_penalty" in r for r in rows)
    if "--algorithm.dynamic_sampling=true" in options:  # half the groups are uniform: refilled, then cut to 8
        assert all(
            r["dynamic_sampling/kept_groups"] == 8 and r["dynamic_sampling/drawn_groups"] > 8 for r in rows
        )
        assert all("reward/overlong_penalty" in r for r in rows)
    if "--trainer.critic=true" in options:
        assert all(any(k.startswith("critic/") for k in r) for r in rows)
