"""Where a trainer step's time goes, by operator, and the most any compiler could gain on it.

    .venv/bin/python bench/trainer_profile.py [--size small] [--mode eager] [--batch 64] [--micro-batch-size 16]

Two trainer ranks (TorchTitan, FSDP2 or SimpleFSDP over gloo, one thread each: the shape of
`bench/trainer.py --world-size 2`) train on the same random batch; after `--warmup` steps rank 0 runs one
step under `torch.profiler` and sorts the operators' own CPU time into four classes:

- matmul: aten's `mm` / `addmm` / `bmm` and oneDNN's linears (the GEMMs: a compiler calls the same
  kernels, it does not make them faster);
- attention: the SDPA kernels, forward and backward (likewise library kernels);
- collective: FSDP's all-gathers and reduce-scatters and gloo's own ops (time in the collectives,
  waiting for the other rank included);
- other: everything else (elementwise ops, copies, norms, the optimizer's update, Python, autograd).

`ceiling` = step / (matmul + attention + collective): the speedup of a compiler that made every "other"
operator free and left the library kernels and collectives as they are (Amdahl's bound for
`trainer.mode = "compile"` or "graph" on this workload). It is an upper bound: fusion removes memory
traffic and launches, not all of "other". The last line is one JSON object with the shares and `ceiling`.
The profiler's own overhead shows as the gap between `step_s_profiled` and `step_s`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import json_line, load_average  # noqa: E402

CLASSES = {  # first match wins, in this order
    "matmul": re.compile(r"^aten::(mm|addmm|bmm|baddbmm)$|mkldnn::|onednn"),
    "attention": re.compile(r"scaled_dot_product|flash_attention|efficient_attention"),
    "collective": re.compile(r"^FSDP::|gloo|c10d::|all_gather|reduce_scatter|all_reduce|wait_tensor"),
}


def classify(rows: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds of own CPU time per class over (operator name, microseconds) rows."""
    out = dict.fromkeys([*CLASSES, "other"], 0.0)
    for name, us in rows:
        cls = next((c for c, rx in CLASSES.items() if rx.search(name)), "other")
        out[cls] += us / 1e6
    return out


def _rank(rank: int, path: str, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rl_tpu.config import load_config
    from rl_tpu.trainer.worker import TrainerWorker
    from trainer import make_batch

    overrides = [
        "--trainer.num_threads=1",
        f"--trainer.micro_batch_size={args.micro_batch_size}",
        f"--trainer.mode={args.mode}",
        *(["--trainer.fsdp=simple"] if args.mode == "graph" else []),
        *args.override,
    ]
    cfg = load_config(None, overrides)
    w = TrainerWorker(cfg, path, rank, 2, "127.0.0.1", port)
    vocab = int(w.spec.hf_config["vocab_size"])
    batch = make_batch(vocab, args.batch, args.prompt_len, args.response_len, group_size=args.group_size)
    for _ in range(args.warmup):
        w.train_step(batch, cfg.algorithm)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        w.train_step(batch, cfg.algorithm)
    profiled = time.perf_counter() - t0
    t0 = time.perf_counter()
    w.train_step(batch, cfg.algorithm)
    plain = time.perf_counter() - t0
    if rank == 0:
        rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        Path(out).write_text(json.dumps({"rows": rows, "profiled": profiled, "plain": plain}))
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "mini", "small", "medium"])
    ap.add_argument("--mode", default="eager", choices=["eager", "compile", "graph"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=36)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2, help="steps before the profiled one (compiles, heap)")
    ap.add_argument("--override", action="append", default=[], metavar="--trainer.KEY=VALUE")
    ap.add_argument("--top", type=int, default=15, help="operators listed by own time")
    args = ap.parse_args()

    import torch.multiprocessing as mp

    from rl_tpu.devices import cpu_process_env, get_device
    from rl_tpu.tiny_model import make_tiny_model

    get_device("cpu").apply_env()  # the environment a trainer rank gets from TrainerGroup
    os.environ.update(cpu_process_env())
    load = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(Path(tmp) / "model", size=args.size))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = str(Path(tmp) / "profile.json")
        mp.spawn(_rank, args=(path, port, args, out), nprocs=2, join=True)
        got = json.loads(Path(out).read_text())
    rows = [(k, us) for k, us in got["rows"]]
    classes = classify(rows)
    total = sum(classes.values())
    print(
        f"{args.size}, mode {args.mode}, 2 ranks x 1 thread, batch {args.batch} x {args.prompt_len}+"
        f"{args.response_len} tokens, micro-batch {args.micro_batch_size}; load {load:.2f} before"
    )
    print(
        f"step {got['plain']:.3f} s ({got['profiled']:.3f} s profiled); rank 0's own CPU time {total:.3f} s:"
    )
    for c, sec in classes.items():
        print(f"  {c:10s} {sec:8.3f} s  {sec / total:6.1%}")
    fixed = total - classes["other"]
    ceiling = total / fixed if fixed > 0 else float("inf")
    print(f"ceiling (all 'other' free): {ceiling:.2f}x")
    print("top operators by own time:")
    for name, us in sorted(rows, key=lambda r: -r[1])[: args.top]:
        print(f"  {us / 1e3:9.1f} ms  {name}")
    print(
        json_line(
            {
                "size": args.size,
                "mode": args.mode,
                "step_s": got["plain"],
                "step_s_profiled": got["profiled"],
                **{f"share_{c}": sec / total for c, sec in classes.items()},
                "ceiling": ceiling,
                "load_before": load,
            }
        )
    )


if __name__ == "__main__":
    main()
