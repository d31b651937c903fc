"""Rewards: built-in scorers on right / wrong / malformed answers, spec loading, and the process pool
(weights, async, errors, hangs, dead workers, the raise policy, overhead)."""

from __future__ import annotations

import logging
import os
import signal
import textwrap
import time

import pytest

from rl_tpu.config import RewardConfig
from rl_tpu.rewards import (
    RewardError,
    RewardInput,
    RewardPool,
    RewardSpecError,
    arithmetic,
    auto,
    countdown,
    gsm8k,
    load_reward_fn,
    reward_name,
)
from rl_tpu.rewards import format as fmt
from rl_tpu.rewards import math as math_reward
from rl_tpu.rewards.pool import MAX_CHUNK, normalize_output

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A user reward file whose behaviour is chosen by the response text: the pool's failure modes on demand.
FLAKY = textwrap.dedent("""
    import asyncio, os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
        if solution_str == "raise":
            raise ValueError("boom on purpose")
        if solution_str == "hang":
            time.sleep(600)
        if solution_str == "spin":
            while True:
                pass
        if solution_str == "die":
            os._exit(3)
        if solution_str == "junk":
            return "not a number"
        return {"score": float(solution_str == str(ground_truth)), "length": float(len(solution_str))}

    async def async_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
        await asyncio.sleep(0.001)
        return 2.0 if solution_str == str(ground_truth) else -1.0

    NOT_CALLABLE = 3
""")


@pytest.fixture(scope="module")
def flaky_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "flaky_reward.py"
    path.write_text(FLAKY)
    return path


def _inputs(texts, truth="7"):
    return [
        RewardInput(sample_id=f"s{i}", data_source="arithmetic", solution_str=t, ground_truth=truth)
        for i, t in enumerate(texts)
    ]


# ---------------------------------------------------------------------------------------------------
# built-ins


@pytest.mark.parametrize(
    "text,expected",
    [
        ("82", 1.0),
        ("37+45=82", 1.0),
        ("<answer>82</answer>", 1.0),
        ("The answer is 82.\n", 1.0),
        ("81", 0.0),
        ("What is 37+45", 0.0),
        ("<answer>eighty-two</answer> 82", 0.0),
        ("", 0.0),
        ("<answer>82</answer> then 5", 1.0),
        ("12-82", 1.0),
    ],
)
def test_arithmetic(text, expected):
    assert arithmetic.compute_score("arithmetic", text, "82") == expected


def test_arithmetic_negative_and_bad_truth():
    assert arithmetic.compute_score("arithmetic", "45-52=-7", "-7") == 1.0
    assert arithmetic.extract_answer("12-5") == 5
    with pytest.raises(ValueError, match="ground_truth must be an integer"):
        arithmetic.compute_score("arithmetic", "1", "one")


def test_gsm8k_strict_and_flexible():
    good = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert gsm8k.compute_score("openai/gsm8k", good, "72") == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "#### 1,072", "1072") == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "#### 72.0", "72") == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("openai/gsm8k", "the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k.compute_score("openai/gsm8k", "the answer is 72.", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "no digits at all", "72", method="flexible") == 0.0
    with pytest.raises(ValueError, match="method"):
        gsm8k.extract_solution("x", "lenient")


def test_math_uses_math_verify_and_falls_back(monkeypatch):
    assert math_reward.compute_score("lighteval/MATH", "so $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_reward.compute_score("lighteval/MATH", "so $\\boxed{\\frac{1}{3}}$", "\\frac{1}{2}") == 0.0
    assert math_reward.compute_score("lighteval/MATH", "}}{{ \\boxed{", "3") == 0.0

    def broken(*a, **k):
        raise RuntimeError("parser bug")

    monkeypatch.setattr(math_reward, "parse", broken)
    # only string normalisation now: equal up to spaces and $, but 0.5 no longer equals 1/2
    assert math_reward.compute_score("lighteval/MATH", "thus \\boxed{ \\frac{1}{2} }", "\\frac{1}{2}") == 1.0
    assert math_reward.compute_score("lighteval/MATH", "thus \\boxed{0.5}", "\\frac{1}{2}") == 0.0


GT = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<answer>(2+4)*4</answer>", 0.1),  # 4 used twice
        ("<answer>2*3*4</answer>", 1.0),
        ("<answer>4*3*2 = 24</answer>", 1.0),
        ("<answer>4*3*2 = 25</answer>", 0.1),
        ("<answer>(3-2)*4*6</answer>", 0.1),  # 6 is not given
        ("<answer>2*3*4+0</answer>", 0.1),
        ("<answer>4/(3-3)</answer>", 0.1),  # division by zero, and 3 twice
        ("<answer>__import__('os').system('true')</answer>", 0.1),  # never evaluated
        ("<answer>2**3*3</answer>", 0.1),  # power is not an allowed operator
        ("I think 2*3*4", 0.0),  # no answer tag
        ("<answer>1</answer> <answer>2*3*4</answer>", 1.0),  # the last tag counts
    ],
)
def test_countdown(text, expected):
    assert countdown.compute_score("countdown", text, GT) == expected


def test_countdown_exact_division_and_json_truth():
    gt = '{"target": 7, "numbers": [7, 2, 2]}'
    assert countdown.compute_score("countdown", "<answer>7/2*2</answer>", gt) == 1.0
    assert countdown.compute_score("countdown", "<answer>7/2</answer>", gt) == 0.1
    with pytest.raises(ValueError, match="countdown ground_truth"):
        countdown.compute_score("countdown", "<answer>1</answer>", {"numbers": [1]})


def test_format():
    assert fmt.compute_score("arithmetic", "<answer>82</answer>", "82") == 1.0
    assert fmt.compute_score("arithmetic", "82", "82") == 0.0
    assert fmt.compute_score("arithmetic", "<answer> </answer>", "82") == 0.0
    assert fmt.compute_score("arithmetic", "<answer>1</answer><answer>2</answer>", "2") == 0.0
    assert fmt.compute_score("arithmetic", "<answer>1</answer> trailing", "1") == 0.0
    assert fmt.compute_score("openai/gsm8k", "steps\n#### 72", "72") == 1.0
    assert fmt.compute_score("openai/gsm8k", "72", "72") == 0.0
    assert fmt.compute_score("lighteval/MATH", "\\boxed{x}", "x") == 1.0
    assert fmt.compute_score("lighteval/MATH", "\\boxed{x", "x") == 0.0
    assert fmt.compute_score("countdown", "#### 3", "3", extra_info={"format_style": "gsm8k"}) == 1.0


def test_auto_dispatches_by_data_source():
    assert auto.compute_score("arithmetic", "82", "82") == 1.0
    assert auto.compute_score("countdown", "<answer>2*3*4</answer>", GT) == 1.0
    assert auto.compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert auto.compute_score("lighteval/MATH", "\\boxed{2}", "2") == 1.0
    with pytest.raises(NotImplementedError, match="'my/task'"):
        auto.compute_score("my/task", "1", "1")


def test_normalize_output():
    assert normalize_output(True) == (1.0, {})
    assert normalize_output({"score": 1, "acc": 1, "note": "x"}) == (1.0, {"acc": 1.0})
    for junk, err in [("1", TypeError), ({"acc": 1}, TypeError), (float("nan"), ValueError)]:
        with pytest.raises(err):
            normalize_output(junk)


# ---------------------------------------------------------------------------------------------------
# spec loading


def test_load_builtin_and_example_specs(monkeypatch):
    for name in ("arithmetic", "countdown", "gsm8k", "math", "format", "auto"):
        fn = load_reward_fn(f"rl_tpu.rewards.{name}:compute_score")
        assert fn.__module__ == f"rl_tpu.rewards.{name}"
    assert load_reward_fn("rl_tpu.rewards.gsm8k") is gsm8k.compute_score  # default function name
    monkeypatch.chdir(REPO)  # relative file paths resolve against the working directory
    fn = load_reward_fn("examples/my_reward.py:compute_score")
    out = fn("arithmetic", "82", "82")
    assert out["score"] == 1.0 and out["correct"] == 1.0
    assert load_reward_fn("examples/my_reward.py") is fn  # imported once per process
    assert reward_name("examples/my_reward.py:compute_score") == "my_reward"
    assert reward_name("rl_tpu.rewards.gsm8k:compute_score") == "gsm8k"
    assert reward_name("pkg.mod:judge") == "judge"


def test_load_errors(flaky_file, tmp_path, monkeypatch):
    with pytest.raises(RewardSpecError, match="not found") as e:
        load_reward_fn("no/such/file.py:f")
    assert "no/such/file.py" in str(e.value)
    with pytest.raises(RewardSpecError, match="no_such_pkg_xyz.*not importable.*ModuleNotFoundError"):
        load_reward_fn("no_such_pkg_xyz.mod:f")
    (tmp_path / "broken.py").write_text("import definitely_missing_dep_abc\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardSpecError, match="broken.py.*definitely_missing_dep_abc"):
        load_reward_fn("broken.py:f")
    with pytest.raises(RewardSpecError, match="no attribute 'compute'.*async_score, compute_score"):
        load_reward_fn(f"{flaky_file}:compute")
    with pytest.raises(RewardSpecError, match="NOT_CALLABLE is a int, not callable"):
        load_reward_fn(f"{flaky_file}:NOT_CALLABLE")
    with pytest.raises(RewardSpecError, match="not a valid function name"):
        load_reward_fn("rl_tpu.rewards.gsm8k:not-a-name")


# ---------------------------------------------------------------------------------------------------
# the pool


@pytest.fixture(scope="module")
def pool(flaky_file):
    cfg = RewardConfig(
        functions=[f"{flaky_file}:compute_score", "rl_tpu.rewards.arithmetic:compute_score"],
        weights=[0.5, 2.0],
        timeout_s=1.0,
        workers=2,
        on_error="zero",
    )
    p = RewardPool(cfg)
    yield p
    p.close()


def test_pool_weighted_sum_extras_and_order(pool):
    res = pool.score(_inputs(["7", "8", "the answer is 7", "7"]))
    # flaky: 1 if text == "7"; arithmetic: 1 if last integer is 7
    assert res.scores == [0.5 + 2.0, 0.0, 0.0 + 2.0, 2.5]
    assert res.function_scores == {"flaky_reward": [1.0, 0.0, 0.0, 1.0], "arithmetic": [1.0, 0.0, 1.0, 1.0]}
    assert res.extra == {"flaky_reward/length": [1.0, 1.0, 15.0, 1.0]}
    assert (res.errors, res.timeouts, res.failed) == (0, 0, [False] * 4)
    m = res.metrics()
    assert m["reward/mean"] == pytest.approx(7.0 / 4) and m["reward/flaky_reward/length"] == pytest.approx(
        4.5
    )
    assert pool.score([]).scores == []
    from rl_tpu.data import make_synthetic

    ex = make_synthetic("arithmetic", 1, 1)[0][0]
    inp = RewardInput.for_example(ex, ex.ground_truth, sample_index=3)
    assert inp.sample_id == "arithmetic-train-0#3" and pool.score([inp]).scores == [2.5]


def test_pool_survives_errors_hangs_and_dead_workers(pool, caplog):
    pids = set(pool.worker_pids)
    texts = ["7", "raise", "hang", "7", "junk", "raise", "die", "spin"] + ["7"] * 20
    caplog.set_level(logging.WARNING, logger="rl_tpu.rewards.pool")
    t0 = time.monotonic()
    res = pool.score(_inputs(texts))
    elapsed = time.monotonic() - t0
    # raise x2 + junk + die = 4 errors; hang + spin = 2 timeouts; the arithmetic reward never fails
    assert (res.errors, res.timeouts) == (4, 2)
    assert res.failed == [t not in ("7",) for t in texts]
    assert res.scores[0] == 2.5 and res.scores[8:] == [2.5] * 20  # everything else still scored
    assert res.function_scores["flaky_reward"][1:8] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert res.metrics()["reward/errors"] == 4.0 and res.metrics()["reward/timeouts"] == 2.0
    # "hang" sleeps 600 s and "spin" never ends: only an unenforced timeout takes anywhere near that
    # (timeouts == 2 above says they were enforced; replacing the killed workers takes seconds, more on a
    # loaded box, so the bound is loose on purpose)
    assert elapsed < 300, f"two 1 s timeouts should not take {elapsed:.1f} s"
    assert pids - set(pool.worker_pids), "hung workers must have been replaced"
    tracebacks = [r for r in caplog.records if "raised" in r.getMessage()]
    assert len(tracebacks) == 1 and "boom on purpose" in tracebacks[0].getMessage()
    assert "'s1'" in tracebacks[0].getMessage() and "Traceback" in tracebacks[0].getMessage()
    assert "boom on purpose" in res.first_error and "s1" in res.first_error
    # the next step works on the replacement workers, and logs nothing new
    caplog.clear()
    again = pool.score(_inputs(["7", "raise"]))
    assert again.scores == [2.5, 0.0] and again.errors == 1 and not caplog.records


def test_pool_replaces_a_worker_killed_while_idle(pool):
    victim = pool._workers[0]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.join(timeout=10)
    res = pool.score(_inputs(["7"] * 40))
    assert res.scores == [2.5] * 40 and (res.errors, res.timeouts) == (0, 0)
    assert victim.proc.pid not in pool.worker_pids


def test_pool_async_reward_and_default_weights(flaky_file):
    cfg = RewardConfig(functions=[f"{flaky_file}:async_score", f"{flaky_file}:async_score"], workers=1)
    with RewardPool(cfg) as p:
        res = p.score(_inputs(["7", "3"]))
    assert res.scores == [4.0, -2.0]
    assert list(res.function_scores) == ["async_score", "async_score_1"]


def test_pool_raise_policy_names_function_sample_and_exception(flaky_file):
    cfg = RewardConfig(functions=[f"{flaky_file}:compute_score"], on_error="raise", timeout_s=1.0, workers=2)
    with RewardPool(cfg) as p:
        with pytest.raises(RewardError) as e:
            p.score(_inputs(["7"] * 10 + ["raise"] + ["7"] * 10))
        msg = str(e.value)
        assert "flaky_reward" in msg and "'s10'" in msg and "ValueError: boom on purpose" in msg
        with pytest.raises(RewardError, match=r"flaky_reward.*'s1'.*timed out after 1 s"):
            p.score(_inputs(["7", "hang"]))
        assert p.score(_inputs(["7", "6"])).scores == [1.0, 0.0]  # still usable afterwards


def test_pool_bad_spec_fails_in_constructor(flaky_file):
    # No clock: a pool that missed the worker's load error would wait out its startup timeout and raise
    # "did not start within ...", which does not name the function's attribute.
    with pytest.raises(RewardSpecError, match="no attribute 'nope'"):
        RewardPool(RewardConfig(functions=[f"{flaky_file}:nope"], workers=1))


def test_pool_names_a_module_that_blocks_at_import(tmp_path):
    """The user's mistake, one line from the CLI (a RewardSpecError is a UserError), not a traceback."""
    (tmp_path / "slow_import.py").write_text(
        "import time\ntime.sleep(60)\n\ndef compute_score(**kw):\n    return 1.0\n"
    )
    t0 = time.monotonic()
    with pytest.raises(
        RewardSpecError, match=r"did not start within 2 s \(loading .*slow_import.py.*block or loop"
    ):
        RewardPool(
            RewardConfig(functions=[f"{tmp_path}/slow_import.py:compute_score"], workers=1),
            startup_timeout_s=2,
        )
    assert time.monotonic() - t0 < 20


def test_pool_gives_up_when_workers_crash_while_loading(tmp_path):
    (tmp_path / "crash_on_import.py").write_text("import os\nos._exit(5)\n")
    with pytest.raises(RewardSpecError, match=r"exited during startup 3 times in a row \(last exit code 5\)"):
        RewardPool(RewardConfig(functions=[f"{tmp_path}/crash_on_import.py:compute_score"], workers=1))


def test_pool_overhead_512_trivial_scores():
    cfg = RewardConfig(functions=["rl_tpu.rewards.arithmetic:compute_score"], workers=2)
    samples = [
        RewardInput(
            sample_id=str(i), data_source="arithmetic", solution_str=f"so {i % 10}", ground_truth=str(i % 7)
        )
        for i in range(512)
    ]
    expected = [float(i % 10 == i % 7) for i in range(512)]
    with RewardPool(cfg) as p:
        p.score(samples)  # warm-up
        sent = []  # calls per message to a worker
        for w in p._workers:
            w.conn.send = lambda msg, send=w.conn.send: (sent.append(len(msg)), send(msg))[1]
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            res = p.score(samples)
            times.append(time.perf_counter() - t0)
        for w in p._workers:
            del w.conn.send
    print(f"512 trivial scores: best {min(times) * 1e3:.1f} ms, worst {max(times) * 1e3:.1f} ms")
    assert res.scores == expected
    # What keeps the overhead low, counted instead of timed (a time bound failed on a loaded box): calls
    # go to the workers in chunks of MAX_CHUNK, one pipe message each, not one message per call.
    assert sent == [MAX_CHUNK] * (3 * 512 // MAX_CHUNK)
