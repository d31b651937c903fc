"""The trainer's inner attentions (`trainer.attention`, rl_tpu/devices/kernels.py): TorchTitan's SDPA and its
FlexAttention, each running packed rows that hold each prompt once.

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

`SharedPromptFlex` (FlexAttention) runs the same packed row without the padded views: the row's mask
as a block mask (`shared_prompt_mask_mod`), so the same keys as above and the same log-probs.

On CPU, SDPA in bf16/fp16 computes in float32 (inputs cast up, the output cast back): torch's CPU
flash-attention backward in bf16 is slower than in float32 on the trainer's shapes, and float32 is the
more exact of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

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


class SharedPromptFlex(FlexAttention):
    """TorchTitan's `FlexAttention` (`trainer.attention = "flex"`). Its `attention_masks` is the block
    mask `flex_block_mask` builds once per forward (forward.py; the blocks share it): causal for
    right-padded rows, `shared_prompt_mask_mod` for a packed row, which is then attended as it is, with no
    padded views (FlexAttention skips the blocks the mask empties).

    FlexAttention trains only where torch has its backward (CUDA, Triton: rl_tpu/devices/kernels.py). On CPU the
    forward runs unfused and eager instead of TorchTitan's compiled kernel: for inference, and for the
    tests that check these masks against `SharedPromptSDPA`."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        if q_BLNH.device.type != "cpu":
            return super().forward(
                q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = flex_attention(q, k, v, block_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def shared_prompt_mask_mod(rows: SharedPromptRows):
    """The mask of a packed row as a FlexAttention `mask_mod`: position q sees key k when both belong to
    the same prompt's group, k <= q, and k is a prompt token or in q's own response slot. Groups and
    slots are read off `rows.out_index` (prompt g's tokens come before its responses)."""
    G, P = rows.prompt_index.shape
    R = rows.slot_index.shape[1]
    j = rows.out_index
    in_prompt = j < G * P
    slot = torch.where(in_prompt, -1, (j - G * P) // R)
    group = torch.where(in_prompt, j // P, rows.slot_prompt[slot.clamp(min=0)])

    def mask_mod(b, h, q_idx, kv_idx):
        same = (group[q_idx] == group[kv_idx]) & (kv_idx <= q_idx)
        return same & ((slot[kv_idx] < 0) | (slot[kv_idx] == slot[q_idx]))

    return mask_mod


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_block_mask(rows: SharedPromptRows | None, L: int, device):
    """The block mask of one forward over rows of length `L`: a packed row's (`rows`), else causal."""
    mod = _causal if rows is None else shared_prompt_mask_mod(rows)
    return create_block_mask(mod, None, None, L, L, device=device)
