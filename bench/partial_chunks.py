"""What partial rollouts cost when no weight update comes: one engine, the same batch generated three ways.

    .venv/bin/python bench/partial_chunks.py [--size small] [--prompts 8] [--n 8] [--tokens 256] [--chunk 8]

- `one`: one `LLM.generate` call (what `rollout.partial = false` does);
- `reprefill`: partial rollouts before #44's change (`generate_in_chunks` below) over `LLM.generate`: every
  `--chunk` tokens each unfinished sequence is a new request, its prompt + response so far prefilled again;
- `held`: `generate_held` over `rl_tpu.rollout.held.HeldRequests`: unfinished sequences stay in the engine
  between chunk calls (what `rollout.partial = true` does now);
- `held_update`: the same with the prefix cache reset as a weight install does (`reset_kv`) after every
  `--update-every` chunk calls: each reset preempts the held sequences, recomputed at the next call.

The demo's arithmetic chat prompts, each sampled `--n` times at temperature 1, every sequence forced to
`--tokens` tokens (ignore_eos), fp32, the run's default engine settings, `--threads` threads, in one
process; calls alternate (one, reprefill, held, one, ...), one warm-up each; best and median seconds of
`--reps`. The last line is one JSON object; `ratio` = reprefill's best / held's best, and
`reprefill_over_one`, `held_over_one` are each chunked form's overhead over one call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import arithmetic_chat_prompts, json_line, load_average  # noqa: E402


def generate_in_chunks(
    generate: Callable[..., list[list[Any]]],
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    chunk: int,
) -> list[list[Any]]:
    """Partial rollouts as they were before the engines held sequences (rl-tpu before #44's change, kept
    here as the baseline): per prompt, its `n` completions, `chunk` tokens per `generate` call, every
    later chunk a new request per unfinished sequence whose prompt is prompt + response so far."""
    groups = generate(prompts, n=n, max_tokens=min(chunk, max_tokens))
    done = min(chunk, max_tokens)
    active = [c for g in groups for c in g if _unfinished(c, min(chunk, max_tokens))]
    while active and done < max_tokens:
        budget = min(chunk, max_tokens - done)
        more = generate([c.prompt_ids + c.response_ids for c in active], n=1, max_tokens=budget)
        still = []
        for c, (k,) in zip(active, more, strict=True):
            c.token_versions = c.versions() + k.versions()
            c.response_ids += k.response_ids
            c.logprobs += k.logprobs
            c.finish_reason = k.finish_reason
            c.extra["stop_reason"] = k.extra.get("stop_reason")
            c.extra["generate_s"] = c.extra.get("generate_s", 0.0) + k.extra.get("generate_s", 0.0)
            if _unfinished(k, budget):
                still.append(c)
        active, done = still, done + budget
    return groups


def _unfinished(c: Any, budget: int) -> bool:
    return c.finish_reason == "length" and len(c.response_ids) >= budget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "mini", "small", "medium"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per sequence")
    ap.add_argument("--chunk", type=int, default=8, help="rollout.partial_chunk_tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--update-every", type=int, default=8, help="held_update: chunk calls between resets")
    ap.add_argument("--sides", default="one,reprefill,held,held_update")
    a = ap.parse_args()

    from rl_tpu.placement import apply_threads

    apply_threads(a.threads)  # before vLLM starts: it drops to 1 thread unless OMP_NUM_THREADS is set
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from rl_tpu.config import engine_config, load_config
    from rl_tpu.rollout.engine import build_engine, rollout_device, to_completions
    from rl_tpu.rollout.held import HeldRequests
    from rl_tpu.rollout.partial import generate_held
    from rl_tpu.tiny_model import make_tiny_model
    from rl_tpu.weight_sync.receiver import reset_kv

    load = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "model", size=a.size))
        tok = AutoTokenizer.from_pretrained(model)
        prompts = arithmetic_chat_prompts(tok, a.prompts)
        cfg = load_config(
            None,
            [
                f"--rollout.max_model_len={max(512, a.tokens + 128)}",
                f"--rollout.num_threads={a.threads}",
                "--model.dtype=float32",
                "--rollout.dtype=float32",
            ],
        )
        llm = build_engine(engine_config(cfg), rollout_device(cfg), model)

        def params(n: int, max_tokens: int) -> SamplingParams:
            return SamplingParams(
                n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False
            )

        def llm_generate(ps, n=1, max_tokens=1):
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], params(n, max_tokens), use_tqdm=False)
            return to_completions(outs, range(len(ps)), 0)

        held = HeldRequests(llm)
        calls = [0]

        def chunk_call(active, update_every=0):
            calls[0] += 1
            if update_every and calls[0] % update_every == 0:
                reset_kv(llm)  # what an install between two chunk calls ends with
            return held.chunk(
                [((c.prompt_index, c.sample_index), c.prompt_ids, c.response_ids) for c in active],
                params(1, a.tokens),
                a.chunk,
            )

        def count(groups) -> int:
            assert all(len(c.response_ids) == a.tokens for g in groups for c in g)
            return sum(len(c.response_ids) for g in groups for c in g)

        all_sides = {
            "one": lambda: count(llm_generate(prompts, n=a.n, max_tokens=a.tokens)),
            "reprefill": lambda: count(
                generate_in_chunks(llm_generate, prompts, n=a.n, max_tokens=a.tokens, chunk=a.chunk)
            ),
            "held": lambda: count(generate_held(chunk_call, prompts, n=a.n)),
            "held_update": lambda: count(
                generate_held(lambda s: chunk_call(s, a.update_every), prompts, n=a.n)
            ),
        }
        sides = {k: all_sides[k] for k in a.sides.split(",")}
        for f in sides.values():
            f()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in sides}
        tokens: dict[str, int] = {}
        for _ in range(a.reps):
            for k, f in sides.items():
                t = time.perf_counter()
                tokens[k] = f()
                times[k].append(time.perf_counter() - t)
    batch = a.prompts * a.n
    print(
        f"{a.size}, batch {batch} x {a.tokens} tokens, chunk {a.chunk}, held_update resets every "
        f"{a.update_every} calls, {a.threads} threads, "
        f"load {load:.2f} before"
    )
    out = {"bench": "partial_chunks", "size": a.size, "batch": batch, "tokens": a.tokens, "chunk": a.chunk}
    out["update_every"] = a.update_every
    out |= {"threads": a.threads, "load_before": load}
    for k, ts in times.items():
        best = min(ts)
        print(
            f"  {k:9s} best {best:7.2f} s  median {statistics.median(ts):7.2f} s  {tokens[k] / best:8.0f} tok/s"
        )
        out[k] = {"best_s": best, "median_s": statistics.median(ts), "tok_s": tokens[k] / best}
    best = {k: min(ts) for k, ts in times.items()}
    if "one" in best:
        for k in ("reprefill", "held", "held_update"):
            if k in best:
                out[f"{k}_over_one"] = best[k] / best["one"]
    if "reprefill" in best and "held" in best:
        out["ratio"] = best["reprefill"] / best["held"]
    out["load_after"] = load_average()
    print(" ".join(f"{k} {v:.2f}" for k, v in out.items() if k.endswith("_over_one") or k == "ratio"))
    print(json_line(out))


if __name__ == "__main__":
    main()
