"""GPU check: what runs on a lent CUDA machine with torch alone (no vLLM, no Ray), timed side by side.

(a) `sync`: weight sync between two processes through the `cuda_ipc` transport, the way the trainer and a
    colocated engine do it: a Qwen3-1.7B-shaped bf16 model, planned by our planner (`plan.build_plan`)
    into vLLM's fused layouts (qkv_proj, gate_up_proj, vocab padded; the row-run tables of
    `bench/plan_scale.synthetic_layouts`, which tests/integration/test_weight_sync.py checks against a real engine's),
    packed by our sender (`SyncSender.ws_pack`) and installed by our engine-side `apply_bucket`, two
    buckets in flight. Reports sync GB/s ÷ device-copy GB/s of the same bytes (goal ≥ 0.5) and checks
    every engine tensor bit for bit against the layout applied directly to the trainer's tensors. Each
    byte is copied twice on the device (packed into the bucket, installed out of it), so 0.5 is this
    route's ceiling; above it needs the engine to copy straight out of the trainer's shards (IPC handles
    of the parameters themselves, one copy), which is not built.
(b) `step`: one optimizer step of the trainer's model (TorchTitan, built from the same config.json
    through `trainer.model.build_model_spec`, FSDP2 with bf16 compute on one rank) next to a plain
    transformers `Qwen3ForCausalLM` step in bf16: tokens/s and MFU (goal ≥ 45 %).

Without a GPU (`--device cpu`) the same code runs on a tiny shape with the `shm` transport and fp32, so
the harness is tested on every machine (tests/integration/test_gpu_check.py); the figures only mean something on CUDA.
The last line is one JSON object.

    python bench/gpu_check.py                       # on the GPU machine: both parts
    python bench/gpu_check.py --device cpu --tiny   # the harness on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN3_1_7B = dict(
    arch="qwen3", hidden=2048, layers=28, heads=16, kv=8, head_dim=128, inter=6144, vocab=151936, tie=True
)
TINY = dict(arch="qwen3", hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=128, vocab=1000, tie=True)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, SXM


# ---------------------------------------------------------------------------------------------- (a) sync


def _hf_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    D, hd = m["hidden"], m["head_dim"]
    out = {"model.embed_tokens.weight": (m["vocab"], D), "model.norm.weight": (D,)}
    if not m["tie"]:
        out["lm_head.weight"] = (m["vocab"], D)
    for i in range(m["layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out.update(
            {
                a + "q_proj.weight": (m["heads"] * hd, D),
                a + "k_proj.weight": (m["kv"] * hd, D),
                a + "v_proj.weight": (m["kv"] * hd, D),
                a + "o_proj.weight": (D, m["heads"] * hd),
                a + "q_norm.weight": (hd,),
                a + "k_norm.weight": (hd,),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
                p + "mlp.gate_proj.weight": (m["inter"], D),
                p + "mlp.up_proj.weight": (m["inter"], D),
                p + "mlp.down_proj.weight": (D, m["inter"]),
            }
        )
    return out


def plan_for(m: dict, dtype: str, bucket_mb: float):
    """Our planner on HF-named trainer tensors (one rank, so the trainer-side names are the HF names and
    no TorchTitan adapter is needed) into one engine rank's fused layout."""
    from plan_scale import synthetic_layouts

    from rl_tpu.weight_sync.names import hf_row_map
    from rl_tpu.weight_sync.plan import build_plan
    from rl_tpu.weight_sync.specs import ParamSpec

    shapes = _hf_shapes(m)
    specs = [
        ParamSpec(name=n, shape=s, dtype=dtype, mesh_shape=(), mesh_dim_names=(), placements=())
        for n, s in sorted(shapes.items())
    ]
    order = sorted(shapes.items())
    layouts = synthetic_layouts(m, order, 1)
    for _, lay in layouts:
        lay.dtype = dtype
    plan = build_plan(specs, hf_row_map(specs, lambda sd: sd), order, layouts, int(bucket_mb * 2**20))
    return plan, layouts[0][1], order


def _fingerprint(t: torch.Tensor) -> list[int]:
    """Two integer sums over the raw bits (plain and position-weighted): equal tensors give equal prints,
    and a moved, dropped or altered element changes them."""
    bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1).long()
    w = torch.arange(bits.numel(), device=bits.device).remainder_(65521).add_(1)
    return [int(bits.sum()), int((bits * w).sum())]


def _join(group: tuple | None, rank: int, device: str) -> None:
    """The `collective` transport: join the two-member sync group (sender 0, receiver 1)."""
    if group is not None:
        from rl_tpu.weight_sync.transports import join_group

        host, port, backend = group
        join_group(host, port, 2, rank, senders=1, backend=backend, device=device, timeout_s=120.0)


def _trainer(conn, m: dict, device: str, dtype: str, transport: str, bucket_mb: float, group=None) -> None:
    """The sender process: holds the trainer's tensors, packs buckets on request, and reports the engine
    tensors' fingerprints computed by applying the layout directly (the reference)."""
    from rl_tpu.weight_sync.rows import as_2d
    from rl_tpu.weight_sync.sender import LocalSender

    torch.manual_seed(0)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)
    plan, layout, order = plan_for(m, dtype, bucket_mb)
    dt = getattr(torch, dtype)
    shards = {n: torch.randn(s, device=device).to(dt) for n, s in order}
    sender = LocalSender(lambda: shards)
    sender.ws_setup(plan.titan_names, plan.for_sender(0), plan.sender_dtypes(0))
    ref = {}
    for name, runs in layout.runs.items():
        t = torch.zeros(layout.shapes[name], dtype=dt, device=device)
        v = as_2d(t)
        for dr, dc, nr, nc, h, hr, hc in runs.tolist():
            v[dr : dr + nr, dc : dc + nc] = as_2d(shards[order[h][0]])[hr : hr + nr, hc : hc + nc]
        ref[name] = _fingerprint(t)
    conn.send(("ready", ref))
    _join(group, 0, device)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        bucket, version, slot = msg
        conn.send(sender.ws_pack(bucket, transport, version, slot))
    sender.ws_close()


def _engine(
    conn, pipe, m: dict, device: str, dtype: str, transport: str, bucket_mb: float, syncs: int, group=None
):
    """The receiver process: engine parameters in the fused layout, filled bucket by bucket. Under
    `collective` each bucket's receive is posted before the sender is asked for it (as an engine does)."""
    from rl_tpu.weight_sync.engine_side import apply_bucket
    from rl_tpu.weight_sync.rows import rows_cols
    from rl_tpu.weight_sync.transports import Collective, get_transport
    from rl_tpu.weight_sync.wire import bucket_nbytes

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device).index or 0)
    plan, layout, _ = plan_for(m, dtype, bucket_mb)
    dt = getattr(torch, dtype)
    params = {n: torch.zeros(s, dtype=dt, device=device) for n, s in layout.shapes.items()}
    names = plan.dst_names[0]
    order = plan.for_receiver(0)
    tr = get_transport(transport)
    _join(group, 1, device)

    def ask(k: int, version: int) -> None:
        bid, _, pieces = order[k]
        if transport == "collective":
            numel = int((pieces[:, 3] * pieces[:, 4]).sum())
            Collective.post(0, bid, bucket_nbytes(dt, numel, version, bid), (0, k % 2))
        pipe.send((bid, version, (0, k % 2)))

    seconds = []
    for version in range(syncs):
        t0 = time.perf_counter()
        for k in range(min(2, len(order))):
            ask(k, version)
        for k, (bid, _, pieces) in enumerate(order):
            handle = pipe.recv()
            buf = tr.open(handle)
            apply_bucket(
                buf, pieces, names, lambda n: params[n].view(rows_cols(tuple(params[n].shape))), bucket=bid
            )
            del buf
            if cuda:
                torch.cuda.current_stream().synchronize()  # the slot is free before the sender reuses it
            tr.release(handle)
            if k + 2 < len(order):
                ask(k + 2, version)
        seconds.append(time.perf_counter() - t0)
    prints = {n: _fingerprint(t) for n, t in params.items()}
    conn.send({"seconds": seconds, "prints": prints, "bytes": plan.nbytes, "buckets": int(len(plan.buckets))})


def device_copy_gbps(nbytes: int, device: str, repeats: int = 5) -> float:
    """One copy of `nbytes` within the device (GB/s of bytes copied): the floor a sync is compared with."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _recv(conn, procs: list, what: str, timeout: float = 600.0):
    """`conn.recv()`, or an error naming `what` once a process in `procs` died or `timeout` passed
    (a child that fails at import would otherwise leave the parent waiting for good)."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        dead = [p for p in procs if p.exitcode is not None and p.exitcode != 0]
        if dead:
            raise RuntimeError(
                f"{what}: a child process exited with code {dead[0].exitcode} (its output is above)"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: nothing after {timeout:.0f} s")
    return conn.recv()


def check_sync(
    m: dict, device: str, dtype: str, bucket_mb: float, syncs: int, transport: str | None = None
) -> dict:
    """Sync the model `syncs` times from a trainer process into an engine process over `transport`
    (default `cuda_ipc` on CUDA, `shm` on CPU; `collective`: NCCL between GPUs 0 and 1 on CUDA, gloo on
    CPU); GB/s of the best sync after the first against one device copy of the same bytes."""
    transport = transport or ("cuda_ipc" if device == "cuda" else "shm")
    devices = (device, device)
    group = None
    if transport == "collective":
        import socket

        import torch.distributed as dist

        if device == "cuda":
            devices = ("cuda:0", "cuda:1")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
        group = ("127.0.0.1", port, "nccl" if device == "cuda" else "gloo")
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    t_conn, t_child = ctx.Pipe()
    e_conn, e_child = ctx.Pipe()
    pipe_t, pipe_e = ctx.Pipe()
    trainer = ctx.Process(target=_trainer, args=(t_child, m, devices[0], dtype, transport, bucket_mb, group))
    trainer.start()
    tag, ref = _recv(t_conn, [trainer], "the trainer process's reference")

    def relay():  # the engine's requests go to the trainer and its handles come back (the driver's role)
        while True:
            req = pipe_t.recv()
            t_conn.send(req)
            if req is None:
                return
            pipe_t.send(t_conn.recv())

    import threading

    th = threading.Thread(target=relay, daemon=True)
    th.start()
    engine = ctx.Process(
        target=_engine, args=(e_child, pipe_e, m, devices[1], dtype, transport, bucket_mb, syncs, group)
    )
    engine.start()
    try:
        res = _recv(e_conn, [trainer, engine], "the engine process's syncs")
    except BaseException:
        for proc in (trainer, engine):
            proc.kill()
        raise
    pipe_e.send(None)
    th.join(timeout=60)
    engine.join(timeout=60)
    trainer.join(timeout=60)
    best = min(res["seconds"][1:] or res["seconds"])  # the first sync opens handles and warms caches
    gbps = res["bytes"] / best / 1e9
    floor = device_copy_gbps(res["bytes"], device)
    bad = sorted(n for n in ref if ref[n] != res["prints"].get(n))
    return {
        "transport": transport,
        "dtype": dtype,
        "bytes": res["bytes"],
        "buckets": res["buckets"],
        "sync_seconds": [round(s, 4) for s in res["seconds"]],
        "sync_gbps": _sig(gbps),
        "device_copy_gbps": _sig(floor),
        "ratio": _sig(gbps / floor),  # significant digits: a tiny CPU run's ratio must not round to 0
        "bit_exact": not bad,
        "mismatched": bad[:5],
    }


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


# ---------------------------------------------------------------------------------------------- (b) step


def write_config(m: dict, out: Path) -> Path:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": m["hidden"],
        "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv"],
        "head_dim": m["head_dim"],
        "intermediate_size": m["inter"],
        "vocab_size": m["vocab"],
        "tie_word_embeddings": m["tie"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def flops_per_token(m: dict, seq: int) -> float:
    """Training FLOPs per token: 6 × (non-embedding parameters + the LM head) + attention's 12·L·d·s."""
    D, L = m["hidden"], m["layers"]
    attn = D * (m["heads"] + 2 * m["kv"]) * m["head_dim"] + m["heads"] * m["head_dim"] * D
    per_layer = attn + 3 * D * m["inter"]
    return 6 * (L * per_layer + m["vocab"] * D) + 12 * L * m["heads"] * m["head_dim"] * seq


def _timed_steps(step, steps: int, device: str) -> float:
    step()  # warm-up (allocations, kernel selection)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def titan_step(model_dir: Path, device: str, tokens: torch.Tensor, steps: int) -> float:
    """Seconds per optimizer step of our trainer's TorchTitan model under FSDP2 (bf16 compute on CUDA)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from rl_tpu.trainer.model import build_model_spec

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    spec = build_model_spec(model_dir, max_seq_len=tokens.shape[1])
    with torch.device("meta"):
        model = spec.config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))  # RoPE caches (as trainer/parallel.py)
        for p in model.parameters():
            p.normal_(0, 0.02)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    mp_policy = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)
    for block in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed_steps(step, steps, device)


def transformers_step(model_dir: Path, device: str, tokens: torch.Tensor, steps: int) -> float:
    """Seconds per optimizer step of transformers' Qwen3ForCausalLM (bf16 on CUDA), same batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).to(
        device=device, dtype=dt
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = tokens.to(device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed_steps(step, steps, device)


def check_step(m: dict, device: str, batch: int, seq: int, steps: int) -> dict:
    tokens = torch.randint(0, m["vocab"], (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    peak = None
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    fpt = flops_per_token(m, seq)
    out = {"batch": batch, "seq": seq, "flops_per_token": fpt, "peak_tflops": peak}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(m, Path(tmp))
        for side, fn in (("titan", titan_step), ("transformers", transformers_step)):
            try:
                s = fn(model_dir, device, tokens, steps)
                tps = batch * seq / s
                mfu = tps * fpt / (peak * 1e12) if peak else None
                out[side] = {
                    "step_s": round(s, 4),
                    "tokens_per_s": round(tps, 1),
                    "mfu": mfu and round(mfu, 3),
                }
            except Exception as e:  # a missing package on the lent machine: say which, keep the other side
                out[side] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model (the CPU harness check)")
    p.add_argument("--parts", default="sync,step")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)  # 8 x 2048 would not leave room on 80 GB
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    m = TINY if a.tiny else QWEN3_1_7B
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = {"device": a.device, "model": "tiny" if a.tiny else "qwen3-1.7b", "torch": torch.__version__}
    if a.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    if "sync" in a.parts:
        out["sync"] = check_sync(m, a.device, dtype, a.bucket_mb, a.syncs)
        print("sync:", json.dumps(out["sync"]), flush=True)
    if "step" in a.parts:
        out["step"] = check_step(m, a.device, a.batch, a.seq, a.steps)
        print("step:", json.dumps(out["step"]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
