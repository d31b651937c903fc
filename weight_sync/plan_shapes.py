"""Meta shapes of real model sizes and synthetic engine layouts: weight sync planned without weights.

Used by `rl-tpu estimate` (rl_tpu/commands/estimate.py) and `bench/plan_scale.py`; nothing here allocates a weight.

- `PUBLISHED`: the `config.json` values of the recipe models (examples/recipes/) as published on their
  Hugging Face model cards' config.json files (Qwen/Qwen3-8B, Qwen/Qwen3-32B, Qwen/Qwen3-30B-A3B,
  Qwen/Qwen3-235B-A22B, meta-llama/Meta-Llama-3-70B), for hub ids with no local copy. Only the keys the
  shapes need are kept; `head_dim` is hidden / heads where the file has none (Llama 3).
- `model_shape(hf)`: an HF config dict -> the flat shape dict the functions below take.
- `titan_shapes`: TorchTitan parameter names and global shapes of that model (names from the adapters'
  tables; tests/integration/test_estimate.py checks them against a built tiny trainer).
- `to_hf_for`: TorchTitan's own state-dict adapter's `to_hf` (dense Qwen3, Llama 3); for MoE its expert
  split written out, mirroring `Qwen3StateDictAdapter`.
- `synthetic_layouts`: vLLM's loaded layout of every TP rank as row-run tables, written from vLLM's sharding
  conventions (fused qkv / gate_up narrowed by rows, o/down narrowed by columns, KV heads replicated when
  TP exceeds them, vocab padded to 64 then split, FusedMoE w13/w2): the same tables a real engine derives
  with its loaders; `tests/integration/test_weight_sync.py` checks them against real derived layouts of a TP=2
  vLLM-CPU engine.
- `trainer_spec`: the `ParamSpec` a trainer rank reports (FSDP2 `Shard(0)`, or TorchTitan's sparse mesh for
  experts under expert parallelism).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from rl_tpu.errors import ModelError

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, tie_word_embeddings=False)
PUBLISHED: dict[str, dict] = {
    "Qwen/Qwen3-8B": dict(
        _QWEN3,
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=12288,
    ),
    "Qwen/Qwen3-32B": dict(
        _QWEN3,
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=25600,
    ),
    "meta-llama/Meta-Llama-3-70B": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-30B-A3B": dict(
        _QWEN3,
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "Qwen/Qwen3-235B-A22B": dict(
        _QWEN3,
        model_type="qwen3_moe",
        hidden_size=4096,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        intermediate_size=12288,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
    ),
}
PUBLISHED["meta-llama/Meta-Llama-3-70B-Instruct"] = PUBLISHED["meta-llama/Meta-Llama-3-70B"]


def model_shape(hf: dict) -> dict:
    """The shape dict of an HF `config.json` (qwen3, llama, qwen3_moe with every layer sparse)."""
    mt = hf.get("model_type")
    if mt not in ("qwen3", "llama", "qwen3_moe"):
        raise ModelError(f"model_type {mt!r}: the estimate knows qwen3, llama and qwen3_moe")
    heads = hf["num_attention_heads"]
    m = dict(
        arch="llama" if mt == "llama" else "qwen3",
        hidden=hf["hidden_size"],
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        inter=hf["intermediate_size"],
        vocab=hf["vocab_size"],
        tie=bool(hf.get("tie_word_embeddings", False)),
    )
    if mt == "qwen3_moe":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ModelError(
                "qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step): not estimated"
            )
        m.update(
            experts=hf.get("num_experts", hf.get("num_local_experts")),
            top_k=hf["num_experts_per_tok"],
            moe_inter=hf["moe_intermediate_size"],
        )
    return m


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


def synthetic_layouts(m: dict, hf_order: list, tp: int, dtype: str = "bfloat16") -> list:
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
        out.append(((0, r), EngineLayout(tp_rank=r, tp_size=tp, dtype=dtype, shapes=shapes, runs=runs)))
    return out


def trainer_spec(name: str, shape: tuple[int, ...], fsdp: int, ep: int, dtype: str = "bfloat16"):
    """The ParamSpec a trainer rank reports: FSDP2 `Shard(0)` over all ranks, or, for an expert tensor
    under expert parallelism, TorchTitan's sparse mesh (`efsdp` x `ep`, row-major over the ranks)."""
    from rl_tpu.weight_sync.specs import ParamSpec

    if ep > 1 and "inner_experts" in name:
        return ParamSpec(
            name=name,
            shape=shape,
            dtype=dtype,
            mesh_shape=(fsdp // ep, ep),
            mesh_dim_names=("efsdp", "ep"),
            placements=(f"_S(0, {ep})", "S(0)"),
            mesh_ranks=tuple(range(fsdp)),
        )
    return ParamSpec(
        name=name,
        shape=shape,
        dtype=dtype,
        mesh_shape=(fsdp,),
        mesh_dim_names=("fsdp",),
        placements=("Shard(dim=0)",),
    )
