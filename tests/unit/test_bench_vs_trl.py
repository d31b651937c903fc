"""Pure helpers of bench/vs_trl.py and bench/_common.py: the TRL reward adapter, the batch layout, the
per-side figures, the final JSON line and process-tree memory. No TRL run here (TRL lives in the
`bench` extra, not the test environment); bench/vs_trl.py imports nothing heavy at module level."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import overhead  # noqa: E402
import vs_trl  # noqa: E402

from rl_tpu.config import load_config  # noqa: E402
from rl_tpu.rewards.arithmetic import compute_score  # noqa: E402


def test_completion_text_standard_and_conversational():
    assert vs_trl.completion_text("37+45=82") == "37+45=82"
    assert vs_trl.completion_text([{"role": "assistant", "content": "82"}]) == "82"
    # tool turns and the like are not the model's answer
    assert (
        vs_trl.completion_text(
            [
                {"role": "assistant", "content": "8"},
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "2"},
            ]
        )
        == "82"
    )
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        vs_trl.completion_text(82)


def test_trl_reward_adapter_matches_verl_reward():
    reward = vs_trl.make_trl_reward(compute_score)
    assert reward.__name__ == "arithmetic"
    completions = [
        [{"role": "assistant", "content": "The answer is 82"}],
        [{"role": "assistant", "content": "81"}],
        "<answer>-3</answer>",
        "no number",
    ]
    gts = ["82", "82", "-3", "5"]
    got = reward(
        prompts=[None] * 4,
        completions=completions,
        completion_ids=[[]] * 4,
        ground_truth=gts,
        data_source=["arithmetic"] * 4,
        trainer_state=None,
    )
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert got == [
        compute_score("arithmetic", vs_trl.completion_text(c), g) for c, g in zip(completions, gts)
    ]
    with pytest.raises(ValueError, match="2 completions but 1 ground truths"):
        reward(prompts=[], completions=["1", "2"], ground_truth=["1"], data_source=["a", "a"])


def test_score_value_accepts_verl_dicts_and_rejects_junk():
    assert vs_trl.score_value(1) == 1.0
    assert vs_trl.score_value({"score": 0.5, "acc": 1}) == 0.5
    with pytest.raises(ValueError, match="without a 'score' key"):
        vs_trl.score_value({"acc": 1.0})
    with pytest.raises(TypeError, match="must be a number"):
        vs_trl.score_value("1")


def test_trl_batch_layout_is_one_optimizer_step_per_batch():
    assert vs_trl.trl_batch_layout(8, 8, 16) == (16, 4)
    assert vs_trl.trl_batch_layout(8, 8, 64) == (64, 1)
    with pytest.raises(ValueError, match="--micro-batch 24 must divide prompts x n = 8 x 8 = 64"):
        vs_trl.trl_batch_layout(8, 8, 24)


def test_parse_args_names_bad_values():
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--modes", "sync,fast"])
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--micro-batch", "24"])
    a = vs_trl.parse_args([])
    assert (a.size, a.prompts, a.n, a.max_tokens, a.steps) == ("small", 8, 8, 64, 6)


def test_overhead_runs_vs_trls_workload_and_checks_it_the_same_way(capsys):
    workload = (
        "size",
        "prompts",
        "n",
        "max_tokens",
        "steps",
        "lr",
        "threads",
        "world_size",
        "micro_batch",
        "seed",
        "engine",
        "train_size",
        "timeout",
        "workdir",
    )
    argv = ["--prompts", "4", "--n", "4", "--engine", "eager", "--seed", "3"]
    ours, theirs = overhead.parse_args(argv), vs_trl.parse_args(argv)
    assert {k: getattr(ours, k) for k in workload} == {k: getattr(theirs, k) for k in workload}
    assert (ours.prompts, ours.engine) == (4, "eager")
    with pytest.raises(SystemExit):
        overhead.parse_args(["--prompts", "0"])
    assert "--prompts must be >= 1, got 0" in capsys.readouterr().err


def test_ours_overrides_load_into_a_valid_config(tmp_path):
    a = vs_trl.parse_args(
        [
            "--prompts",
            "4",
            "--n",
            "2",
            "--max-tokens",
            "32",
            "--steps",
            "3",
            "--micro-batch",
            "4",
            "--threads",
            "2",
            "--world-size",
            "2",
        ]
    )
    cfg = load_config(None, vs_trl.ours_overrides(a, str(tmp_path / "m"), "async", str(tmp_path / "run")))
    assert (cfg.data.batch_size, cfg.rollout.n, cfg.rollout.max_tokens, cfg.trainer.total_steps) == (
        4,
        2,
        32,
        3,
    )
    assert cfg.cluster.mode == "async" and cfg.data.shuffle is False and cfg.algorithm.use_kl_loss is False
    assert cfg.reward.functions == [vs_trl.REWARD_FN] and cfg.trainer.num_threads == 1
    assert cfg.rollout.enforce_eager is False  # --engine compiled, the default
    assert cfg.trainer.lr == a.lr and cfg.rollout.temperature == 1.0


def test_summarize_drops_warmup_and_totals_rates():
    s = vs_trl.summarize([10.0, 2.0, 4.0, 3.0], [5.0, 1.0, 1.0, 2.0], [100, 200, 200, 200])
    assert s["measured_steps"] == 3 and s["s_per_step"] == 3.0
    assert s["gen_tok_s"] == 600 / 4 and s["step_tok_s"] == 600 / 9 and s["tokens_per_step"] == 200
    one = vs_trl.summarize([7.0], [1.0], [70])  # a single step is kept rather than leaving nothing
    assert one["s_per_step"] == 7.0 and one["measured_steps"] == 1
    empty = vs_trl.summarize([], [], [])
    assert math.isnan(empty["s_per_step"])
    with pytest.raises(ValueError, match="differ in length"):
        vs_trl.summarize([1.0], [1.0, 2.0], [1])


def test_speedup_and_per_step():
    assert vs_trl.speedup(4.0, 2.0) == 2.0
    assert vs_trl.speedup(None, 2.0) is None and vs_trl.speedup(4.0, float("nan")) is None
    assert vs_trl.per_step([1.0, 2.0, 3.0, 4.0], 2) == [3.0, 7.0]
    with pytest.raises(ValueError, match="do not split evenly"):
        vs_trl.per_step([1.0, 2.0, 3.0], 2)


def test_failure_reason_quotes_the_last_exception(tmp_path):
    mem = _common.MemoryPeak()
    ok = _common.RunResult(["x"], 0, 1.0, mem, tmp_path / "log", tail=["done"])
    assert vs_trl.failure_reason(ok, 3, 3) is None
    bad = _common.RunResult(
        ["x"],
        1,
        1.0,
        mem,
        tmp_path / "log",
        tail=["Traceback (most recent call last):", "  File x", "RuntimeError: engine died", ""],
    )
    why = vs_trl.failure_reason(bad, 0, 3)
    assert "RuntimeError: engine died" in why and "0/3 steps" in why and str(tmp_path / "log") in why
    late = _common.RunResult(["x"], 0, 1.0, mem, tmp_path / "log", timed_out=True)
    assert "timed out after 1 s with 1/3 steps" in vs_trl.failure_reason(late, 1, 3)


def test_side_status_keeps_partial_runs_with_two_steps():
    assert vs_trl.side_status(None, False, 6) == "ok"
    assert vs_trl.side_status("timed out", True, 4) == "partial"
    assert vs_trl.side_status("timed out", True, 1) == "FAILED"
    assert vs_trl.side_status("exit 1", False, 4) == "FAILED"


def test_json_line_is_one_parseable_line_with_null_for_nan():
    line = _common.json_line(
        {"bench": "vs_trl", "ratio": float("nan"), "x": [1.5, float("inf")], "d": {"y": 2}}
    )
    assert "\n" not in line
    assert json.loads(line) == {"bench": "vs_trl", "ratio": None, "x": [1.5, None], "d": {"y": 2}}


def test_format_table_has_a_row_per_side():
    rows = [{"side": "TRL", "s_per_step": 4.0, "status": "ok"}, {"side": "ours (sync)", "status": "FAILED"}]
    lines = vs_trl.format_table(rows).splitlines()
    assert len(lines) == 4 and "4.000" in lines[2] and "FAILED" in lines[3] and lines[3].count("| -") >= 5


def test_process_tree_memory_counts_children(tmp_path):
    # a child that holds ~64 MiB, under a parent shell: the tree sum must include it
    code = "import time; b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    parent = subprocess.Popen(["/bin/sh", "-c", f'{sys.executable} -c "{code}"; true'])
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            tree = _common.process_tree(parent.pid)
            rss, pss, n = _common.tree_memory(parent.pid)
            if len(tree) >= 2 and rss > 64 * 2**20:
                break
            time.sleep(0.2)
        assert tree[0] == parent.pid and len(tree) >= 2
        assert rss > 64 * 2**20 and 0 < pss <= rss and n == len(tree)
        assert _common.process_tree(os.getpid())[0] == os.getpid()
    finally:
        for pid in reversed(_common.process_tree(parent.pid)):
            os.kill(pid, 9)
        parent.wait()


def test_run_measured_reports_rc_log_and_peak(tmp_path):
    code = "import time; b = bytearray(32 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0); print('hi')"
    res = _common.run_measured([sys.executable, "-c", code], tmp_path / "a.log", interval=0.1)
    assert res.returncode == 0 and res.tail[-1] == "hi" and not res.timed_out
    assert res.memory.rss > 32 * 2**20 and res.memory.samples >= 2
    unsampled = _common.run_measured([sys.executable, "-c", code], tmp_path / "c.log", interval=None)
    assert unsampled.returncode == 0 and unsampled.tail[-1] == "hi" and unsampled.memory.samples == 0
    slow = _common.run_measured(
        [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "b.log", timeout=1
    )
    assert slow.timed_out and slow.returncode != 0 and slow.seconds < 30


def test_trl_config_kwargs_are_grpo_config_fields():
    a = vs_trl.parse_args(["--workdir", "/tmp/x"])
    kw = vs_trl.trl_config_kwargs(a)
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (16, 4)
    assert kw["num_generations"] == 8 and kw["max_completion_length"] == 64 and kw["beta"] == 0.0
    assert kw["max_steps"] == 6 and kw["use_vllm"] is False and kw["num_iterations"] == 1
    assert vs_trl.trl_config_kwargs(a, vllm=True)["vllm_mode"] == "colocate"
    trl = pytest.importorskip(
        "trl", reason="TRL is in the `bench` extra: bash scripts/setup.sh --extra bench"
    )
    import dataclasses

    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert set(vs_trl.trl_config_kwargs(a, vllm=True)) <= names


def test_round_ratios_are_per_round_with_their_median():
    rounds = [
        {"sync": 2.0, "async": 4.0, "trl": 6.0},
        {"sync": 3.0, "async": None, "trl": 6.0},
        {"sync": 4.0, "async": 2.0, "trl": 4.0},
    ]
    got = vs_trl.round_ratios(rounds)
    assert got["per_round"] == [
        {"ratio": 3.0, "ratio_async": 1.5},
        {"ratio": 2.0, "ratio_async": None},
        {"ratio": 1.0, "ratio_async": 2.0},
    ]
    assert got["ratio"] == 2.0 and got["ratio_async"] == 1.75  # a failed side is left out of its median
    assert vs_trl.round_ratios([{"sync": 2.0, "trl": None}]) == {
        "per_round": [{"ratio": None}],
        "ratio": None,
    }
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--rounds", "0"])


def test_side_figures_are_medians_over_rounds_and_the_largest_peak():
    rows = [
        {
            "status": "ok",
            "s_per_step": 4.0,
            "gen_tok_s": 10.0,
            "step_tok_s": 1.0,
            "peak_rss_gib": 2.0,
            "peak_pss_gib": 1.0,
        },
        {"status": "FAILED", "s_per_step": 1.0, "gen_tok_s": 99.0, "step_tok_s": 9.0, "peak_rss_gib": 9.0},
        {
            "status": "partial",
            "s_per_step": 6.0,
            "gen_tok_s": 30.0,
            "step_tok_s": None,
            "peak_rss_gib": 3.0,
            "peak_pss_gib": None,
        },
        {
            "status": "ok",
            "s_per_step": 5.0,
            "gen_tok_s": 20.0,
            "step_tok_s": 3.0,
            "peak_rss_gib": 1.0,
            "peak_pss_gib": 0.5,
        },
    ]
    assert vs_trl.side_figures(rows) == {
        "s_per_step": 5.0,
        "gen_tok_s": 20.0,
        "step_tok_s": 2.0,
        "peak_rss_gib": 3.0,
        "peak_pss_gib": 1.0,
    }
    assert vs_trl.side_figures(rows[1:2]) == dict.fromkeys(
        ["s_per_step", "gen_tok_s", "step_tok_s", "peak_rss_gib", "peak_pss_gib"]
    )
