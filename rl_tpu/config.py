"""Typed run configuration: a tree of dataclasses, loaded from TOML with `--section.key=value` overrides.

Invariants:
- Every key a user can write is a dataclass field below; an unknown key, a wrong type or an
  out-of-range value raises `ConfigError` naming the key (and the file it came from).
- Overrides are parsed as TOML values (`--rollout.n=4`, `--reward.functions='["a.py:f"]'`); a value
  that is not valid TOML is taken as a string, so `--logging.run_dir=runs/x` needs no quotes.
- A list-typed key also takes one value (verl's habit, `--data.train_files=train.parquet`), stored as a
  one-item list; a value that is not a valid item is still an error naming the key.
- The resolved config round-trips: `to_toml(load(...))` loads back to an equal config.
Names follow verl where verl has the same knob, so configs translate.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl_tpu.errors import UserError

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny_cpu.toml"


class ConfigError(UserError, ValueError):
    """A config problem a user can fix; the message names the key and the source."""


def _range(ge: float | None = None, gt: float | None = None, le: float | None = None) -> dict:
    return {"ge": ge, "gt": gt, "le": le}


def F(default: Any, **bounds: float) -> Any:  # noqa: N802 - a field with a validated range
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.copy(d), metadata=_range(**bounds))
    return field(default=default, metadata=_range(**bounds))


@dataclass(kw_only=True)
class ModelConfig:
    """The policy's starting weights (or the tiny model built when none are named) and the precision."""

    # a Hugging Face model folder, a Hub id (org/name[@revision]), a .gguf file or a catalog name
    # (smollm2-135m-instruct; rl_tpu/model_source.py); empty: build a tiny model into the run folder
    path: str = ""
    arch: Literal["qwen3", "llama"] = "qwen3"  # used when path is empty
    # used when path is empty (rl_tpu.tiny_model.SIZES; "medium", ~100 M, is a benchmark shape)
    size: Literal["tiny", "mini", "small", "medium"] = "tiny"
    seed: int = 0  # weights seed of the built tiny model
    tie_embeddings: bool = False  # used when path is empty: the tiny model ties its embedding and output head
    # the precision switch for both roles (each role's "auto" follows it): bfloat16 = the trainer computes
    # in bf16 over fp32 master weights and reduces gradients in `trainer.reduce_dtype`; the engine runs bf16
    dtype: Literal["float32", "bfloat16"] = "float32"


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the policy's linears ([trainer.lora], TorchTitan's LoRA converter; trainer/lora.py):
    y = W x + (alpha / rank) B A x, with A `[rank, in]` and B `[out, rank]` trained and W frozen (no gradient,
    no optimizer state). The engines serve the base model plus the adapters (vLLM's LoRA) and each weight
    sync moves only the adapters; runs export the merged model and the adapters (a PEFT folder;
    docs/lora.md)."""

    rank: int = F(0, ge=0)  # the adapters' rank; 0: no LoRA (full fine-tuning)
    alpha: float = F(16.0, gt=0)  # the adapters' output is scaled by alpha / rank
    # dropout on the adapters' input in the update (not in the log-prob passes, so with it the PPO ratio
    # compares a dropped-out forward with a plain one: 0 keeps the on-policy ratio exactly 1)
    dropout: float = F(0.0, ge=0, le=0.9)
    # Hugging Face names of the decoder linears that get adapters (k_proj and v_proj only together: one
    # TorchTitan module builds both); the embeddings, the output head, MoE routers and experts never do
    targets: list[str] = F(["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass(kw_only=True)
class TrainerConfig:
    """The TorchTitan trainer ranks: optimizer, parallelism, execution mode, kernels and memory."""

    # the trainer's device row (rl_tpu/devices, docs/devices.md); `rl-tpu doctor` says which are usable here
    device: Literal["cpu", "cuda", "tpu", "xla"] = "cpu"
    world_size: int = F(2, ge=1)  # trainer ranks (one Ray actor each)
    # expert parallelism of a mixture-of-experts model (TorchTitan's EP, all-to-all token dispatch): the
    # experts are split over `expert_parallel` ranks and FSDP shards each rank's experts over the other
    # world_size / expert_parallel; dense weights stay FSDP over all ranks. 1 = FSDP only; must divide
    # world_size
    expert_parallel: int = F(1, ge=1)
    total_steps: int = F(20, ge=0)  # RL steps (one rollout batch each) in the run
    lr: float = F(1e-5, gt=0)  # the policy's AdamW learning rate
    weight_decay: float = F(0.0, ge=0)  # AdamW weight decay
    betas: list[float] = F([0.9, 0.999])  # AdamW betas
    # optimizer steps of linear warmup from lr / (warmup_steps + 1) up to lr
    warmup_steps: int = F(0, ge=0)
    # after warmup: constant, or cosine decay to `min_lr_ratio` x lr at the last optimizer step
    # (total_steps x ppo_epochs x ppo_mini_batches)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = F(0.0, ge=0, le=1)  # the cosine schedule's final lr, as a fraction of lr
    grad_clip: float = F(1.0, ge=0)  # 0 disables clipping
    ppo_epochs: int = F(1, ge=1)  # passes over one rollout batch per RL step
    ppo_mini_batches: int = F(1, ge=1)  # optimizer steps per epoch over one rollout batch
    micro_batch_size: int = F(8, ge=1)  # sequences per forward/backward on one rank
    logprob_chunk_size: int = F(2048, ge=1)  # vocabulary chunk for log-softmax
    # the policy's (and reference's) final projection + log-softmax over the response tokens
    # (trainer/converters.py): "chunked" (`logprob_chunk_size` vocabulary rows at a time, the logits never
    # whole, recomputed in backward: memory O(tokens x chunk)) or "full" (the whole logits, autograd's
    # backward: no recompute, memory O(tokens x vocab)). TorchTitan's ChunkedLossWrapper, which chunks
    # the sequence and runs each chunk's loss and backward inside the loss call, cannot host a loss that
    # needs a whole sequence's log-probs (docs/decisions.md)
    logprob_head: Literal["chunked", "full"] = "chunked"
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # FSDP2 compute dtype; auto: model.dtype
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # FSDP2 gradient reduction dtype
    # FSDP2 (world_size > 1) within one optimizer step. "sharded": TorchTitan's default (each layer gathered
    # in forward and again in backward, gradients reduce-scattered after every micro-batch; least memory).
    # "replicated": parameters gathered once per step and kept with full gradients until the rank's last
    # micro-batch, then one reduce-scatter (fewest collectives, DDP memory during the step; optimizer state
    # stays sharded). "auto": replicated up to 500M parameters (docs/decisions.md)
    fsdp_step: Literal["auto", "sharded", "replicated"] = "auto"
    seq_len_buckets: list[int] = F([])  # pad to these lengths (TPU/XLA); empty: no padding buckets
    # how the decoders execute (trainer/modes.py): "eager"; "compile": each TorchTitan transformer block one
    # torch.compile program (inductor; TorchTitan's apply_compile), shapes dynamic unless seq_len_buckets
    # pads them, cpu_matmul kernels then only outside the blocks (inductor cannot lower oneDNN's linear
    # with trainable weights); "graph": each micro-batch's forward, loss and backward captured as one graph
    # by TorchTitan's graph trainer (trainer/graph.py; needs fsdp = "simple", lengths padded to buckets,
    # one graph per bucket), compiled by `graph_compile`: "inductor" (the whole graph) or "none" (the
    # captured ATen graph run as is)
    mode: Literal["eager", "compile", "graph"] = "eager"
    graph_compile: Literal["inductor", "none"] = "inductor"  # trainer.mode = "graph" only (see `mode`)
    # parameter sharding (trainer/parallel.py): "fsdp2" (torch's fully_shard, TorchTitan's default) or
    # "simple" (TorchTitan's SimpleFSDP, experiments/graph_trainer/simple_fsdp.py: parameters stay DTensor
    # shards, gathered by a parametrization in each forward, so the collectives can live in a compiled
    # graph). Weight sync reads the shards' placements from the DTensors either way
    fsdp: Literal["fsdp2", "simple"] = "fsdp2"
    # activation checkpointing of the trained models' transformer blocks, TorchTitan's own policies
    # (torchtitan/distributed/activation_checkpoint.py) applied in its order (after TP/EP, before compile
    # and FSDP): "none"; "selective" (SelectiveAC: keeps the outputs of matmuls and attention, every second
    # matmul recomputed); "full" (FullAC: keeps each block's input and recomputes the block in backward).
    # Same loss and gradients, less activation memory for more compute (`rl-tpu estimate` counts it). In
    # trainer.mode = "graph" the same two policies are the graph trainer's passes over the captured graph
    # (trainer/graph.py)
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    # move the activations saved for backward to host memory. TorchTitan 0.3.0 offers it only inside its
    # graph trainer's compile pipeline (experiments/graph_trainer, memory_policy "sac_and_offload": a pass
    # over its traced joint graph, with accelerator streams and pinned host memory), which trainer.mode =
    # "graph" does not apply (unverified without a GPU); on CPU the host is the device. true is refused
    # (docs/decisions.md)
    activation_offload: bool = False
    # the decoders' inner attention (TorchTitan's; rl_tpu/devices/kernels.py): "sdpa"
    # (ScaledDotProductAttention, packed shared-prompt rows as padded views; every device) or "flex"
    # (FlexAttention, the packed rows' mask as a block mask; trains on CUDA only: torch has no FlexAttention
    # backward on CPU).
    # "auto": the device's default (cuda: flex, falling back to sdpa without Triton; others: sdpa).
    # `rl-tpu doctor` says what each device gets
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    # float32 matmuls of the model's linears and log-prob head on CPU (trainer/cpu_matmul.py): "auto" times
    # MKL (aten) and oneDNN on the model's shapes at start and runs each matmul on the faster (cached per
    # CPU model, torch and thread count, so a machine keeps its choice); "onednn" or "aten" (torch's
    # default, MKL's sgemm) pin one; which is faster depends on the CPU (docs/decisions.md). Other devices
    # and bf16: aten
    cpu_matmul: Literal["auto", "onednn", "aten"] = "auto"
    # a micro-batch's samples of one prompt run packed: the prompt once, each response at its own length
    # attending to it (trainer/attention.py); same log-probs and gradients, fewer positions. Off on
    # static-shape devices
    share_prompts: bool = True
    # sequences whose advantage is zero on every token (a GRPO group whose samples all scored the same) are
    # not run when the loss gives them exactly zero gradient (losses.zero_advantage_inert: no KL loss, no
    # entropy bonus): same loss and update, less work. Their tokens still normalise the loss; token
    # metrics (actor/entropy, mismatch/*) cover the sequences run (one per rank when no sequence has an
    # advantage); actor/skipped_frac says how many were not
    skip_zero_advantage: bool = True
    # world_size > 1: the rows of a step are dealt to the ranks so each runs about the same number of tokens
    # (ops.balance_rows; a prompt's samples stay on one rank where they fit; verl's balance_batch): the
    # step waits for its slowest rank. Same loss and gradients up to fp32 summation order
    balance_tokens: bool = True
    reference: bool = False  # keep a frozen reference model for the KL term
    critic: bool = False  # train a value model (needed by adv_estimator = "gae")
    critic_lr: float = F(1e-5, gt=0)  # the critic's learning rate (trainer.critic = true)
    test_freq: int = F(0, ge=0)  # steps between held-out evaluations (greedy); 0: none
    seed: int = 0  # torch and Python RNG seed of every trainer rank (the critic's value head: seed + 1)
    num_threads: int = F(1, ge=1)  # CPU threads per trainer rank (torch threads; the actor's Ray num_cpus)
    # before step 1, run the largest batch a step can bring (every row the longest prompt + the whole
    # response budget) through the log-prob passes and the update's forward and backward, changing
    # nothing: an out-of-memory shows at once, not at the first long batch, and the trainer's memory stays
    # flat over a run (rl_tpu/controller/preflight.py)
    preflight: bool = True
    # interpreter of the trainer's own environment, e.g. ".venv-xla/bin/python" (scripts/setup.sh --role-env
    # xla); empty: the controller's. Same Python minor and Ray version required (rl_tpu.devices.roles)
    python: str = ""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(kw_only=True)
class RolloutConfig:
    """The vLLM engines: how many, sampling, engine settings, and multi-turn environments and tools."""

    engines: int = F(1, ge=1)  # vLLM engines (one Ray actor each)
    tensor_parallel_size: int = F(1, ge=1)  # vLLM tensor parallelism within each engine
    n: int = F(8, ge=1)  # samples per prompt (the GRPO group)
    temperature: float = F(1.0, ge=0)  # sampling temperature (evaluations are greedy)
    top_p: float = F(1.0, gt=0, le=1)  # nucleus sampling; 1: off
    top_k: int = F(-1, ge=-1)  # -1: off
    max_tokens: int = F(64, ge=1)  # the most tokens sampled per completion (per turn when multi-turn)
    stop: list[str] = F([])  # strings that end a completion
    stop_token_ids: list[int] = F([])  # token ids that end a completion (besides the tokenizer's EOS)
    # sampling seed: engine i is seeded rollout.seed + i; engines that take per-request seeds also seed each
    # request from (seed, call index, prompt index) (rollout/engine.py)
    seed: int = 0
    max_model_len: int = F(512, ge=32)  # the engine's context: prompt + response tokens
    kv_cache_gb: float = F(1.0, gt=0)  # VLLM_CPU_KVCACHE_SPACE on CPU
    # fraction of device memory an accelerator engine takes (weights + KV cache); CPU uses kv_cache_gb
    gpu_memory_utilization: float = F(0.5, gt=0, le=1)
    # false: vLLM compiles the model (torch.compile / inductor): more tokens/s, for a longer start (much
    # longer the first time on a machine, before inductor's cache holds it); true keeps starts and tests
    # fast (docs/decisions.md).
    enforce_eager: bool = True
    multiprocess: bool = False  # vLLM engine core in its own process
    # CPU threads per engine TP rank; 0: auto (rl_tpu.placement.rollout_threads)
    num_threads: int = F(0, ge=0)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # engine dtype; auto: model.dtype
    # the engine's log-prob of each sampled token: feeds `mismatch/kl` and `algorithm.rollout_is`; false
    # skips it (verl's key; about a quarter of generation time for a small model on CPU)
    calculate_log_probs: bool = True
    # engines that die or hang are restarted and re-synced, this many times per run
    max_restarts: int = F(3, ge=0)
    # an engine call (a generation batch, a weight sync) with no answer for this long counts as a hung
    # engine: it is killed and restarted like a dead one
    timeout_s: float = F(600.0, gt=0)
    # seconds an engine may take to start (load, compile, warm up) before it counts as failed; 0: its
    # engine package's default (rollout/engine.py EngineTraits: 600 s, vLLM-TorchTPU 1800 s for a cold XLA
    # compile of every padded shape); never less than `timeout_s`
    start_timeout_s: float = F(0.0, ge=0)
    # interpreter of the engines' own environment; empty: the controller's (like trainer.python)
    python: str = ""
    # the engines' device row; empty: trainer.device, except under an `xla` trainer, which must name it
    # (no vLLM engine runs on `xla`: `cpu` on the PJRT CPU device, `tpu` on a TPU; docs/devices.md)
    device: Literal["", "cpu", "cuda", "tpu", "xla"] = ""
    # async mode: generate in chunks of `partial_chunk_tokens` tokens; a weight update waiting for the
    # engines goes between two chunks, and unfinished sequences continue on the new weights (the engines
    # hold them between chunks; an update recomputes their KV), so an update never waits for a whole batch
    # (rl_tpu.rollout.partial). A `max_tokens` that fits one chunk is generated in one plain call
    partial: bool = False
    partial_chunk_tokens: int = F(8, ge=1)  # tokens per chunk when `partial` is on
    # multi-turn (rollout/multi_turn.py, docs/multi_turn.md): "module:Class" or "path.py:Class", an environment
    # whose `step` answers each assistant turn, or verl's interaction config file ("interaction.yaml",
    # rollout/verl_interactions.py); "" = one completion per prompt. `max_tokens` bounds each turn,
    # `max_total_tokens` every token after the prompt (0: max_model_len - data.max_prompt_length)
    env: str = ""
    max_turns: int = F(4, ge=1)  # assistant turns per trajectory (multi-turn)
    max_total_tokens: int = F(0, ge=0)  # tokens after the prompt per trajectory; 0: see `env`
    # "independent": a trajectory waiting on a tool or its environment does not hold up the others' next
    # turns (free engines wait at most 50 ms for it); "lockstep": each turn waits for every trajectory, so
    # engines seeded per call (vllm-cpu, TorchTPU) sample the same tokens whatever the tools' timing
    turn_scheduling: Literal["independent", "lockstep"] = "independent"
    # tools (rollout/tools.py, docs/multi_turn.md): "module:function" or "path.py:function", plain functions
    # whose calls the model writes in its template's format (`<tool_call>...</tool_call>`); they make a run
    # multi-turn with or without `env`. Each call runs in one of `tool_workers` processes, killed after
    # `tool_timeout_s` (the model then reads the timeout as the tool's result), under an address-space limit
    # of `tool_memory_mb` MiB (RLIMIT_AS: a runaway allocation is that call's MemoryError; 0: none)
    tools: list[str] = F([])
    tool_timeout_s: float = F(10.0, gt=0)  # seconds per tool call before it is killed (see `tools`)
    tool_workers: int = F(2, ge=1)  # processes running tool calls
    tool_memory_mb: int = F(4096, ge=0)  # address-space limit of a tool call in MiB; 0: none
    # seconds an environment's `reset` or `step` may run; past it, its trajectory ends with reward 0
    # (`rollout/env_timeouts`) and its worker, taking no new trajectories, is killed once its others end
    env_timeout_s: float = F(30.0, gt=0)
    # processes holding the environment's instances (one per trajectory, many per process)
    env_workers: int = F(2, ge=1)
    # address-space limit of an environment worker in MiB (RLIMIT_AS: a runaway allocation is that call's
    # MemoryError, ending its trajectory); 0: none
    env_memory_mb: int = F(4096, ge=0)
    # processes and threads a tool or environment worker may have at once, its own included (a pids cgroup
    # of its own where one can be made, whose every process dies with the worker; else RLIMIT_NPROC, which
    # root ignores: a warning says so); 0: none
    worker_procs: int = F(256, ge=0)
    # CPU seconds a tool or environment worker process may use over its life (RLIMIT_CPU); past it the
    # kernel kills it and, like any dead worker, it is replaced (its calls and trajectories end as
    # failed); 0: none (each call's wall time is bounded by `tool_timeout_s` / `env_timeout_s` anyway)
    worker_cpu_s: float = F(0.0, ge=0)
    # environment variables the processes running tools and environments see, beyond a default allow-list
    # of harmless ones (PATH, HOME, LANG, ...: rl_tpu/containment.py): fnmatch patterns such as "MY_API_*".
    # Everything else (API keys, tokens) is left out of their environment
    worker_env: list[str] = F([])
    # run tools and environments under bubblewrap (`bwrap`, the Debian package bubblewrap): no network, no
    # other process visible, the filesystem read-only except a scratch folder per worker
    # (docs/multi_turn.md, "What a tool or environment can do")
    sandbox: bool = False
    # MoE models (docs/moe.md): the trainer's routers take the experts the engine routed each token to
    # (routing replay, "R3"; the router's probabilities of those experts still carry the gradient), so
    # training and sampling use the same experts and the router's drift between the two cannot blow up the
    # importance ratios. Each sample then computes its whole prompt (no prefix-cache reads). Dense models
    # refuse it; `moe/router_agreement` is reported with or without it
    routing_replay: bool = False


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages, losses, KL, importance sampling, DAPO and staleness (names and defaults as verl's)."""

    # the advantage estimator (rl_tpu/algorithms/advantages.py); "gae" needs trainer.critic = true
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"] = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # grpo divides by the group's std (false: Dr.GRPO's mean-only)
    gamma: float = F(1.0, ge=0, le=1)  # discount of gae and reinforce_plus_plus
    lam: float = F(1.0, ge=0, le=1)  # GAE lambda
    policy_loss: Literal["vanilla", "gspo", "sft"] = "vanilla"  # vanilla = PPO clip (verl's name); sft = NLL
    clip_ratio_low: float = F(0.2, ge=0)  # PPO clip: the ratio is kept above 1 - clip_ratio_low
    clip_ratio_high: float = F(0.2, ge=0)  # PPO clip: the ratio is kept below 1 + clip_ratio_high
    clip_ratio_c: float = F(3.0, gt=1)  # dual-clip bound for negative advantages
    gspo_clip_ratio_low: float = F(3e-4, ge=0)  # GSPO clips a sequence ratio: far tighter (verl recipe)
    gspo_clip_ratio_high: float = F(4e-4, ge=0)  # GSPO's upper clip (see gspo_clip_ratio_low)
    # how token losses make the batch loss: mean over all tokens, mean of per-sequence means, or per-sequence
    # sums over a constant horizon (Dr.GRPO; `loss_scale_factor`)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    loss_scale_factor: int = F(0, ge=0)  # horizon of seq-mean-token-sum-norm; 0: T of each batch
    cliprange_value: float = F(0.5, ge=0)  # PPO value-loss clip (critic)
    use_kl_loss: bool = False  # a KL-to-reference term in the loss (needs trainer.reference = true)
    kl_loss_coef: float = F(0.001, ge=0)  # weight of the KL loss
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"  # estimator of the KL loss
    # a KL-to-reference penalty subtracted from the token rewards (needs trainer.reference = true)
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"  # in-reward KL estimator (verl: "kl" = k1)
    kl_coef: float = F(0.001, ge=0)  # weight of the in-reward KL penalty
    entropy_coeff: float = F(0.0, ge=0)  # entropy bonus subtracted from the loss; 0: none
    rollout_is: Literal["none", "token", "sequence"] = "none"  # truncated IS, inference vs trainer
    rollout_is_threshold: float = F(2.0, gt=0)  # upper bound of the truncated importance weights
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill
    max_refill_rounds: int = F(3, ge=0)  # dynamic sampling: extra rounds of prompts drawn to refill a batch
    overlong_buffer_len: int = F(0, ge=0)  # DAPO soft overlong penalty; 0 disables
    # the overlong penalty reached at max_tokens (-factor), falling linearly from 0 over the last
    # overlong_buffer_len tokens
    overlong_penalty_factor: float = F(1.0, ge=0)
    # async mode: no trained token was sampled by a policy more than this many versions behind the one
    # being updated; `wait`: the engines wait before generating further ahead; `drop`: they generate
    # ahead, and groups over the bound are dropped and generated again (`rollout/dropped`)
    max_staleness: int = F(1, ge=1)
    staleness_policy: Literal["wait", "drop"] = "wait"  # see max_staleness


@dataclass(kw_only=True)
class RewardConfig:
    """The reward functions and the worker processes that run them."""

    # `module:function` or `path/to/file.py:function`, verl's compute_score signature
    functions: list[str] = F(["rl_tpu.rewards.arithmetic:compute_score"])
    weights: list[float] = F([])  # one per function; empty: all 1.0
    # a reward that raises or times out: score 0 and count it (reward/errors, reward/timeouts), or stop the run
    on_error: Literal["zero", "raise"] = "zero"
    timeout_s: float = F(10.0, gt=0)  # seconds per reward call
    workers: int = F(2, ge=1)  # reward worker processes


@dataclass(kw_only=True)
class DataConfig:
    """The prompts: verl parquet or JSONL files, or a synthetic task, and how they are batched."""

    train_files: list[str] = F([])  # verl parquet or JSONL; empty: the synthetic task below
    # held-out prompts, evaluated every trainer.test_freq steps; empty: none, or the synthetic task's test
    # split when train_files is empty
    test_files: list[str] = F([])
    # the built-in task when train_files is empty (rl_tpu/data/synthetic.py)
    synthetic: Literal["arithmetic", "countdown"] = "arithmetic"
    synthetic_train_size: int = F(2048, ge=1)  # prompts in the synthetic task's train split
    synthetic_test_size: int = F(128, ge=1)  # prompts in the synthetic task's test split
    # the synthetic task's own options, e.g. {digits = 1, ops = "+*"} (rl_tpu/data/synthetic.py)
    synthetic_options: dict[str, int | str] = F({})
    batch_size: int = F(8, ge=1)  # prompts per RL step
    max_prompt_length: int = F(128, ge=1)  # tokens of a templated prompt (see truncation)
    truncation: Literal["error", "left"] = "error"  # an over-long prompt: fail naming it, or keep its tail
    shuffle: bool = True  # a new order of the train prompts each epoch
    seed: int = 0  # seed of the shuffle and of the synthetic task


@dataclass(kw_only=True)
class SyncConfig:
    """How the trained weights reach the engines after every update (docs/weight_sync.md)."""

    # plan-based transports ("auto": CUDA IPC between GPUs of one node, for which CUDA engines see every
    # GPU of their node, shared memory within a Ray node, the object store across nodes), or
    # "reload": the full-tensor reference path (HF export + vLLM reload_weights). Under trainer.lora only
    # the adapters move: written in place into the engines' LoRA slots, or through a PEFT folder and vLLM's
    # LoRA reload with "reload" (docs/lora.md)
    transport: Literal["auto", "inprocess", "shm", "cuda_ipc", "ray", "collective", "reload"] = "auto"
    bucket_mb: float = F(64.0, gt=0)  # MiB per bucket of the plan-based transports
    # shm into a CPU engine: each engine rank keeps one shared-memory region holding its loaded-layout
    # weights for the engine's lifetime, and trainer ranks write straight into it (no bucket files, no copy
    # on the engine side). Costs the model's loaded-layout bytes per engine rank; a rank whose region would
    # be larger than this takes bucket files instead. 0 = always bucket files.
    receiver_buffer_mb: float = F(4096.0, ge=0)
    verify: bool = False  # compare every engine parameter with the trainer's after each sync


@dataclass(kw_only=True)
class ClusterConfig:
    """Ray, the sync or async schedule, and where the roles run (docs/placement.md)."""

    address: str = ""  # Ray address; empty: start a local Ray instance
    # "sync": each step generates, then trains; "async": the engines generate the next batches while the
    # trainer trains (bounded by algorithm.max_staleness)
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = F(1, ge=0)  # replaced by algorithm.max_staleness; any value but 1 is an error
    # "auto": colocated in sync mode, disaggregated in async mode or where an engine cannot share its
    # device with a trainer rank (TPU; tensor-parallel engines on an accelerator). See docs/placement.md
    placement: Literal["auto", "colocated", "disaggregated"] = "auto"
    # for a local Ray instance; 0: enough for the placement bundles, at least all cores
    num_cpus: int = F(0, ge=0)
    # Ray custom resource -> amount added to each bundle of that role: {node_a = 0.01} pins the role to
    # the nodes started with --resources='{"node_a": 1}'
    trainer_resources: dict[str, float] = F({}, ge=0)
    rollout_resources: dict[str, float] = F({}, ge=0)  # the same for the engines' bundles


@dataclass(kw_only=True)
class LoggingConfig:
    """The run folder and what is written to it or shown on the console."""

    run_dir: str = "runs/tiny"  # metrics, samples, checkpoints and the exported policy go here
    tensorboard: bool = True  # TensorBoard event files in run_dir
    wandb: bool = False  # log to Weights & Biases too (needs the wandb package)
    wandb_project: str = "rl-tpu"  # the wandb project
    samples_per_step: int = F(4, ge=0)  # completions written to samples.jsonl per step
    progress: bool = True  # the console progress bar
    verbose: bool = False  # library logs on the console (Ray, vLLM, actors' output); `--verbose` on the CLI


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints in the run folder, and resuming from them."""

    every: int = F(0, ge=0)  # steps between checkpoints; 0: only at the end
    keep_last: int = F(2, ge=1)  # complete checkpoints kept; older ones are deleted
    resume: str = ""  # "", "auto" (newest complete checkpoint in run_dir) or a checkpoint folder


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# ---------------------------------------------------------------------------------------------------
# loading and validation


def _check_value(key: str, tp: Any, value: Any, meta: Any, where: str) -> Any:
    """Return `value` converted to `tp`, or raise ConfigError naming `key`."""

    def bad(msg: str) -> ConfigError:
        return ConfigError(f"config error{where}: `{key}` {msg}")

    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise bad(f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            # verl's habit: one value where a list is allowed (`data.train_files=~/gsm8k/train.parquet`)
            # means a list of that one value. Anything that is not a valid single item keeps the list error.
            try:
                _check_value(key, item_tp, value, None, where)  # the item's type alone, without its range
            except ConfigError:
                raise bad(
                    f"must be a list (or a single {_type_name(item_tp)}), "
                    f"got {type(value).__name__} {value!r}"
                ) from None
            return [_check_value(key, item_tp, value, meta, where)]  # a range error names the key
        return [_check_value(f"{key}[{i}]", item_tp, v, meta, where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad(f"must be a table such as {{name = 1.0}}, got {type(value).__name__} {value!r}")
        key_tp, item_tp = typing.get_args(tp)
        for k in value:
            _check_value(f"{key} key {k!r}", key_tp, k, None, where)
        return {k: _check_value(f"{key}.{k}", item_tp, v, meta, where) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise bad(f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"must be an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"must be a number, got {value!r}")
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise bad(f"must be a string, got {value!r}")
        return value
    bounds = meta or {}
    if bounds.get("ge") is not None and value < bounds["ge"]:
        raise bad(f"must be >= {bounds['ge']}, got {value!r}")
    if bounds.get("gt") is not None and value <= bounds["gt"]:
        raise bad(f"must be > {bounds['gt']}, got {value!r}")
    if bounds.get("le") is not None and value > bounds["le"]:
        raise bad(f"must be <= {bounds['le']}, got {value!r}")
    return value


def check_lora(cfg: Config) -> None:
    """`trainer.lora`: known targets, k and v together, none of the modes LoRA is not verified with."""
    lc, tc = cfg.trainer.lora, cfg.trainer
    if not lc.rank:
        return
    unknown = sorted(set(lc.targets) - set(LORA_TARGETS))
    if unknown or not lc.targets:
        raise ConfigError(
            f"config error: `trainer.lora.targets` names {unknown or 'nothing'}; choose among "
            f"{', '.join(LORA_TARGETS)}"
        )
    if ("k_proj" in lc.targets) != ("v_proj" in lc.targets):
        raise ConfigError(
            "config error: `trainer.lora.targets` must name k_proj and v_proj together or neither (one "
            "TorchTitan module computes both)"
        )
    refused = {
        "trainer.critic = true": tc.critic,
        'trainer.fsdp = "simple"': tc.fsdp == "simple",
        'trainer.mode = "graph"': tc.mode == "graph",
        f"trainer.expert_parallel = {tc.expert_parallel}": tc.expert_parallel > 1,
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"config error: `trainer.lora.rank > 0` is not verified with `{what}` yet")


def check_lora_runnable(cfg: Config) -> None:
    """LoRA engines are vLLM's LoRA layers, checked on vllm-cpu (and the same code on CUDA vLLM);
    vLLM-TorchTPU's LoRA is not, and vllm-cpu cannot start a LoRA engine on an MoE model (with LoRA on,
    vLLM 0.32 runs every MoE layer through its Triton LoRA experts, fused_moe/oracle/unquantized.py
    234-248, which vllm-cpu lacks, adapters on the experts or not): refuse both in one line before
    anything starts (`cfg.model.path` resolved to a folder)."""
    from rl_tpu.hf_config import MOE_MODEL_TYPES, read_hf_config

    rank = cfg.trainer.lora.rank
    device = cfg.rollout.device or cfg.trainer.device
    if rank and device not in ("cpu", "cuda"):
        raise ConfigError(
            f"config error: `trainer.lora.rank = {rank}` with engines on `{device}`: "
            "serving adapters is verified with vLLM on cpu and cuda only (docs/lora.md); set "
            "trainer.lora.rank = 0 for full fine-tuning there"
        )
    if rank and device == "cpu" and cfg.model.path:
        model_type = read_hf_config(cfg.model.path).get("model_type")
        if model_type in MOE_MODEL_TYPES:
            raise ConfigError(
                f"config error: `trainer.lora.rank = {rank}` on {cfg.model.path} ({model_type}, a "
                "mixture-of-experts model) with vllm-cpu engines: vLLM runs MoE layers through Triton "
                "kernels whenever LoRA is on, which vllm-cpu lacks (docs/lora.md); set trainer.lora.rank "
                "= 0, or run the engines on CUDA"
            )


def _type_name(tp: Any) -> str:
    return {str: "string", int: "integer", float: "number", bool: "true/false"}.get(tp, str(tp))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=False)


def _apply(section_obj: Any, section: str, values: dict[str, Any], where: str) -> None:
    hints = _hints(type(section_obj))
    fields = {f.name: f for f in dataclasses.fields(section_obj)}
    for key, value in values.items():
        head, dot, rest = key.partition(".")
        if head in fields and dataclasses.is_dataclass(hints[head]):  # a sub-table: [trainer.lora], or
            if dot:  # `--trainer.lora.rank=16`
                value = {rest: value}
            elif not isinstance(value, dict):
                raise ConfigError(
                    f"config error{where}: `{section}.{key}` must be a table ([{section}.{key}])"
                )
            _apply(getattr(section_obj, head), f"{section}.{head}", value, where)
            continue
        if key not in fields:
            raise ConfigError(
                f"config error{where}: unknown key `{section}.{key}`; "
                f"known keys in [{section}]: {', '.join(sorted(fields))}"
            )
        checked = _check_value(f"{section}.{key}", hints[key], value, fields[key].metadata, where)
        setattr(section_obj, key, checked)


def _merge(cfg: Config, data: dict[str, Any], where: str) -> None:
    sections = {f.name for f in dataclasses.fields(cfg)}
    for section, values in data.items():
        if section not in sections:
            raise ConfigError(
                f"config error{where}: unknown section `{section}`; known sections: {', '.join(sorted(sections))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"config error{where}: `{section}` must be a table ([{section}])")
        _apply(getattr(cfg, section), section, values, where)


def parse_override(text: str) -> tuple[str, str, Any]:
    """`--section.key=value` (leading dashes optional) -> (section, key, value)."""
    body = text.lstrip("-")
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"config error: override {text!r} must look like --section.key=value")
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings such as paths
    return section, key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- TOML file (if any; its `extends` base first) <- overrides, each validated as applied."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config error: file {str(path)!r} does not exist")
        _apply_file(cfg, path, ())
    return with_overrides(cfg, overrides)


def _apply_file(cfg: Config, path: Path, chain: tuple[Path, ...]) -> None:
    """Apply `path` to `cfg`, after the file its top-level `extends = "base.toml"` names.

    Why: recipes for one model on several machines share most of their keys; a base file holds them once
    and each hardware file names only what differs. The base path is relative to the extending file's
    folder (not the cwd); a base may extend another. Tables apply key by key, so a key the child sets
    overrides the base's and the base's other keys in that table stay. `chain` is the files extending
    this one, outermost first (for the cycle error).
    """
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config error in {path}: not valid TOML: {e}") from None
    where = f" in {path}"
    for section, values in data.items():
        if isinstance(values, dict) and "extends" in values:
            raise ConfigError(
                f"config error{where}: `extends` must be a top-level key, above the first table; "
                f"here it is inside [{section}]"
            )
    if "extends" in data:
        _apply_base(cfg, path, data.pop("extends"), (*chain, path))
    _merge(cfg, data, where)


def _apply_base(cfg: Config, path: Path, extends: Any, chain: tuple[Path, ...]) -> None:
    """Check `path`'s `extends` value (a string; an existing file; no cycle) and apply that base to `cfg`."""
    if not isinstance(extends, str):
        raise ConfigError(
            f"config error in {path}: `extends` must be a string (a TOML file, relative to this file's "
            f"folder), got {type(extends).__name__} {extends!r}"
        )
    base = path.parent / extends
    if base.resolve() in {p.resolve() for p in chain}:
        names = " -> ".join(str(p) for p in (*chain, base))
        raise ConfigError(f"config error in {path}: `extends` makes a cycle: {names}")
    if not base.is_file():
        raise ConfigError(
            f"config error in {path}: `extends = {extends!r}` resolves to {str(base)!r}, which does not exist"
        )
    _apply_file(cfg, base, chain)


def with_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A validated copy of `cfg` with `--section.key=value` overrides applied (cfg is not changed)."""
    cfg = copy.deepcopy(cfg)
    for text in overrides:
        section, key, value = parse_override(text)
        _merge(cfg, {section: {key: value}}, f" in override {text!r}")
    _check_cross_fields(cfg)
    return cfg


# trainer devices whose engines cannot default to the same row (`rollout.device` empty): vLLM has no
# XLA engine (on a TPU the engine is vllm-torchtpu, the `tpu` row)
NO_ENGINE_DEVICES = ("xla",)


def _check_cross_fields(cfg: Config) -> None:
    r = cfg.reward
    if r.weights and len(r.weights) != len(r.functions):
        raise ConfigError(
            f"config error: `reward.weights` has {len(r.weights)} entries but `reward.functions` has "
            f"{len(r.functions)}; give one weight per function or none"
        )
    if not r.functions:
        raise ConfigError("config error: `reward.functions` is empty; name at least one `module:function`")
    if cfg.algorithm.adv_estimator == "gae" and not cfg.trainer.critic:
        raise ConfigError('config error: `algorithm.adv_estimator = "gae"` needs `trainer.critic = true`')
    if cfg.cluster.mode == "async" and cfg.cluster.placement == "colocated":
        raise ConfigError(
            'config error: `cluster.mode = "async"` overlaps generation with training, so the '
            'engines cannot sleep while the trainer runs: set `cluster.placement = "disaggregated"` '
            '(or "auto", which follows the mode)'
        )
    if cfg.cluster.max_staleness != 1:
        raise ConfigError(
            "config error: `cluster.max_staleness` is now `algorithm.max_staleness` (bounded per token)"
        )
    if cfg.rollout.partial and cfg.cluster.mode != "async":
        raise ConfigError(
            "config error: `rollout.partial = true` continues sequences across weight updates, which only "
            'happen during generation in `cluster.mode = "async"`'
        )
    if cfg.trainer.world_size % cfg.trainer.expert_parallel:
        raise ConfigError(
            f"config error: `trainer.expert_parallel = {cfg.trainer.expert_parallel}` must divide "
            f"`trainer.world_size = {cfg.trainer.world_size}` (the experts are split over that many ranks)"
        )
    multi_turn = "`rollout.env`" if cfg.rollout.env else "`rollout.tools`"
    if (
        (cfg.rollout.env or cfg.rollout.tools)
        and cfg.cluster.mode == "async"
        and cfg.algorithm.staleness_policy == "drop"
    ):
        raise ConfigError(
            f'config error: {multi_turn} (multi-turn) does not run with `algorithm.staleness_policy = "drop"` '
            'yet (stale groups are generated again single-turn): use "wait"'
        )
    if cfg.rollout.partial and (cfg.rollout.env or cfg.rollout.tools):
        raise ConfigError(
            f"config error: {multi_turn} (multi-turn) does not run with `rollout.partial = true` yet: "
            "set one of them"
        )
    if (cfg.rollout.env or cfg.rollout.tools) and response_budget(cfg) < 1:
        raise ConfigError(
            f"config error: {multi_turn} (multi-turn): `rollout.max_model_len = {cfg.rollout.max_model_len}` "
            f"leaves no token for the trajectory after `data.max_prompt_length = {cfg.data.max_prompt_length}`: "
            "raise max_model_len, lower max_prompt_length, or set `rollout.max_total_tokens`"
        )
    if cfg.rollout.partial and cfg.rollout.stop:
        raise ConfigError(
            "config error: `rollout.partial = true` generates in chunks, and a stop string can span two "
            "chunks: use `rollout.stop_token_ids`, or no partial rollouts"
        )
    check_lora(cfg)
    if cfg.trainer.mode == "graph" and cfg.trainer.fsdp != "simple":
        raise ConfigError(
            'config error: `trainer.mode = "graph"` captures the collectives of SimpleFSDP in its graph, and '
            'those of FSDP2 (hooks) cannot be captured: set `trainer.fsdp = "simple"`'
        )
    for key in ("trainer_resources", "rollout_resources"):
        reserved = sorted(
            set(getattr(cfg.cluster, key)) & {"CPU", "GPU", "TPU", "memory", "object_store_memory"}
        )
        if reserved:
            raise ConfigError(
                f"config error: `cluster.{key}` names Ray's built-in resource(s) {reserved}; "
                "CPUs follow trainer.num_threads / rollout.num_threads and accelerators trainer.device"
            )
    if cfg.algorithm.rollout_is != "none" and not cfg.rollout.calculate_log_probs:
        raise ConfigError(
            f'config error: `algorithm.rollout_is = "{cfg.algorithm.rollout_is}"` corrects with the '
            "engine's log-probs: set `rollout.calculate_log_probs = true`"
        )
    if not cfg.rollout.device and cfg.trainer.device in NO_ENGINE_DEVICES:
        # checked here, not when the engine actor starts: there the device's error blamed the trainer
        raise ConfigError(
            f'config error: `trainer.device = "{cfg.trainer.device}"` and `rollout.device` is unset, so '
            f"the engines would run on {cfg.trainer.device!r}, where no vLLM engine runs: set "
            "--rollout.device=cpu (vLLM-CPU; --rollout.device=tpu on a TPU VM)"
        )
    if cfg.trainer.attention == "flex":
        from rl_tpu.devices import DEVICES
        from rl_tpu.devices.kernels import attention_missing

        missing = attention_missing("flex", DEVICES[cfg.trainer.device], has_triton=True)
        if missing:
            raise ConfigError(
                f'config error: `trainer.attention = "flex"` on trainer.device = "{cfg.trainer.device}": '
                f'{missing}; use "sdpa" or "auto"'
            )
    if (
        cfg.trainer.activation_checkpoint != "none"
        and cfg.trainer.fsdp == "simple"
        and cfg.trainer.mode == "compile"
    ):
        raise ConfigError(
            f'config error: `trainer.activation_checkpoint = "{cfg.trainer.activation_checkpoint}"` does not '
            'run with `trainer.fsdp = "simple"` and `trainer.mode = "compile"` together: AOTAutograd fails on '
            "SimpleFSDP's all-gathers inside a checkpointed compiled block (it saves their DeviceMesh as a "
            'tensor, torch 2.13); use trainer.fsdp = "fsdp2" or trainer.mode = "eager"'
        )
    if cfg.trainer.activation_offload:
        raise ConfigError(
            "config error: `trainer.activation_offload = true`: "
            + (
                f'trainer.device = "{cfg.trainer.device}" computes in host memory, so there is no device '
                "memory to offload activations from"
                if cfg.trainer.device == "cpu"
                else "TorchTitan 0.3.0 offloads activations only inside its graph trainer's compile "
                'pipeline (memory_policy "sac_and_offload", with CUDA streams and pinned host memory), '
                'which trainer.mode = "graph" does not apply: unverified without a GPU'
            )
        )
    if cfg.algorithm.use_kl_loss and not cfg.trainer.reference:
        raise ConfigError("config error: `algorithm.use_kl_loss = true` needs `trainer.reference = true`")
    if cfg.algorithm.use_kl_in_reward and not cfg.trainer.reference:
        raise ConfigError(
            "config error: `algorithm.use_kl_in_reward = true` needs `trainer.reference = true`"
        )


def resolved_dtype(value: str, cfg: Config) -> str:
    """A role's dtype key (`trainer.param_dtype`, `rollout.dtype`): "auto" follows `model.dtype`."""
    return cfg.model.dtype if value == "auto" else value


def response_budget(cfg: Config) -> int:
    """The most tokens after the prompt one trained sample can hold: `rollout.max_tokens`, or for multi-turn
    rollouts (`rollout.env` / `rollout.tools`) the whole trajectory's, `rollout.max_total_tokens` (0: what
    `rollout.max_model_len` leaves after `data.max_prompt_length`)."""
    rc = cfg.rollout
    if rc.env or rc.tools:
        return rc.max_total_tokens or rc.max_model_len - cfg.data.max_prompt_length
    return rc.max_tokens


def engine_config(cfg: Config) -> RolloutConfig:
    """`cfg.rollout` with its dtype resolved: what `rollout.engine.build_engine` takes."""
    return dataclasses.replace(cfg.rollout, dtype=resolved_dtype(cfg.rollout.dtype, cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (what `rl-tpu config show` prints)."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))
