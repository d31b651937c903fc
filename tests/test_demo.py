"""The demo, shortened (`--quick`: tiny model, a few steps): it runs end to end on the real stack and
writes a well-formed report and picture. Whether RL beats SFT and the control is what the full demo
measures; a few steps of a tiny model cannot show it, so this test checks the plumbing and the report."""

import json
import math
import struct
import subprocess
import sys

import pytest


@pytest.mark.timeout(2100)  # above the demo subprocess's own 1800 s timeout, which reports better
def test_quick_demo_writes_report_and_curves(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "rl_tpu.cli", "demo", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for key in ("accuracy_sft", "accuracy_rl", "accuracy_control", "steps", "wall_seconds", "tokens_per_s"):
        assert key in report and isinstance(report[key], (int, float)) and math.isfinite(report[key]), key
    for key in ("accuracy_sft", "accuracy_rl", "accuracy_control"):
        assert 0.0 <= report[key] <= 1.0
    assert report["steps"] == report["plan"]["grpo_steps"]
    assert report["rl_gain_over_control"] == report["accuracy_rl"] - report["accuracy_control"]
    assert len(report["grpo_curve"]) == report["steps"] and report["sft"]["curve"]
    assert abs(report["grpo_curve"][-1]["train_seconds"] - report["grpo_seconds"]) < 1e-6  # cumulative step time
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 800 and height >= 300
    assert "held-out accuracy" in r.stdout and "GRPO (verifier only)" in r.stdout
