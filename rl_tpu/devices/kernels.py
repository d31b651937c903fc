"""Which kernel each device gets for each kernel flag of the trainer: attention (`trainer.attention`), the
log-prob head, the CPU matmuls (`trainer.cpu_matmul`). Pure (no torch import): the trainer resolves its
flags here when it builds its models (trainer/worker.py), `rl-tpu doctor` reports the same resolution from probe facts.

Invariants:
- Defaults come from the devices table (`Device.attention`), never from `if device == ...` here.
- "auto" never fails: where the device's default kernel is missing, it falls back to "sdpa" and says
  why. A kernel named explicitly that cannot run on the device is an error naming the key.
- Attention kernels, all TorchTitan inner attentions running our batches (trainer/attention.py):
  "sdpa" (TorchTitan's ScaledDotProductAttention; packed shared-prompt rows as padded views) runs on
  every device; "flex" (TorchTitan's FlexAttention; the packed rows' mask as a block mask) trains only
  where torch has a FlexAttention backward: CUDA with Triton (on CPU torch raises "FlexAttention does not
  support backward on CPU"). TorchTitan's third, VarlenAttention, is not offered: it is CUDA flash
  attention over whole documents, and a packed row's responses attend to their prompt, which a
  per-document causal mask cannot express without copying the prompt before every response (what packing
  avoids).
"""

from __future__ import annotations

import importlib.util

ATTENTION = ("auto", "sdpa", "flex")  # trainer.attention


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def attention_missing(kernel: str, device, has_triton: bool) -> str | None:
    """Why `kernel` cannot train on `device` (a devices-table row), or None when it can."""
    if kernel == "sdpa":
        return None
    if kernel != "flex":
        raise ValueError(f"trainer.attention = {kernel!r}: expected one of {ATTENTION}")
    if not device.flex_attention:
        return (
            f"FlexAttention has no backward on {device.name} (torch's FlexAttention training kernels are "
            "Triton programs for CUDA)"
        )
    if not has_triton:
        return "FlexAttention's CUDA kernels are Triton programs, and this environment has no triton"
    return None


def resolve_attention(choice: str, device, has_triton: bool) -> tuple[str, str]:
    """(kernel, why): the inner attention `trainer.attention = choice` runs on `device`."""
    if choice == "auto":
        default = device.attention
        missing = attention_missing(default, device, has_triton)
        if missing:
            return "sdpa", f"{device.name}'s default {default} falls back: {missing}"
        return default, f"{device.name}'s default"
    missing = attention_missing(choice, device, has_triton)
    if missing:
        raise ValueError(f"trainer.attention = {choice!r}: {missing}; use 'sdpa' or 'auto'")
    return choice, "trainer.attention"


def logprob_head(device, onednn: bool, kind: str = "chunked") -> str:
    """The log-prob head `device` runs for `trainer.logprob_head = kind` (trainer/ops.py: "chunked",
    `trainer.logprob_chunk_size` vocabulary rows at a time, logits never whole; "full", the whole logits
    under autograd), and its matmuls' kernels."""
    if kind == "full":
        return f"full log-softmax ({device.torch_device} matmul)"
    mm = (
        "cpu_matmul's kernels"
        if device.torch_device == "cpu" and onednn
        else f"{device.torch_device} matmuls"
    )
    return f"chunked log-softmax ({mm})"


def cpu_matmul(device, onednn: bool) -> str:
    """What `trainer.cpu_matmul = "auto"` gives the float32 linears on `device`."""
    if device.torch_device != "cpu":
        return "aten (CPU float32 only)"
    if not onednn:
        return "aten (no oneDNN linear in this torch)"
    return "MKL or oneDNN per shape, timed once and cached (float32; bf16: aten)"
