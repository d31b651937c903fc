"""The trainer's inner attention: TorchTitan's SDPA, plus packed rows that hold each prompt once.

GRPO samples n responses per prompt, so a batch holds every prompt n times and the trainer would run
each prompt's tokens through every layer n times, and every response padded to the longest. A *packed
row* (`ops.pack_shared_prompts`) holds each distinct prompt of a micro-batch once, followed by its
responses, with no padding: `[prompt 1 | response 1.1 | ... | response 1.n | prompt 2 | ...]`. Each
response attends to its prompt's real tokens and causally to itself, never to the other responses, and
takes RoPE positions that continue its prompt's, so every response token sees exactly the context of
its own padded row: the same log-probs (up to fp32 summation order), and the prompt's gradient is the
sum of its n responses' contributions, as with n copies.

The projections and MLPs run on the packed positions only. Attention runs on padded views gathered from
them: the prompts `[G, P]` causally, then each response slot `[S, R]` with keys (its prompt, then
itself), not the whole packed row under a dense mask: attention stays S * R * (P + R), what the
one-row-per-sequence layout costs for those queries. The outputs are gathered back to packed order.

On CPU, attention in bf16/fp16 computes in float32 (inputs cast up, the output cast back): torch's CPU
flash-attention backward in bf16 is slower than in float32 on the trainer's shapes, and float32 is the
more exact of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import ScaledDotProductAttention

from rl_tpu.trainer.ops import SharedPromptRows


class SharedPromptSDPA(ScaledDotProductAttention):
    """`ScaledDotProductAttention` (causal, unchanged when `attention_masks` is None) that also runs
    `SharedPromptRows` batches."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(
        self,
        q_BLNH,
        k_BLNH,
        v_BLNH,
        *,
        attention_masks=None,
        scale=None,
        enable_gqa=False,
        is_causal=True,
        **kwargs,
    ):
        dtype = q_BLNH.dtype
        if q_BLNH.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            out = self.forward(
                q_BLNH.float(),
                k_BLNH.float(),
                v_BLNH.float(),
                attention_masks=attention_masks,
                scale=scale,
                enable_gqa=enable_gqa,
                is_causal=is_causal,
                **kwargs,
            )
            return out.to(dtype)
        if not isinstance(attention_masks, SharedPromptRows):
            return super().forward(
                q_BLNH,
                k_BLNH,
                v_BLNH,
                attention_masks=attention_masks,
                scale=scale,
                enable_gqa=enable_gqa,
                is_causal=is_causal,
                **kwargs,
            )
        rows = attention_masks
        q, k, v = q_BLNH[0], k_BLNH[0], v_BLNH[0]  # [L, N, H]: one packed row

        def gather(t, index):  # [L, N, H] -> [*index.shape[:-1], N, len, H]
            return t.index_select(0, index.reshape(-1)).unflatten(0, index.shape).transpose(-3, -2)

        qp, kp, vp = (gather(t, rows.prompt_index) for t in (q, k, v))
        out_p = F.scaled_dot_product_attention(qp, kp, vp, scale=scale, is_causal=True, enable_gqa=enable_gqa)
        qr = gather(q, rows.slot_index)
        kr = torch.cat([kp.index_select(0, rows.slot_prompt), gather(k, rows.slot_index)], dim=2)
        vr = torch.cat([vp.index_select(0, rows.slot_prompt), gather(v, rows.slot_index)], dim=2)
        out_r = F.scaled_dot_product_attention(
            qr, kr, vr, attn_mask=rows.slot_mask, scale=scale, enable_gqa=enable_gqa
        )
        flat = torch.cat([out_p.transpose(1, 2).flatten(0, 1), out_r.transpose(1, 2).flatten(0, 1)])
        return flat.index_select(0, rows.out_index)[None]
