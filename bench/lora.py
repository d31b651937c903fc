"""LoRA benchmark: the adapter-only sync, step time, memory and engine speed against full fine-tuning of
the same model, measured side by side in one run.

Part `runs`: `rl-tpu train` three times on `--model` (full fine-tuning; `--trainer.lora.rank=R` with the
adapter written into the engines' LoRA slots, the default; the same through a PEFT folder and vLLM's
reload, `--sync.transport=reload`), the same batch and seed, each in its own process tree (peak PSS of
the tree sampled every second: driver, Ray, trainer ranks, engine). Medians over steps 2..N of
`sync/bytes`, `sync/seconds`, `time/step`, `time/train`, `time/generate`; the ratios LoRA ÷ full for
both LoRA runs.

Part `engine`: one vLLM engine per process on `--model`, plain or serving a random rank-R adapter on the
same target linears; the same prompts, greedy with `ignore_eos` so both generate exactly the same number
of tokens; tokens/s of the best of `--repeats` calls after a warm-up call. Ratio LoRA ÷ plain.

Part `learn` (not in the default parts: ~15 minutes): GRPO on the real-model demo's task (`rl-tpu demo
--model`'s plan: one-digit sums and products, 100 held-out questions, greedy accuracy) from the shipped
weights, full fine-tuning at the demo's learning rate and LoRA on all seven linears at 50x it (10x, the
usual LoRA rule, learned at half the pace here), the same number of steps; held-out accuracy before and
after each, gains, and each run's training seconds (sum of `time/step` less evaluation). LoRA ÷ full gain
is the headline of this part.

The last line is one JSON object; its "ratio" is sync bytes LoRA ÷ full (issue #58's first target, ≤ 0.02).

    python bench/lora.py                                  # smollm2-135m-instruct, rank 16, 4 steps
    python bench/lora.py --parts engine --rank 16
    python bench/lora.py --model /path/to/hf_folder --steps 6
    python bench/lora.py --parts learn --learn-steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import json_line, load_average, median, run_measured  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RUN_METRICS = ("sync/bytes", "sync/seconds", "time/step", "time/train", "time/generate")


def train_run(work: Path, name: str, model: str, steps: int, extra: list[str]) -> dict:
    run_dir = work / name
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.commands.cli",
        "train",
        "examples/tiny_cpu.toml",
        f"--model.path={model}",
        f"--logging.run_dir={run_dir}",
        f"--trainer.total_steps={steps}",
        "--data.batch_size=4",
        "--rollout.n=4",
        "--rollout.max_tokens=32",
        "--logging.tensorboard=false",
        "--logging.progress=false",
        "--checkpoint.every=0",
        "--trainer.test_freq=0",
        *extra,
    ]
    r = run_measured(cmd, work / f"{name}.log", cwd=Path(__file__).resolve().parents[1])
    if r.returncode != 0:
        raise SystemExit(f"{name}: rl-tpu train failed (exit {r.returncode}):\n" + "\n".join(r.tail))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    later = rows[1:] or rows
    out = {k: median([row[k] for row in later if k in row]) for k in RUN_METRICS}
    out["pss_gib"] = r.memory.pss / 2**30
    out["wall_s"] = r.seconds
    return out


def engine_child(model: str, rank: int, prompts: int, tokens: int, repeats: int, folder: str) -> None:
    """In its own process: one engine, plain (`rank` 0) or serving a random adapter; prints RESULT {json}."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import SamplingParams

    from rl_tpu import peft_folder
    from rl_tpu.config import LoraConfig, engine_config, load_config
    from rl_tpu.devices import rollout_device
    from rl_tpu.model_source import resolve_model_path
    from rl_tpu.rollout.engine import build_engine, lora_kwargs
    from rl_tpu.weight_sync.names import checkpoint_shapes

    model = resolve_model_path(model)
    cfg = load_config(None, ["--rollout.kv_cache_gb=1", f"--model.path={model}"])
    extra, request = {}, None
    if rank:
        from vllm.lora.request import LoRARequest

        lc = LoraConfig(rank=rank, targets=TARGETS)
        g = torch.Generator().manual_seed(0)
        zero = peft_folder.zero_adapter(checkpoint_shapes(model), lc)
        peft_folder.save(
            folder, {n: torch.randn(t.shape, generator=g) * 0.02 for n, t in zero.items()}, lc, model
        )
        extra, request = lora_kwargs(rank, lc.targets), LoRARequest("bench", 1, folder)
    llm = build_engine(engine_config(cfg), rollout_device(cfg), model, **extra)
    ids = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i, 400 + i]} for i in range(prompts)]
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    llm.generate(ids, sp, use_tqdm=False, lora_request=request)  # warm-up
    best, outs = float("inf"), []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(ids, sp, use_tqdm=False, lora_request=request)
        best = min(best, time.perf_counter() - t)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"tokens": n, "seconds": best, "tokens_per_s": n / best}), flush=True)


def engine_speed(work: Path, model: str, rank: int, prompts: int, tokens: int, repeats: int) -> dict:
    folder = str(work / f"engine_adapter_{rank}")
    args = [model, rank, prompts, tokens, repeats, folder]
    r = subprocess.run(
        [sys.executable, __file__, "--engine-child", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"engine (rank {rank}) failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def learn(
    work: Path, model: str, rank: int, steps: int, lora_lr_factor: float, targets: list[str], arms: list[str]
) -> dict:
    """Held-out accuracy gain of GRPO with full fine-tuning vs LoRA on the real-model demo's task."""
    from rl_tpu.cluster import start_ray
    from rl_tpu.commands.demo_model import ModelDemoPlan, model_demo_config
    from rl_tpu.config import with_overrides
    from rl_tpu.controller.evaluation import Evaluator
    from rl_tpu.controller.loop import start_shared_roles, train
    from rl_tpu.data import build_datasets
    from rl_tpu.metrics import read_metrics
    from rl_tpu.model_folder import load_tokenizer
    from rl_tpu.model_source import resolve_model_path

    plan = ModelDemoPlan(model=model, grpo_steps=steps)
    base = resolve_model_path(model, key="--model")
    cfg = model_demo_config(plan, base, work / "learn")
    _, test_set = build_datasets(cfg.data)
    start_ray(cfg)
    tok = load_tokenizer(base, chat_template=True)
    out = {}
    runs = (
        ("full", [f"--trainer.lr={plan.grpo_lr}"]),
        (
            "lora",
            [
                f"--trainer.lora.rank={rank}",
                f"--trainer.lora.targets={json.dumps(targets)}",
                f"--trainer.lr={plan.grpo_lr * lora_lr_factor}",
            ],
        ),
    )
    for name, extra in (run for run in runs if run[0] in arms):
        run_cfg = with_overrides(
            cfg,
            [
                f"--logging.run_dir={work / 'learn' / name}",
                f"--trainer.total_steps={steps}",
                f"--trainer.test_freq={steps}",  # evaluated once, after the last step's sync
                *extra,
            ],
        )
        roles = start_shared_roles(run_cfg, base)
        try:
            ev = Evaluator(run_cfg, roles.rollout, tok, test_set)
            before = ev.accuracy()  # the shipped weights (a LoRA engine: the zero adapter)
            ev.close()
            train(run_cfg, roles=roles)
        finally:
            roles.shutdown()
        rows = read_metrics(work / "learn" / name)
        seconds = sum(r["time/step"] - r.get("time/eval", 0.0) for r in rows)
        after = rows[-1]["eval/accuracy"]
        out[name] = {"before": before, "after": after, "gain": after - before, "train_seconds": seconds}
        print(
            f"{name}: held-out accuracy {before:.3f} -> {after:.3f} in {seconds:.0f} s of steps", flush=True
        )
    if {"full", "lora"} <= set(out):
        out["gain_ratio"] = out["lora"]["gain"] / out["full"]["gain"] if out["full"]["gain"] else float("nan")
        out["seconds_ratio"] = out["lora"]["train_seconds"] / out["full"]["train_seconds"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model.path (a folder or a known name)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="RL steps per run (medians over steps 2..N)")
    p.add_argument("--parts", default="runs,engine")
    p.add_argument("--prompts", type=int, default=16, help="engine part: prompts per call")
    p.add_argument("--tokens", type=int, default=64, help="engine part: tokens per response")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--learn-steps", type=int, default=20, help="learn part: GRPO steps per run")
    # 10x (the usual LoRA rule) learned at half full fine-tuning's pace here; 50x on all seven linears
    # matched it (bench/RESULTS.md, session 42)
    p.add_argument("--lora-lr-factor", type=float, default=50.0, help="learn part: LoRA lr / full lr")
    p.add_argument("--learn-arms", default="full,lora", help="learn part: which runs (full, lora)")
    p.add_argument(
        "--learn-targets",
        default=",".join(TARGETS),
        help="learn part: the adapted linears (HF names, commas)",
    )
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    work = a.workdir or Path(tempfile.mkdtemp(prefix="rl_tpu_bench_lora_"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "lora", "model": a.model, "rank": a.rank, "load_start": load_average()}
    print(f"model {a.model}, rank {a.rank}; load average {result['load_start']:.2f}")
    if "runs" in parts:
        full = train_run(work, "full", a.model, a.steps, [])
        lora_args = [f"--trainer.lora.rank={a.rank}"]
        lora = train_run(work, "lora", a.model, a.steps, lora_args)
        folder = train_run(work, "lora_folder", a.model, a.steps, [*lora_args, "--sync.transport=reload"])
        print(
            f"\n{'per step (median of 2..N)':28s} {'full':>12s} {'lora':>12s} {'lora folder':>12s} "
            f"{'lora/full':>10s} {'folder/full':>12s}"
        )
        for k in (*RUN_METRICS, "pss_gib", "wall_s"):
            ratio = lora[k] / full[k] if full[k] else float("nan")
            ratio_folder = folder[k] / full[k] if full[k] else float("nan")
            print(
                f"{k:28s} {full[k]:12.4g} {lora[k]:12.4g} {folder[k]:12.4g} {ratio:10.4f} {ratio_folder:12.4f}"
            )
            result[f"{k}_ratio"] = ratio
            result[f"{k}_ratio_folder"] = ratio_folder
        result |= {
            "full": full,
            "lora": lora,
            "lora_folder": folder,
            "ratio": result["sync/bytes_ratio"],
            "targets": TARGETS,
        }
    if "engine" in parts:
        plain = engine_speed(work, a.model, 0, a.prompts, a.tokens, a.repeats)
        served = engine_speed(work, a.model, a.rank, a.prompts, a.tokens, a.repeats)
        ratio = served["tokens_per_s"] / plain["tokens_per_s"]
        print(
            f"\nengine tokens/s ({a.prompts} prompts x {a.tokens} tokens, greedy): plain "
            f"{plain['tokens_per_s']:.0f}, with a rank-{a.rank} adapter {served['tokens_per_s']:.0f}: {ratio:.3f}"
        )
        result |= {"engine_plain": plain, "engine_lora": served, "engine_tokens_per_s_ratio": ratio}
        result.setdefault("ratio", None)
    if "learn" in parts:
        targets = a.learn_targets.split(",")
        arms = a.learn_arms.split(",")
        result["learn"] = learn(work, a.model, a.rank, a.learn_steps, a.lora_lr_factor, targets, arms)
        result["learn"]["targets"] = targets
        result.setdefault("ratio", None)
    result["load_end"] = load_average()
    print(json_line(result))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine-child"]:
        m, r, p, t, n, f = sys.argv[2:8]
        engine_child(m, int(r), int(p), int(t), int(n), f)
        sys.exit(0)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.perf_counter()
    rc = main()
    print(f"# {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
