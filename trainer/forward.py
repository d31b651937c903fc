"""How one trainer rank lays out a batch (its rows, micro-batches, padding) and runs the forward passes.

Invariants:
- Every rank receives the WHOLE batch and takes its rows with `ops.split_rows` (deterministic; the
  same number of micro-batches on every rank, padded with the pad row: row B, `with_pad_row`, whose
  response mask is zero), after `ops.balance_rows` has ordered them so every rank runs about the same
  number of tokens (`trainer.balance_tokens`). Global token/sequence counts are therefore computed
  locally and are identical on all ranks, no all-reduce needed.
- Log-probs come from the log-prob head (`converters.install_logprob_head`) inside the decoder's
  forward; which positions and targets it scores is set on `lm_head.rl_index` just before and cleared
  after, also when the forward raises.
- Static shapes (XLA/TPU compile one program per shape): sequence AND response lengths are padded to
  `buckets`, micro-batches to full size; results leave on the host, cut to the real response length.
- Shared-prompt rows (trainer/attention.py) have data-dependent shapes: never with buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_tpu.config import TrainerConfig
from rl_tpu.devices import Device
from rl_tpu.trainer import ops, parallel
from rl_tpu.types import TrainBatch


def with_pad_row(batch: TrainBatch) -> TrainBatch:
    """Append one row (index B) that contributes nothing: row 0's tokens, zero per-token fields."""
    fields = {}
    for k, v in batch.tensor_fields().items():
        extra = (
            v[:1].clone() if k in ("input_ids", "attention_mask", "prompt_lens") else torch.zeros_like(v[:1])
        )
        fields[k] = torch.cat([v, extra])
    return TrainBatch(**fields)


@dataclass
class Forward:
    """This rank's view of a batch and its forward passes. Fixed at start (the model and device decide
    it); what a restart may change (`trainer.share_prompts`, `balance_tokens`, `micro_batch_size`) comes
    with each call as `tc`."""

    rank: int
    world_size: int
    local: torch.device
    pad_id: int
    max_len: int  # the model's max_position_embeddings
    buckets: list[int]  # static shapes: lengths are padded to these (empty: no padding)
    can_share_prompts: bool  # the model's attention runs shared-prompt rows, and shapes may vary
    flex: bool = False  # the model's attention is FlexAttention: every forward passes its block mask

    @classmethod
    def for_model(cls, spec, device: Device, tc: TrainerConfig, rank: int, world_size: int) -> Forward:
        max_len = int(spec.hf_config.get("max_position_embeddings", 4096))
        # the configured list wins over the device default; graph mode captures one graph per shape
        static = device.static_shapes or tc.mode == "graph"
        buckets = list(tc.seq_len_buckets) or (ops.static_buckets(max_len) if static else [])
        return cls(
            rank=rank,
            world_size=world_size,
            local=device.local_device(),
            pad_id=int(spec.hf_config.get("pad_token_id") or 0),
            max_len=max_len,
            buckets=buckets,
            can_share_prompts=not buckets and spec.shares_prompts,
            flex=spec.attention == "flex",
        )

    def shares_prompts(self, tc: TrainerConfig) -> bool:
        return tc.share_prompts and self.can_share_prompts

    def inputs(self, mb: TrainBatch) -> torch.Tensor:
        ids = mb.input_ids.to(self.local)
        L = ids.shape[1]
        Lb = ops.bucket_length(L, self.buckets)
        if Lb > self.max_len:
            raise ValueError(
                f"batch sequence length {Lb} exceeds the model's max_position_embeddings {self.max_len}"
            )
        if Lb > L:  # right padding keeps every real position's causal context unchanged
            ids = torch.nn.functional.pad(ids, (0, Lb - L), value=self.pad_id)
        return ids

    def policy(self, model, mb: TrainBatch, tc: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy `[b, T]` of the response tokens of a micro-batch: one row per sequence,
        or, where the micro-batch repeats prompts, one packed row holding each prompt once (trainer/attention.py)."""
        packed = None
        # a batch longer than the model's positions takes the plain path, whose error names the limit
        if self.shares_prompts(tc) and mb.input_ids.shape[1] <= self.max_len:
            packed = ops.pack_shared_prompts(
                mb.input_ids, mb.attention_mask, mb.prompt_lens, mb.response_len, self.pad_id
            )
        if packed is None:
            ids = self.inputs(mb)
            hidx, tidx = ops.response_index(mb.prompt_lens.to(self.local), mb.response_len, ids.shape[1])
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None] * ids.shape[1]
            model.lm_head.rl_index = (rows + hidx, ids.gather(1, tidx))
            kwargs = {}
        else:
            packed = packed.to(self.local)
            ids = packed.input_ids
            model.lm_head.rl_index = (packed.hidden_index, packed.targets)
            kwargs = {"positions": packed.positions, "attention_masks": packed.rows}
        kwargs.update(self.flex_masks(packed.rows if packed is not None else None, ids))
        model.rl_micro_batch = (
            mb  # MoE: its engine experts (routing replay, router agreement; metrics.MoeStats)
        )
        try:
            return model(ids, **kwargs)
        finally:
            model.lm_head.rl_index = None
            model.rl_micro_batch = None

    def flex_masks(self, rows: ops.SharedPromptRows | None, ids: torch.Tensor) -> dict:
        """With FlexAttention, the forward's block mask (built once, shared by every block): a packed
        row's, or causal; nothing otherwise (SDPA reads `rows` itself, or is causal)."""
        if not self.flex:
            return {}
        from rl_tpu.trainer.attention import flex_block_mask

        return {"attention_masks": flex_block_mask(rows, ids.shape[1], ids.device)}

    def critic(self, model, mb: TrainBatch) -> torch.Tensor:
        """Values `[b, T]` of the response tokens, read at the state that predicts each."""
        ids = self.inputs(mb)
        v = model(ids, **self.flex_masks(None, ids)).squeeze(-1)  # [b, L]
        hidx, _ = ops.response_index(mb.prompt_lens.to(self.local), mb.response_len, ids.shape[1])
        return v.gather(1, hidx).float()

    def micro_batches(self, padded: TrainBatch, rows: torch.Tensor, tc: TrainerConfig) -> list[torch.Tensor]:
        """Global row indices (B = the pad row) of this rank's micro-batches over `rows`."""
        micro = tc.micro_batch_size
        B = padded.num_seqs - 1
        if tc.balance_tokens and self.world_size > 1 and len(rows) > self.world_size:
            rows = rows[ops.balance_rows(*self.row_costs(padded, rows, tc), self.world_size)]
        ext = torch.cat([rows, torch.tensor([B])])
        out = []
        for local in ops.split_rows(len(rows), self.world_size, self.rank, micro):
            idx = ext[local]
            if self.buckets and len(idx) < micro:  # static shapes: full micro-batches
                idx = torch.cat([idx, torch.full((micro - len(idx),), B)])
            out.append(idx)
        return out

    def row_costs(
        self, batch: TrainBatch, rows: torch.Tensor, tc: TrainerConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens each of `rows` puts through the model, and its prompt's group id (`ops.balance_rows`).
        Where prompts are shared a group's prompt runs once, so each member carries its share of it."""
        plen = batch.prompt_lens[rows]
        group = ops.prompt_groups(batch.input_ids[rows], plen)
        cost = batch.attention_mask[rows].sum(1).to(torch.float64)
        if self.shares_prompts(tc):
            cost = cost - plen + plen / torch.bincount(group)[group]
        return cost, group

    def padded(self, batch: TrainBatch) -> TrainBatch:
        """`batch` plus the pad row, its sequence and response lengths padded to their buckets (static shapes)."""
        if self.buckets:
            L = ops.bucket_length(batch.input_ids.shape[1], self.buckets)
            batch = batch.pad_to(L, ops.bucket_length(batch.response_len, self.buckets), self.pad_id)
        return with_pad_row(batch)

    @torch.no_grad()
    def infer(
        self,
        batch: TrainBatch,
        fn: Callable[[TrainBatch], tuple[torch.Tensor, ...]],
        tc: TrainerConfig,
        models: list[torch.nn.Module | None],
        rows: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """`fn` over this rank's micro-batches of `rows` (default: all): (global row indices, host results
        cut to the response length) per micro-batch; then every one of `models` is resharded."""
        padded = self.padded(batch)
        T = batch.response_len  # results leave without the response bucket's padding
        rows = torch.arange(batch.num_seqs) if rows is None else rows
        out = []
        for idx in self.micro_batches(padded, rows, tc):
            res = fn(padded.select(idx))
            out.append((idx, tuple(r.detach().cpu()[:, :T].float() for r in res)))  # cut on the host
        for m in models:
            if m is not None:
                parallel.reshard(m)  # keep every parameter a DTensor shard between calls
        return out
