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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

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


class GraphSteps:
    """The captured micro-batch steps of one model. `run` replaces `loss_fn(mb, ...)` + `loss.backward()`."""

    def __init__(self, model: torch.nn.Module, compiler: str):
        if compiler not in COMPILERS:
            raise ValueError(f"trainer.graph_compile = {compiler!r}: expected one of {COMPILERS}")
        self.model, self.compiler = model, compiler
        self.graphs: dict[tuple, object] = {}

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
        if self.compiler == "inductor":
            graph.gm = _inductor_pass(graph.gm, graph.example_inputs)
        dt = time.perf_counter() - t
        log.info(
            "trainer.mode = graph: captured a step of shape %s in %.1f s",
            tuple(fields["input_ids"].shape),
            dt,
        )
        return graph
