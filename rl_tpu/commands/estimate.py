"""`rl-tpu estimate RECIPE`: per-device memory of the trainer and the engines, and the weight-sync plan,
from meta shapes (no weights, no Ray, no device): will this recipe fit the hardware it names?

What is counted, per device (bytes; GiB = 2**30):
- Trainer rank (the largest one; FSDP2 chunks dim 0 with torch.chunk sizes, so rank 0 holds the most):
  parameters, gradients and AdamW state of the policy as the trainer keeps them (trainer/parallel.py,
  trainer/optim.py): the sharded parameters stay float32 whatever `trainer.param_dtype` is (FSDP2 mixed
  precision casts a gathered copy for compute; the fp32 shard *is* the master copy, there is no second
  one), the sharded gradients are float32, AdamW keeps exp_avg and exp_avg_sq (float32, the parameter's
  size each) and a float32 `step` scalar per parameter tensor. Each parameter's local rows come from
  `weight_sync.plan.owners` (DTensor's chunking, experts under expert parallelism included), so
  these three are exact; tests/integration/test_estimate.py checks them against a built tiny trainer. A frozen
  reference (`trainer.reference`) adds its parameters, a critic (`trainer.critic`) its own three.
- FSDP buffers: with `trainer.fsdp_step` resolving to "replicated" (auto: <= 500M parameters) the whole
  model's gathered parameters and unsharded gradients in the compute dtype stay for the step; otherwise
  two gathered units (the one computing, the one prefetched) and one unsharded gradient unit.
- Activations of one micro-batch (`trainer.micro_batch_size` rows of the longest sequence a step can bring:
  `data.max_prompt_length` + the response budget, as trainer preflight runs it), under the chosen
  `trainer.activation_checkpoint` (`_checkpointed_elems`): "full" keeps each block's input only;
  "selective" (TorchTitan's SelectiveAC) keeps the block's input and the outputs of the ops its policy
  saves: every other matmul (wq, wv, w1, w2 in a block's order) and attention (output and fp32
  log-sum-exp) off CPU, where the policy's op list names the device's SDPA kernel (CPU's is
  recomputed), the rest recomputed. Without checkpointing the model counts the tensors autograd keeps per token
  of each decoder layer (`_activation_elems`), read off what it saves in TorchTitan's Qwen3 on CPU in fp32
  and bf16: per RMSNorm its fp32 input copy and x * rstd and its output in the compute dtype; Qwen3's q
  and k in fp32 from their norms on (projection output, x * rstd, after RoPE, and the attention output),
  v, and wo's input; the SwiGLU intermediates (4 x intermediate; MoE: each token's top_k experts'
  4 x moe_intermediate and its routed copy in and out, the router's fp32 scores); FlashAttention-style
  SDPA (no T x T matrix); plus the final norm and the log-prob head's input over the response tokens.
  Llama 3's attention (no q/k norm) is counted as q, k after RoPE, v, output and wo's copy.
  Shared prompts (`trainer.share_prompts`) only shorten rows, so this is an upper bound for them.
  tests/integration/test_estimate.py compares it with the saved bytes of the tiny model's real forward.
- Engine TP rank: weights in the engine dtype from vLLM's layout per rank (`plan_shapes.synthetic_layouts`:
  vocab padded, KV heads replicated when TP exceeds them), and the KV cache its memory setting leaves:
  `rollout.kv_cache_gb` on CPU, else `rollout.gpu_memory_utilization` x device memory - weights - a
  fixed 1 GiB for vLLM's activations and runtime (an assumption, not measured).
- Sync: the plan `WeightSync.build` would make (`weight_sync.plan.build_plan` over the trainer's specs and
  synthetic engine layouts, `sync.bucket_mb` buckets), its bytes and buckets per sync, and its time at
  `--bandwidth-gbps` (GB/s per sender and per receiver link, links in parallel: the busiest link's bytes
  over that bandwidth; the per-iteration plan execution only, not plan building).
- LoRA (`trainer.lora.rank > 0`): the adapters (A `[rank, in]`, B `[out, rank]` per target linear,
  FSDP-sharded) join the parameters; gradients and AdamW state are the adapters' only; activations add
  each adapter's `[tokens, rank]` input to B; the engine adds one LoRA slot (the rank rounded up to one
  vLLM serves, x (in + out) per adapted linear, engine dtype); the sync is the adapter's fp32 bytes to
  every engine (no plan). tests/integration/test_estimate.py checks the trainer side against a built one.
- Fit: disaggregated (TPU, TP > 1 engines, async) = trainer peak <= device memory and an engine's
  KV cache holds at least one `rollout.max_model_len` sequence; colocated (a TP-1 engine sharing each
  trainer rank's GPU, sleeping while it trains) = trainer peak <= device memory and trainer's resident
  state + the engine's share <= device memory. Devices needed: world_size + engines x TP, or
  max(world_size, engines) colocated.

Model shapes: the model folder's config.json when `model.path` is a local folder; a hub id in
`plan_shapes.PUBLISHED` takes the published config.json values; another source (a catalog name, a GGUF
file, a Hub id in the local cache) its resolved folder's (rl_tpu/model_source.py); an empty path is the
tiny model of `model.arch` / `model.size`. The named hardware: `--hardware`, else the recipe file's name
(`...-v5p.toml`), else the device's default (below).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rl_tpu.config import Config, resolved_dtype, response_budget
from rl_tpu.errors import UserError

GIB = 2**30
# Memory per device. TPU v5p: 95 GiB HBM per chip, TPU v6e: 32 GiB HBM per chip (Google Cloud TPU docs,
# "TPU v5p" and "TPU v6e" system architecture pages, cloud.google.com/tpu/docs/v5p and /v6e); H100 SXM:
# 80 GB HBM3 (NVIDIA H100 Tensor Core GPU datasheet), counted as 80 GiB as nvidia-smi reports about it.
HARDWARE = {"v5p": 95 * GIB, "v6e": 32 * GIB, "h100": 80 * GIB}
# devices of one host: a v5p VM holds 4 chips, a v6e host 8, an H100 node 8 GPUs. An engine runs on one
# host (its TP ranks are processes there: vLLM's `mp` backend, never Ray inside the rollout actor), so
# its TP size must fit in it; a trainer group may span hosts
HOST_DEVICES = {"v5p": 4, "v6e": 8, "h100": 8}
DEFAULT_HARDWARE = {"tpu": "v5p", "xla": "v5p", "cuda": "h100"}  # cpu: this host's RAM
ENGINE_RUNTIME_BYTES = 1 * GIB  # vLLM's activations, sampler and runtime besides weights and KV (assumed)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_ACCELERATOR = {"cpu": None, "xla": None, "cuda": "GPU", "tpu": "TPU"}  # Ray resource (placement.py)


class EstimateError(UserError, ValueError):
    """A recipe the estimate cannot size (unknown model, unknown hardware)."""


# ---------------------------------------------------------------------------------------------- model


def hf_config(cfg: Config) -> tuple[dict, str]:
    """The model's config.json values and where they came from."""
    from rl_tpu.weight_sync.plan_shapes import PUBLISHED

    path = cfg.model.path
    if not path:
        from rl_tpu.tiny_model import SIZES, build_config

        hf = build_config(cfg.model.arch, cfg.model.size, SIZES[cfg.model.size]["vocab_size"], 2, 3)
        return hf.to_dict(), f"the built-in {cfg.model.size} {cfg.model.arch} model (rl_tpu.tiny_model)"
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text()), str(local)
    if path in PUBLISHED:
        return dict(
            PUBLISHED[path]
        ), f"published config.json of {path} (rl_tpu.weight_sync.plan_shapes.PUBLISHED)"
    from rl_tpu.errors import ModelError
    from rl_tpu.model_source import resolve_model_path

    try:  # a catalog name, a GGUF file, or a Hub id in the local cache
        local = Path(resolve_model_path(path)) / "config.json"
    except ModelError as e:
        raise EstimateError(f"{e}; or one of the built-in models ({', '.join(sorted(PUBLISHED))})") from None
    return json.loads(local.read_text()), f"{local} ({path})"


def _activation_elems(m: dict) -> tuple[int, int]:
    """(compute-dtype elements, fp32 elements) autograd keeps per token per decoder layer (module doc)."""
    D, q, kv = m["hidden"], m["heads"] * m["head_dim"], m["kv"] * m["head_dim"]
    # two RMSNorms: input and x * rstd in fp32 (TorchTitan normalises in fp32), output (the linears' input)
    compute, fp32 = 2 * D, 4 * D + 2
    if m["arch"] == "qwen3":  # q, k through their fp32 norms: projection out, x * rstd, after RoPE; v; and
        fp32 += 4 * q + 4 * kv + m["heads"] + m["kv"]  # the attention output, wo's copy in compute dtype
        compute += q
    else:  # Llama 3: q, k after RoPE, v, the attention output and wo's copy
        compute += 3 * q + 2 * kv
    if "experts" in m:  # per token: top_k routed copies in and out, 4 x moe width each; fp32 router scores
        k = m["top_k"]
        return compute + k * (4 * m["moe_inter"] + 2 * D), fp32 + 2 * m["experts"]
    return compute + 4 * m["inter"], fp32  # SwiGLU: w1 out, w3 out, silu(w1 out), their product


def _checkpointed_elems(m: dict, policy: str, saves_attention: bool) -> tuple[int, int]:
    """(compute-dtype, fp32) elements a checkpointed block keeps per token (module doc): "full" its input;
    "selective" also q (wq), v (wv), w1's output and w2's (TorchTitan's SelectiveAC saves every other
    matmul, counted in forward order) and, where its policy saves the device's attention op
    (`saves_attention`: CUDA's flash / efficient SDPA; not CPU's `_scaled_dot_product_flash_attention_for_cpu`,
    which it recomputes), the attention output and its per-head log-sum-exp."""
    D, q, kv = m["hidden"], m["heads"] * m["head_dim"], m["kv"] * m["head_dim"]
    if policy == "full":
        return D, 0
    if not saves_attention:
        return D + q + kv + m["inter"] + D, 0
    return D + q + kv + q + m["inter"] + D, m["heads"]


# ---------------------------------------------------------------------------------------------- trainer


def _local_numel(spec) -> dict[int, int]:
    """Trainer rank -> elements of `spec` it holds (DTensor chunking, `plan.owners`)."""
    from rl_tpu.weight_sync.plan import owners
    from rl_tpu.weight_sync.rows import rows_cols

    cols = rows_cols(spec.shape)[1]
    out: dict[int, int] = {}
    for rank, lo, hi in owners(spec):
        out[rank] = out.get(rank, 0) + (hi - lo) * cols
    return out


def _per_rank(specs: list, ws: int) -> list[int]:
    """Elements each trainer rank holds of `specs`."""
    out = [0] * ws
    for s in specs:
        for r, n in _local_numel(s).items():
            out[r] += n
    return out


# HF name of a LoRA target -> the TorchTitan parameter (its last segments) that gets the adapter
LORA_PARAMS = {
    "q_proj": "qkv_linear.wq.weight",
    "k_proj": "qkv_linear.wk.weight",
    "v_proj": "qkv_linear.wv.weight",
    "o_proj": "attention.wo.weight",
    "gate_proj": "feed_forward.w1.weight",
    "up_proj": "feed_forward.w3.weight",
    "down_proj": "feed_forward.w2.weight",
}


def adapter_specs(cfg: Config, specs: list) -> list:
    """The LoRA adapters' specs under `trainer.lora` (A `[rank, in]`, B `[out, rank]` per target linear
    of every decoder layer, FSDP2-sharded like the rest; MoE experts have none); [] without LoRA."""
    import dataclasses

    lc = cfg.trainer.lora
    if not lc.rank:
        return []
    wanted = tuple(LORA_PARAMS[t] for t in lc.targets)
    out = []
    for s in specs:
        if s.name.startswith("layers.") and s.name.endswith(wanted):
            prefix = s.name.removesuffix(".weight")
            out.append(dataclasses.replace(s, name=f"{prefix}.lora_a.weight", shape=(lc.rank, s.shape[1])))
            out.append(dataclasses.replace(s, name=f"{prefix}.lora_b.weight", shape=(s.shape[0], lc.rank)))
    return out


def trainer_memory(cfg: Config, m: dict, specs: list) -> dict:
    """Bytes per trainer rank (the largest), by kind; see the module docstring."""
    import dataclasses

    from rl_tpu.trainer.parallel import replicated_step

    tc = cfg.trainer
    ws = tc.world_size
    adapters = adapter_specs(cfg, specs)
    per_rank = _per_rank(specs + adapters, ws)
    rank = max(range(ws), key=per_rank.__getitem__)
    local = per_rank[rank]
    compute = DTYPE_BYTES[resolved_dtype(tc.param_dtype, cfg)]
    total = sum(math.prod(s.shape) for s in specs)
    trained = adapters or specs  # under LoRA only the adapters have gradients and AdamW state
    trained_local = _per_rank(trained, ws)[rank]
    out = {
        "rank": rank,
        "params": 4 * local,
        "grads": 4 * trained_local,
        "optimizer": 8 * trained_local + 4 * len(trained),
    }
    if tc.reference:
        out["reference"] = 4 * _per_rank(specs, ws)[rank]
    if tc.critic:  # the same body under a Linear(hidden, 1) head with bias (trainer/build.py)
        body = [s for s in specs if not s.name.startswith("lm_head.")]
        head = next(s for s in specs if s.name == "tok_embeddings.weight")
        critic = body + [
            dataclasses.replace(head, name="lm_head.weight", shape=(1, m["hidden"])),
            dataclasses.replace(head, name="lm_head.bias", shape=(1,)),
        ]
        out["critic"] = 16 * _per_rank(critic, ws)[rank] + 4 * len(critic)
    # FSDP2's gathered units: the transformer blocks, and the root (embeddings; norm + lm_head)
    block = (total - (1 if m["tie"] else 2) * m["vocab"] * m["hidden"]) / m["layers"]
    if "experts" in m:  # under EP a block gathers only its EP rank's experts (over `efsdp`)
        experts = 3 * m["experts"] * m["moe_inter"] * m["hidden"]
        block += experts / tc.expert_parallel - experts
    unit = max(block, m["vocab"] * m["hidden"])
    nets = 1 + tc.critic
    trained_total = sum(math.prod(s.shape) for s in trained)
    if ws > 1 and tc.fsdp == "fsdp2" and replicated_step(tc.fsdp_step, total):  # parameters + gradients
        out["fsdp_buffers"] = int(compute * (total + trained_total) * nets)
    elif ws > 1:
        out["fsdp_buffers"] = int(3 * compute * unit)
    T = cfg.data.max_prompt_length + max(response_budget(cfg), 1)
    tokens = tc.micro_batch_size * T
    ac = tc.activation_checkpoint
    elems, fp32 = _activation_elems(m) if ac == "none" else _checkpointed_elems(m, ac, tc.device != "cpu")
    resp = tc.micro_batch_size * max(response_budget(cfg), 1)
    out["activations"] = int(
        tokens * m["layers"] * (elems * compute + fp32 * 4)
        + tokens * m["hidden"] * 4 * 2  # the final norm's fp32 input and x * rstd
        + resp * (m["hidden"] * compute + 16)  # log-prob head: its input, fp32 lse / E[z] / targets
        # "full": the fp32 log-softmax and its exp (the entropy's), kept for backward
        + (resp * m["vocab"] * 8 if tc.logprob_head == "full" else 0)
        # LoRA: each adapter's A x (`[tokens, rank]`), what its B saves for backward
        + tokens * (len(adapters) // 2) * tc.lora.rank * compute
    )
    out["total"] = sum(v for k, v in out.items() if k != "rank")
    out["resident"] = out["total"] - out["activations"] - out.get("fsdp_buffers", 0)
    out["seq_len"], out["micro_batch"], out["activation_checkpoint"] = T, tc.micro_batch_size, ac
    return out


# ---------------------------------------------------------------------------------------------- engine, sync


def engine_and_sync(cfg: Config, m: dict, specs: list, device_bytes: int, bandwidth_gbps: float) -> tuple:
    """(engine bytes per TP rank, sync plan summary)."""
    import numpy as np

    from rl_tpu.weight_sync.names import hf_row_map, hf_shapes
    from rl_tpu.weight_sync.plan import build_plan
    from rl_tpu.weight_sync.plan_shapes import synthetic_layouts, to_hf_for

    r = cfg.rollout
    tp, dt = r.tensor_parallel_size, resolved_dtype(r.dtype, cfg)
    to_hf = to_hf_for(m)
    hf_order = sorted(hf_shapes(specs, to_hf).items())
    one = synthetic_layouts(m, hf_order, tp, dtype=dt)
    weights = max(sum(math.prod(s) for s in lay.shapes.values()) for _, lay in one) * DTYPE_BYTES[dt]
    kv_per_token = 2 * m["layers"] * max(m["kv"] // tp, 1) * m["head_dim"] * DTYPE_BYTES[dt]
    engine_device = r.device or cfg.trainer.device
    if engine_device == "cpu":
        kv = int(r.kv_cache_gb * GIB)
        engine = {"weights": weights, "kv_cache": kv, "total": weights + kv}
    else:
        kv = int(r.gpu_memory_utilization * device_bytes) - weights - ENGINE_RUNTIME_BYTES
        engine = {
            "weights": weights,
            "kv_cache": kv,
            "runtime": ENGINE_RUNTIME_BYTES,
            "total": int(r.gpu_memory_utilization * device_bytes),
        }
    engine["kv_tokens"] = max(kv, 0) // kv_per_token
    engine["kv_seqs"] = engine["kv_tokens"] // r.max_model_len
    engine["tp"] = tp
    layouts = [((e, rank), lay) for e in range(r.engines) for (_, rank), lay in one]
    plan = build_plan(specs, hf_row_map(specs, to_hf), hf_order, layouts, int(cfg.sync.bucket_mb * 2**20))
    b = plan.buckets
    busiest = max(  # bytes of the busiest sender (column 1) or receiver (column 0)
        np.bincount(b[:, 1], weights=b[:, 2]).max(), np.bincount(b[:, 0], weights=b[:, 2]).max()
    )
    sync = {
        "bytes": plan.nbytes,
        "buckets": int(len(b)),
        "pieces": int(plan.pieces.shape[0]),
        "busiest_link_bytes": int(busiest),
        "bandwidth_gbps": bandwidth_gbps,
        "seconds": float(busiest) / (bandwidth_gbps * 1e9),
    }
    return engine, sync


def lora_engine_and_sync(cfg: Config, adapters: list, engine: dict, sync: dict) -> tuple[dict, dict]:
    """Under `trainer.lora`: the engine's LoRA slot tensors added (one slot: `max_lora_rank` x (in + out)
    per adapted linear in the engine dtype, TP-split) and the sync replaced by the adapter's fp32 bytes,
    sent whole to every engine (rollout/adapter.py)."""
    from rl_tpu.rollout.engine import LORA_RANKS

    r = cfg.rollout
    slot_rank = next(x for x in LORA_RANKS if x >= cfg.trainer.lora.rank)
    dt = DTYPE_BYTES[resolved_dtype(r.dtype, cfg)]
    slots = sum(slot_rank * (s.shape[1] if ".lora_a." in s.name else s.shape[0]) for s in adapters)
    engine = dict(engine, lora_slots=slots * dt // r.tensor_parallel_size)
    # CPU: on top of the KV cache's fixed size; GPU: inside the memory budget, out of the KV cache's share
    # (not recounted: ~0.2 % of it at rank 16 on attention)
    engine["total"] += engine["lora_slots"] if engine.get("runtime") is None else 0
    nbytes = 4 * sum(math.prod(s.shape) for s in adapters)
    sync = dict(
        sync,
        bytes=nbytes * r.engines,  # every engine reads the whole adapter
        buckets=1,
        pieces=len(adapters),
        busiest_link_bytes=nbytes,  # rank 0 writes it once; each engine reads it, in parallel
        seconds=nbytes / (sync["bandwidth_gbps"] * 1e9),
        adapter_only=True,
    )
    return engine, sync


# ---------------------------------------------------------------------------------------------- estimate


def hardware_for(cfg: Config, recipe: str | Path | None, hardware: str | None) -> tuple[str, int]:
    """(name, bytes per device): `hardware`, else the recipe file's name, else the device's default."""
    if hardware is None and recipe is not None:
        hardware = next((h for h in HARDWARE if h in Path(recipe).stem.lower().split("-")), None)
    if hardware is None:
        hardware = DEFAULT_HARDWARE.get(cfg.trainer.device, "host")
    if hardware == "host":
        return "host", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if hardware not in HARDWARE:
        raise EstimateError(f"--hardware={hardware!r}: expected one of {', '.join(HARDWARE)} or host")
    return hardware, HARDWARE[hardware]


def estimate(
    cfg: Config, recipe: str | Path | None = None, hardware: str | None = None, bandwidth_gbps: float = 10.0
) -> dict:
    """Everything `rl-tpu estimate` prints, as one dict (bytes)."""
    from rl_tpu.placement import choose_placement
    from rl_tpu.weight_sync.plan_shapes import model_shape, titan_shapes, trainer_spec

    if bandwidth_gbps <= 0:
        raise EstimateError(f"--bandwidth-gbps={bandwidth_gbps}: must be > 0")
    hf, source = hf_config(cfg)
    m = model_shape(hf)
    tc = cfg.trainer
    if "experts" in m and m["experts"] % tc.expert_parallel:
        raise EstimateError(
            f"trainer.expert_parallel = {tc.expert_parallel} must divide the {m['experts']} experts"
        )
    if "experts" in m and tc.expert_parallel > 1 and m["experts"] % tc.world_size:
        raise EstimateError(  # weight_sync.plan.owners: a strided expert shard must split evenly
            f"{m['experts']} experts over trainer.world_size = {tc.world_size} with expert parallelism: "
            "the weight-sync plan needs the experts to divide evenly over all ranks"
        )
    if "experts" in m and tc.activation_checkpoint != "none":
        raise EstimateError(  # as the trainer (trainer/build.py)
            f"trainer.activation_checkpoint = {tc.activation_checkpoint!r}: not on MoE models yet"
        )
    if "experts" not in m and tc.expert_parallel > 1:
        raise EstimateError(f"trainer.expert_parallel = {tc.expert_parallel}: the model has no experts")
    name, device_bytes = hardware_for(cfg, recipe, hardware)
    specs = [
        trainer_spec(n, s, tc.world_size, tc.expert_parallel, dtype="float32")
        for n, s in titan_shapes(m).items()
    ]
    trainer = trainer_memory(cfg, m, specs)
    engine, sync = engine_and_sync(cfg, m, specs, device_bytes, bandwidth_gbps)
    adapters = adapter_specs(cfg, specs)
    if adapters:  # the engines serve base + adapter; a sync moves the adapter file only
        engine, sync = lora_engine_and_sync(cfg, adapters, engine, sync)
    r = cfg.rollout
    placement = choose_placement(
        cfg.cluster.placement,
        mode=cfg.cluster.mode,
        accelerator=_ACCELERATOR[tc.device],
        tp=r.tensor_parallel_size,
        rollout_accelerator=_ACCELERATOR[r.device or tc.device],
    )
    shared = placement == "colocated" and _ACCELERATOR[tc.device] is not None
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    over = []  # why it does not fit
    if name == "host":  # every process on this host's RAM
        devices = 1
        need = tc.world_size * trainer["total"] + r.engines * r.tensor_parallel_size * engine["total"]
        if need > device_bytes:
            over.append(f"trainer ranks + engines need {gib(need)} of {gib(device_bytes)} RAM")
    else:
        devices = (
            max(tc.world_size, r.engines) if shared else tc.world_size + r.engines * r.tensor_parallel_size
        )
        if trainer["total"] > device_bytes:
            over.append(f"a trainer rank needs {gib(trainer['total'])} > {gib(device_bytes)}")
        if shared and trainer["resident"] + engine["total"] > device_bytes:
            over.append(
                f"trainer state {gib(trainer['resident'])} + engine {gib(engine['total'])} > {gib(device_bytes)}"
            )
        if engine["kv_seqs"] < 1:
            over.append(f"the engine's KV cache holds no {r.max_model_len}-token sequence")
        if r.tensor_parallel_size > HOST_DEVICES[name]:
            over.append(
                f"an engine of TP {r.tensor_parallel_size} spans {r.tensor_parallel_size} devices, but one {name} "
                f"host has {HOST_DEVICES[name]} (an engine runs on one host)"
            )
    params = sum(math.prod(s.shape) for s in specs)
    return {
        "recipe": str(recipe) if recipe else "",
        "model": cfg.model.path or f"tiny {cfg.model.arch} {cfg.model.size}",
        "shapes_from": source,
        "params": params,
        "hardware": name,
        "device_bytes": device_bytes,
        "placement": placement,
        "devices": devices,
        "world_size": tc.world_size,
        "expert_parallel": tc.expert_parallel,
        "trainer": trainer,
        "engine": engine,
        "sync": sync,
        "fits": not over,
        "why_not": "; ".join(over),
    }


def _size(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"


def format_table(est: dict) -> str:
    """The human table `rl-tpu estimate` prints before its JSON line."""
    t, e, s = est["trainer"], est["engine"], est["sync"]
    unit, scale = ("GiB", GIB) if t["total"] >= GIB else ("MiB", 2**20)
    g = lambda b: f"{b / scale:9.2f}"  # noqa: E731
    lines = [
        f"model {est['model']}: {est['params'] / 1e9:.3g} B parameters (shapes: {est['shapes_from']})",
        f"hardware {est['hardware']} ({est['device_bytes'] / GIB:.0f} GiB per device), {est['placement']}, "
        f"{est['devices']} devices: trainer {est['world_size']} ranks (EP {est['expert_parallel']}), "
        f"engines of TP {e['tp']}",
        f"{'per device':<44}{unit:>9}",
        f"trainer rank {t['rank']}: parameters (fp32 shards)".ljust(44) + g(t["params"]),
        "  gradients (fp32 shards)".ljust(44) + g(t["grads"]),
        "  AdamW exp_avg + exp_avg_sq + step".ljust(44) + g(t["optimizer"]),
    ]
    for key, label in (
        ("reference", "  reference parameters"),
        ("critic", "  critic (params, grads, AdamW)"),
    ):
        if key in t:
            lines.append(label.ljust(44) + g(t[key]))
    if "fsdp_buffers" in t:
        lines.append("  FSDP gathered parameters / gradients".ljust(44) + g(t["fsdp_buffers"]))
    lines += [
        f"  activations ({t['micro_batch']} x {t['seq_len']} tokens, AC {t['activation_checkpoint']})".ljust(
            44
        )
        + g(t["activations"]),
        "  trainer total".ljust(44) + g(t["total"]),
        "engine TP rank: weights".ljust(44) + g(e["weights"]),
        *(["  LoRA slot (one adapter)".ljust(44) + g(e["lora_slots"])] if "lora_slots" in e else []),
        f"  KV cache ({e['kv_tokens']} tokens, {e['kv_seqs']} x max_model_len)".ljust(44) + g(e["kv_cache"]),
        "  engine total".ljust(44) + g(e["total"]),
        f"sync{' (the LoRA adapter only)' if s.get('adapter_only') else ''}: {_size(s['bytes'])} in "
        f"{s['buckets']} buckets per sync, "
        f"{s['seconds']:.3g} s at {s['bandwidth_gbps']:g} GB/s per link (busiest link "
        f"{_size(s['busiest_link_bytes'])})",
        f"fits {est['hardware']}: " + ("yes" if est["fits"] else f"NO ({est['why_not']})"),
    ]
    return "\n".join(lines)


def run(recipe: str | Path | None, overrides: list[str], hardware: str | None, bandwidth_gbps: float) -> dict:
    """`rl-tpu estimate`: load, estimate, print the table and one JSON line."""
    from rl_tpu.config import DEFAULT_CONFIG, load_config

    cfg = load_config(recipe if recipe is not None else DEFAULT_CONFIG, overrides)
    est = estimate(cfg, recipe, hardware, bandwidth_gbps)
    print(format_table(est))
    print(json.dumps(est))
    return est
