"""Our GRPO step against the raw parts it is made of, side by side in one run.

    .venv/bin/python bench/overhead.py                 # vs_trl's workload: Qwen3 small, 8 x 8 x 64, 6 steps
    .venv/bin/python bench/overhead.py --size tiny --steps 3 --max-tokens 16

(a) ours: `rl-tpu train` with exactly the overrides `bench/vs_trl.py` gives our side (same model, prompts,
    sampling, batch, loss, engine compiled or not (`--engine`), `--threads` CPU threads, `--world-size`
    FSDP2 ranks), timed from its
    `metrics.jsonl`: `time/step` and its phases `time/rollout` (generation + reward), `time/train`
    (advantages + update), `time/sync` (weights into the engine) and the rest.
(b) raw parts, back to back in one process with the same thread count (`OMP_NUM_THREADS`, which vLLM
    keeps): `vllm.LLM.generate` (in-process engine, the same sampling parameters and prompts), then a
    TorchTitan forward/backward/AdamW step on those tokens with the same PPO-clip loss and micro-batches
    (the bare TorchTitan model: no FSDP, no Ray; its linears on the same kernels as ours, `trainer.cpu_matmul`),
    then the new weights into the engine through vLLM's own loader (its layerwise reload fed the full HF
    state dict: the plain copy a user without resharding would do). Advantages are group-normalised random
    scores (rewards cost ~5 ms in (a)).

Both run steps 1..N; step 1 is warm-up and the median of steps 2..N is reported. `ratio` = ours s/step ÷
raw s/step (1.0: no overhead of ours beyond the parts; the issue's target is ≤ 1.15), with the per-phase
breakdown of both. Each side runs in its own subprocess, one after the other; the load average before
and after each is printed. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_workload_args, check_workload_args, json_line, load_average, median, run_measured  # noqa: E402
from vs_trl import ours_overrides, read_jsonl  # noqa: E402

PHASES = ("rollout", "train", "sync")


def _reload_weights(worker, hf_sd: dict) -> None:
    """vLLM's own path for new weights: its layerwise reload fed the full HF state dict (runs in the worker)."""
    import torch

    from rl_tpu.weight_sync import vllm_compat

    model = vllm_compat.model(worker)
    with vllm_compat.current_config(worker), torch.no_grad():
        vllm_compat.begin_reload(model)
        model.load_weights(iter(hf_sd.items()))
        vllm_compat.finish_reload(model, worker.vllm_config.model_config)


def raw_worker(a: argparse.Namespace) -> None:
    """(b): the parts, one process, `a.threads` threads. Prints one `RAW {json}` line per step."""
    import torch
    from transformers import AutoTokenizer

    from rl_tpu.algorithms.losses import compute_policy_loss
    from rl_tpu.config import engine_config, load_config
    from rl_tpu.data.loader import PromptLoader, build_datasets, encode_prompts
    from rl_tpu.rollout.engine import build_engine, rollout_device, sampling_params
    from rl_tpu.trainer import cpu_matmul, ops
    from rl_tpu.trainer import model as tmodel
    from rl_tpu.types import TrainBatch

    torch.set_num_threads(a.threads)
    cfg = load_config(None, ours_overrides(a, a.model, "sync", str(a.workdir / "raw-unused")))
    tok = AutoTokenizer.from_pretrained(a.model)
    train_set, _ = build_datasets(cfg.data)
    loader = PromptLoader(train_set, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    llm = build_engine(engine_config(cfg), rollout_device(cfg), a.model)
    sp = sampling_params(cfg.rollout, rollout_device(cfg))

    spec = tmodel.build_model_spec(a.model)
    with torch.device("cpu"):
        titan = spec.config.build()
    titan.init_weights(buffer_device=torch.device("cpu"))
    titan.load_state_dict(tmodel.hf_to_titan(spec, tmodel.load_hf_state_dict(a.model)))
    titan.train()
    tc = cfg.trainer
    cpu_matmul.install_mode(titan, tc.cpu_matmul)  # the same matmul kernels as ours
    opt = torch.optim.AdamW(titan.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    g = torch.Generator().manual_seed(a.seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        prompts = encode_prompts(tok, next(loader), cfg.data.max_prompt_length)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        t1 = time.perf_counter()
        P = [list(o.prompt_token_ids) for o in outs for _ in o.outputs]
        R = [list(c.token_ids) for o in outs for c in o.outputs]
        scores = torch.randn(len(outs), cfg.rollout.n, generator=g)
        adv = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).flatten()
        batch = TrainBatch.from_sequences(P, R, pad_id=pad, advantages=adv.tolist())
        tokens = float(batch.response_mask.sum())
        for rows in torch.arange(batch.num_seqs).split(tc.micro_batch_size):
            mb = batch.select(rows)
            logits = titan(mb.input_ids)  # [b, L, V]
            hidx, tidx = ops.response_index(mb.prompt_lens, mb.response_len, mb.input_ids.shape[1])
            lp = logits.gather(1, hidx[..., None].expand(-1, -1, logits.shape[-1])).float().log_softmax(-1)
            lp = lp.gather(-1, mb.input_ids.gather(1, tidx)[..., None])[..., 0]
            loss, _ = compute_policy_loss(
                cfg.algorithm, lp, lp.detach(), mb.advantages, mb.response_mask, global_tokens=tokens
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(titan.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        hf_sd = tmodel.titan_to_hf(spec, {k: v.detach() for k, v in titan.state_dict().items()})
        llm.collective_rpc(_reload_weights, args=(hf_sd,))
        t3 = time.perf_counter()
        print(
            "RAW "
            + json.dumps(
                {
                    "step": step,
                    "time/rollout": t1 - t0,
                    "time/train": t2 - t1,
                    "time/sync": t3 - t2,
                    "time/step": t3 - t0,
                    "tokens": sum(map(len, R)),
                }
            ),
            flush=True,
        )


def summarize(rows: list[dict]) -> dict:
    """Median over steps 2..N of the step and each phase; `other` = step minus the phases."""
    rows = [r for r in rows if r["step"] >= 2] or rows
    out = {k: median([r[f"time/{k}"] for r in rows]) for k in ("step",) + PHASES}
    out["other"] = median([r["time/step"] - sum(r[f"time/{p}"] for p in PHASES) for r in rows])
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(
        p,
        threads_help="CPU threads, both sides",
        engine_help="vLLM engine on both sides: compiled (rollout.enforce_eager=false) or eager",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    check_workload_args(p, a)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        raw_worker(a)
        return 0
    from rl_tpu.tiny_model import make_tiny_model

    a.workdir = Path(a.workdir or tempfile.mkdtemp(prefix="overhead_")).resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    a.model = str(make_tiny_model(a.workdir / "model", "qwen3", a.size, seed=a.seed))
    print(
        f"overhead: Qwen3 {a.size}, {a.prompts} prompts x {a.n} samples x {a.max_tokens} tokens, {a.steps} steps "
        f"(step 1 = warm-up), {a.threads} threads; work dir {a.workdir}",
        flush=True,
    )

    loads = {"ours": [load_average()]}
    run_dir = a.workdir / "ours"
    res = run_measured(
        [
            sys.executable,
            "-m",
            "rl_tpu.commands.cli",
            "train",
            *ours_overrides(a, a.model, "sync", str(run_dir)),
        ],
        a.workdir / "ours.log",
        timeout=a.timeout,
        interval=None,
    )  # no memory sampling: it taxes our Ray tree
    loads["ours"].append(load_average())
    ours_rows = read_jsonl(run_dir / "metrics.jsonl")
    if res.returncode != 0 or len(ours_rows) < 2:
        print(
            f"OUR SIDE FAILED (exit {res.returncode}); log {a.workdir / 'ours.log'}:\n" + "\n".join(res.tail)
        )
        return 1

    loads["raw"] = [load_average()]
    env = os.environ | {"OMP_NUM_THREADS": str(a.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    argv_raw = [
        sys.executable,
        __file__,
        "--worker",
        "--model",
        a.model,
        "--workdir",
        str(a.workdir),
        *(
            f"--{k.replace('_', '-')}={getattr(a, k)}"
            for k in (
                "prompts",
                "n",
                "max_tokens",
                "steps",
                "lr",
                "threads",
                "world_size",
                "micro_batch",
                "seed",
                "train_size",
                "engine",
            )
        ),
    ]
    res = run_measured(argv_raw, a.workdir / "raw.log", env=env, timeout=a.timeout, interval=None)
    loads["raw"].append(load_average())
    log = (a.workdir / "raw.log").read_text(errors="replace").splitlines()
    raw_rows = [json.loads(x[4:]) for x in log if x.startswith("RAW ")]
    if res.returncode != 0 or len(raw_rows) < 2:
        print(
            f"RAW SIDE FAILED (exit {res.returncode}); log {a.workdir / 'raw.log'}:\n" + "\n".join(res.tail)
        )
        return 1

    ours, raw = summarize(ours_rows), summarize(raw_rows)
    print(f"\n{'phase':<10}{'ours s':>10}{'raw s':>10}{'ours/raw':>10}")
    for k in ("step",) + PHASES + ("other",):
        r = ours[k] / raw[k] if raw[k] > 1e-9 else float("nan")
        print(f"{k:<10}{ours[k]:>10.3f}{raw[k]:>10.3f}{r:>10.2f}")
    ratio = ours["step"] / raw["step"]
    print(f"ratio (ours s/step / raw parts s/step): {ratio:.3f}   (target <= 1.15)")
    print(
        "load average (1 min) before/after: "
        + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}" for k, v in loads.items())
        + (
            "  WARNING: above the core count, timings skewed"
            if max(max(v) for v in loads.values()) > (os.cpu_count() or 1)
            else ""
        )
    )
    print(
        json_line(
            {
                "bench": "overhead",
                "size": a.size,
                "prompts": a.prompts,
                "n": a.n,
                "max_tokens": a.max_tokens,
                "steps": a.steps,
                "threads": a.threads,
                "world_size": a.world_size,
                "engine": a.engine,
                "ratio": round(ratio, 3),
                "ours": {k: round(v, 3) for k, v in ours.items()},
                "raw": {k: round(v, 3) for k, v in raw.items()},
                "load_avg": loads,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
