"""Generated tokens/s through `RolloutGroup` (Ray actor + conversion to `Completion`s) vs raw
`vllm.LLM.generate` in this process, on the same prompts, sampling and engine settings.

Both engines stay up and the measurements alternate (raw, group, raw, group, ...) so load from other
processes on a shared machine hits both alike; the ratio uses the median of each side. Both sides run
the same torch thread count (`--threads`): left to Ray, the actor would get OMP_NUM_THREADS=1 per CPU it
asked for while this process kept all of its threads, and the ratio would measure that, not Ray.
Last line: one JSON object, headline `ratio` = group tok/s / raw tok/s (target >= 0.95).

    python bench/rollout.py [--size small] [--prompts 64] [--n 8] [--max-tokens 64] [--reps 3]
                            [--threads N] [--engine eager|compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from rl_tpu.cluster import init_ray
from rl_tpu.config import engine_config, load_config
from rl_tpu.rollout.engine import build_engine, rollout_device, sampling_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF model folder; empty: build a tiny model")
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of each engine, both sides (0: this process's torch.get_num_threads())",
    )
    ap.add_argument(
        "--engine",
        default="eager",
        choices=["eager", "compiled"],
        help="rollout.enforce_eager true (eager) or false (compiled, as bench/vs_trl.py runs it)",
    )
    args = ap.parse_args()

    import ray

    from rl_tpu.rollout import RolloutGroup

    model = args.model
    if not model:
        from rl_tpu.tiny_model import make_tiny_model

        model = str(make_tiny_model(os.path.join(tempfile.mkdtemp(), "m"), size=args.size, seed=0))
    import torch

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # the raw engine takes this process's count when it starts
    # the actor gets the same count: left at 0 it keeps Ray's OMP_NUM_THREADS (1 per num_cpus)
    cfg = load_config(
        None,
        [
            f"--rollout.n={args.n}",
            f"--rollout.max_tokens={args.max_tokens}",
            "--rollout.temperature=1.0",
            "--rollout.max_model_len=256",
            f"--rollout.num_threads={threads}",
            f"--rollout.enforce_eager={str(args.engine == 'eager').lower()}",
        ],
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    # ignore_eos is not a config knob; fixed-length outputs come from a vocabulary-wide random model
    # rarely hitting EOS, and both sides count the tokens they actually produced.

    init_ray(
        attempts=3, num_cpus=max(4, threads * args.workers), include_dashboard=False, log_to_driver=False
    )
    try:
        llm = build_engine(engine_config(cfg), rollout_device(cfg), model)
        sp = sampling_params(cfg.rollout, rollout_device(cfg))
        group = RolloutGroup(cfg, model, num_workers=args.workers, num_cpus_per_worker=threads)
        actor_threads = {t["threads"] for t in group.threads()}
        if actor_threads != {threads}:
            raise RuntimeError(f"the engine actors run {actor_threads} torch threads, not {threads}")

        def raw() -> int:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            return sum(len(o.token_ids) for r in outs for o in r.outputs)

        def through_group() -> int:
            t = time.perf_counter()
            out = group.generate(prompts)
            # engine time inside the actor vs the caller's wall time: the group's own overhead
            engine_share.append(out[0][0].extra["generate_s"] / (time.perf_counter() - t))
            return sum(len(c.response_ids) for g in out for c in g)

        engine_share: list[float] = []

        raw(), through_group()  # warm-up
        rates: dict[str, list[float]] = {"raw": [], "group": []}
        for _ in range(args.reps):
            for name, fn in (("raw", raw), ("group", through_group)):
                t = time.perf_counter()
                toks = fn()
                rates[name].append(toks / (time.perf_counter() - t))
        group.shutdown()
    finally:
        ray.shutdown()

    raw_tps, group_tps = statistics.median(rates["raw"]), statistics.median(rates["group"])
    print(f"raw vllm.LLM.generate : {raw_tps:10.0f} tok/s  (runs: {[round(r) for r in rates['raw']]})")
    print(f"RolloutGroup.generate : {group_tps:10.0f} tok/s  (runs: {[round(r) for r in rates['group']]})")
    print(f"ratio group/raw       : {group_tps / raw_tps:.3f}")
    share = statistics.median(engine_share[1:])
    print(f"engine time / group wall time (1 - Ray and conversion overhead): {share:.3f}")
    print(
        json.dumps(
            {
                "bench": "rollout",
                "model_size": args.size,
                "prompts": args.prompts,
                "n": args.n,
                "threads": threads,
                "engine": args.engine,
                "max_tokens": args.max_tokens,
                "workers": args.workers,
                "raw_tok_s": round(raw_tps, 1),
                "group_tok_s": round(group_tps, 1),
                "engine_share_of_group_wall": round(share, 4),
                "ratio": round(group_tps / raw_tps, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
