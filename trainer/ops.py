"""Pure tensor and index math of the trainer: chunked log-probs, response gathering, LR schedule, row splits.

Invariants:
- `chunked_log_probs` never materialises more than `[N, chunk]` logits: the forward keeps a running
  log-sum-exp over vocabulary chunks, the backward recomputes each chunk's logits. Its values equal
  `log_softmax(h @ W.T).gather(targets)` up to fp32 summation order, and so do its gradients.
- `split_rows` is deterministic and depends only on (B, world_size, micro_batch_size): every rank runs
  the same number of micro-batches (FSDP collectives must match), padding with rows whose
  response mask is zero, so they add nothing to any loss or count. `balance_rows` reorders a batch so
  those blocks carry near-equal tokens; it too depends only on the batch, so every rank agrees.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class _ChunkedLogProbs(torch.autograd.Function):
    """Works on any leading shape `[...]` (hidden `[..., D]`, targets `[...]`) and returns `[...]`
    tensors of its own: never views, which FSDP2 warns about on a module's outputs."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, targets: Tensor, chunk: int, mm: Matmuls):
        shape, acc = targets.shape, torch.promote_types(h.dtype, torch.float32)  # bf16 logits reduce in fp32
        m = torch.full(shape, -math.inf, dtype=acc, device=h.device)
        s = torch.zeros(shape, dtype=acc, device=h.device)  # sum exp(z - m)
        t = torch.zeros(shape, dtype=acc, device=h.device)  # sum exp(z - m) * z
        tgt = torch.zeros(shape, dtype=acc, device=h.device)
        for lo in range(0, w.shape[0], chunk):
            z = mm.fwd(h, w[lo : lo + chunk]).to(acc)
            m_new = torch.maximum(m, z.max(dim=-1).values)
            scale = torch.exp(m - m_new)
            e = torch.exp(z - m_new[..., None])
            s = s * scale + e.sum(dim=-1)
            t = t * scale + (e * z).sum(dim=-1)
            m = m_new
            inside = (targets >= lo) & (targets < lo + z.shape[-1])
            idx = (targets - lo).clamp(0, z.shape[-1] - 1)
            tgt = torch.where(inside, z.gather(-1, idx[..., None])[..., 0], tgt)
        lse = m + torch.log(s)
        ez = t / s  # E_p[z]
        ctx.save_for_backward(h, w, targets, lse, ez)
        ctx.chunk, ctx.mm = chunk, mm
        return tgt - lse, lse - ez  # log p(target), entropy

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None):
        h, w, targets, lse, ez = ctx.saved_tensors
        chunk, mm = ctx.chunk, ctx.mm
        acc = lse.dtype
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(acc)
        grad_h = torch.zeros(h.shape, dtype=acc, device=h.device)
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device)
        h2 = h.reshape(-1, h.shape[-1])
        for lo in range(0, w.shape[0], chunk):
            wc = w[lo : lo + chunk]
            z = mm.fwd(h, wc).to(acc)
            p = torch.exp(z - lse[..., None])
            dz = -g_lp[..., None] * p  # d log p_t / dz_k = 1[k = t] - p_k
            inside = (targets >= lo) & (targets < lo + z.shape[-1])
            idx = (targets - lo).clamp(0, z.shape[-1] - 1)
            dz.scatter_add_(-1, idx[..., None], (g_lp * inside)[..., None])
            if g_ent is not None:  # d H / dz_k = p_k (E_p[z] - z_k)
                dz = dz + g_ent.to(acc)[..., None] * p * (ez[..., None] - z)
            dz = dz.to(h.dtype)
            grad_h += mm.dgrad(dz, wc.T)
            grad_w[lo : lo + chunk] = mm.wgrad(dz.reshape(-1, dz.shape[-1]).T, h2.T)
        return grad_h.to(h.dtype), grad_w.to(w.dtype), None, None, None


def mm_t(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b.T`."""
    return a @ b.T


class Matmuls(NamedTuple):
    """The kernels of a linear map's three matmuls, each `(a, b) -> a @ b.T`: the forward `x @ W.T`, the
    input gradient `gy @ W` and the weight gradient `gy.T @ x` (trainer/cpu_matmul.py picks them on CPU)."""

    fwd: Callable[[Tensor, Tensor], Tensor] = mm_t
    dgrad: Callable[[Tensor, Tensor], Tensor] = mm_t
    wgrad: Callable[[Tensor, Tensor], Tensor] = mm_t


def chunked_log_probs(
    h: Tensor, w: Tensor, targets: Tensor, chunk: int, mm: Matmuls = Matmuls()
) -> tuple[Tensor, Tensor]:
    """Log-prob of `targets` `[...]` and entropy `[...]` under logits `h @ w.T`, `h` `[..., D]`, `w`
    `[V, D]`, computed `chunk` vocabulary rows at a time (memory O(N * chunk), not O(N * V)), with
    `mm`'s kernels."""
    if targets.numel() == 0:
        return h.new_zeros(targets.shape, dtype=torch.float32), h.new_zeros(
            targets.shape, dtype=torch.float32
        )
    return _ChunkedLogProbs.apply(h, w, targets, int(chunk), mm)


def full_log_probs(h: Tensor, w: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """`chunked_log_probs` with the whole `[..., V]` logits at once, differentiated by autograd: no
    recompute of the head's matmul in backward, for O(N * V) memory (log-softmax keeps its output)."""
    acc = torch.promote_types(h.dtype, torch.float32)  # bf16 logits reduce in fp32, as the chunked head
    logp = torch.log_softmax((h @ w.T).to(acc), dim=-1)
    # new tensors, not views of `logp`: FSDP2 warns about views among a module's outputs
    return logp.gather(-1, targets[..., None])[..., 0] * 1.0, -(logp.exp() * logp).sum(dim=-1)


def response_index(prompt_lens: Tensor, T: int, L: int) -> tuple[Tensor, Tensor]:
    """Positions `[B, T]` of the hidden state predicting response token j (prompt_len + j - 1) and of
    the token itself (prompt_len + j), clamped into `[0, L)` (out-of-range ones are masked anyway)."""
    j = torch.arange(T, device=prompt_lens.device)[None, :]
    tok = prompt_lens[:, None].long() + j
    return (tok - 1).clamp(0, L - 1), tok.clamp(0, L - 1)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warmup from 1/(warmup+1), then constant
    or cosine decay to `min_lr_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"trainer.lr_schedule must be 'constant' or 'cosine', got {schedule!r}")
    decay = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def split_rows(B: int, world_size: int, rank: int, micro_batch_size: int) -> list[Tensor]:
    """Row indices of each micro-batch this rank runs, over a batch of B rows; index B means a padding
    row. Rank r takes the contiguous block r of ceil(B / world) rows, in micro-batches of at most
    `micro_batch_size`; all ranks get the same number of micro-batches."""
    per_rank = max(math.ceil(B / world_size), 1)
    rows = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    rows = torch.where(rows < B, rows, torch.full_like(rows, B))
    return list(rows.split(micro_batch_size))


def prompt_groups(input_ids: Tensor, prompt_lens: Tensor) -> Tensor:
    """Group id of each row `[b]`: rows whose prompt tokens are equal share one, numbered 0, 1, ... in
    order of first appearance (a GRPO group's samples; what `pack_shared_prompts` runs once)."""
    keys: dict[tuple[int, ...], int] = {}
    return torch.tensor(
        [
            keys.setdefault(tuple(input_ids[i, :p].tolist()), len(keys))
            for i, p in enumerate(prompt_lens.tolist())
        ],
        dtype=torch.long,
    )


def _members(group: list[int]) -> dict[int, list[int]]:
    """Row indices of each group id, in order of first appearance."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        members.setdefault(g, []).append(i)
    return members


def balance_rows(cost: Tensor, group: Tensor, world_size: int) -> Tensor:
    """An order of B rows whose contiguous blocks (`split_rows`: ceil(B / world) rows per rank) carry
    near-equal `cost` (tokens): a step waits for its slowest rank. `group[i]` names row i's prompt;
    rows of one prompt stay on one rank where a rank has room for all of them (their prompt then runs
    once there: `pack_shared_prompts`). Greedy: groups by cost, largest first, each to the least-loaded
    rank with room, split over ranks only when no rank has room left for the whole group. Each rank runs
    its groups longest first. Deterministic (ties by rank, then row), so every rank computes the same."""
    B = len(cost)
    per_rank = max(math.ceil(B / world_size), 1)
    room = [min(per_rank, max(B - r * per_rank, 0)) for r in range(world_size)]
    load = [0.0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    gid = group.tolist()
    members = _members(gid)
    c = cost.tolist()
    units = sorted(members.values(), key=lambda rows: (-sum(c[i] for i in rows), rows[0]))
    for rows in units:
        while rows:
            fits = [r for r in range(world_size) if room[r] >= len(rows)] or [
                r for r in range(world_size) if room[r]
            ]
            r = min(fits, key=lambda r: (load[r], r))
            take, rows = rows[: room[r]], rows[room[r] :]
            owned[r] += take
            room[r] -= len(take)
            load[r] += sum(c[i] for i in take)
    # within a rank, groups longest first: a micro-batch's response slots pad to its longest response, so
    # groups of like lengths share micro-batches
    longest = {g: max(c[i] for i in rows) for g, rows in members.items()}
    return torch.tensor(
        [i for rows in owned for i in sorted(rows, key=lambda i: (-longest[gid[i]], gid[i], i))],
        dtype=torch.long,
    )


def static_buckets(max_len: int, smallest: int = 16) -> list[int]:
    """Default length buckets of a static-shape device (`Device.static_shapes`) when
    `trainer.seq_len_buckets` is empty: powers of two from `smallest`, then `max_len` itself. At most
    log2(max_len / smallest) + 1 shapes per dimension, so at most that many compilations."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def bucket_length(L: int, buckets: list[int]) -> int:
    """Smallest bucket >= L (static shapes for XLA/TPU); L itself when no buckets are configured."""
    if not buckets:
        return L
    for b in sorted(buckets):
        if b >= L:
            return b
    raise ValueError(f"sequence length {L} exceeds the largest trainer.seq_len_buckets entry {max(buckets)}")


@dataclass(frozen=True)
class SharedPromptRows:
    """Layout of a packed micro-batch `[1, L]` (trainer/attention.py), passed to the model as its
    `attention_masks`: each prompt once, then its responses, no padding. Attention runs on padded views
    gathered from the packed positions: prompts `[G, P]`, response slots `[S, R]`."""

    prompt_index: Tensor  # [G, P] packed position of prompt g's token t (0 past the prompt: never read)
    slot_index: Tensor  # [S, R] packed position of slot s's token t (0 past the slot: never read)
    slot_prompt: Tensor  # [S] the prompt (row of prompt_index) slot s follows
    slot_mask: Tensor  # [S, 1, R, P + R] keys a slot's queries see: its prompt's real tokens, itself causally
    out_index: Tensor  # [L] row of cat(prompt outputs [G * P], slot outputs [S * R]) for each packed position

    def to(self, device) -> SharedPromptRows:
        return _fields_to(self, device)


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch as one packed row, and where each response token's log-prob is read."""

    input_ids: Tensor  # [1, L]
    positions: Tensor  # [1, L] RoPE positions: a response continues its prompt's
    rows: SharedPromptRows
    hidden_index: Tensor  # [b, T] index into the L packed hidden states of the position predicting token j
    targets: Tensor  # [b, T] response token j (pad_id past the response)

    def to(self, device) -> PackedBatch:
        return _fields_to(self, device)


def _fields_to(obj, device):
    """A copy of dataclass `obj` with every field (a tensor, or anything with `.to`) moved to `device`."""
    return type(obj)(**{f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)})


def pack_shared_prompts(
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_lens: Tensor,
    T: int,
    pad_id: int,
    min_repeat: float = 2.0,
) -> PackedBatch | None:
    """A right-padded micro-batch `[b, L]` whose rows repeat prompts as one packed row: each distinct
    prompt once, followed by its responses, with no padding; None unless each prompt comes
    `min_repeat` times on average (GRPO groups; a batch of mostly distinct prompts, as in SFT, keeps one
    row per sequence).

    A response's last token predicts nothing, so it is left out: a response of r tokens takes r - 1
    positions (its token 0 is predicted by the prompt's last position)."""
    b = input_ids.shape[0]
    plen = prompt_lens.tolist()
    rlen = (attention_mask.sum(1) - prompt_lens).clamp(min=0).tolist()
    groups = _members(prompt_groups(input_ids, prompt_lens).tolist())
    if len(groups) * min_repeat > b:
        return None
    G, P, R = len(groups), max(plen), max(max(r - 1 for r in rlen), 1)
    prompt_index = torch.zeros(G, P, dtype=torch.long)
    slot_index = torch.zeros(b, R, dtype=torch.long)
    slot_prompt = torch.zeros(b, dtype=torch.long)
    to_prompt = torch.zeros(b, P, dtype=torch.bool)
    hidden = torch.zeros(b, T, dtype=torch.long)
    targets = torch.full((b, T), pad_id, dtype=input_ids.dtype)
    ids, pos, out_index = [], [], []
    j = torch.arange(T)
    at, s = 0, 0  # next packed position, next slot
    for g, members in enumerate(groups.values()):
        p = plen[members[0]]
        ids.append(input_ids[members[0], :p])
        pos.append(torch.arange(p))
        prompt_index[g, :p] = torch.arange(at, at + p)
        out_index.append(g * P + torch.arange(p))
        last, at = at + p - 1, at + p
        for i in members:
            r = rlen[i]
            n = max(r - 1, 0)
            ids.append(input_ids[i, p : p + n])
            pos.append(torch.arange(p, p + n))
            slot_index[s, :n] = torch.arange(at, at + n)
            out_index.append(G * P + s * R + torch.arange(n))
            slot_prompt[s] = g
            to_prompt[s, :p] = True
            # token 0 is predicted by the prompt's last position, token j > 0 by the slot's position j - 1
            # (past the response: the prompt's last position, masked out of every loss)
            hidden[i] = torch.where((j > 0) & (j < r), at + j - 1, last)
            targets[i, :r] = input_ids[i, p : p + r]
            at, s = at + n, s + 1
    causal = torch.ones(R, R, dtype=torch.bool).tril()
    slot_mask = torch.cat([to_prompt[:, None, :].expand(b, R, P), causal.expand(b, R, R)], dim=2)[:, None]
    rows = SharedPromptRows(prompt_index, slot_index, slot_prompt, slot_mask, torch.cat(out_index))
    return PackedBatch(
        input_ids=torch.cat(ids)[None],
        positions=torch.cat(pos)[None],
        rows=rows,
        hidden_index=hidden,
        targets=targets,
    )
