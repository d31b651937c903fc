"""The trainer's inner attention: TorchTitan's SDPA, plus rows that carry one prompt and its group's responses.

GRPO samples n responses per prompt, so a batch holds every prompt n times and the trainer would run
each prompt's tokens through every layer n times. A *shared-prompt row* holds the prompt once, followed
by n response slots of R tokens each: `[prompt (P) | response 1 (R) | ... | response n (R)]`. Each
response attends to its prompt's real tokens and causally to itself, never to the other responses, and
takes RoPE positions that continue its prompt's, so every response token sees exactly the context of
its own padded row: the same log-probs (up to fp32 summation order), and the prompt's gradient is the
sum of its n responses' contributions, as with n copies.

The response queries are computed per slot (keys: the prompt, then the slot), not over the whole packed
row with a dense mask: attention stays n * R * (P + R) per group, what the one-row-per-sequence layout
costs for those queries.
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

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                is_causal=True, **kwargs):
        if not isinstance(attention_masks, SharedPromptRows):
            return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, scale=scale,
                                   enable_gqa=enable_gqa, is_causal=is_causal, **kwargs)
        rows = attention_masks
        G, P, n, R = q_BLNH.shape[0], rows.prompt_len, rows.slots, rows.slot_len

        def heads_first(t):  # (B, L, N, H) -> (B, N, L, H)
            return t.transpose(1, 2)

        qp, kp, vp = (heads_first(t[:, :P]) for t in (q_BLNH, k_BLNH, v_BLNH))
        out_p = F.scaled_dot_product_attention(qp, kp, vp, scale=scale, is_causal=True, enable_gqa=enable_gqa)

        def per_slot(t):  # (G, n*R, N, H) -> (G*n, N, R, H)
            return heads_first(t[:, P:].reshape(G * n, R, *t.shape[2:]))

        def prompt_per_slot(t):  # (G, N, P, H) -> (G*n, N, P, H): each slot sees its row's prompt
            return t.repeat_interleave(n, dim=0)

        qr = per_slot(q_BLNH)
        kr = torch.cat([prompt_per_slot(kp), per_slot(k_BLNH)], dim=2)
        vr = torch.cat([prompt_per_slot(vp), per_slot(v_BLNH)], dim=2)
        dev = q_BLNH.device
        to_prompt = torch.arange(P, device=dev)[None, :] < rows.prompt_lens.to(dev)[:, None]  # [G, P]
        causal = torch.ones(R, R, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([to_prompt.repeat_interleave(n, dim=0)[:, None, :].expand(G * n, R, P),
                          causal.expand(G * n, R, R)], dim=2)[:, None]  # [G*n, 1, R, P+R]
        out_r = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        N, H = out_r.shape[1], out_r.shape[3]
        out_r = out_r.transpose(1, 2).reshape(G, n * R, N, H)
        return torch.cat([out_p.transpose(1, 2), out_r], dim=1)
