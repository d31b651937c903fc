"""Run outputs: metrics.jsonl contract, resume truncation, atomic checkpoints, plots."""

import json
import struct
import subprocess
import sys

import pytest

from rl_tpu.config import LoggingConfig
from rl_tpu.controller.checkpoint import complete_checkpoints, load_state, resolve_resume, save_checkpoint
from rl_tpu.metrics import MetricsLogger, read_metrics


def _log_steps(run_dir, steps, resume_step=0, tb=False):
    log = MetricsLogger(run_dir, LoggingConfig(tensorboard=tb), resume_step=resume_step)
    for s in steps:
        log.log(s, {"reward/mean": s / 10, "loss/policy": -s, "time/step": 0.5})
        log.log_samples(s, [{"text": f"s{s}", "reward": 1.0}])
    log.close()


def test_metrics_jsonl_one_object_per_step_and_resume_truncates(tmp_path):
    _log_steps(tmp_path, [1, 2, 3, 4], tb=True)
    assert (tmp_path / "tensorboard").is_dir()
    # a resumed run from a checkpoint at step 2 rewrites steps 3.. : the file reads as one run
    _log_steps(tmp_path, [3, 4, 5], resume_step=2)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2] == {"step": 3, "loss/policy": -3.0, "reward/mean": 0.3, "time/step": 0.5}
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2, 3, 4, 5]


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    def writer(folder):
        folder.mkdir()
        (folder / "shard").write_text("x")

    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, {"version": step}, writer, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000004", "step_000006"]
    # a save that dies half way leaves a .tmp that resume ignores
    with pytest.raises(RuntimeError):
        save_checkpoint(
            tmp_path, 8, {}, lambda f: (_ for _ in ()).throw(RuntimeError("disk full")), keep_last=2
        )
    assert (tmp_path / "checkpoints" / "step_000008.tmp").exists()
    newest = resolve_resume(tmp_path, "auto")
    assert newest.name == "step_000006" and load_state(newest) == {"version": 6, "step": 6}
    assert resolve_resume(tmp_path, "") is None
    assert resolve_resume(tmp_path / "empty", "auto") is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))
    save_checkpoint(tmp_path, 10, {}, writer, keep_last=2)
    assert not (tmp_path / "checkpoints" / "step_000008.tmp").exists()


def test_plot_cli_writes_a_png(tmp_path):
    _log_steps(tmp_path, range(1, 8))
    r = subprocess.run(
        [sys.executable, "-m", "rl_tpu.commands.cli", "plot", str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 500 and height > 200
    bad = subprocess.run(
        [sys.executable, "-m", "rl_tpu.commands.cli", "plot", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "metrics.jsonl" in bad.stderr and "Traceback" not in bad.stderr
