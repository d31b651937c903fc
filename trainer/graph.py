"""`trainer.mode = "graph"`: each micro-batch's forward, RL loss and backward captured as one FX graph
by TorchTitan's graph trainer (`experiments/graph_trainer`: `minimal_fx_tracer`, `run_traced`,
`accumulate_param_grads_`), then compiled whole by inductor (`trainer.graph_compile = "inductor"`) or
run as the captured ATen graph ("none").

Invariants:
- What is in the graph: the decoder's forward (SimpleFSDP's all-gathers included: its parameters are
  DTensor parametrizations, so the collectives are traced into the graph), the log-prob head, the loss
  (policy or value, with its KL and entropy terms and its metrics) and `torch.autograd.grad` of the
  loss (the reduce-scatters of the gradients included). What is not: the reference model's forward
  (run eagerly before the graph, its log-probs an input: its weights are not the traced module's), the
  gradient accumulation into `.grad`, the clipping and the optimizer step (TorchTitan 0.3.0's tracer
  does not capture an optimizer step: `accumulate_param_grads_` then the usual `optimizer.step()`).
- One graph per input signature (every tensor's shape and dtype, and which optional fields the batch
  carries). Graph mode pads sequence and response lengths to buckets and micro-batches to full size
  (forward.py, as on a static-shape device), so a run traces one graph per bucket and model, then
  replays them: `traces` counts them, and a steady run keeps it constant.
- The loss's normalisers (`global_tokens`, `global_seqs`) are graph inputs, not constants: they change
  every step.
- Needs SimpleFSDP (`trainer.fsdp = "simple"`): FSDP2's hooks resize parameter storage outside
  autograd, which a trace cannot replay. Dense models only.
- `trainer.activation_checkpoint` is a pass over the captured graph, not a wrapper around the blocks (a
  checkpoint wrapper's own recompute would be traced as forward ops): the graph trainer's memory
  policies tag each forward node of the transformer blocks save or recompute (`tag_sac_policy`:
  "selective" = its "eager" policy, the same alternation of matmuls as TorchTitan's eager SelectiveAC;
  "full" = only each block's output saved), and `selective_activation_remat_pass` moves the recomputed
  nodes in front of their first backward use. The blocks' nodes carry their module names
  (`annotate_module_fqns`, applied once per model) for that. The log-prob head and the loss are never
  recomputed (the pass leaves `lm_head.*` and `loss` alone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from rl_tpu.trainer.parallel import AC_POLICIES
from rl_tpu.types import TrainBatch

log = logging.getLogger(__name__)

COMPILERS = ("inductor", "none")


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    # remove_duplicate=False, as TorchTitan's graph trainer: tied weights keep both entries
    return [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]


def _inductor_pass(gm: torch.fx.GraphModule, example_inputs: tuple) -> torch.fx.GraphModule:
    """The whole graph as one inductor region (TorchTitan's `full_inductor_compilation_pass` without its
    CUDA-graph preparation, which moves CPU constants to CUDA)."""
    from torchtitan.experiments.graph_trainer.inductor_passes import regional_inductor_pass

    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.op not in ("placeholder", "output"):
                    node.meta.setdefault("custom", {})["compile_with_inductor"] = {"inductor_configs": {}}
    return regional_inductor_pass(gm, example_inputs)


def _memory_policy_pass(gm: torch.fx.GraphModule, policy: str) -> int:
    """Recompute in backward what `policy` does not save (TorchTitan's graph-trainer passes); returns how
    many forward nodes of the blocks were recomputed."""
    from torchtitan.distributed.activation_checkpoint import _get_default_save_ops
    from torchtitan.experiments.graph_trainer import memory_policy
    from torchtitan.experiments.graph_trainer.selective_activation_remat import (
        selective_activation_remat_pass,
    )

    if policy == "selective":
        # CPU's attention kernel is not in TorchTitan's list of attention ops to save, and it is tagged
        # random (its dropout), which the remat pass cannot replay: saved, as SelectiveAC means to
        save = _get_default_save_ops() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
        policy_fn = memory_policy._make_eager_memory_policy(save)
    else:
        policy_fn = memory_policy._make_full_memory_policy()  # saves random ops by itself
    memory_policy.tag_sac_policy(gm, policy_fn=policy_fn)
    selective_activation_remat_pass(gm)
    return sum(n.name.endswith("_recomputed") for n in gm.graph.nodes)


def saved_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of the forward values the backward reads: the activations a step keeps between them."""
    total = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get("autograd_backward", False):
            continue
        if not any(u.meta.get("autograd_backward", False) for u in n.users):
            continue
        for v in torch.utils._pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


class GraphSteps:
    """The captured micro-batch steps of one model. `run` replaces `loss_fn(mb, ...)` + `loss.backward()`."""

    def __init__(self, model: torch.nn.Module, compiler: str, memory_policy: str = "none"):
        if compiler not in COMPILERS:
            raise ValueError(f"trainer.graph_compile = {compiler!r}: expected one of {COMPILERS}")
        if memory_policy not in AC_POLICIES:
            raise ValueError(
                f"trainer.activation_checkpoint = {memory_policy!r}: expected one of {AC_POLICIES}"
            )
        self.model, self.compiler, self.memory_policy = model, compiler, memory_policy
        self.graphs: dict[tuple, object] = {}
        self.recomputed = 0  # forward nodes recomputed in backward, in the latest captured graph
        self.saved = 0  # its activations kept from forward to backward, bytes (`saved_bytes`)
        if memory_policy != "none":
            from torchtitan.experiments.graph_trainer.common_utils import annotate_module_fqns

            annotate_module_fqns(model)

    @property
    def traces(self) -> int:
        return len(self.graphs)

    def run(
        self, loss_fn: Callable, mb: TrainBatch, global_tokens: float, global_seqs: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss and metrics; its gradients are added to the parameters' `.grad`."""
        from torchtitan.experiments.graph_trainer.common_utils import accumulate_param_grads_
        from torchtitan.experiments.graph_trainer.make_fx_tracer import run_traced

        prepare = getattr(loss_fn, "prepare", None)
        if prepare is not None:  # what must not be traced (the reference's forward)
            mb = prepare(mb)
        fields = mb.tensor_fields()
        norms = torch.tensor([global_tokens, global_seqs], dtype=torch.float64)
        key = tuple((k, tuple(v.shape), v.dtype) for k, v in fields.items())
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(loss_fn, fields, norms)
        loss, metrics, grads = run_traced(graph, module=self.model)(fields, norms)
        accumulate_param_grads_(_params(self.model), grads)
        return loss, metrics

    def _capture(self, loss_fn: Callable, fields: dict[str, torch.Tensor], norms: torch.Tensor):
        from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer

        model = self.model

        def step(fields: dict[str, torch.Tensor], norms: torch.Tensor):
            params = _params(model)  # the traced state's (minimal_fx_tracer swaps it in)
            loss, metrics = loss_fn(TrainBatch(**fields), norms[0], norms[1])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
            metrics = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in metrics.items()}
            return loss.detach(), metrics, grads

        t = time.perf_counter()
        graph = minimal_fx_tracer(step, module=model)(fields, norms)
        if self.memory_policy != "none":
            self.recomputed = _memory_policy_pass(graph.gm, self.memory_policy)
        self.saved = saved_bytes(graph.gm)
        if self.compiler == "inductor":
            graph.gm = _inductor_pass(graph.gm, graph.example_inputs)
        dt = time.perf_counter() - t
        log.info(
            "trainer.mode = graph: captured a step of shape %s in %.1f s (%d forward nodes recomputed)",
            tuple(fields["input_ids"].shape),
            dt,
            self.recomputed,
        )
        return graph
