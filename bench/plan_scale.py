"""Plan scale: can the driver plan weight sync for real model sizes? Seconds and driver peak RSS per case.

For Qwen3-8B, Qwen3-32B, Llama-3-70B, Qwen3-30B-A3B and Qwen3-235B-A22B (MoE) shapes, trainer FSDP 8
and 64 ranks (MoE also with expert parallelism 8: the experts `Shard(0)` over `ep`, FSDP2's
`_StridedShard(0)` over the other `efsdp` ranks, as TorchTitan lays them out) into one engine of TP 1, 4
and 8, this builds the plan the way `WeightSync.build` does on the driver:
TorchTitan's own state-dict adapter probed for the row map (`names.hf_row_map`; the MoE expert split is
written out in `weight_sync/plan_shapes.py`, mirroring `Qwen3StateDictAdapter`), then `plan.build_plan` and
every receiver's tables.
No weights are allocated. Engine layouts are synthetic: row-run tables written from vLLM's sharding
conventions (`synthetic_layouts`: fused qkv / gate_up narrowed by rows, o/down narrowed by columns, KV
heads replicated when TP exceeds them, vocab padded to 64 per rank, FusedMoE w13/w2) — the same tables a
real engine derives with its loaders; `tests/integration/test_weight_sync.py` checks them against real derived
layouts of a TP=2 vLLM-CPU engine. Each case runs in its own process; peak RSS is that process's VmHWM.

`--derive` also measures layout derivation on a real vLLM-CPU engine with a Qwen3-0.6B-shaped model
(random weights, built locally): time and extra peak RSS of the engine process during derivation, as a
fraction of the model's bytes in the engine.

Last line: one JSON object with `max_seconds`, `max_driver_rss_mib` over the cases (targets: <= 10 s,
<= 1024 MiB) and `layout_extra_fraction` (with --derive; target <= 0.25).

    python bench/plan_scale.py                 # all 42 plan cases
    python bench/plan_scale.py --derive        # plus derivation on a real engine (~0.6B, a few minutes)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from rl_tpu.weight_sync.plan_shapes import (
    PUBLISHED,
    model_shape,
    synthetic_layouts,
    titan_shapes,
    to_hf_for,
    trainer_spec,
)

# the published config.json values (rl_tpu.weight_sync.plan_shapes.PUBLISHED) under this bench's short names
MODELS = {
    name: model_shape(PUBLISHED[hub_id])
    for name, hub_id in (
        ("qwen3-8b", "Qwen/Qwen3-8B"),
        ("qwen3-32b", "Qwen/Qwen3-32B"),
        ("llama3-70b", "meta-llama/Meta-Llama-3-70B"),
        ("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B"),
        ("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B"),
    )
}
FSDP = (8, 64)
TP = (1, 4, 8)
EP = 8  # MoE models also run with trainer expert parallelism 8 (x FSDP 8 and 1 of the experts)
MIB = 2**20


def rss_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ---------------------------------------------------------------------------------------------- one case


def run_case(model: str, fsdp: int, tp: int, ep: int = 1) -> dict:
    from rl_tpu.weight_sync.installers import receiver_tables
    from rl_tpu.weight_sync.names import hf_row_map, hf_shapes
    from rl_tpu.weight_sync.plan import build_plan

    m = MODELS[model]
    specs = [trainer_spec(n, s, fsdp, ep) for n, s in titan_shapes(m).items()]
    to_hf = to_hf_for(m)
    hf_order = sorted(hf_shapes(specs, to_hf).items())
    layouts = synthetic_layouts(m, hf_order, tp)  # what the engine ranks would send back
    base = rss_peak_mib()
    t0 = time.perf_counter()
    row_map = hf_row_map(specs, to_hf)
    t_map = time.perf_counter() - t0
    plan = build_plan(specs, row_map, hf_order, layouts, 64 * MIB)
    senders = [plan.for_sender(r) for r in range(fsdp)]
    tables, rounds = receiver_tables(plan, 0)
    secs = time.perf_counter() - t0
    params = sum(math.prod(s.shape) for s in specs)
    return {
        "model": model,
        "fsdp": fsdp,
        "ep": ep,
        "tp": tp,
        "params_b": round(params / 1e9, 2),
        "seconds": round(secs, 2),
        "row_map_s": round(t_map, 2),
        "driver_rss_mib": round(rss_peak_mib(), 1),
        "rss_before_plan_mib": round(base, 1),
        "pieces": int(plan.pieces.shape[0]),
        "buckets": int(len(plan.buckets)),
        "gb": round(plan.nbytes / 1e9, 1),
        "sender_buckets_max": max(len(s) for s in senders),
        "rounds": len(rounds),
        "tables": len(tables),
    }


# ---------------------------------------------------------------------------------------------- derivation


def build_qwen3_06b(out: Path) -> Path:
    """A Qwen3-0.6B-shaped HF folder with random bf16 weights (no network)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from rl_tpu.tiny_model import make_tiny_model

    make_tiny_model(out, "qwen3", "tiny", 0)  # tokenizer files
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )
    cfg.save_pretrained(out)
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (151936, 1024), "model.norm.weight": (1024,)}
    for i in range(28):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (2048, 1024),
                p + "self_attn.k_proj.weight": (1024, 1024),
                p + "self_attn.v_proj.weight": (1024, 1024),
                p + "self_attn.o_proj.weight": (1024, 2048),
                p + "self_attn.q_norm.weight": (128,),
                p + "self_attn.k_norm.weight": (128,),
                p + "mlp.gate_proj.weight": (3072, 1024),
                p + "mlp.up_proj.weight": (3072, 1024),
                p + "mlp.down_proj.weight": (1024, 3072),
                p + "input_layernorm.weight": (1024,),
                p + "post_attention_layernorm.weight": (1024,),
            }
        )
    sd = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    save_file(sd, str(out / "model.safetensors"))
    return out


def run_derive(tmp: Path) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from rl_tpu.weight_sync import EngineReceiver
    from rl_tpu.weight_sync.names import checkpoint_shapes

    model = build_qwen3_06b(tmp / "qwen3-0.6b")
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        block_size=32,
        seed=0,
        worker_extension_cls="rl_tpu.rollout.worker_extension.WorkerExtension",
    )
    model_bytes = sum(math.prod(s) * 2 for s in checkpoint_shapes(model).values())
    Path("/proc/self/clear_refs").write_text("5")
    before = int(
        [x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:")][0].split()[
            1
        ]
    )
    hf_order = sorted(checkpoint_shapes(model).items())
    hf_order = [(n, s) for n, s in hf_order if n != "lm_head.weight"]
    t0 = time.perf_counter()
    (lay,) = EngineReceiver(llm).ws_derive(hf_order)
    secs = time.perf_counter() - t0
    extra = (rss_peak_mib() * 1024 - before) * 1024
    n_runs = sum(len(b) // 56 for b in lay["runs"].values())
    return {
        "model_mb": round(model_bytes / MIB),
        "derive_s": round(secs, 1),
        "extra_peak_mb": round(extra / MIB),
        "layout_extra_fraction": round(extra / model_bytes, 3),
        "engine_params": len(lay["runs"]),
        "runs": n_runs,
    }


# ---------------------------------------------------------------------------------------------- main


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"plan_scale child {args} failed (rc {out.returncode})")
    return json.loads(line[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument(
        "--derive", action="store_true", help="also derive a layout on a real vLLM-CPU engine (~0.6B)"
    )
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case == "derive":
        import tempfile

        print("RESULT " + json.dumps(run_derive(Path(tempfile.mkdtemp(prefix="plan_scale_")))))
        return
    if a.case:
        model, fsdp, tp, ep = a.case.split(":")
        print("RESULT " + json.dumps(run_case(model, int(fsdp), int(tp), int(ep))))
        return
    rows = []
    print(
        f"{'model':15} {'params':>7} {'fsdp':>4} {'ep':>2} {'tp':>2} {'seconds':>7} {'row map':>7} {'RSS MiB':>8} "
        f"{'pieces':>8} {'buckets':>7}"
    )
    for model in a.models.split(","):
        eps = (1, EP) if "experts" in MODELS[model] else (1,)
        for fsdp, ep in [(f, e) for e in eps for f in FSDP if f % e == 0]:
            for tp in TP:
                r = _child(["--case", f"{model}:{fsdp}:{tp}:{ep}"])
                rows.append(r)
                print(
                    f"{model:15} {r['params_b']:6.1f}B {fsdp:4} {ep:2} {tp:2} {r['seconds']:7.2f} "
                    f"{r['row_map_s']:7.2f} {r['driver_rss_mib']:8.0f} {r['pieces']:8} {r['buckets']:7}",
                    flush=True,
                )
    result = {
        "bench": "plan_scale",
        "max_seconds": max(r["seconds"] for r in rows),
        "max_driver_rss_mib": max(r["driver_rss_mib"] for r in rows),
        "cases": rows,
    }
    if a.derive:
        d = _child(["--case", "derive"])
        print(
            f"\nlayout derivation, real vLLM-CPU engine, Qwen3-0.6B shape (bf16, {d['model_mb']} MB): "
            f"{d['derive_s']} s, extra peak {d['extra_peak_mb']} MB = {d['layout_extra_fraction']} of the model"
        )
        result["layout_extra_fraction"] = d["layout_extra_fraction"]
        result["derive"] = d
    result["ratio"] = (
        result["max_seconds"] / 10.0
    )  # headline: share of the 10 s budget used by the worst case
    print(json.dumps(result))


if __name__ == "__main__":
    main()
