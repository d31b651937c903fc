"""Typed records that flow through the loop: one field per quantity, never dicts of string keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are made: this module stays cheap to import
    import torch


@dataclass(kw_only=True)
class Completion:
    """One sampled response to one prompt, as a rollout worker returns it."""

    prompt_index: int  # index of the prompt in the request batch
    sample_index: int  # 0..n-1 within the prompt's group
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # log-probability of each response token under the sampling engine; [] if not asked
    finish_reason: str  # "stop" | "length" | ...
    text: str
    policy_version: int  # version of the weights that generated its first token (the oldest)
    # the version that sampled each response token; [] = every token `policy_version` (a partial rollout,
    # `rollout.partial`, continues a sequence on newer weights: its later tokens carry newer versions)
    token_versions: list[int] = field(default_factory=list)
    # 1 where the policy sampled the token (it carries loss); 0 on tokens a multi-turn rollout inserted
    # (an environment's or tool's messages, rollout/multi_turn.py); [] = every token sampled
    loss_mask: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # engine-specific details (worker id, timings)
    # MoE models: the experts the engine routed each position to, `[len(prompt_ids) + len(response_ids) - 1,
    # moe_layers, top_k]` int16 holding expert id + 1, 0 where the engine ran no forward of this request
    # (a prefix-cache hit; the last sampled token is never run); None for dense models
    routed_experts: torch.Tensor | None = None

    def versions(self) -> list[int]:
        """The policy version of each response token."""
        return list(self.token_versions) or [self.policy_version] * len(self.response_ids)


@dataclass(kw_only=True)
class TrainBatch:
    """A padded batch of prompt+response sequences for the trainer (tensors only, no config).

    Layout: row i holds `prompt_lens[i]` prompt tokens then its response, right-padded to `L`
    (`attention_mask` is 1 on real tokens). Response token j of row i sits at
    `input_ids[i, prompt_lens[i] + j]`; every per-token field is `[B, T]` indexed by j, with
    `response_mask[i, j] = 1` on tokens that count in losses. Optional fields are None until the
    stage that fills them (rollout, reference, critic, advantage estimator) has run.
    """

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] 1 on real tokens
    prompt_lens: torch.Tensor  # [B] int64
    response_mask: torch.Tensor  # [B, T] float32
    old_log_probs: torch.Tensor | None = None  # [B, T] trainer log-probs before the update
    ref_log_probs: torch.Tensor | None = None  # [B, T] frozen reference model
    rollout_log_probs: torch.Tensor | None = None  # [B, T] inference engine's (behaviour) log-probs
    policy_versions: torch.Tensor | None = None  # [B, T] version that sampled each token (float32, exact)
    advantages: torch.Tensor | None = None  # [B, T]
    returns: torch.Tensor | None = None  # [B, T] critic targets (GAE)
    values: torch.Tensor | None = None  # [B, T] critic values before the update
    # [B, L, moe_layers, top_k] int16, indexed like input_ids (not by response token): the engine's experts
    # at each position, expert id + 1, 0 = no record (padding included); MoE models only (routing replay)
    routed_experts: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_mask.shape[1])

    def tensor_fields(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def select(self, rows) -> TrainBatch:
        """Rows `rows` (index tensor, list or slice) of every field."""
        return TrainBatch(**{k: v[rows] for k, v in self.tensor_fields().items()})

    def pad_to(self, L: int, T: int, pad_id: int) -> TrainBatch:
        """The same rows right-padded to `L` tokens and `T` response positions (static shapes): new
        tokens are `pad_id` with attention 0, new per-token entries 0 (masked out of every loss)."""
        import torch.nn.functional as F

        if L < self.input_ids.shape[1] or T < self.response_len:
            raise ValueError(
                f"pad_to({L}, {T}) is smaller than the batch ({self.input_ids.shape[1]}, {self.response_len})"
            )
        out = {}
        for k, v in self.tensor_fields().items():
            if k == "input_ids":
                out[k] = F.pad(v, (0, L - v.shape[1]), value=pad_id)
            elif k == "attention_mask":
                out[k] = F.pad(v, (0, L - v.shape[1]))
            elif k == "routed_experts":  # [B, L, layers, k]: 0 = no record
                out[k] = F.pad(v, (0, 0, 0, 0, 0, L - v.shape[1]))
            elif k == "prompt_lens":
                out[k] = v
            else:  # [B, T] per-token fields
                out[k] = F.pad(v, (0, T - v.shape[1]))
        return TrainBatch(**out)

    def replace(self, **fields) -> TrainBatch:
        return TrainBatch(**{**self.__dict__, **fields})

    @classmethod
    def from_sequences(
        cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int, **per_token: list[list[float]]
    ) -> TrainBatch:
        """Right-pad token lists into a batch; `per_token` lists (e.g. `rollout_log_probs=`,
        `advantages=`) are padded to `[B, T]` with zeros. A scalar per row broadcasts over its tokens.
        `per_token["response_mask"]`, if given, replaces the default mask (1 on every response token)."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"TrainBatch: {len(prompts)} prompts but {len(responses)} responses")
        if not prompts:
            raise ValueError("TrainBatch: empty batch")
        B = len(prompts)
        L = max(len(p) + len(r) for p, r in zip(prompts, responses))
        T = max(max(len(r) for r in responses), 1)
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        attn = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, T)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if not p:
                raise ValueError(f"TrainBatch: prompt {i} is empty (a response needs a preceding token)")
            seq = list(p) + list(r)
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attn[i, : len(seq)] = 1
            mask[i, : len(r)] = 1
        extra = {}
        for name, rows in per_token.items():
            if len(rows) != B:
                raise ValueError(f"TrainBatch: `{name}` has {len(rows)} rows, expected {B}")
            t = torch.zeros(B, T)
            for i, (row, r) in enumerate(zip(rows, responses)):
                if isinstance(row, (int, float)):
                    t[i, : len(r)] = float(row)
                else:
                    if len(row) != len(r):
                        raise ValueError(
                            f"TrainBatch: `{name}`[{i}] has {len(row)} values for {len(r)} tokens"
                        )
                    t[i, : len(r)] = torch.tensor(row, dtype=torch.float32)
            extra[name] = t
        mask = extra.pop("response_mask", mask)
        return cls(
            input_ids=ids,
            attention_mask=attn,
            prompt_lens=torch.tensor([len(p) for p in prompts]),
            response_mask=mask,
            **extra,
        )
