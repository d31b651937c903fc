"""Training throughput of the TrainerGroup (TorchTitan, FSDP2 over Ray actors) vs a plain transformers step.

Both sides run the same model (built locally), the same batch (prompt + response tokens), the same
PPO-clip loss (`rl_tpu.algorithms.losses.compute_policy_loss` on response-token log-probs), the same
micro-batching, AdamW and gradient clipping, and the same total number of CPU threads
(world_size ranks x threads_per_rank for the group; that many threads for transformers). They run one
after the other, not concurrently. Tokens/s counts every real (non-pad) token of the batch per step.

Usage: .venv/bin/python bench/trainer.py [--size small] [--world-size 1] [--threads 1] [--steps 4]
The last output line is a JSON object; "ratio" = trainer tokens/s / transformers tokens/s (with `--modes`:
the best mode's tokens/s / eager's).

`--variant NAME="--trainer.key=value ..."` (repeatable) builds one TrainerGroup per variant, all alive
at once, and runs their steps in turn (step 1 of A, of B, step 2 of A, ...), so this box's drift in speed
hits every variant alike; each variant's ratio is against the same transformers figure, e.g.
    bench/trainer.py --world-size 2 --batch 64 --micro-batch-size 16 --skip-hf \
        --variant sharded="--trainer.fsdp_step=sharded" --variant replicated="--trainer.fsdp_step=replicated"
    bench/trainer.py --world-size 2 --batch 64 --group-size 8 --prompt-len 36 --micro-batch-size 16 --skip-hf \
        --variant shared="--trainer.share_prompts=true" --variant rows="--trainer.share_prompts=false"
    bench/trainer.py --world-size 2 --batch 64 --group-size 8 --prompt-len 36 --micro-batch-size 16 --skip-hf \
        --alike-groups 0.5 --variant skip="--trainer.skip_zero_advantage=true" \
        --variant all="--trainer.skip_zero_advantage=false"
    bench/trainer.py --world-size 2 --batch 64 --group-size 8 --prompt-len 36 --micro-batch-size 16 --skip-hf \
        --response-len 256 --response-len-min 16 --lengths-by-group \
        --variant balanced="--trainer.balance_tokens=true" --variant blocks="--trainer.balance_tokens=false"

`--modes eager,compile,graph` (trainer.mode, #46) is a shorthand for one variant per execution mode (added
to any `--variant` overrides, e.g. `--param-dtype bfloat16`; graph mode with `--trainer.fsdp=simple`, which
it needs, the others with the variant's own FSDP). Each mode's first step (the warm-up) includes
its compile; `compile_s` is that step's wall time less the mode's steady step time, reported apart from
the tokens/s, which count the steady steps only. The last line then has `speedup_<mode>` = that mode's
tokens/s / eager's, and `payback_steps` = compile_s / (eager s/step - mode s/step): the steps a run
needs before compiling has paid for itself (none when the mode is not faster). For example
    bench/trainer.py --world-size 2 --batch 64 --group-size 8 --prompt-len 36 --micro-batch-size 16 \
        --skip-hf --modes eager,compile,graph --steps 6

`--old-log-probs` also times the loop's separate old-log-prob pass before each step (what several
mini-batches or epochs need), over the rows the loop asks for (`loop.old_log_prob_rows`), e.g. the
skipped sequences left out of it too:
    bench/trainer.py ... --alike-groups 0.5 --old-log-probs \
        --variant skip="--trainer.ppo_mini_batches=2 --trainer.skip_zero_advantage=true" \
        --variant all="--trainer.ppo_mini_batches=2 --trainer.skip_zero_advantage=false"
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def make_batch(
    vocab: int,
    batch: int,
    prompt_len: int,
    response_len: int,
    seed: int = 0,
    group_size: int = 1,
    response_len_min: int | None = None,
    alike_groups: float = 0.0,
    lengths_by_group: bool = False,
):
    """`batch` rows of random tokens; each prompt repeated for `group_size` consecutive rows (a GRPO group);
    response lengths uniform in [response_len_min, response_len] (all response_len by default), or with
    `lengths_by_group` in [response_len_min, L] for a length L drawn per group from that range (some
    prompts draw long answers, some short, as in real GRPO batches); a random `alike_groups` share of the
    groups has advantage 0 (samples that all scored the same)."""
    from rl_tpu.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(-(-batch // group_size))
    ]
    P = [prompts[i // group_size] for i in range(batch)]
    lo = response_len if response_len_min is None else response_len_min
    if lengths_by_group:
        top = torch.randint(lo, response_len + 1, (len(prompts),), generator=g)
        lens = [
            int(torch.randint(lo, int(top[i // group_size]) + 1, (1,), generator=g)) for i in range(batch)
        ]
    else:
        lens = torch.randint(lo, response_len + 1, (batch,), generator=g).tolist()
    R = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lens]
    adv = torch.randn(batch, generator=g)
    n_groups = len(prompts)
    alike = torch.randperm(n_groups, generator=g)[: round(alike_groups * n_groups)]
    adv[torch.isin(torch.arange(batch) // group_size, alike)] = 0.0
    return TrainBatch.from_sequences(P, R, pad_id=3, advantages=adv.tolist())


def hf_train(model_path: str, batch, cfg, steps: int, warmup: int, threads: int) -> float:
    """Seconds per step of a plain transformers training step with the same loss and optimizer."""
    from transformers import AutoModelForCausalLM

    from rl_tpu.algorithms.losses import compute_policy_loss

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    tc = cfg.trainer
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    B, T = batch.num_seqs, batch.response_len
    P = int(batch.prompt_lens[0])  # the bench batch has equal lengths: no per-row gather needed
    tokens = float(batch.response_mask.sum())
    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        for rows in torch.arange(B).split(tc.micro_batch_size):
            mb = batch.select(rows)
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            lp = (
                logits[:, P - 1 : P - 1 + T]
                .float()
                .log_softmax(-1)
                .gather(-1, mb.input_ids[:, P : P + T, None])
                .squeeze(-1)
            )
            loss, _ = compute_policy_loss(
                cfg.algorithm, lp, lp.detach(), mb.advantages, mb.response_mask, global_tokens=tokens
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "mini", "small", "medium"])
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per trainer rank")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument(
        "--response-len-min",
        type=int,
        default=None,
        help="responses of uniform random length in [this, --response-len] (default: all --response-len)",
    )
    ap.add_argument(
        "--lengths-by-group",
        action="store_true",
        help="each group draws its own longest response in [--response-len-min, --response-len]",
    )
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="consecutive rows sharing a prompt (GRPO's n; `trainer.share_prompts` runs each once)",
    )
    ap.add_argument(
        "--alike-groups",
        type=float,
        default=0.0,
        help="share of groups whose advantage is 0 (`trainer.skip_zero_advantage` does not run them)",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="--trainer.k=v ..."',
        help="a TrainerGroup with these config overrides (repeatable; default: one plain group)",
    )
    ap.add_argument(
        "--modes",
        default="",
        help="comma-separated trainer.mode values, one variant each (e.g. eager,compile); eager first",
    )
    ap.add_argument(
        "--param-dtype", default="float32", choices=["float32", "bfloat16"], help="trainer.param_dtype"
    )
    ap.add_argument(
        "--skip-hf", action="store_true", help="no transformers baseline (ratios are then omitted)"
    )
    ap.add_argument(
        "--old-log-probs",
        action="store_true",
        help="each step also runs the loop's separate old-log-prob pass first (timed with it)",
    )
    args = ap.parse_args()
    variants = dict(v.split("=", 1) if "=" in v else (v, "") for v in args.variant)
    modes = [m for m in args.modes.split(",") if m]
    if modes:
        if modes[0] != "eager":
            modes = ["eager"] + [m for m in modes if m != "eager"]  # speedups are against eager
        base_variants = variants or {"": ""}
        # graph mode captures SimpleFSDP's collectives (FSDP2's hooks cannot be captured)
        fsdp = {"graph": " --trainer.fsdp=simple"}
        variants = {
            (f"{name}/{mode}" if name else mode): f"{extra} --trainer.mode={mode}{fsdp.get(mode, '')}".strip()
            for name, extra in base_variants.items()
            for mode in modes
        }
    variants = variants or {"trainer": ""}

    import ray

    from rl_tpu.cluster import init_ray
    from rl_tpu.config import load_config
    from rl_tpu.controller.loop import old_log_prob_rows
    from rl_tpu.devices import get_device
    from rl_tpu.tiny_model import make_tiny_model
    from rl_tpu.trainer import TrainerGroup

    get_device("cpu").apply_env()
    total_threads = args.world_size * args.threads
    base = [
        f"--trainer.micro_batch_size={args.micro_batch_size}",
        f"--trainer.num_threads={args.threads}",
        "--trainer.lr=1e-5",
        "--trainer.logprob_chunk_size=2048",
        f"--trainer.world_size={args.world_size}",
        f"--trainer.param_dtype={args.param_dtype}",
    ]
    cfgs = {name: load_config(None, base + extra.split()) for name, extra in variants.items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(f"{tmp}/model", arch=args.arch, size=args.size))
        from transformers import AutoConfig

        batch = make_batch(
            AutoConfig.from_pretrained(path).vocab_size,
            args.batch,
            args.prompt_len,
            args.response_len,
            group_size=args.group_size,
            response_len_min=args.response_len_min,
            alike_groups=args.alike_groups,
            lengths_by_group=args.lengths_by_group,
        )
        tokens = float(batch.attention_mask.sum())

        hf_s = None
        if not args.skip_hf:
            hf_s = hf_train(path, batch, next(iter(cfgs.values())), args.steps, args.warmup, total_threads)
            print(f"transformers: {hf_s:.3f} s/step, {tokens / hf_s:,.0f} tok/s ({total_threads} threads)")

        init_ray(
            attempts=3,
            num_cpus=max(total_threads * len(cfgs), 2),
            include_dashboard=False,
            log_to_driver=False,
        )
        groups = {name: TrainerGroup(cfg, path, world_size=args.world_size) for name, cfg in cfgs.items()}
        walls = {name: [] for name in groups}
        inner = {name: [] for name in groups}
        first = {name: 0.0 for name in groups}  # the warm-up steps' wall time (a compiled mode's compile)
        try:
            for step in range(args.warmup + args.steps):
                for name, group in groups.items():
                    t0 = time.perf_counter()
                    b = batch
                    if args.old_log_probs:
                        rows = old_log_prob_rows(cfgs[name], batch, group.world_size)
                        b = batch.replace(old_log_probs=group.compute_log_probs(batch, rows=rows))
                    m = group.train_step(b, cfgs[name].algorithm)
                    if step < args.warmup:
                        first[name] += time.perf_counter() - t0
                    else:
                        walls[name].append(time.perf_counter() - t0)
                        inner[name].append(m["perf/train_s"])
        finally:
            for group in groups.values():
                group.shutdown()
            ray.shutdown()
    rows = {}
    for name in groups:
        tt_s, inner_s = sum(walls[name]) / len(walls[name]), sum(inner[name]) / len(inner[name])
        line = (
            f"{name}: {tt_s:.3f} s/step ({inner_s:.3f} s inside the actors; steps "
            f"{' '.join(f'{w:.2f}' for w in walls[name])}), {tokens / tt_s:,.0f} tok/s "
            f"({args.world_size} rank(s) x {args.threads} thread(s))"
        )
        rows[name] = {
            "s_per_step": round(tt_s, 3),
            "trainer_tok_s": round(tokens / tt_s, 1),
            "trainer_inner_tok_s": round(tokens / inner_s, 1),
        }
        if modes:
            rows[name]["compile_s"] = round(max(first[name] - args.warmup * tt_s, 0.0), 2)
            line += f", first step(s) {first[name]:.2f} s"
        if hf_s is not None:
            rows[name]["ratio"] = round(hf_s / tt_s, 3)
            line += f", ratio trainer/transformers tokens/s {hf_s / tt_s:.3f}"
        print(line)
    first_name = next(iter(rows))
    for name in list(rows)[1:]:
        print(
            f"{name} / {first_name} s/step: {rows[name]['s_per_step'] / rows[first_name]['s_per_step']:.3f}"
        )
    out = {
        "bench": "trainer",
        "arch": args.arch,
        "size": args.size,
        "world_size": args.world_size,
        "threads_total": total_threads,
        "batch": args.batch,
        "group_size": args.group_size,
        "seq_len": args.prompt_len + args.response_len,
        "tokens_per_step": tokens,
        "old_log_probs": args.old_log_probs,
        "hf_tok_s": round(tokens / hf_s, 1) if hf_s else None,
    }
    if modes:
        out.update(mode_table(rows, modes, args.param_dtype))
    if len(rows) == 1:
        out.update(rows[first_name])
    else:
        out["variants"] = rows
    print(json.dumps(out))


def mode_table(rows: dict[str, dict], modes: list[str], dtype: str) -> dict:
    """Print one table row per (variant, mode) against the same variant's eager; the JSON figures of the
    first variant: `speedup_<mode>`, `compile_s_<mode>`, `payback_steps_<mode>`, and `ratio` (the best
    mode's speedup, the issue's headline figure)."""
    print(f"{'variant':<24} {'tok/s':>10} {'s/step':>8} {'compile s':>10} {'speedup':>8} {'payback':>8}")
    out: dict = {"param_dtype": dtype, "modes": modes}
    prefixes = list(dict.fromkeys(name.rsplit("/", 1)[0] if "/" in name else "" for name in rows))
    for prefix in prefixes:

        def key(m: str, prefix: str = prefix) -> str:
            return f"{prefix}/{m}" if prefix else m

        eager = rows[key("eager")]
        for mode in modes:
            r = rows[key(mode)]
            speedup = r["trainer_tok_s"] / eager["trainer_tok_s"]
            saved = eager["s_per_step"] - r["s_per_step"]
            payback = round(r["compile_s"] / saved, 1) if mode != "eager" and saved > 0 else None
            print(
                f"{key(mode):<24} {r['trainer_tok_s']:>10,.0f} {r['s_per_step']:>8.3f} "
                f"{r['compile_s']:>10.2f} {speedup:>8.3f} {str(payback):>8}"
            )
            if prefix == prefixes[0] and mode != "eager":
                out[f"speedup_{mode}"] = round(speedup, 3)
                out[f"compile_s_{mode}"] = r["compile_s"]
                out[f"payback_steps_{mode}"] = payback
    speedups = [v for k, v in out.items() if k.startswith("speedup_")]
    out["ratio"] = max(speedups) if speedups else 1.0
    return out


if __name__ == "__main__":
    main()
