"""Per-token policy versions and the staleness metrics (pure logic, no Ray)."""

import torch

from rl_tpu.batching import build_rollout_batch, staleness_metrics
from rl_tpu.types import Completion


def _c(p, s, resp, version, token_versions=()):
    return Completion(
        prompt_index=p,
        sample_index=s,
        prompt_ids=[1, 2],
        response_ids=resp,
        logprobs=[-0.5] * len(resp),
        finish_reason="stop",
        text="",
        policy_version=version,
        token_versions=list(token_versions),
    )


def test_every_token_carries_its_version_into_the_batch_and_the_metrics():
    groups = [
        [_c(0, 0, [5, 6, 7, 8], 2, [2, 2, 3, 4]), _c(0, 1, [9], 3)],  # a partial rollout; a whole one
        [_c(1, 0, [10, 11], 4, [4, 4])],
    ]
    rb = build_rollout_batch(groups, [1.0, 0.0, 0.5], pad_id=0)
    b = rb.batch
    assert b.policy_versions.shape == b.response_mask.shape == b.rollout_log_probs.shape
    assert b.policy_versions.tolist() == [[2, 2, 3, 4], [3, 0, 0, 0], [4, 4, 0, 0]]
    assert rb.policy_versions.tolist() == [2, 3, 4]  # the oldest token of each row
    m = staleness_metrics(b, trainer_version=5)
    # tokens behind version 5: 3 3 2 1 | 2 | 1 1 -> mean 13/7, max 3; 2 of 7 sampled after an update
    assert m["rollout/staleness_max"] == 3.0
    assert abs(m["rollout/staleness_mean"] - 13 / 7) < 1e-6
    assert abs(m["rollout/partial_fraction"] - 2 / 7) < 1e-6
    # padding survives the trainer's reshaping: new positions get version 0 and mask 0
    padded = b.pad_to(b.input_ids.shape[1] + 2, 6, pad_id=0)
    assert padded.policy_versions[0].tolist() == [2, 2, 3, 4, 0, 0]
    assert staleness_metrics(padded, 5) == m


def test_whole_rollouts_have_no_partial_tokens():
    rb = build_rollout_batch([[_c(0, 0, [5, 6], 1), _c(0, 1, [7], 1)]], [0.0, 1.0], pad_id=0)
    m = staleness_metrics(rb.batch, trainer_version=1)
    assert m == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/partial_fraction": 0.0}
    assert torch.equal(rb.batch.policy_versions, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))


# ---------------------------------------------------------------------------------------------------
# partial rollouts and the producer, on fakes (pure logic: no Ray, no engine)


class _Engines:
    """`generate` and `generate_chunk` like RolloutGroup's: token t of a sequence is `len(prompt) + t`,
    log-prob -version; a sequence stops (EOS) once its prompt plus response reaches `stop_at`. `version`
    is what it serves."""

    def __init__(self, stop_at=None):
        self.version, self.stop_at, self.calls = 0, stop_at or {}, []

    def state_dict(self):
        return {"calls": len(self.calls)}

    def generate(self, prompts, n=None, max_tokens=None, **kw):
        n = n or 2
        max_tokens = max_tokens or 6
        self.calls.append((len(prompts), n, max_tokens))
        out = []
        for k, p in enumerate(prompts):
            group = []
            for j in range(n):
                stop = self.stop_at.get(p[0])
                toks, reason = [], "length"
                for t in range(max_tokens):
                    toks.append(len(p) + t)
                    if stop is not None and len(p) + len(toks) >= stop:
                        reason = "stop"
                        break
                group.append(
                    Completion(
                        prompt_index=k,
                        sample_index=j,
                        prompt_ids=list(p),
                        response_ids=toks,
                        logprobs=[-float(self.version)] * len(toks),
                        finish_reason=reason,
                        text="",
                        policy_version=self.version,
                        token_versions=[self.version] * len(toks),
                    )
                )
            out.append(group)
        return out

    def generate_chunk(self, seqs, chunk, max_tokens=6):
        from rl_tpu.rollout.held import Piece

        self.calls.append((len(seqs), chunk))
        pieces = []
        for c in seqs:
            p, done, stop = c.prompt_ids, len(c.response_ids), self.stop_at.get(c.prompt_ids[0])
            piece = Piece(policy_version=self.version, worker=0)
            while piece.finish_reason is None and len(piece.token_ids) < chunk:
                piece.token_ids.append(len(p) + done + len(piece.token_ids))
                piece.logprobs.append(-float(self.version))
                if stop is not None and len(p) + done + len(piece.token_ids) >= stop:
                    piece.finish_reason = "stop"
                elif done + len(piece.token_ids) >= max_tokens:
                    piece.finish_reason = "length"
            pieces.append(piece)
        return pieces


def test_chunks_continue_unfinished_sequences_with_the_versions_of_their_chunks():
    from rl_tpu.rollout.partial import generate_held

    engines = _Engines(stop_at={20: 5})  # prompt [20, 1] stops after 3 tokens; [10, 1] runs to max_tokens

    def chunk(seqs):
        out = engines.generate_chunk(seqs, 3, max_tokens=7)
        engines.version += 1  # a weight update between every two chunks
        return out

    groups = generate_held(chunk, [[10, 1], [20, 1]], n=2)
    # chunks of 3, 3, 1 tokens; the second prompt's samples stopped in the first chunk
    assert engines.calls == [(4, 3), (2, 3), (2, 3)]
    long, short = groups[0][1], groups[1][0]
    assert (long.prompt_index, long.sample_index, short.prompt_index, short.sample_index) == (0, 1, 1, 0)
    assert long.response_ids == [2, 3, 4, 5, 6, 7, 8] and long.finish_reason == "length"
    assert long.token_versions == [0, 0, 0, 1, 1, 1, 2] and long.policy_version == 0
    assert long.logprobs == [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -2.0]
    assert short.response_ids == [2, 3, 4] and short.finish_reason == "stop" and short.versions() == [0, 0, 0]


def test_a_waiting_exclusive_turn_goes_before_the_next_generation_call():
    import threading
    import time

    from rl_tpu.rollout.partial import EngineTurns

    turns, order = EngineTurns(), []
    started = threading.Event()

    def exclusive_waiting() -> bool:
        with turns._cv:
            return turns._exclusive_waiting > 0

    def producer():
        for k in range(3):
            with turns.generating():
                started.set()
                order.append(f"chunk{k}")
                time.sleep(0.05)
                # chunk 0 ends only once the update asks for its turn (events, not the scheduler's timing)
                deadline = time.monotonic() + 30
                while k == 0 and not exclusive_waiting() and time.monotonic() < deadline:
                    time.sleep(0.005)

    t = threading.Thread(target=producer)
    t.start()
    started.wait()
    with turns.exclusive():
        order.append("update")
    t.join()
    assert order == ["chunk0", "update", "chunk1", "chunk2"]
    assert turns.busy_s >= 0.15


def _producer(tmp_path, *overrides, steps=6):
    from rl_tpu.config import load_config
    from rl_tpu.controller.producer import Rollouts
    from rl_tpu.data import Example, PromptLoader
    from rl_tpu.rewards.pool import RewardResult

    class Tok:
        chat_template, pad_token_id = "{{ messages }}", 0

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return messages[0]["content"]

        def __call__(self, texts, add_special_tokens):
            return {"input_ids": [[int(t), 1] for t in texts]}

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

        def batch_decode(self, rows, **kw):
            return [self.decode(r) for r in rows]

    class Pool:
        def score(self, inputs):
            return RewardResult(
                scores=[1.0] * len(inputs), function_scores={}, extra={}, failed=[False] * len(inputs)
            )

    cfg = load_config(
        None,
        [
            f"--logging.run_dir={tmp_path}",
            "--cluster.mode=async",
            "--rollout.n=2",
            "--rollout.max_tokens=6",
            "--data.batch_size=2",
            *overrides,
        ],
    )
    examples = [
        Example(
            data_source="f",
            messages=[{"role": "user", "content": str(10 + i)}],
            ground_truth="",
            extra_info={"index": i},
            uid=f"f-{i}",
        )
        for i in range(64)
    ]
    engines = _Engines()
    loader = PromptLoader(examples, cfg.data.batch_size, shuffle=False)
    return cfg, engines, Rollouts(cfg, engines, Pool(), loader, Tok(), version=0, steps=steps)


def _wait_ready(rollouts, count: int) -> None:
    """Until the producer holds `count` batches ready (at most 30 s)."""
    import time

    deadline = time.monotonic() + 30
    while len(rollouts._ready) < count and time.monotonic() < deadline:
        time.sleep(0.005)


def _consume(rollouts, engines, steps, refill=0):
    """The trainer's side: take a batch at version v, "train" (until the producer holds `refill` batches
    ready again, or as many as are left to make), then the engines serve v + 1 (a sync)."""
    from rl_tpu.batching import build_rollout_batch, staleness_metrics

    out = []
    for v in range(steps):
        data, timings = rollouts.next(v)
        rb = build_rollout_batch(data.groups, data.scores, 0)
        out.append(staleness_metrics(rb.batch, v) | data.metrics | timings)
        _wait_ready(rollouts, min(refill, steps - v - 1))
        with rollouts.turns.exclusive():
            engines.version = v + 1
        rollouts.updated(v + 1)
    rollouts.close()
    return out


def test_wait_policy_keeps_every_token_within_max_staleness(tmp_path):
    cfg, engines, rollouts = _producer(
        tmp_path, "--algorithm.max_staleness=2", "--rollout.partial=true", "--rollout.partial_chunk_tokens=2"
    )
    rows = _consume(rollouts, engines, 6)
    assert all(r["rollout/staleness_max"] <= 2 for r in rows), rows
    assert all(r["rollout/dropped"] == 0 for r in rows)
    assert all(r["time/trainer_idle"] >= 0 for r in rows)
    # the checkpoint's positions: nothing left in flight after the last batch
    assert rollouts.loader_state() == rollouts.loader.state_dict()


def test_partial_rollouts_generate_in_chunks_only_when_a_response_can_outgrow_one(tmp_path):
    # max_tokens 6: chunks of 2 pause sequences between updates; chunks of 6 never would, so one plain call
    for chunk, chunked in ((2, True), (6, False), (8, False)):
        cfg, engines, rollouts = _producer(
            tmp_path, "--rollout.partial=true", f"--rollout.partial_chunk_tokens={chunk}", steps=2
        )
        rows = _consume(rollouts, engines, 2)
        assert [len(c) == 2 for c in engines.calls] == [chunked] * len(engines.calls), (chunk, engines.calls)
        assert all(r["rollout/staleness_max"] <= 1 for r in rows)


def test_drop_policy_generates_stale_groups_again_and_counts_them(tmp_path):

    cfg, engines, rollouts = _producer(
        tmp_path, "--algorithm.max_staleness=1", "--algorithm.staleness_policy=drop"
    )
    _wait_ready(rollouts, 2)  # the producer fills its buffer (max_staleness + 1 batches)
    # while step 1 trains, the producer makes batch 2 with version 0 (the trainer waits for it before its
    # sync): it would be trained at version 2, so it is dropped and made again
    rows = _consume(rollouts, engines, 6, refill=2)
    assert all(r["rollout/staleness_max"] <= 1 for r in rows), rows
    assert sum(r["rollout/dropped"] for r in rows) > 0


def test_config_refuses_partial_rollouts_outside_async_mode_with_stop_strings_and_the_old_key():
    import pytest

    from rl_tpu.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.partial = true` continues"):
        load_config(None, ["--rollout.partial=true"])
    with pytest.raises(ConfigError, match="stop string"):
        load_config(None, ["--cluster.mode=async", "--rollout.partial=true", '--rollout.stop=["\\n"]'])
    with pytest.raises(ConfigError, match="now `algorithm.max_staleness`"):
        load_config(None, ["--cluster.max_staleness=4"])
    cfg = load_config(None, ["--cluster.mode=async", "--rollout.partial=true", "--algorithm.max_staleness=4"])
    assert cfg.algorithm.max_staleness == 4 and cfg.algorithm.staleness_policy == "wait"


def test_a_checkpoint_records_the_positions_before_the_oldest_batch_not_trained(tmp_path):
    import time

    cfg, engines, rollouts = _producer(tmp_path, "--algorithm.max_staleness=2", steps=4)
    deadline = time.monotonic() + 10
    while len(rollouts._ready) < 3 and time.monotonic() < deadline:  # batches 0..2 may start at version 0
        time.sleep(0.01)
    assert len(rollouts._ready) == 3 and rollouts.loader_state()["position"] == 0  # nothing trained yet
    assert rollouts.rollout_state() == {"calls": 0}
    rollouts.next(0)
    # batch 1 is the oldest not trained: a resume draws its prompts again, not those after batch 2
    assert rollouts.loader_state() == rollouts._states[1][0] != rollouts.loader.state_dict()
    assert rollouts.rollout_state() == {"calls": 1}
    rollouts.close()


class _FakeEngine:
    """`LLMEngine`'s add_request / step / abort_request / has_unfinished_requests on a fake model: each
    step gives every running request one token (the count of its tokens so far); `fail_at` raises at
    that step."""

    def __init__(self, fail_at=None):
        self.running, self.added, self.aborted, self.steps, self.fail_at = {}, [], [], 0, fail_at
        self.llm_engine = self

    def add_request(self, rid, prompt, sp, lora_request=None):
        self.added.append((rid, list(prompt["prompt_token_ids"]), sp.max_tokens))
        self.running[rid] = [len(prompt["prompt_token_ids"]), sp.max_tokens, 0]

    def abort_request(self, rids):
        self.aborted += rids
        for r in rids:
            self.running.pop(r, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        from types import SimpleNamespace

        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("engine failed")
        out = []
        for rid, st in list(self.running.items()):
            st[2] += 1
            done = st[2] >= st[1]
            tok = st[0] + st[2]
            o = SimpleNamespace(
                token_ids=[tok],
                logprobs=[{tok: SimpleNamespace(logprob=-1.0)}],
                finish_reason="length",
                stop_reason=None,
            )
            out.append(SimpleNamespace(request_id=rid, outputs=[o], finished=done))
            if done:
                del self.running[rid]
        return out


def test_held_requests_continue_re_add_what_they_do_not_hold_and_park_on_failure():
    import pytest
    from vllm import SamplingParams

    from rl_tpu.rollout.held import HeldRequests

    llm = _FakeEngine()
    held = HeldRequests(llm)
    params = SamplingParams(max_tokens=5, logprobs=0, detokenize=False)
    a, b = ((0, 0), [7, 7], []), ((0, 1), [7, 7], [])
    first = held.chunk([a, b], params, chunk=2)
    assert [p.token_ids for p in first] == [[3, 4], [3, 4]] and [p.finish_reason for p in first] == [
        None,
        None,
    ]
    assert [x[1:] for x in llm.added] == [([7, 7], 5), ([7, 7], 5)]
    # the caller has (0, 0) at 2 tokens as the engine does: continued, no new request; (0, 1) at 1 token
    # (not what the engine holds): aborted and added again as prompt + response, with the rest of its budget
    second = held.chunk([((0, 0), [7, 7], [3, 4]), ((0, 1), [7, 7], [3])], params, chunk=2)
    assert llm.aborted == ["rl-held-1"] and llm.added[-1][1:] == ([7, 7, 3], 4)
    assert second[0].token_ids == [5, 6] and second[1].token_ids == [4, 5]
    assert held.held == {(0, 0): ("rl-held-0", 4), (0, 1): ("rl-held-2", 3)}
    last = held.chunk([((0, 0), [7, 7], [3, 4, 5, 6]), ((0, 1), [7, 7], [3, 4, 5])], params, chunk=2)
    assert [p.finish_reason for p in last] == ["length", "length"] and held.held == {}
    assert [len(p.token_ids) for p in last] == [1, 2] and last[1].logprobs == [-1.0, -1.0]
    # a failure in the middle of a call leaves nothing held (the engine may be past what the caller knows)
    llm.fail_at = llm.steps + 2
    with pytest.raises(RuntimeError, match="engine failed"):
        held.chunk([((1, 0), [9], [])], params, chunk=4)
    assert held.held == {} and not llm.running
