"""Run outputs: metrics to JSONL (always), TensorBoard (default) and wandb (optional); sampled completions.

Invariants:
- `RUN_DIR/metrics.jsonl` holds one JSON object per step, each with the integer key `step`; values are
  plain floats. A resumed run truncates the file to the steps before the resume point, so the file
  always reads as one uninterrupted run.
- `RUN_DIR/samples.jsonl` holds a few sampled completions per step with their rewards.
- Metric names are a public contract (listed in the README): `reward/mean`, `loss/policy`, `time/step`, ...
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rl_tpu.config import LoggingConfig


def process_rss_mb() -> float:
    """This process's resident memory in MB (2^20 bytes): the `memory/*_rss_mb` metrics. Each role reads it
    at the same point of every step (the trainer after its update, the driver at the step's end), so a
    series that climbs over a run is a leak, not the phase it was read at."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class MetricsLogger:
    def __init__(
        self, run_dir: str | Path, cfg: LoggingConfig, *, resume_step: int = 0, config: dict | None = None
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        _truncate_after(self.path, resume_step)
        _truncate_after(self.samples_path, resume_step)
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step + 1)
        self._wandb = None
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    "logging.wandb = true needs the wandb package: uv pip install wandb"
                ) from None
            self._wandb = wandb.init(
                project=cfg.wandb_project, dir=str(self.run_dir), config=config, resume="allow"
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step} | {k: _plain(v) for k, v in sorted(metrics.items()) if k != "step"}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        with self.samples_path.open("a") as f:
            for s in samples:
                f.write(json.dumps({"step": step} | s) + "\n")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return v
    return float(v)


def _truncate_after(path: Path, step: int) -> None:
    """Keep only rows with row['step'] <= step (rows written by an earlier, interrupted run)."""
    if not path.exists():
        return
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: is it a run folder (logging.run_dir)?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
