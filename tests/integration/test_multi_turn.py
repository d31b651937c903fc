"""Multi-turn rollouts (rollout/multi_turn.py): token-in/token-out trajectories with an environment.

The environments below run in `EnvPool` worker processes, which import this module by name: it imports
nothing heavy at its top (torch is imported inside the one test that needs it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rl_tpu.rollout.env_pool import EnvPool
from rl_tpu.rollout.multi_turn import ChatDelta, EnvError, MultiTurn, load_env, retokenize_drift
from rl_tpu.types import Completion

ROOT = Path(__file__).resolve().parents[2]


class Echo:
    """Answers every assistant turn with "again"; after `turns` turns rewards the number of messages."""

    turns = 3

    def reset(self, sample):
        self.n = 0
        return [{"role": "user", "content": sample["question"]}]

    def step(self, messages):
        self.n += 1
        if self.n >= self.turns:
            return [], float(len(messages)), True
        return [{"role": "user", "content": f"again {self.n}"}], None, False


class AsyncEcho(Echo):
    async def step(self, messages):
        return super().step(messages)


@pytest.fixture(scope="module")
def tok(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.fixture
def envs():
    """`envs(Class)` (a class of this module) or `envs("path.py:Class")`: an `EnvPool` of one worker,
    closed after the test."""
    pools = []

    def make(env, **kw):
        spec = env if isinstance(env, str) else f"{__name__}:{env.__name__}"
        pools.append(EnvPool(spec, **{"workers": 1} | kw))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def _scripted(tok, texts):
    """A generate that answers each prompt with the next of `texts` plus the stop token, and records prompts."""
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    calls, it = [], iter(texts * 100)

    def generate(prompts, max_tokens):
        calls.append([list(p) for p in prompts])
        out = []
        for p in prompts:
            text = next(it)
            whole = tok(text, add_special_tokens=False)["input_ids"] + [eos]
            ids = whole[:max_tokens]
            out.append(
                Completion(
                    prompt_index=0,
                    sample_index=0,
                    prompt_ids=list(p),
                    response_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    finish_reason="stop" if ids == whole else "length",
                    text=text,
                    policy_version=3,
                )
            )
        return out

    return generate, calls


def test_delta_is_the_templates_text_for_the_new_messages(tok):
    d = ChatDelta(tok)
    new = [{"role": "user", "content": "again"}]
    assert d.text(new) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    # the sampled turn (ending in the stop token) + the delta = the template's rendering of the conversation
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    rendered = tok.apply_chat_template(conv + new, tokenize=False, add_generation_prompt=True)
    head = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert rendered == head + "x" + tok.eos_token + d.text(new)


@pytest.mark.parametrize("env", [Echo, AsyncEcho])
def test_trajectory_is_sampled_ids_and_inserted_ids_with_mask(tok, envs, env):
    generate, calls = _scripted(tok, ["one", "two two", "three"])
    mt = MultiTurn(tok, envs(env), generate, max_turns=5, max_tokens=16, max_total_tokens=200)
    (t,) = mt.rollout([{"question": "hi"}])
    assert t.turns == 3 and t.finish_reason == "env" and t.reward == 6.0  # user + 3 assistant + 2 user
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    expect, mask = [], []
    for i, text in enumerate(["one", "two two", "three"]):
        sampled = tok(text, add_special_tokens=False)["input_ids"] + [eos]
        expect += sampled
        mask += [1] * len(sampled)
        if i < 2:
            inserted = ChatDelta(tok).ids([{"role": "user", "content": f"again {i + 1}"}])
            expect += inserted
            mask += [0] * len(inserted)
    assert t.ids == expect and t.mask == mask
    assert t.logprobs == [-0.5 if m else 0.0 for m in mask]
    assert t.versions == [3 if m else -1 for m in mask]
    # each turn's prompt was exactly the trajectory so far: nothing re-tokenized
    full = t.prompt_ids + t.ids
    assert t.prompt_ids == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    for c in calls:
        assert full[: len(c[0])] == c[0]
    assert len(calls) == 3 and len({len(c[0]) for c in calls}) == 3
    assert t.last_text == "three"


def test_limits_end_trajectories(tok, envs):
    generate, _ = _scripted(tok, ["a b c d e f"])
    (t,) = MultiTurn(tok, envs(Echo), generate, max_turns=2, max_tokens=16, max_total_tokens=500).rollout(
        [{"question": "q"}]
    )
    assert (t.turns, t.finish_reason, t.reward) == (2, "max_turns", None)
    assert t.mask[-1] == 1  # ends on the sampled turn, no dangling inserted tokens
    (t,) = MultiTurn(tok, envs(Echo), generate, max_turns=9, max_tokens=3, max_total_tokens=500).rollout(
        [{"question": "q"}]
    )
    assert (t.turns, t.finish_reason, len(t.ids)) == (1, "length", 3)  # no stop token within max_tokens
    (t,) = MultiTurn(tok, envs(Echo), generate, max_turns=9, max_tokens=16, max_total_tokens=12).rollout(
        [{"question": "q"}]
    )
    assert t.finish_reason in ("max_total_tokens", "length") and len(t.ids) <= 12
    two = MultiTurn(tok, envs(Echo), generate, max_turns=9, max_tokens=16, max_total_tokens=500).rollout(
        [{"question": "q"}, {"question": "r"}], n=2
    )
    assert [t.sample["question"] for t in two] == ["q", "q", "r", "r"]


class NoStep:
    def reset(self, sample):
        return []


class BadStep(Echo):
    def step(self, messages):
        return "text"


class BadMessages(Echo):
    def step(self, messages):
        return ["again"], None, False


class WordReward(Echo):
    def step(self, messages):
        return [], "high", True


class EmptyReset(Echo):
    def reset(self, sample):
        return []


def test_environment_errors_name_the_culprit(tok, envs, tmp_path):
    with pytest.raises(EnvError, match="no step method"):
        load_env(f"{__name__}:NoStep")
    with pytest.raises(EnvError, match="rollout.env 'nowhere.py:Env': file"):
        load_env("nowhere.py:Env")
    with pytest.raises(EnvError, match="name the class"):
        load_env("some_module")
    f = tmp_path / "my_env.py"
    f.write_text(
        "class Env:\n    def reset(self, s): return []\n    def step(self, m): return [], 1.0, True\n"
    )
    assert load_env(f"{f}:Env").__name__ == "Env"
    generate, _ = _scripted(tok, ["x"])
    with pytest.raises(EnvError, match=r"BadStep.step must return \(new_messages"):
        MultiTurn(tok, envs(BadStep), generate, max_turns=3, max_tokens=8, max_total_tokens=99).rollout(
            [{"question": "q"}]
        )
    with pytest.raises(EnvError, match="BadMessages.step must return a list of"):
        MultiTurn(tok, envs(BadMessages), generate, max_turns=3, max_tokens=8, max_total_tokens=99).rollout(
            [{"question": "q"}]
        )
    with pytest.raises(
        EnvError, match="WordReward.step must return a number or None as its reward, got 'high'"
    ):
        MultiTurn(tok, envs(WordReward), generate, max_turns=3, max_tokens=8, max_total_tokens=99).rollout(
            [{"question": "q"}]
        )
    with pytest.raises(EnvError, match="EmptyReset.reset returned no messages"):
        MultiTurn(tok, envs(EmptyReset), generate, max_turns=3, max_tokens=8, max_total_tokens=99).rollout(
            [{"question": "q"}]
        )


@pytest.mark.timeout(600)
def test_real_engine_trajectories_score_the_same_under_the_model(tiny_qwen3, tok, envs):
    """With a real vLLM engine: every turn's prompt is the trajectory's own ids, and the model's log-probs
    of the full trajectory (teacher-forced, transformers, fp32) at the sampled tokens equal the engine's."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from rl_tpu.rollout.engine import to_completions

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(
        model=tiny_qwen3,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=32,
        kv_cache_memory_bytes=2**30,
        seed=0,
        logprobs_mode="raw_logprobs",  # the model's own log-softmax, before the bias below
    )
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    calls = []

    def generate(prompts, max_tokens):
        calls.append([list(p) for p in prompts])
        # a random tiny model rarely stops by itself: bias sampling towards the stop token
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, logit_bias={eos: 3.0})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [g[0] for g in to_completions(outs, range(len(prompts)), policy_version=0, tokenizer=tok)]

    try:
        trajs = MultiTurn(
            tok, envs(Echo), generate, max_turns=3, max_tokens=24, max_total_tokens=300
        ).rollout([{"question": "What is 2+3?"}, {"question": "Name a color."}], n=2)
    finally:
        from rl_tpu.weight_sync import vllm_compat

        vllm_compat.release_engine(llm)
    assert any(t.turns >= 2 and 0 in t.mask for t in trajs), [(t.turns, t.finish_reason) for t in trajs]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    worst = 0.0
    for t in trajs:
        full = torch.tensor([t.prompt_ids + t.ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf(full).logits[0, :-1].float(), -1)
        ref = lp.gather(1, full[0, 1:, None])[:, 0][len(t.prompt_ids) - 1 :]
        m = torch.tensor(t.mask, dtype=torch.bool)
        worst = max(worst, (ref[m] - torch.tensor(t.logprobs)[m]).abs().max().item())
        assert torch.tensor(t.logprobs)[~m].eq(0).all()
    assert worst <= 1e-5, worst
    for c in calls:  # each turn's prompts are prefixes of some trajectory's ids
        for p in c:
            assert any((t.prompt_ids + t.ids)[: len(p)] == p for t in trajs)


def test_retokenize_drift_tells_ids_a_text_round_trip_keeps_from_ids_it_changes(tok):
    """A word the tokenizer writes as one token, sampled in parts (its first letter, then the rest): the
    text is the same, the ids a text pipeline would train on are not."""
    from rl_tpu.rollout.multi_turn import Trajectory

    def pieces(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    def as_two(i: int) -> tuple[int, list[int]] | None:  # token i's text, tokenized in two parts
        text = tok.decode([i])
        split = pieces(text[:1]) + pieces(text[1:]) if len(text) >= 3 and text.strip().isalpha() else []
        return (i, split) if pieces(text) == [i] and len(split) >= 2 and tok.decode(split) == text else None

    whole, split = next(found for i in range(len(tok)) if (found := as_two(i)))  # from the model's vocabulary
    prompt = tok("Say it:", add_special_tokens=False)["input_ids"]
    same = Trajectory(sample={}, prompt_ids=prompt, messages=[], ids=[whole])
    drifted = Trajectory(sample={}, prompt_ids=prompt, messages=[], ids=split)
    assert retokenize_drift(tok, same) is False and retokenize_drift(tok, drifted) is True


def test_a_turn_ended_by_another_stop_token_gets_the_templates_stop_token_inserted(tok, envs):
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    stop = tok("x", add_special_tokens=False)["input_ids"][-1]  # as if rollout.stop_token_ids=[stop]

    def generate(prompts, max_tokens):
        ids = tok("y y", add_special_tokens=False)["input_ids"] + [stop]
        return [
            Completion(
                prompt_index=0,
                sample_index=0,
                prompt_ids=list(p),
                response_ids=ids,
                logprobs=[-1.0] * len(ids),
                finish_reason="stop",
                text="y y",
                policy_version=0,
            )
            for p in prompts
        ]

    (t,) = MultiTurn(tok, envs(Echo), generate, max_turns=2, max_tokens=8, max_total_tokens=99).rollout(
        [{"question": "q"}]
    )
    first = t.mask.index(0)
    assert t.ids[first - 1] == stop and t.ids[first] == eos  # inserted after the sampled stop, unsampled
    assert t.ids[first:][
        : len(ChatDelta(tok).ids([{"role": "user", "content": "again 1"}], closed=False))
    ] == (ChatDelta(tok).ids([{"role": "user", "content": "again 1"}], closed=False))
    c = t.completion(5, 1)
    assert (c.prompt_index, c.sample_index, c.loss_mask, c.response_ids) == (5, 1, t.mask, t.ids)
    assert c.policy_version == 0 and c.extra["turns"] == 2 and len(c.logprobs) == len(c.response_ids)


def test_the_documented_example_environment(tok, envs):
    retry = str(ROOT / "examples" / "envs" / "retry.py") + ":Retry"
    generate, _ = _scripted(tok, ["It is 5.", "It is 7."])
    row = {"messages": [{"role": "user", "content": "What is 3+4?"}], "ground_truth": "7"}
    (t,) = MultiTurn(tok, envs(retry), generate, max_turns=3, max_tokens=16, max_total_tokens=200).rollout(
        [row]
    )
    assert (t.turns, t.reward, t.finish_reason) == (2, 1.0, "env")
    assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant"]


class Flaky(Echo):
    """Raises on the second question's first step (a bad row), answers the rest."""

    def reset(self, sample):
        self.bad = sample["question"] == "bad"
        return super().reset(sample)

    def step(self, messages):
        if self.bad:
            raise KeyError("no such row")
        return super().step(messages)


def test_an_environment_that_raises_ends_its_trajectory_with_reward_zero(tok, envs, caplog):
    generate, _ = _scripted(tok, ["a"])
    mt = MultiTurn(tok, envs(Flaky), generate, max_turns=5, max_tokens=8, max_total_tokens=200)
    with caplog.at_level("WARNING"):
        ok, bad, bad2 = mt.rollout([{"question": "ok"}, {"question": "bad"}, {"question": "bad"}])
    assert (ok.finish_reason, ok.reward, ok.env_error, ok.turns) == ("env", 6.0, False, 3)
    assert (bad.finish_reason, bad.reward, bad.env_error, bad.turns) == ("env_error", 0.0, True, 1)
    assert bad.mask[-1] == 1 and bad2.env_error
    logged = [r for r in caplog.records if "Flaky.step raised KeyError" in r.getMessage()]
    assert len(logged) == 1 and "Traceback" in logged[0].getMessage()  # the first one, with its traceback


class Interaction:
    """Reads verl's `extra_info.interaction_kwargs` (its agent loop's per-row interaction settings)."""

    def reset(self, sample):
        self.kw = sample["extra_info"]["interaction_kwargs"]
        return list(sample["messages"])

    def step(self, messages):
        return [], float(self.kw["ground_truth"] in messages[-1]["content"]), True


def test_a_verl_rows_interaction_kwargs_reach_the_environment(tok, envs):
    import dataclasses

    from rl_tpu.data.schema import example_from_row

    row = {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": "What is 3+4?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"index": 0, "interaction_kwargs": {"name": "gsm8k", "ground_truth": "7"}},
    }
    sample = dataclasses.asdict(example_from_row(row, "rows.jsonl line 1", "u0"))  # what Sampler passes
    generate, _ = _scripted(tok, ["It is 7."])
    (t,) = MultiTurn(
        tok, envs(Interaction), generate, max_turns=2, max_tokens=16, max_total_tokens=99
    ).rollout([sample])
    assert (t.reward, t.finish_reason) == (1.0, "env")


class SlowFirst(Echo):
    """Echo whose first step on the question "slow" lasts until the two "fast" rows have taken their last
    step (at most 3 s: where they wait for it, it waits that long); logs when each step ends to the row's
    `log` file (the instances live in a worker process)."""

    def reset(self, sample):
        self.slow, self.log = sample["question"] == "slow", sample["log"]
        return super().reset(sample)

    def _fast_done(self) -> int:
        try:
            with open(self.log) as f:
                return sum(line.split()[1:] == ["0", "3"] for line in f)
        except FileNotFoundError:
            return 0

    def step(self, messages):
        deadline = time.monotonic() + 3.0
        while self.slow and self.n == 0 and self._fast_done() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        answer = super().step(messages)
        with open(self.log, "a") as f:
            f.write(f"{time.monotonic()} {int(self.slow)} {self.n}\n")
        return answer


@pytest.mark.parametrize("scheduling", ["independent", "lockstep"])
def test_a_slow_environment_holds_only_its_own_trajectory(tok, envs, scheduling, tmp_path):
    generate, calls = _scripted(tok, ["a"])
    mt = MultiTurn(
        tok, envs(SlowFirst), generate, max_turns=5, max_tokens=8, max_total_tokens=300, scheduling=scheduling
    )
    log = tmp_path / "steps.log"
    trajs = mt.rollout([{"question": q, "log": str(log)} for q in ("slow", "fast", "fast")])
    assert [(t.turns, t.finish_reason, t.reward) for t in trajs] == [(3, "env", 6.0)] * 3
    # CLOCK_MONOTONIC is one clock for every process of the machine: the worker's times compare with ours
    ends = [
        (float(at), bool(int(slow)), int(n)) for at, slow, n in map(str.split, log.read_text().splitlines())
    ]
    slow_first = next(at for at, slow, n in ends if slow and n == 1)
    fast_last = max(at for at, slow, n in ends if not slow and n == 3)
    if scheduling == "independent":  # the fast ones went through all their turns meanwhile
        assert fast_last < slow_first, ends
        assert mt.stats["generate_calls"] >= 4
    else:
        assert fast_last > slow_first, ends
        assert mt.stats == {"generate_calls": 3.0, "turns_per_call": 3.0} and len(calls) == 3
