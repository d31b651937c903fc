"""Pure figures of bench/time_to_accuracy.py: training time without evaluations, time to a threshold,
accuracy within a budget, the JSON line's ratios, and the sides' `rl-tpu train` overrides being valid
config. The sides themselves run Ray, vLLM and TRL (`bench` extra): a benchmark, not a test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import time_to_accuracy as tta  # noqa: E402

from rl_tpu.config import load_config, to_toml  # noqa: E402
from rl_tpu.demo import DemoPlan, demo_config  # noqa: E402


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
    assert tta.accuracy_within(curve, 10.0) == 0.5
    assert tta.accuracy_within(curve, 11.0) == 0.75
    assert tta.accuracy_within(curve, 4.0) is None


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


@pytest.mark.parametrize("side", ["sync", "async1", "async4p"])
def test_each_side_is_a_valid_config_on_the_demos(side, tmp_path):
    a = tta.parse_args(["--sft-model", "unused", "--max-steps", "7", "--eval-every", "3"])
    config = tmp_path / "demo.toml"
    config.write_text(to_toml(demo_config(DemoPlan(), tmp_path / "run")))
    cmd = tta.ours_command(a, "MODEL", side, tmp_path / "run", config)
    assert cmd[3:5] == ["train", str(config)]
    cfg = load_config(config, cmd[5:])
    assert (cfg.trainer.total_steps, cfg.trainer.test_freq, cfg.data.shuffle) == (7, 3, False)
    assert cfg.cluster.mode == ("sync" if side == "sync" else "async")
    assert cfg.algorithm.max_staleness == (4 if side == "async4p" else 1)
    assert cfg.rollout.partial == (side == "async4p")


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        tta.parse_args(["--sides", "sync,fast"])
    assert "--sides" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tta.parse_args(["--eval-every", "0"])
    assert "--eval-every" in capsys.readouterr().err
