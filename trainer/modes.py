"""`trainer.mode`: how a trainer rank executes its decoders. "eager" runs TorchTitan's modules as they are;
"compile" makes each TorchTitan transformer block one `torch.compile` program, as TorchTitan's own
`apply_compile` (torchtitan/distributed/compile.py) does: `block.compile(fullgraph=True)`, so the
blocks, which share one forward, share the compiled code; "graph" captures each micro-batch's whole
forward, loss and backward as one graph (trainer/graph.py). The invariants below are compile mode's.

Invariants:
- Only the transformer blocks are compiled. The embedding, the final norm and the heads (the chunked
  log-prob head, trainer/ops.py, and the critic's value head) stay eager, as do the RL loss and the
  optimizer: they run once per micro-batch, outside the repeated structure.
- FSDP2's hooks stay outside the compiled programs (dynamo skips FSDP hooks by default), so the
  all-gathers and reduce-scatters are FSDP2's own, exactly as in eager mode.
- Shapes: RL batches change token counts every step (and packed shared-prompt rows, trainer/attention.py,
  change every dimension of their attention views). Without `seq_len_buckets` the blocks compile with
  `dynamic=True`: every size is symbolic from the first trace, one program per (training / inference)
  kind and no recompilation when lengths change. Dynamo's default ("automatic dynamic") instead
  recompiles each time another dimension is first seen to change (4 programs over 4 varied GRPO
  batches measured on the tiny model, each 8-12 s to compile on 2 shared cores; docs/decisions.md).
  With `seq_len_buckets` lengths are padded to the buckets and micro-batches to full size
  (forward.py), so the blocks compile static: one program per bucket.
- Compiling is lazy: a block is traced at its first call, so the first step of a shape pays the
  compile time. `compiled_programs()` counts what dynamo has compiled in this process (its own
  `unique_graphs` counter); a steady run keeps it constant.
- `cpu_matmul` kernels are not used inside compiled blocks: inductor cannot lower oneDNN's
  `mkldnn._linear_pointwise` with trainable weights (its lowering asserts the weight is a frozen
  constant, torch/_inductor/mkldnn_lowerings.py `linear_unary`), so the blocks' linears are aten
  matmuls that inductor schedules itself; the heads outside the blocks keep the kernel table
  (converters.py).
"""

from __future__ import annotations

import torch

MODES = ("eager", "compile", "graph")


def check(mode: str) -> None:
    """Raise for a mode this trainer cannot run."""
    if mode not in MODES:
        raise ValueError(f"trainer.mode = {mode!r}: expected one of {MODES}")


def compiles_blocks(mode: str) -> bool:
    return mode == "compile"


def compile_blocks(model: torch.nn.Module, *, dynamic: bool, backend: str = "inductor") -> int:
    """Make each of `model.layers` one compiled program (TorchTitan's `apply_compile`, with `dynamic`
    chosen by the caller, see the module docstring); returns how many blocks."""
    # TorchTitan sets this for the data-dependent shapes of token-choice MoE dispatch; harmless for dense
    torch._dynamo.config.capture_scalar_outputs = True
    # as TorchTitan's apply_compile: an activation-checkpointed block's recompute does not replay the
    # forward's Python side effects (RoPE cache updates), which compiled code cannot reapply
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    n = 0
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True, dynamic=dynamic)
        n += 1
    return n


def compiled_programs() -> int:
    """Graphs dynamo has compiled in this process so far (`torch._dynamo.utils.counters`)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def aot_compiles() -> int:
    """Graphs AOTAutograd has compiled in this process so far (its own `total` counter): in graph mode with
    inductor, one per captured graph (TorchTitan's regional inductor compiles through it)."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["total"])
