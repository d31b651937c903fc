"""The models of one trainer rank: policy, frozen reference and critic, each a TorchTitan decoder built
from the HF folder's spec, parallelised (parallel.py), loaded with the HF weights, then converted by the
declared model converters (converters.py).

Invariants:
- Every parameter is a DTensor FSDP2 shard after the build (plain tensors on a device without FSDP2).
- The policy and the reference are the same build (same converters: CPU kernels where they apply, then
  the log-prob head); the reference is frozen (`requires_grad_(False)`, eval mode).
- The critic is the same decoder whose `lm_head` is a `Linear(hidden, 1)` (with bias), seeded from
  `trainer.seed + 1`, so every rank starts with the same value head: the value of response token j is
  read at the state that predicts it, like the log-prob. It has no log-prob head.
- Every rank builds the same models in the same order (converting them may be collective).
- `trainer.activation_checkpoint` wraps the blocks of the trained models (policy, critic; not the frozen
  reference, which runs no backward) in TorchTitan's policy during the parallelize step (parallel.py):
  after TP/EP, before FSDP, so compiled blocks trace the checkpointed block.
- `trainer.mode = "compile"` (trainer/modes.py) compiles each model's transformer blocks last, after the
  converters, so the compiled programs trace the converted forwards; dynamic shapes unless lengths are
  padded to buckets (`seq_len_buckets`, or the device's static shapes).
"""

from __future__ import annotations

import dataclasses

import torch

from rl_tpu.config import Config, resolved_dtype
from rl_tpu.devices import Device
from rl_tpu.trainer import converters, cpu_matmul, graph, lora, metrics, modes, parallel


class ModelBuilder:
    """Builds this rank's models; holds what their build resolved (FSDP step mode, CPU kernel table)."""

    def __init__(self, cfg: Config, spec, device: Device, rank: int, world_size: int, num_params: int):
        tc = cfg.trainer
        self.spec, self.device = spec, device
        self.param_dtype = resolved_dtype(tc.param_dtype, cfg)
        self.reduce_dtype = tc.reduce_dtype
        self.logprob_chunk = tc.logprob_chunk_size
        self.logprob_head = tc.logprob_head
        self.seed = tc.seed
        modes.check(tc.mode)
        self.mode = tc.mode
        self.compiled = modes.compiles_blocks(tc.mode)
        # trainer.mode = "graph" needs trainer.fsdp = "simple": a config error (rl_tpu.config) otherwise
        self.graph_compile = tc.graph_compile if tc.mode == "graph" else None
        if spec.arch == "qwen3_moe" and (self.compiled or self.graph_compile or tc.fsdp != "fsdp2"):
            raise ValueError(
                "trainer.mode = 'compile' or 'graph' and trainer.fsdp = 'simple' are not verified on MoE "
                "models yet (their routers carry Python hooks, metrics.MoeStats; experts shard over EP): use "
                "trainer.mode = 'eager', trainer.fsdp = 'fsdp2'"
            )
        # the trained models' blocks (policy, critic); the reference runs no backward, so nothing to recompute
        self.activation_checkpoint = tc.activation_checkpoint
        self.checkpointed_blocks = 0  # the policy's blocks wrapped by it
        if spec.arch == "qwen3_moe" and tc.activation_checkpoint != "none":
            raise ValueError(
                f"trainer.activation_checkpoint = {tc.activation_checkpoint!r} is not verified on MoE models "
                "yet (their routers' Python hooks, metrics.MoeStats, would run again in the recompute): use "
                "trainer.activation_checkpoint = 'none'"
            )
        # padded lengths and full micro-batches (forward.py) compile static; anything else varies per step
        self.dynamic = not (tc.seq_len_buckets or device.static_shapes)
        self.pdims = parallel.make_parallel_dims(device, world_size, ep=tc.expert_parallel)
        self.fsdp = tc.fsdp
        # SimpleFSDP gathers in every forward and reduce-scatters in every backward (parallel.py)
        self.replicated_step = tc.fsdp == "fsdp2" and parallel.replicated_step(tc.fsdp_step, num_params)
        # float32 CPU linears: kernels per (shape, matmul) from trainer/cpu_matmul.py
        self.cpu_kernels = (
            tc.cpu_matmul != "aten"
            and device.local_device().type == "cpu"
            and cpu_matmul.available()
            and self.param_dtype == "float32"
            and not self.graph_compile  # inductor cannot lower oneDNN's linear with trainable weights
        )
        self.matmuls = converters.MatmulTable(tc.cpu_matmul, rank, world_size)
        self.moe_stats: metrics.MoeStats | None = None  # the policy's expert load (`moe/*` metrics)
        self.routing_replay = cfg.rollout.routing_replay  # the policy's MoE routers take the engine's experts
        self.lora = tc.lora if tc.lora.rank else None  # adapters on the policy (trainer/lora.py)

    def _build(self, spec, state_dict: dict[str, torch.Tensor], convs, what: str) -> torch.nn.Module:
        m = parallel.build_parallel_model(
            spec,
            self.pdims,
            self.device,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward="never" if self.replicated_step else "default",
            fsdp=self.fsdp,
            # graph mode checkpoints by a pass over its captured graph (graph.py), not block wrappers
            activation_checkpoint="none"
            if what == "reference" or self.graph_compile
            else self.activation_checkpoint,
        )
        parallel.load_full_state_dict(m, state_dict)
        converters.apply(m, convs, what)
        if self.compiled:
            modes.compile_blocks(m, dynamic=self.dynamic)
        if self.graph_compile and what != "reference":  # the reference runs no backward: eager
            m.rl_graph = graph.GraphSteps(m, self.graph_compile, self.activation_checkpoint)
        return m

    def policy(self, titan_sd: dict[str, torch.Tensor], frozen: bool = False) -> torch.nn.Module:
        """The policy (or, `frozen`, the reference) with the TorchTitan weights `titan_sd`."""
        hf = self.spec.hf_config  # TorchTitan 0.2.0's configs (titan_compat) name these differently
        convs = converters.model_converters(
            self.matmuls,
            self.cpu_kernels,
            self.logprob_chunk,
            hidden=int(hf["hidden_size"]),
            vocab=int(hf["vocab_size"]),
            compiled_blocks=self.compiled,
            head_kind=self.logprob_head,
        )
        spec = self.spec
        if self.lora and not frozen:  # the reference stays the base model
            spec = dataclasses.replace(spec, config=lora.convert(spec.config, self.lora))
            titan_sd = titan_sd | lora.initial_adapters(lora.adapter_shapes(spec.config), self.seed)
            at = next((i for i, c in enumerate(convs) if isinstance(c, converters.CpuMatmuls)), -1)
            convs.insert(at + 1, lora.LoraForward(self.lora.dropout))  # after the kernels' forward swap
        m = self._build(spec, titan_sd, convs, "reference" if frozen else "policy")
        if frozen:
            m.requires_grad_(False)
            m.eval()
        else:
            self.checkpointed_blocks = parallel.checkpointed_blocks(m)
            self.moe_stats = metrics.MoeStats(m, replay=self.routing_replay)
        return m

    def critic(self, titan_sd: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The decoder body of `titan_sd` under a fresh value head."""
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
        g = torch.Generator().manual_seed(self.seed + 1)  # same value head on every rank
        sd = {k: v for k, v in titan_sd.items() if not k.startswith("lm_head.")}
        sd["lm_head.weight"] = torch.randn(1, dim, generator=g) * 0.02
        sd["lm_head.bias"] = torch.zeros(1)
        convs = converters.model_converters(self.matmuls, self.cpu_kernels, compiled_blocks=self.compiled)
        return self._build(cspec, sd, convs, "critic")

    def summary(self) -> dict:
        """What the build resolved, for `TrainerWorker.ready`."""
        return {
            "mode": self.mode,  # trainer.mode
            "compile_dynamic": self.compiled and self.dynamic,  # compiled blocks with symbolic shapes
            "graph_compile": self.graph_compile,  # trainer.mode = "graph": the captured graphs' compiler
            # what `trainer.fsdp_step` resolved to; devices without FSDP2 (xla) train unsharded
            "fsdp": self.fsdp,  # trainer.fsdp
            "logprob_head": self.logprob_head,  # trainer.logprob_head
            "activation_checkpoint": self.activation_checkpoint,  # trainer.activation_checkpoint
            "checkpointed_blocks": self.checkpointed_blocks,
            "fsdp_step": "unsharded"
            if self.pdims is None
            else "simple"
            if self.fsdp == "simple"
            else "replicated"
            if self.replicated_step
            else "sharded",
            # what `trainer.cpu_matmul` resolved to: a kernel, or how many matmuls each runs; its table
            "matmul": self.matmuls.summary(),
            "matmul_table": self.matmuls.table,
            "matmul_cached": self.matmuls.cached,
        }
