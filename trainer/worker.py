"""`TrainerWorker`: one trainer rank (a Ray actor) holding the FSDP2 policy, optional frozen reference
and optional critic, all TorchTitan models whose parameters are DTensors.

Invariants:
- Every rank receives the WHOLE batch and takes its rows with `ops.split_rows` (deterministic; the
  same number of micro-batches on every rank, padded with zero-mask rows), after `ops.balance_rows`
  has ordered them so every rank runs about the same number of tokens (`trainer.balance_tokens`).
  Global token/sequence counts are therefore computed locally and are identical on all ranks, no
  all-reduce needed.
- Gradients are summed across micro-batches and ranks (FSDP sum reduction, see `parallel.py`); each
  micro-batch's loss is its share of the whole mini-batch loss (`global_tokens` / `global_seqs`),
  so N ranks x M micro-batches give the same update as one rank with one micro-batch.
- Log-probs come from `ops.chunked_log_probs` run as the lm_head's forward (replaced, see
  `_install_logprob_head`), inside the decoder's forward: FSDP then unshards the weight and
  reduce-scatters its gradient exactly as for logits, and logits `[b, L, V]` are never materialised.
- The critic is the same TorchTitan decoder whose `lm_head` is a `Linear(hidden, 1)` (with bias):
  the value of response token j is read at the state that predicts it, like the log-prob.
- Optimizer steps per `train_step` = ppo_epochs x ppo_mini_batches; mini-batches are contiguous row
  blocks in batch order (no shuffling), the LR schedule advances once per optimizer step.
- Lazy-tensor devices (XLA): every optimizer step ends its graph (`Device.step_end`) before the step's
  single read of the metrics, so each step is ONE program, the same for every step of a shape bucket;
  the optimizer state exists (zeros) before the first step for the same reason, and device results
  are moved to the host before they are cut to the real lengths. `perf/compiles` counts the programs
  compiled by this rank so far.
Methods that touch parameters are collective: the group calls them on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rl_tpu.config import AlgorithmConfig, Config, TrainerConfig, resolved_dtype
from rl_tpu.devices import get_device
from rl_tpu.trainer import cpu_matmul, ops, parallel
from rl_tpu.trainer import model as tmodel
from rl_tpu.types import TrainBatch
from rl_tpu.weight_sync.specs import ParamSpec


def _install_logprob_head(lm_head: torch.nn.Module, chunk: int, mm: ops.Matmuls = ops.Matmuls()) -> None:
    """Make the lm_head return (log-probs, entropy) `[b, T]` of the response tokens instead of logits.

    The decoder calls it inside its own forward (so FSDP's grouped norm+lm_head unit sees a normal
    forward/backward); which positions and targets to score is set on `lm_head.rl_index` just before.
    """
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("chunked log-probs assume an lm_head without bias")

    def forward(h: torch.Tensor):
        hidx, targets = lm_head.rl_index  # hidx: [b, T] flat indices into h's [B * L] positions
        hs = h.reshape(-1, h.shape[-1])[hidx]  # [b, T, D]
        # verl scores tokens at the sampling temperature (logits / t); (h / t) @ W.T is the same thing
        if lm_head.rl_temperature != 1.0:
            hs = hs / lm_head.rl_temperature
        return ops.chunked_log_probs(hs, lm_head.weight, targets, chunk, mm)  # [b, T] each, not views

    lm_head.rl_index = None
    lm_head.rl_temperature = 1.0
    lm_head.forward = forward  # FSDP hooks live in __call__, so they still wrap this


def _with_pad_row(batch: TrainBatch) -> TrainBatch:
    """Append one row (index B) that contributes nothing: row 0's tokens, zero per-token fields."""
    fields = {}
    for k, v in batch.tensor_fields().items():
        extra = (
            v[:1].clone() if k in ("input_ids", "attention_mask", "prompt_lens") else torch.zeros_like(v[:1])
        )
        fields[k] = torch.cat([v, extra])
    return TrainBatch(**fields)


# what `restart_from` may change: the optimizer, its schedule and the step's batching and row layout; the
# rest shapes the processes, the model build or the sharding and is fixed at start
RESTARTABLE = frozenset(
    {
        "total_steps",
        "lr",
        "weight_decay",
        "betas",
        "warmup_steps",
        "lr_schedule",
        "min_lr_ratio",
        "grad_clip",
        "ppo_epochs",
        "ppo_mini_batches",
        "micro_batch_size",
        "share_prompts",
        "skip_zero_advantage",
        "balance_tokens",
        "test_freq",
        "seed",
    }
)


def restart_conflicts(old: TrainerConfig, new: TrainerConfig) -> list[str]:
    """The fields of `new` outside RESTARTABLE that differ from `old` (a restart cannot apply them)."""
    return [
        f.name
        for f in dataclasses.fields(old)
        if f.name not in RESTARTABLE and getattr(old, f.name) != getattr(new, f.name)
    ]


def check_restartable(old: TrainerConfig, new: TrainerConfig, who: str) -> None:
    """ValueError naming the fields a restart from `old` to `new` cannot apply (`restart_conflicts`)."""
    fixed = restart_conflicts(old, new)
    if fixed:
        raise ValueError(
            f"{who}: {', '.join('trainer.' + f for f in fixed)} differ from the trainer's; they are "
            "fixed when its processes start (start a new TrainerGroup)"
        )


class TrainerWorker:
    def __init__(
        self, cfg: Config, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int
    ):
        tc = cfg.trainer
        self.cfg, self.tc, self.rank, self.world_size = cfg, tc, rank, world_size
        self.model_path = str(model_path)
        self.device = get_device(tc.device)
        self.device.init()  # imports the device runtime and registers its distributed backend
        torch.set_num_threads(tc.num_threads)
        parallel.init_process_group(self.device, rank, world_size, master_addr, master_port)
        self.device.seed(tc.seed)
        self.local = self.device.local_device()

        self.spec = tmodel.build_model_spec(model_path)
        self.pad_id = int(self.spec.hf_config.get("pad_token_id") or 0)
        self.max_len = int(self.spec.hf_config.get("max_position_embeddings", 4096))
        # static shapes (XLA/TPU compile one program per shape): sequence AND response lengths are padded
        # to these buckets, micro-batches to full size; the configured list wins over the device default
        self.buckets = list(tc.seq_len_buckets) or (
            ops.static_buckets(self.max_len) if self.device.static_shapes else []
        )
        # shared-prompt rows have data-dependent shapes: not on static-shape devices
        self.can_share_prompts = not self.buckets and self.spec.shares_prompts
        self.pdims = parallel.make_parallel_dims(self.device, world_size)
        # float32 CPU linears: kernels per (shape, matmul) from trainer.cpu_matmul (trainer/cpu_matmul.py)
        self.tune_matmuls = (
            tc.cpu_matmul != "aten"
            and self.local.type == "cpu"
            and cpu_matmul.available()
            and resolved_dtype(tc.param_dtype, self.cfg) == "float32"
        )
        self.matmul_table: dict[str, dict[str, str]] = {}
        self.matmul_cached = True
        titan_sd = tmodel.hf_to_titan(self.spec, tmodel.load_hf_state_dict(model_path))
        self.replicated_step = parallel.replicated_step(
            tc.fsdp_step, sum(t.numel() for t in titan_sd.values())
        )

        self.model = self._build(self.spec, titan_sd)
        self.optimizer, self.scheduler = self._optimizer(self.model, tc.lr)
        self.ref = None
        if tc.reference:
            self.ref = self._build(self.spec, titan_sd)
            self.ref.requires_grad_(False)
            self.ref.eval()
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        if tc.critic:
            self.critic = self._build_critic(titan_sd)
            self.critic_optimizer, self.critic_scheduler = self._optimizer(self.critic, tc.critic_lr)
        self.step = 0  # optimizer steps taken by the policy
        self._host: dict[str, torch.Tensor] | None = None  # host copy of the weights (lazy devices' sync)
        self.device.step_end()  # loaded weights and optimizer state become device data before step 1
        if self.device.lazy_tensors:
            self._host_shards()  # XLA compiles a transfer program per parameter shape: now, not after step 1

    # ------------------------------------------------------------------ construction

    def _parallel_model(self, spec, extra_shapes: tuple[tuple[int, int], ...] = ()) -> torch.nn.Module:
        m = parallel.build_parallel_model(
            spec,
            self.pdims,
            self.device,
            param_dtype=resolved_dtype(self.tc.param_dtype, self.cfg),
            reduce_dtype=self.tc.reduce_dtype,
            reshard_after_forward="never" if self.replicated_step else "default",
        )
        if self.tune_matmuls:
            self._resolve_matmuls(cpu_matmul.linear_shapes(m) | set(extra_shapes))
            cpu_matmul.install(m, self._matmuls)
        return m

    def _resolve_matmuls(self, shapes: set[tuple[int, int]]) -> None:
        """Fill `matmul_table` for `shapes` (collective: every rank builds the same models in the same order,
        so with "auto" all ranks read the same cache entries or time the same shapes and agree)."""
        todo = sorted(s for s in shapes if f"{s[0]},{s[1]}" not in self.matmul_table)
        if not todo:
            return

        def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t)
            return t

        table, cached = cpu_matmul.resolve(
            self.tc.cpu_matmul,
            todo,
            torch.get_num_threads(),
            sum_over_ranks if self.world_size > 1 else None,
            is_writer=self.rank == 0,
            ranks=self.world_size,
        )
        self.matmul_table.update(table)
        self.matmul_cached = self.matmul_cached and cached

    def _matmuls(self, k: int, n: int) -> ops.Matmuls:
        """The kernels of a `[.., k] -> [.., n]` linear (aten's when not tuned)."""
        table = self.matmul_table.get(f"{k},{n}")
        return cpu_matmul.matmuls(table) if table else ops.Matmuls()

    def _build(self, spec, titan_sd) -> torch.nn.Module:
        hf = spec.hf_config  # TorchTitan 0.2.0's configs (titan_compat) name these differently
        head = (
            int(hf["hidden_size"]),
            min(self.tc.logprob_chunk_size, int(hf["vocab_size"])),
        )  # log-prob head's matmuls
        m = self._parallel_model(spec, (head,))
        parallel.load_full_state_dict(m, titan_sd)
        _install_logprob_head(m.lm_head, self.tc.logprob_chunk_size, self._matmuls(*head))
        return m

    def _build_critic(self, titan_sd) -> torch.nn.Module:
        from torchtitan.models.common import Linear

        dim = self.spec.config.dim
        head = Linear.Config(
            in_features=dim,
            out_features=1,
            bias=True,
            param_init={"weight": torch.nn.init.zeros_, "bias": torch.nn.init.zeros_},
        )
        cspec = dataclasses.replace(
            self.spec, config=dataclasses.replace(self.spec.config, lm_head=head, enable_weight_tying=False)
        )
        m = self._parallel_model(cspec)
        g = torch.Generator().manual_seed(self.tc.seed + 1)  # same value head on every rank
        sd = {k: v for k, v in titan_sd.items() if not k.startswith("lm_head.")}
        sd["lm_head.weight"] = torch.randn(1, dim, generator=g) * 0.02
        sd["lm_head.bias"] = torch.zeros(1)
        parallel.load_full_state_dict(m, sd)
        return m

    def _optimizer(self, model: torch.nn.Module, lr: float):
        tc = self.tc
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay, eps=1e-8)
        if self.device.lazy_tensors:
            _zero_adamw_state(opt)
        total = max(tc.total_steps * tc.ppo_epochs * tc.ppo_mini_batches, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: ops.lr_factor(
                s,
                warmup_steps=tc.warmup_steps,
                total_steps=total,
                schedule=tc.lr_schedule,
                min_lr_ratio=tc.min_lr_ratio,
            ),
        )
        return opt, sched

    def ready(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "arch": self.spec.arch,
            "params": sum(p.numel() for p in self.model.parameters()),
            # what `trainer.fsdp_step` resolved to; devices without FSDP2 (xla) train unsharded
            "fsdp_step": "unsharded"
            if self.pdims is None
            else "replicated"
            if self.replicated_step
            else "sharded",
            # what `trainer.cpu_matmul` resolved to: a kernel, or how many matmuls each runs; its table
            "matmul": cpu_matmul.summary(self.matmul_table) if self.matmul_table else "aten",
            "matmul_table": self.matmul_table,
            "matmul_cached": self.matmul_cached,
        }

    # ------------------------------------------------------------------ forward helpers

    def _inputs(self, mb: TrainBatch) -> torch.Tensor:
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

    def _policy_forward(self, model, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy `[b, T]` of the response tokens of a micro-batch: one row per sequence,
        or, where the micro-batch repeats prompts, one packed row holding each prompt once (trainer/attention.py)."""
        packed = None
        # a batch longer than the model's positions takes the plain path, whose error names the limit
        if self.tc.share_prompts and self.can_share_prompts and mb.input_ids.shape[1] <= self.max_len:
            packed = ops.pack_shared_prompts(
                mb.input_ids, mb.attention_mask, mb.prompt_lens, mb.response_len, self.pad_id
            )
        if packed is None:
            ids = self._inputs(mb)
            hidx, tidx = ops.response_index(mb.prompt_lens.to(self.local), mb.response_len, ids.shape[1])
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None] * ids.shape[1]
            model.lm_head.rl_index = (rows + hidx, ids.gather(1, tidx))
            kwargs = {}
        else:
            packed = packed.to(self.local)
            ids = packed.input_ids
            model.lm_head.rl_index = (packed.hidden_index, packed.targets)
            kwargs = {"positions": packed.positions, "attention_masks": packed.rows}
        try:
            return model(ids, **kwargs)
        finally:
            model.lm_head.rl_index = None

    def _critic_forward(self, mb: TrainBatch) -> torch.Tensor:
        ids = self._inputs(mb)
        v = self.critic(ids).squeeze(-1)  # [b, L]
        hidx, _ = ops.response_index(mb.prompt_lens.to(self.local), mb.response_len, ids.shape[1])
        return v.gather(1, hidx).float()

    def _micro_batches(self, padded: TrainBatch, rows: torch.Tensor, micro: int) -> list[torch.Tensor]:
        """Global row indices (B = the pad row) of this rank's micro-batches over `rows`."""
        B = padded.num_seqs - 1
        if self.tc.balance_tokens and self.world_size > 1 and len(rows) > self.world_size:
            rows = rows[ops.balance_rows(*self._row_costs(padded, rows), self.world_size)]
        ext = torch.cat([rows, torch.tensor([B])])
        out = []
        for local in ops.split_rows(len(rows), self.world_size, self.rank, micro):
            idx = ext[local]
            if self.buckets and len(idx) < micro:  # static shapes: full micro-batches
                idx = torch.cat([idx, torch.full((micro - len(idx),), B)])
            out.append(idx)
        return out

    def _row_costs(self, batch: TrainBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens each of `rows` puts through the model, and its prompt's group id (`ops.balance_rows`).
        Where prompts are shared a group's prompt runs once, so each member carries its share of it."""
        plen = batch.prompt_lens[rows]
        group = ops.prompt_groups(batch.input_ids[rows], plen)
        cost = batch.attention_mask[rows].sum(1).to(torch.float64)
        if self.tc.share_prompts and self.can_share_prompts:
            cost = cost - plen + plen / torch.bincount(group)[group]
        return cost, group

    def _padded(self, batch: TrainBatch) -> TrainBatch:
        """`batch` plus the pad row, its sequence and response lengths padded to their buckets (static shapes)."""
        if self.buckets:
            L = ops.bucket_length(batch.input_ids.shape[1], self.buckets)
            batch = batch.pad_to(L, ops.bucket_length(batch.response_len, self.buckets), self.pad_id)
        return _with_pad_row(batch)

    @torch.no_grad()
    def _infer(
        self, batch: TrainBatch, fn, rows: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        padded = self._padded(batch)
        T = batch.response_len  # results leave without the response bucket's padding
        rows = torch.arange(batch.num_seqs) if rows is None else rows
        out = []
        for idx in self._micro_batches(padded, rows, self.tc.micro_batch_size):
            res = fn(padded.select(idx))
            out.append(
                (idx, tuple(r.detach().cpu()[:, :T].float() for r in res))
            )  # cut on the host: static shapes
        for m in (self.model, self.ref, self.critic):
            if m is not None:
                parallel.reshard(m)  # keep every parameter a DTensor shard between calls
        return out

    # ------------------------------------------------------------------ public (collective) methods

    def compute_log_probs(self, batch: TrainBatch, entropy: bool = False, rows: torch.Tensor | None = None):
        self.model.eval()
        res = self._infer(batch, lambda mb: self._policy_forward(self.model, mb), rows)
        return [(i, r if entropy else r[:1]) for i, r in res]

    def compute_ref_log_probs(self, batch: TrainBatch, rows: torch.Tensor | None = None):
        if self.ref is None:
            raise RuntimeError("compute_ref_log_probs needs trainer.reference = true")
        return [
            (i, r[:1]) for i, r in self._infer(batch, lambda mb: self._policy_forward(self.ref, mb), rows)
        ]

    def compute_values(self, batch: TrainBatch):
        if self.critic is None:
            raise RuntimeError("compute_values needs trainer.critic = true")
        self.critic.eval()
        return self._infer(batch, lambda mb: (self._critic_forward(mb),))

    def train_step(self, batch: TrainBatch, algo: AlgorithmConfig) -> dict[str, float]:
        if batch.advantages is None:
            raise ValueError("train_step: TrainBatch.advantages is None (run the advantage estimator first)")
        t0 = time.perf_counter()
        tc = self.tc
        stats = []
        self.model.train()
        actor_loss = self._actor_loss(algo)
        from rl_tpu.algorithms.losses import compute_value_loss, mini_batch_rows

        skip = self._skips_zero_advantage(algo)
        for _ in range(tc.ppo_epochs):
            for rows in mini_batch_rows(batch.num_seqs, tc.ppo_mini_batches):
                stats.append(
                    self._update(
                        batch,
                        rows,
                        self.model,
                        self.optimizer,
                        self.scheduler,
                        actor_loss,
                        "actor",
                        skip_zero_advantage=skip,
                    )
                )
                self.step += 1
        if self.critic is not None and batch.returns is not None:
            self.critic.train()

            def critic_loss(mb, g_tok, g_seq):
                v = self._critic_forward(mb)
                old = mb.values.to(self.local) if mb.values is not None else v.detach()
                return compute_value_loss(
                    v,
                    old,
                    mb.returns.to(self.local),
                    mb.response_mask.to(self.local),
                    algo.cliprange_value,
                    global_tokens=g_tok,
                )

            for _ in range(tc.ppo_epochs):
                for rows in mini_batch_rows(batch.num_seqs, tc.ppo_mini_batches):
                    stats.append(
                        self._update(
                            batch,
                            rows,
                            self.critic,
                            self.critic_optimizer,
                            self.critic_scheduler,
                            critic_loss,
                            "critic",
                        )
                    )
        if self.ref is not None:
            parallel.reshard(self.ref)  # the reference may have run inside the actor loss
        out = _mean_dicts(stats)
        tokens = float(batch.attention_mask.sum())
        elapsed = time.perf_counter() - t0
        out.update({"actor/step": float(self.step), "perf/train_tokens": tokens, "perf/train_s": elapsed})
        compiles = self.device.compile_count()
        if compiles is not None:
            out["perf/compiles"] = float(compiles)
        return out

    def _actor_loss(self, algo: AlgorithmConfig):
        from rl_tpu.algorithms.losses import compute_policy_loss

        def dev(t):
            return None if t is None else t.to(self.local)

        def loss(mb: TrainBatch, g_tok: float, g_seq: float):
            lp, ent = self._policy_forward(self.model, mb)
            # on-policy (one epoch, one mini-batch): the pre-update log-probs are this very forward's, so
            # the loop skips its separate pass and the ratio is exactly 1 (the clip cannot bind)
            old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
            ref = mb.ref_log_probs
            if ref is None and algo.use_kl_loss and self.ref is not None:
                with torch.no_grad():  # the reference's forward in the same call: the batch crosses once
                    ref = self._policy_forward(self.ref, mb)[0]
            return compute_policy_loss(
                algo,
                lp,
                dev(old),
                dev(mb.advantages),
                dev(mb.response_mask),
                ref_log_prob=dev(ref),
                entropy=ent,
                rollout_log_prob=dev(mb.rollout_log_probs),
                global_tokens=g_tok,
                global_seqs=g_seq,
            )

        return loss

    def _skips_zero_advantage(self, algo: AlgorithmConfig) -> bool:
        from rl_tpu.algorithms.losses import zero_advantage_inert

        return self.tc.skip_zero_advantage and zero_advantage_inert(algo)

    def policy_grads(
        self, batch: TrainBatch, algo: AlgorithmConfig
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Full gradient of the policy loss over the whole batch (one mini-batch), without stepping:
        what `train_step` would clip and apply, and the loss metrics. For verification; leaves no
        gradient behind."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows, skip = torch.arange(batch.num_seqs), self._skips_zero_advantage(algo)
        run = self._rows_to_run(batch, rows, skip)
        metrics = self._reduce(*self._accumulate(batch, rows, self.model, self._actor_loss(algo), run))
        if skip:
            metrics["actor/skipped_frac"] = 1 - len(run) / max(len(rows), 1)
        out = {}
        for n, p in self.model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ref is not None:
            parallel.reshard(self.ref)
        return out, metrics

    def _rows_to_run(self, batch: TrainBatch, rows: torch.Tensor, skip_zero_advantage: bool) -> torch.Tensor:
        """`rows` less the sequences whose advantage is zero on every token, when `skip_zero_advantage`
        (the loss gives them exactly zero gradient: `losses.zero_advantage_inert`). When no sequence has
        an advantage each rank still runs one of them (its gradient is exactly zero too), so the step's
        token metrics (actor/entropy, mismatch/*) keep a sample instead of vanishing from the log."""
        if not skip_zero_advantage:
            return rows
        from rl_tpu.algorithms.losses import rows_to_run

        return rows[rows_to_run(batch.advantages[rows], batch.response_mask[rows], self.world_size)]

    def _accumulate(
        self, batch, rows, model, loss_fn, run: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
        """Forward/backward of this rank's micro-batches of mini-batch `rows` (gradients add up); only
        the rows in `run` (default: all) are run, but all of `rows` normalise the loss. A rank with nothing
        to run runs one padding row, so every rank joins the same collectives.

        Metrics stay device tensors (float64 sums, as exact as the former Python-float sums): nothing
        here waits for the device, so on XLA/TPU the micro-batches trace without a host sync."""
        padded = self._padded(batch)
        mask = batch.response_mask[rows]
        g_tok, g_seq = float(mask.sum()), float((mask.sum(1) > 0).sum())  # host tensors: no device sync
        sums: dict[str, torch.Tensor] = {}
        weighted: dict[str, torch.Tensor] = {}
        weight = 0.0
        micro = self._micro_batches(padded, rows if run is None else run, self.tc.micro_batch_size)
        defer = self.replicated_step and isinstance(model, FSDPModule) and len(micro) > 1
        try:
            for i, idx in enumerate(micro):
                if defer:  # gradients stay full and local until the last micro-batch, then one reduce-scatter
                    last = i == len(micro) - 1
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                mb = padded.select(idx)
                loss, metrics = loss_fn(mb, g_tok, g_seq)
                loss.backward()
                w = float(mb.response_mask.sum())  # host tensor
                weight += w
                for k, v in metrics.items():
                    v = torch.as_tensor(v, device=self.local).to(torch.float64)
                    if k.startswith("loss/"):
                        sums[k] = sums[k] + v if k in sums else v
                    else:
                        weighted[k] = weighted[k] + w * v if k in weighted else w * v
        finally:
            if defer:  # a failed micro-batch must not leave the next call without gradient sync
                model.set_requires_gradient_sync(True)
                model.set_reshard_after_backward(True)
        return sums, weighted, weight

    def _reduce(
        self, sums: dict[str, torch.Tensor], weighted: dict[str, torch.Tensor], weight: float
    ) -> dict[str, float]:
        """One all-reduce for every metric: loss shares add up, other metrics are token-weighted means.
        The step's only read of the metrics from the device (float64: untested on TPU, which lacks it)."""
        keys, vec = self._metric_vector(sums, weighted, weight)
        return self._read_metrics(sums, keys, vec)

    def _metric_vector(self, sums, weighted, weight: float) -> tuple[list[str], torch.Tensor]:
        keys = sorted(sums) + sorted(weighted)
        w = torch.tensor(weight, dtype=torch.float64, device=self.local)
        vec = torch.stack([sums[k] if k in sums else weighted[k] for k in keys] + [w])
        dist.all_reduce(vec)
        return keys, vec

    def _read_metrics(self, sums, keys: list[str], vec: torch.Tensor) -> dict[str, float]:
        """Loss shares as summed; token means only when some token was run (a mean over none is no 0)."""
        vec = vec.cpu().tolist()
        total_w = vec[-1]
        return {
            k: (v if k in sums else v / total_w) for k, v in zip(keys, vec[:-1]) if k in sums or total_w > 0
        }

    def _update(
        self, batch, rows, model, optimizer, scheduler, loss_fn, prefix, skip_zero_advantage: bool = False
    ) -> dict[str, float]:
        """One optimizer step over mini-batch `rows`, split over ranks and micro-batches."""
        from torchtitan.distributed import utils as dist_utils

        run = self._rows_to_run(batch, rows, skip_zero_advantage)
        sums, weighted, weight = self._accumulate(batch, rows, model, loss_fn, run)
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        foreach = None if self.device.lazy_tensors else True  # torch has no foreach kernels for xla tensors
        grad_norm = dist_utils.clip_grad_norm_(params, max_norm, foreach=foreach)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        keys, vec = self._metric_vector(sums, weighted, weight)
        self.device.step_end()  # lazy devices: the update, the metrics and the grad norm are one program
        self._host = None
        out = self._read_metrics(sums, keys, vec)
        out = {
            (f"critic/{k[5:]}" if prefix == "critic" and k.startswith("loss/") else k): v
            for k, v in out.items()
        }
        out[f"{prefix}/grad_norm"] = float(grad_norm)
        out[f"{prefix}/lr"] = float(lr)
        if skip_zero_advantage:
            out[f"{prefix}/skipped_frac"] = 1 - len(run) / max(len(rows), 1)
        return out

    # ------------------------------------------------------------------ checkpoints and export

    def _stateful(self) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
        parts = [("policy", self.model, self.optimizer)]
        if self.critic is not None:
            parts.append(("critic", self.critic, self.critic_optimizer))
        return parts

    def _checkpoint_state(self) -> tuple[dict, dict]:
        """The DCP state of every stateful part, and DCP's extra arguments. Lazy devices (XLA): DCP reads
        and writes host copies (`set_state_dict` copies them back), and a trainer without FSDP2 (one rank)
        runs DCP without its coordination collectives, which the `xla` backend rejects on CPU tensors."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.utils._pytree import tree_map_only

        state = {}
        for name, m, opt in self._stateful():
            state[f"{name}_model"], state[f"{name}_optim"] = get_state_dict(m, opt)
        if self.device.lazy_tensors:
            state = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), state)
        return state, ({} if self.device.fsdp2 else {"no_dist": True})

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def save_checkpoint(self, path: str) -> str:
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        state, kw = self._checkpoint_state()
        dcp.save(state, checkpoint_id=str(path / "dcp"), **kw)
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "critic_scheduler": self.critic_scheduler.state_dict() if self.critic_scheduler else None,
            "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "world_size": self.world_size,
        }
        torch.save(extra, path / f"extra_rank{self.rank}.pt")
        self._barrier()
        return str(path)

    def load_checkpoint(self, path: str) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        if not (path / "dcp").is_dir():
            raise FileNotFoundError(f"checkpoint {str(path)!r} has no dcp/ folder (not a trainer checkpoint)")
        state, kw = self._checkpoint_state()
        dcp.load(state, checkpoint_id=str(path / "dcp"), **kw)
        for name, m, opt in self._stateful():
            set_state_dict(
                m, opt, model_state_dict=state[f"{name}_model"], optim_state_dict=state[f"{name}_optim"]
            )
        self.device.step_end()
        self._host = None
        own = path / f"extra_rank{self.rank}.pt"
        extra = torch.load(own if own.is_file() else path / "extra_rank0.pt", weights_only=False)
        self.step = extra["step"]
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.critic_scheduler is not None and extra["critic_scheduler"] is not None:
            self.critic_scheduler.load_state_dict(extra["critic_scheduler"])
        torch.set_rng_state(extra["torch_rng"])
        random.setstate(extra["py_rng"])
        return self.step

    def restart_from(self, model_path: str, tc: TrainerConfig | None = None) -> int:
        """Become what `TrainerWorker(cfg, model_path, ...)` would be, without a new process: the policy
        (and reference) take the HF weights of `model_path`, the optimizer and scheduler start fresh (from
        `tc`'s optimizer settings when given: lr, schedule, steps, micro-batch...), the seed is set again,
        the step count is 0. The folder must hold the same architecture and shapes (a checkpoint of this
        model); a critic keeps its weights. Saves the start-up (imports, process group, build)."""
        if tc is not None:
            check_restartable(self.tc, tc, "restart_from")
        spec = tmodel.build_model_spec(model_path)
        if spec.config != self.spec.config:
            raise ValueError(
                f"restart_from: {model_path!r} is not the same architecture as {self.model_path!r}"
            )
        self.tc = tc if tc is not None else self.tc
        self.device.seed(self.tc.seed)
        titan_sd = tmodel.hf_to_titan(spec, tmodel.load_hf_state_dict(model_path))
        for m in (self.model, self.ref):
            if m is not None:
                parallel.load_full_state_dict(m, titan_sd)
        self.optimizer, self.scheduler = self._optimizer(self.model, self.tc.lr)
        self.model_path, self.step = str(model_path), 0
        self.device.step_end()
        self._host = None
        self._barrier()
        return self.step

    def export_hf(self, out_dir: str) -> str | None:
        full = parallel.full_state_dict(self.model)
        if self.rank == 0:
            tmodel.save_hf(self.spec, full, out_dir, self.model_path)
        self._barrier()
        return str(out_dir)

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full tensors under HF names on rank 0 (None elsewhere): the full-tensor sync fallback."""
        full = parallel.full_state_dict(self.model)
        return tmodel.titan_to_hf(self.spec, full) if self.rank == 0 else None

    # ------------------------------------------------------------------ weight-sync surface

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec.from_tensor(n, p) for n, p in self.model.named_parameters()]

    def ws_name_maps(self):
        """HF names, shapes and rows of this model through its own TorchTitan adapter (`NameMaps`): the
        driver plans the weight sync with them and needs no TorchTitan of its own."""
        from rl_tpu.weight_sync.names import NameMaps

        return NameMaps.from_adapter(self.param_specs(), functools.partial(tmodel.titan_to_hf, self.spec))

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
        """This rank's slice of every parameter and its offset in the global tensor (a CPU copy)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        out = {}
        for n, p in self.model.named_parameters():
            if isinstance(p, DTensor):
                _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                out[n] = (p.to_local().detach().cpu().clone(), tuple(int(o) for o in offset))
            else:
                out[n] = (p.detach().cpu().clone(), (0,) * p.dim())
        return out

    def policy_step(self) -> int:
        return self.step

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ weight sync (sender side)
    # This rank packs its buckets of the plan from its local DTensor shards (no copies before packing);
    # see rl_tpu.weight_sync.sync.Sender. Receivers call ws_pack directly, the driver only sets up.

    def _ws(self):
        if getattr(self, "_sender", None) is None:
            from rl_tpu.weight_sync.sync import Sender, fsdp_local_shards

            self._sender = Sender(
                self._host_shards if self.device.lazy_tensors else lambda: fsdp_local_shards(self.model)
            )
        return self._sender

    def _host_shards(self) -> dict[str, torch.Tensor]:
        """Lazy devices: slicing device tensors per bucket piece would trace and compile, so the sender
        packs from one host copy per policy version (dropped whenever the weights change)."""
        if self._host is None:
            from rl_tpu.weight_sync.sync import fsdp_local_shards

            self._host = {n: t.cpu() for n, t in fsdp_local_shards(self.model).items()}
        return self._host

    def ws_setup(self, names: list[str], buckets: dict) -> int:
        return self._ws().ws_setup(names, buckets)

    def ws_regions(self, regions: dict, dst: dict) -> int:
        return self._ws().ws_regions(regions, dst)

    def ws_pack(self, bucket: int, transport: str, version: int, slot=None):
        return self._ws().ws_pack(bucket, transport, version, slot)

    def ws_node(self) -> str:
        return self._ws().ws_node()

    def ws_join(self, host: str, port: int, world: int, rank: int, senders: int) -> int:
        return self._ws().ws_join(host, port, world, rank, senders)

    def ws_close(self) -> None:
        self._ws().ws_close()


def _zero_adamw_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter the AdamW state its first step would create (step 0, zero moments), through
    `load_state_dict`: the first step then traces the same program as every later one. Same values as
    a fresh state, so the same update."""
    sd = opt.state_dict()
    ids = [i for g in sd["param_groups"] for i in g["params"]]  # state_dict's indices, in param order
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {
        i: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        for i, p in zip(ids, params)
    }
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in ds for k in d})
    return {k: sum(d[k] for d in ds if k in d) / sum(1 for d in ds if k in d) for k in keys}
