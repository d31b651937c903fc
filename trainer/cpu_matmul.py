"""The trainer's float32 matmuls on CPU: each of a linear's three matmuls (forward, input gradient,
weight gradient) on MKL (torch's `aten::mm`) or oneDNN, chosen by measuring both on this CPU.

Why: PyTorch's CPU wheels send a float32 `aten::mm` to MKL's sgemm. On some CPUs (AVX-512) oneDNN
(also in the wheel, and what vLLM-CPU's linears use) runs the update's shapes faster; on others (AVX2)
MKL is as fast or faster, most of all for the weight gradient, which oneDNN's linear op can only take
after copying both operands transposed. No fixed choice is right for every CPU, so
`trainer.cpu_matmul = "auto"` times both kernels on the model's own shapes when the trainer starts and
keeps the faster per (shape, matmul). Both are IEEE
float32 (no reduced-precision math mode); results differ by summation order only (~1e-6 of the largest
value). bfloat16 matmuls already go to oneDNN inside aten, so they are left alone.

Reproducibility: the choice is cached per CPU model, torch version, thread count and number of ranks
timing at once (they share the cores, so 2 ranks may choose otherwise than 1) (`cache_path()`), so later
runs on the same machine make the same choice and round the same way; a run that must match another
machine's bit for bit pins `aten` or `onednn`.

`install(model, choose)` swaps the forward of every `nn.Linear` for one through `linear`; parameters,
state-dict keys and FSDP2's hooks (which live in `__call__`) are untouched. Each kernel computes
`a @ b.T` (the form of `ops.Matmuls`, which the chunked log-prob head uses too).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rl_tpu.trainer.ops import Matmuls
from rl_tpu.trainer.ops import mm_t as aten_mm_t

OPS = ("fwd", "dgrad", "wgrad")
# oneDNN must beat MKL by this much to be chosen: near-ties keep torch's default
MARGIN = 0.95
# rows of the timed matmuls, fewer for large shapes (about 2e8 multiply-adds each)
TIMED_ROWS, TIMED_MACS = 1024, 200_000_000


def available() -> bool:
    """Whether this torch build has the oneDNN linear kernel (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _plain_cpu_fp32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and not isinstance(t, DTensor) for t in ts)


def onednn_mm_t(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b.T (+ bias)`, on oneDNN for float32 CPU tensors (it copies non-contiguous operands), else aten."""
    if a.dim() >= 2 and _plain_cpu_fp32(a, b):
        return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")
    return a @ b.T if bias is None else torch.nn.functional.linear(a, b, bias)


KERNELS: dict[str, Callable[..., torch.Tensor]] = {"aten": aten_mm_t, "onednn": onednn_mm_t}
ATEN = Matmuls(aten_mm_t, aten_mm_t, aten_mm_t)
ONEDNN = Matmuls(onednn_mm_t, onednn_mm_t, onednn_mm_t)


def matmuls(names: dict[str, str]) -> Matmuls:
    """`Matmuls` from kernel names per matmul, e.g. {"fwd": "onednn", "dgrad": "aten", "wgrad": "aten"}."""
    return Matmuls(*(KERNELS[names[op]] for op in OPS))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mm: Matmuls) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.mm = b is not None, mm
        with torch.no_grad():  # the oneDNN op has an autograd node of its own, unused here
            y = mm.fwd(x, w)
            return y if b is None else y.add_(b)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        mm = ctx.mm
        gx = gw = gb = None
        g2 = gy.reshape(-1, gy.shape[-1])
        with torch.no_grad():
            if ctx.needs_input_grad[0]:
                gx = mm.dgrad(gy, w.t())  # gy @ w
            if ctx.needs_input_grad[1]:
                gw = mm.wgrad(g2.t(), x.reshape(-1, x.shape[-1]).t())  # gy^T @ x, summed over all positions
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g2.sum(0)
        return gx, gw, gb, None


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, mm: Matmuls = ONEDNN
) -> torch.Tensor:
    """`F.linear(x, w, b)` with its three matmuls on `mm`'s kernels (float32 CPU tensors); any other case
    (bfloat16, DTensor weights, another device) goes to `F.linear`."""
    if x.dim() < 2 or not _plain_cpu_fp32(x, w):
        return torch.nn.functional.linear(x, w, b)
    return _Linear.apply(x, w, b, mm)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, self.rl_matmuls)


def linear_shapes(model: torch.nn.Module) -> set[tuple[int, int]]:
    """(in_features, out_features) of every `nn.Linear` in `model`."""
    return {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}


def install(model: torch.nn.Module, choose: Callable[[int, int], Matmuls] | Matmuls = ONEDNN) -> int:
    """Route every `nn.Linear` of `model` through `linear` with the kernels `choose(in, out)` gives (or
    one `Matmuls` for all); returns how many were changed. Linears left all on aten keep `F.linear`."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            mm = choose if isinstance(choose, Matmuls) else choose(m.in_features, m.out_features)
            if mm == ATEN:
                continue
            m.rl_matmuls = mm
            m.forward = types.MethodType(
                _forward, m
            )  # a bound method: `copy.deepcopy` rebinds it to the copy
            n += 1
    return n


# ------------------------------------------------------------------------------------------------ choosing


def _operands(op: str, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (a, b) a linear's `op` passes to its kernel (`a @ b.T`), laid out as `_Linear` passes them."""
    x, w, gy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    return {"fwd": (x, w), "dgrad": (gy, w.t()), "wgrad": (gy.t(), x.t())}[op]


def time_kernels(shapes: Iterable[tuple[int, int]], reps: int = 5) -> dict[str, float]:
    """Median seconds of each kernel for each shape's three matmuls, keyed "K,N/op/kernel". The two kernels
    alternate, so a change in the machine's speed hits both alike."""
    out = {}
    for k, n in sorted(set(shapes)):
        m = max(16, min(TIMED_ROWS, TIMED_MACS // (k * n)))
        for op in OPS:
            a, b = _operands(op, m, k, n)
            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            for rep in range(reps + 1):
                for name, fn in KERNELS.items():
                    t = time.perf_counter()
                    fn(a, b)
                    if rep:  # the first call of each is a warm-up (oneDNN builds its primitive)
                        times[name].append(time.perf_counter() - t)
            for name, ts in times.items():
                out[f"{k},{n}/{op}/{name}"] = statistics.median(ts)
    return out


def pick(times: dict[str, float]) -> dict[str, dict[str, str]]:
    """From `time_kernels`' figures (possibly summed over ranks): per "K,N", the kernel of each matmul."""
    table: dict[str, dict[str, str]] = {}
    for key in times:
        shape, op, _ = key.split("/")
        onednn, aten = times[f"{shape}/{op}/onednn"], times[f"{shape}/{op}/aten"]
        table.setdefault(shape, {})[op] = "onednn" if onednn < MARGIN * aten else "aten"
    return table


def cache_path() -> Path:
    """`$RL_TPU_CACHE_DIR/cpu_matmul.json` (default `$XDG_CACHE_HOME/rl_tpu`, or `~/.cache/rl_tpu`)."""
    from rl_tpu.model_source import cache_dir

    return cache_dir() / "cpu_matmul.json"


def machine_key(threads: int, ranks: int = 1) -> str:
    """What the choice depends on: the CPU model and features, torch's build, the thread count, and how
    many ranks time the kernels at once on this machine's cores."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name") and key not in info:
                info[key] = value.strip()
    except OSError:
        info["processor"] = platform.processor()
    cpu = " / ".join(f"{k} {v}" for k, v in info.items())
    return (
        f"{cpu} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | {threads} threads"
        f" | {ranks} ranks"
    )


def read_cache(key: str) -> dict[str, dict[str, str]]:
    """The cached choices for `key` (an empty table when there are none or the file cannot be read)."""
    try:
        return json.loads(cache_path().read_text()).get(key, {})
    except (OSError, ValueError, AttributeError):
        return {}


def write_cache(key: str, table: dict[str, dict[str, str]]) -> None:
    """Merge `table` into the cache under `key` (atomic replace; another writer's keys are kept)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data.setdefault(key, {}).update(table)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs the next start a measurement


def choose(
    shapes: Iterable[tuple[int, int]],
    threads: int,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    is_writer: bool = True,
    ranks: int = 1,
) -> tuple[dict[str, dict[str, str]], bool]:
    """The kernel of each matmul for each (in, out) shape, and whether it came from the cache.

    Shapes missing from the cache are timed; with `sum_over_ranks` (an all-reduce) every rank times them
    and all decide on the summed times, so all ranks pick the same kernels. Every rank reads the same
    cache: ranks either all find a shape or all time it (the writer writes only after the all-reduce)."""
    key = machine_key(threads, ranks)
    cached = read_cache(key)
    wanted = sorted({f"{k},{n}" for k, n in shapes})
    missing = [s for s in wanted if set(cached.get(s, {})) != set(OPS)]
    if sum_over_ranks is not None:  # agree on what to time: any rank missing a shape times it on all
        flags = torch.tensor([float(s in missing) for s in wanted])
        missing = [s for s, f in zip(wanted, sum_over_ranks(flags).tolist()) if f > 0]
    if not missing:
        return {s: cached[s] for s in wanted}, True
    times = time_kernels([tuple(int(v) for v in s.split(",")) for s in missing])
    if sum_over_ranks is not None:
        keys = sorted(times)
        summed = sum_over_ranks(torch.tensor([times[k] for k in keys], dtype=torch.float64)).tolist()
        times = dict(zip(keys, summed))
    fresh = pick(times)
    if is_writer:
        write_cache(key, fresh)
    return {s: cached[s] if s in cached and s not in fresh else fresh[s] for s in wanted}, False


def summary(table: dict[str, dict[str, str]]) -> str:
    """ "onednn" or "aten" when every matmul uses it, else the count of each, e.g. "onednn 5/15, aten 10/15"."""
    names = [name for ops in table.values() for name in ops.values()]
    if len(set(names)) == 1:
        return names[0]
    return ", ".join(f"{k} {names.count(k)}/{len(names)}" for k in KERNELS)


def resolve(
    mode: str,
    shapes: Iterable[tuple[int, int]],
    threads: int,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    is_writer: bool = True,
    ranks: int = 1,
) -> tuple[dict[str, dict[str, str]], bool]:
    """`trainer.cpu_matmul`'s `mode` ("auto", "onednn", "aten") as a kernel table for `shapes`, and whether
    it came from the cache (pinned modes always do); "auto" goes through `choose` (same arguments)."""
    if mode == "auto" and available():
        return choose(shapes, threads, sum_over_ranks, is_writer, ranks)
    if mode not in ("auto", "onednn", "aten"):
        raise ValueError(f"cpu_matmul = {mode!r}: expected 'auto', 'onednn' or 'aten'")
    kernel = "onednn" if mode == "onednn" and available() else "aten"
    return {f"{k},{n}": dict.fromkeys(OPS, kernel) for k, n in shapes}, True


def install_mode(model: torch.nn.Module, mode: str) -> dict[str, dict[str, str]]:
    """`resolve(mode)` installed in a one-process float32 CPU model (the benches' raw parts, TRL's model in
    bench/vs_trl.py); returns the kernel table."""
    table, _ = resolve(mode, linear_shapes(model), torch.get_num_threads())
    install(model, lambda k, n: matmuls(table[f"{k},{n}"]))
    return table
