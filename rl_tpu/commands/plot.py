"""`rl-tpu plot RUN_DIR`: PNG curves of a run's metrics.jsonl (reward, losses, timings, throughput, memory)."""

from __future__ import annotations

from pathlib import Path

from rl_tpu.metrics import read_metrics

PANELS = [
    ("reward", ["reward/mean", "eval/accuracy"]),
    ("policy loss", ["loss/policy", "loss/kl"]),
    ("actor", ["actor/entropy", "actor/clipfrac", "actor/grad_norm"]),
    ("response length", ["response/length_mean"]),
    (
        "seconds per step",
        ["time/rollout", "time/generate", "time/reward", "time/train", "time/sync", "time/step"],
    ),
    ("throughput (tokens/s)", ["throughput/tokens_per_s"]),
    ("resident memory (MB)", ["memory/trainer_rss_mb", "memory/engine_rss_mb", "memory/driver_rss_mb"]),
]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    panels = [(t, [k for k in keys if any(k in r for r in rows)]) for t, keys in PANELS]
    panels = [(t, keys) for t, keys in panels if keys]
    if not panels:
        raise ValueError(f"{run_dir}/metrics.jsonl has none of the plotted metrics")
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 3.2 * nrows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 40 else None, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
