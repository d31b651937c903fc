"""Linear layers whose three matmuls (forward, input and weight gradients) run on oneDNN, on CPU.

Why: PyTorch's CPU wheels send a float32 `aten::mm` to MKL's sgemm, which on AMD CPUs takes a slower
code path than the same machine's oneDNN (also shipped in the wheel, and what vLLM-CPU's own linears
use). On the 2-core AMD EPYC (Zen 5) of bench/RESULTS.md, session 20, oneDNN ran the update's shapes at
~2x MKL's rate, both IEEE float32 (no reduced-precision math mode). bfloat16 matmuls already go to
oneDNN inside aten, so they are left alone.

`install(model)` swaps the forward of every `nn.Linear` in a model for one through `onednn_linear`
(`mm_t` serves the chunked log-prob head, which has a backward of its own);
parameters, state-dict keys and FSDP2's hooks (which live in `__call__`) are untouched. The numbers
differ from aten's by the summation order only (float32 rounding: ~1e-6 of the largest value).
"""

from __future__ import annotations

import types

import torch
from torch.distributed.tensor import DTensor


def available() -> bool:
    """Whether this torch build has the oneDNN linear kernel (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mm_t(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b.T (+ bias)` on oneDNN; `a` `[..., K]`, `b` `[N, K]`."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


def _plain_cpu_fp32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and not isinstance(t, DTensor) for t in ts)


def mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b.T` (no autograd), on oneDNN for float32 CPU tensors, else aten."""
    if a.dim() >= 2 and _plain_cpu_fp32(a, b):
        return _mm_t(a, b)
    return a @ b.T


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        with torch.no_grad():  # the op has an autograd node of its own, unused here
            return _mm_t(x, w, b)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        g2 = gy.reshape(-1, gy.shape[-1])
        with torch.no_grad():
            if ctx.needs_input_grad[0]:
                gx = _mm_t(gy, w.t())  # gy @ w
            if ctx.needs_input_grad[1]:
                gw = _mm_t(g2.t(), x.reshape(-1, x.shape[-1]).t())  # gy^T @ x, summed over all positions
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g2.sum(0)
        return gx, gw, gb


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)` with its forward and both gradients on oneDNN (float32 CPU tensors); any other
    case (bfloat16, DTensor weights, another device) goes to `F.linear`."""
    if x.dim() < 2 or not _plain_cpu_fp32(x, w):
        return torch.nn.functional.linear(x, w, b)
    return _Linear.apply(x, w, b)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return onednn_linear(x, self.weight, self.bias)


def install(model: torch.nn.Module) -> int:
    """Route every `nn.Linear` of `model` through `onednn_linear`; returns how many were changed."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(_forward, m)  # a bound method: `copy.deepcopy` rebinds it to the copy
            n += 1
    return n
