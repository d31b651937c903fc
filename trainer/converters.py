"""Model converters: the run-time changes the trainer makes to a built TorchTitan model, declared as a list.

A converter has a `name` and `convert(model)`, which changes the model in place (TorchTitan declares its
model changes the same way, as converters; its converters rewrite the model config before the build,
these patch forwards after it, because both change how a module computes and not what it holds).
`model_converters` builds the list from the trainer config; `apply` runs it in order, in one place, and
logs what it applied.

Invariants:
- A converter never touches parameters, buffers or state-dict keys: only `forward`s and attributes, so
  FSDP2's hooks (which live in `__call__`), DCP checkpoints and weight sync see the model unchanged.
- `cpu_matmul` comes before `logprob_head`, whose matmuls read the kernel table `cpu_matmul` fills.
- Resolving the kernel table is collective (trainer.cpu_matmul = "auto" with several ranks times the
  shapes on every rank and all-reduces the times): every rank builds the same models in the same order,
  so all ranks read the same cache entries or time the same shapes, and agree.
- Float32 on CPU only: with `trainer.cpu_matmul = "aten"`, another dtype or another device, the list has
  no `cpu_matmul` and every matmul is aten's (`ops.Matmuls()`), results bit for bit those of `F.linear`.
- `trainer.mode = "compile"`: `cpu_matmul` leaves the linears inside the transformer blocks alone (they
  are compiled, and inductor cannot lower oneDNN's linear with trainable weights: trainer/modes.py); the
  heads outside the blocks keep the table's kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from rl_tpu.trainer import cpu_matmul, ops

log = logging.getLogger(__name__)


class ModelConverter(Protocol):
    name: str

    def convert(self, model: torch.nn.Module) -> None: ...


@dataclass
class MatmulTable:
    """The kernels of each float32 CPU linear shape (trainer/cpu_matmul.py), filled as models are built:
    `table` maps "K,N" to a kernel per matmul; `cached` says whether every entry came from the cache."""

    mode: str  # trainer.cpu_matmul
    rank: int = 0
    world_size: int = 1
    table: dict[str, dict[str, str]] = field(default_factory=dict)
    cached: bool = True

    def resolve(self, shapes: set[tuple[int, int]]) -> None:
        """Add `shapes` to the table (collective, see the module's invariants)."""
        todo = sorted(s for s in shapes if f"{s[0]},{s[1]}" not in self.table)
        if not todo:
            return

        def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t)
            return t

        table, cached = cpu_matmul.resolve(
            self.mode,
            todo,
            torch.get_num_threads(),
            sum_over_ranks if self.world_size > 1 else None,
            is_writer=self.rank == 0,
            ranks=self.world_size,
        )
        self.table.update(table)
        self.cached = self.cached and cached

    def matmuls(self, k: int, n: int) -> ops.Matmuls:
        """The kernels of a `[.., k] -> [.., n]` linear (aten's when not in the table)."""
        names = self.table.get(f"{k},{n}")
        return cpu_matmul.matmuls(names) if names else ops.Matmuls()

    def summary(self) -> str:
        """What `trainer.cpu_matmul` resolved to: a kernel, or how many matmuls each runs."""
        return cpu_matmul.summary(self.table) if self.table else "aten"


@dataclass
class CpuMatmuls:
    """Every `nn.Linear` runs its three matmuls on the kernels the table picks for its shape (MKL or
    oneDNN, `cpu_matmul.install`). `extra_shapes` are matmul shapes of the model that are no linear (the
    log-prob head's vocabulary chunks), resolved in the same call so the head finds them in the table."""

    table: MatmulTable
    extra_shapes: tuple[tuple[int, int], ...] = ()
    outside_blocks: bool = False  # only the linears outside `model.layers` (compiled blocks)
    name: str = "cpu_matmul"

    def convert(self, model: torch.nn.Module) -> None:
        parts = [m for n, m in model.named_children() if n != "layers"] if self.outside_blocks else [model]
        shapes = set().union(*(cpu_matmul.linear_shapes(m) for m in parts))
        self.table.resolve(shapes | set(self.extra_shapes))
        for m in parts:
            cpu_matmul.install(m, self.table.matmuls)


@dataclass
class LogProbHead:
    """The lm_head returns (log-probs, entropy) `[b, T]` of the response tokens instead of logits
    (`install_logprob_head`), with the table's kernels for its `[.., hidden] -> [.., chunk]` matmuls
    (`kind = "chunked"`) or the whole logits at once under autograd (`"full"`)."""

    chunk: int
    table: MatmulTable
    shape: tuple[int, int]
    kind: str = "chunked"  # trainer.logprob_head
    name: str = "logprob_head"

    def convert(self, model: torch.nn.Module) -> None:
        install_logprob_head(model.lm_head, self.chunk, self.table.matmuls(*self.shape), self.kind)


HEADS = ("chunked", "full")  # trainer.logprob_head


def install_logprob_head(
    lm_head: torch.nn.Module, chunk: int, mm: ops.Matmuls = ops.Matmuls(), kind: str = "chunked"
) -> None:
    """Make the lm_head return (log-probs, entropy) `[b, T]` of the response tokens instead of logits:
    `kind = "chunked"` (`ops.chunked_log_probs`, `chunk` vocabulary rows at a time, the logits recomputed
    in backward) or `"full"` (`ops.full_log_probs`, the `[b, T, V]` logits at once, aten's matmul).

    The decoder calls it inside its own forward (so FSDP's grouped norm+lm_head unit unshards the weight
    and reduce-scatters its gradient as for logits, and logits `[b, L, V]` are never materialised); which
    positions and targets to score is set on `lm_head.rl_index` just before, the sampling temperature on
    `lm_head.rl_temperature`.
    """
    if kind not in HEADS:
        raise ValueError(f"trainer.logprob_head = {kind!r}: expected one of {HEADS}")
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("the log-prob head assumes an lm_head without bias")

    def forward(h: torch.Tensor):
        hidx, targets = lm_head.rl_index  # hidx: [b, T] flat indices into h's [B * L] positions
        hs = h.reshape(-1, h.shape[-1])[hidx]  # [b, T, D]
        # verl scores tokens at the sampling temperature (logits / t); (h / t) @ W.T is the same thing
        if lm_head.rl_temperature != 1.0:
            hs = hs / lm_head.rl_temperature
        if kind == "full":
            return ops.full_log_probs(hs, lm_head.weight, targets)
        return ops.chunked_log_probs(hs, lm_head.weight, targets, chunk, mm)  # [b, T] each, not views

    lm_head.rl_index = None
    lm_head.rl_temperature = 1.0
    lm_head.forward = forward  # FSDP hooks live in __call__, so they still wrap this


def model_converters(
    table: MatmulTable,
    cpu_kernels: bool,
    logprob_chunk: int | None = None,
    hidden: int = 0,
    vocab: int = 0,
    compiled_blocks: bool = False,
    head_kind: str = "chunked",
) -> list[ModelConverter]:
    """The converters of one model: CPU kernels from `table` when `cpu_kernels` (float32 on CPU, not
    `trainer.cpu_matmul = "aten"`; outside the blocks only when `compiled_blocks`), the log-prob head when
    `logprob_chunk` is given, of `head_kind` (policy and reference; the critic's head stays a plain
    `Linear(hidden, 1)`)."""
    head = (hidden, min(logprob_chunk, vocab)) if logprob_chunk else None
    out: list[ModelConverter] = []
    if cpu_kernels:
        out.append(CpuMatmuls(table, (head,) if head else (), outside_blocks=compiled_blocks))
    if head:
        out.append(LogProbHead(logprob_chunk, table, head, head_kind))
    return out


def apply(model: torch.nn.Module, converters: list[ModelConverter], what: str = "model") -> list[str]:
    """Run `converters` on `model` in order; returns (and logs) their names."""
    for c in converters:
        c.convert(model)
    names = [c.name for c in converters]
    log.info("%s: applied model converters %s", what, ", ".join(names) or "(none)")
    return names
