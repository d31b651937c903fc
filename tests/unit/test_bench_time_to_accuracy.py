"""Pure figures of bench/time_to_accuracy.py: training time without evaluations, time to a threshold,
accuracy within a budget, the JSON line's ratios, and the sides' `rl-tpu train` overrides being valid
config. The sides themselves run Ray, vLLM and TRL (`bench` extra): a benchmark, not a test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import time_to_accuracy as tta  # noqa: E402

from rl_tpu.commands.demo import DemoPlan, demo_config  # noqa: E402
from rl_tpu.config import load_config, to_toml  # noqa: E402


def _rows():
    return [
        {"step": 1, "time/step": 2.0},
        {"step": 2, "time/step": 5.0, "time/eval": 2.5, "eval/accuracy": 0.25},
        {"step": 3, "time/step": 2.0},
        {"step": 4, "time/step": 4.0, "time/eval": 1.5, "eval/accuracy": 0.5},
        {"step": 5, "time/step": 3.0, "time/eval": 1.0, "eval/accuracy": 0.75},
    ]


def test_curve_leaves_the_evaluations_time_out():
    curve = tta.curve_from_metrics(_rows())
    assert curve == [
        {"step": 2, "train_s": 4.5, "accuracy": 0.25},
        {"step": 4, "train_s": 9.0, "accuracy": 0.5},
        {"step": 5, "train_s": 11.0, "accuracy": 0.75},
    ]


def test_time_to_threshold_and_accuracy_within_budget():
    curve = tta.curve_from_metrics(_rows())
    assert tta.time_to(curve, 0.5) == 9.0
    assert tta.time_to(curve, 0.3) == 9.0  # the first evaluation at or above it
    assert tta.time_to(curve, 0.9) is None
    assert tta.time_to(curve, 0.5, "step") == 4
    assert tta.accuracy_within(curve, 10.0) == 0.5
    assert tta.accuracy_within(curve, 11.0) == 0.75
    assert tta.accuracy_within(curve, 4.0) is None
    assert tta.final_accuracy(curve, 2) == pytest.approx(0.625)
    assert tta.final_accuracy(curve, 9) == pytest.approx(0.5)  # fewer evaluations than asked: all of them
    assert tta.final_accuracy([], 5) is None


def test_summary_ratios_take_the_best_of_ours_and_of_async():
    sides = {
        "sync": {"time_to_threshold_s": 60.0},
        "async1": {"time_to_threshold_s": 50.0},
        "async4p": {"time_to_threshold_s": 40.0},
        "trl": {"time_to_threshold_s": 200.0},
    }
    assert tta.summary(sides) == {"trl_over_ours": 5.0, "async_over_sync": 1.5}
    sides["async4p"]["time_to_threshold_s"] = None  # not reached: the other async side counts
    assert tta.summary(sides) == {"trl_over_ours": 200.0 / 50.0, "async_over_sync": 60.0 / 50.0}
    assert tta.summary({"sync": {"time_to_threshold_s": 60.0}}) == {
        "trl_over_ours": None,
        "async_over_sync": None,
    }


def test_median_time_counts_a_seed_that_never_reached_it_as_the_slowest():
    assert tta.median_time([30.0, 10.0, 20.0]) == 20.0
    assert tta.median_time([30.0, None, 10.0]) == 30.0
    assert tta.median_time([None, None, 10.0]) is None
    assert tta.median_time([10.0, None]) is None  # the median of 10 and "not reached"
    assert tta.median_time([10.0, 20.0]) == 15.0
    assert tta.median_time([]) is None


def test_combine_takes_medians_over_seeds_and_names_failures():
    def run(seed, accs, idle):
        curve = [{"step": 10 * (i + 1), "train_s": 10.0 * (i + 1), "accuracy": x} for i, x in enumerate(accs)]
        return {
            "seed": seed,
            "steps": 30,
            "s_per_step": 1.0 + seed,
            "curve": curve,
            "trainer_idle_frac": idle,
            "staleness_max": float(seed),
        }

    runs = [
        run(0, [0.3, 0.5, 0.6], 0.1),
        run(1, [0.2, 0.3, 0.45], 0.2),
        run(2, [0.5, 0.4, 0.55], 0.3),
        {"seed": 3, "error": "no metrics"},
    ]
    c = tta.combine(runs, [0.5, 0.4], budget_s=20.0)
    assert (c["seeds"], c["failed_seeds"]) == (3, 1)
    assert c["times_to"] == {"0.5": 20.0, "0.4": 20.0}  # 0.5: seeds at 20, never, 10; 0.4: 20, 30, 10
    assert c["time_to_threshold_s"] == 20.0
    assert c["steps_to"] == {"0.5": 20.0, "0.4": 20.0}  # evaluations every 10 steps, 10 s apart
    assert c["accuracy_at_budget"] == 0.4  # 0.5, 0.3, 0.4
    assert c["final_accuracy"] == pytest.approx(1.4 / 3)  # the median of the means 1.4/3, 0.95/3, 1.45/3
    assert (c["s_per_step"], c["trainer_idle_frac"], c["staleness_max"]) == (2.0, 0.2, 2.0)
    assert tta.combine([{"seed": 0, "error": "boom"}], [0.5], 20.0)["error"] == "boom"


def test_summaries_give_the_ratios_at_every_threshold():
    sides = {
        "sync": {"times_to": {"0.5": 60.0, "0.4": 30.0}},
        "async1is": {"times_to": {"0.5": 40.0, "0.4": None}},
        "trl": {"times_to": {"0.5": 120.0, "0.4": 90.0}},
    }
    s = tta.summaries(sides, [0.5, 0.4])
    assert (s["trl_over_ours"], s["async_over_sync"]) == (3.0, 1.5)
    assert s["by_threshold"]["0.4"] == {"trl_over_ours": 3.0, "async_over_sync": None}


@pytest.mark.parametrize("side", ["sync", "async1", "async1is", "async4p"])
def test_each_side_is_a_valid_config_on_the_demos(side, tmp_path):
    a = tta.parse_args(["--sft-model", "unused", "--max-steps", "7", "--eval-every", "3"])
    config = tmp_path / "demo.toml"
    config.write_text(to_toml(demo_config(DemoPlan(), tmp_path / "run")))
    cmd = tta.ours_command(a, "MODEL", side, tmp_path / "run", config, seed=3)
    assert cmd[3:5] == ["train", str(config)]
    cfg = load_config(config, cmd[5:])
    assert (cfg.trainer.total_steps, cfg.trainer.test_freq, cfg.data.shuffle) == (7, 3, False)
    assert cfg.cluster.mode == ("sync" if side == "sync" else "async")
    assert cfg.algorithm.max_staleness == (4 if side == "async4p" else 1)
    assert cfg.rollout.partial == (side == "async4p")
    assert (cfg.rollout.seed, cfg.trainer.seed) == (3, 3)
    assert cfg.algorithm.rollout_is == ("token" if side in ("async1is", "async4p") else "none")
    assert cfg.rollout.calculate_log_probs == (side in ("async1is", "async4p"))


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        tta.parse_args(["--sides", "sync,fast"])
    assert "--sides" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tta.parse_args(["--eval-every", "0"])
    assert "--eval-every" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tta.parse_args(["--seeds", "0,x"])
    assert "--seeds" in capsys.readouterr().err
    a = tta.parse_args(["--threshold", "0.45,0.4", "--seeds", "2,5"])
    assert (a.thresholds, a.threshold, a.seed_list, a.seed) == ([0.45, 0.4], 0.45, [2, 5], 2)
