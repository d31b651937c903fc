"""Tools for multi-turn rollouts: Python functions the model calls in its chat template's tool-call format.

`rollout.tools = ["module:function", "path/to/file.py:function"]` names plain functions, sync or async.
Each one's type hints and docstring (a summary line and an `Args:` section) give its JSON schema
(`transformers.utils.get_json_schema`), which goes to the chat template's `tools=`. A function it cannot
describe is a `ToolError` naming the function, raised when the tools load.

Calls are read from an assistant turn's text in the Qwen3 / Hermes format, any number per turn:

    <tool_call>
    {"name": "multiply", "arguments": {"a": 1234, "b": 5678}}
    </tool_call>

Invariants:
- One result text per call, in the order the calls were written: the tool's return value (a `str`),
  or "Error: ..." for a malformed call (bad JSON, unknown tool, missing or unexpected arguments, an
  unclosed tag), an exception, a return value JSON cannot write, a dead worker or a timeout. A
  non-`str` JSON value (a number, a list, a dict) is written as JSON. A
  failing tool never stops the run; the model reads the error, as real tool APIs return it.
- Arguments are checked against the function's signature in the parent (names only); their types
  are the function's business.
- Row arguments: a function's keyword-only parameters (after `*`) are not the model's to write. They
  are left out of the schema the model sees, a model-written argument of that name is an unexpected
  argument, and `Tools.bind` fills them from the dataset row's `extra_info.tools_kwargs[name]` (verl's
  agent-loop schema: its `create_kwargs` and `execute_kwargs` merged; `calc_reward_kwargs` and
  `release_kwargs` are ignored, as are tools the run does not have). A row whose kwargs a function does
  not take, or that lacks one it needs (no default), is a `ToolError` naming the row and the tool:
  `check_tools_kwargs` checks every row before Ray starts, and `bind` raises it too (never a message
  to the model, which cannot fix the data).
- Well-formed calls run in worker processes (`rollout.tool_workers`, each a one-process `CallPool`:
  `rollout.tool_timeout_s` per call, a hung or crashed worker killed and replaced, an address-space
  limit of `MEMORY_MB` per worker); one trajectory's calls go to one worker, in order. That
  isolates crashes, hangs and runaway allocations; it is not a security sandbox for untrusted code.
"""

from __future__ import annotations

import inspect
import json
import logging
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from rl_tpu.call_pool import CallPool
from rl_tpu.containment import DEFAULT_ENV_ALLOW, Limits, worker_limits
from rl_tpu.errors import UserError
from rl_tpu.rollout import verl_tools
from rl_tpu.user_code import IMPORT_TIMEOUT_S, SpecError, load_callable, split_spec

logger = logging.getLogger(__name__)

# each tool worker's address-space limit (RLIMIT_AS, MiB): a call allocating past it reads as a MemoryError;
# the run's is `rollout.tool_memory_mb` (the same default), 0 for none
MEMORY_MB = 4096
# a pool's limits when not given (`from_config` takes the run's)
TOOL_LIMITS = Limits(memory_mb=MEMORY_MB, env_allow=DEFAULT_ENV_ALLOW)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolError(UserError, ValueError):
    """A tool spec does not load or cannot be described as a tool; the message names it."""


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)  # what the model wrote
    error: str | None = None  # why the call is malformed (then it is not run)
    row_kwargs: dict = field(default_factory=dict)  # the row's arguments (`Tools.bind`), not the model's


class ToolReply(NamedTuple):
    """What a tool may return to give a step reward with its text (verl's tools do, rollout/verl_tools.py):
    the text goes to the model, the rewards are summed per trajectory (`rollout/tool_reward`)."""

    text: str
    reward: float = 0.0


@dataclass
class ToolResult:
    text: str  # what goes back to the model as the `tool` message
    reward: float = 0.0  # the step reward a `ToolReply` gave
    error: bool = False  # malformed call, exception, non-str return or dead worker
    timeout: bool = False


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text`, in order; malformed ones
    carry their `error`. An opening tag without a closing one counts as one malformed call."""
    calls = [_parse_one(body) for body in _CALL.findall(text)]
    if "<tool_call>" in _CALL.sub("", text):
        calls.append(ToolCall(name="", error="a <tool_call> without its closing </tool_call>"))
    return calls


def _parse_one(body: str) -> ToolCall:
    shape = 'a tool call is one JSON object {"name": "<tool>", "arguments": {...}}'
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(name="", error=f"the tool call is not valid JSON ({e.msg}, char {e.pos}); {shape}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(name="", error=f"{shape}, got {body.strip()!r:.200}")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error=f'"arguments" must be a JSON object, got {args!r:.200}')
    return ToolCall(name=obj["name"], arguments=args)


def tool_text(out: Any) -> str | ToolReply:
    """A tool's return value as the `tool` message's content (run in the worker): a `str` as it is,
    anything JSON can write (numbers, lists, dicts, None) as JSON, a `ToolReply` as it is (its text a
    `str`, its reward a number); anything else is an error."""
    if isinstance(out, ToolReply):
        if not isinstance(out.text, str) or not isinstance(out.reward, (int, float)):
            raise TypeError(f"returned {out!r:.80}; a ToolReply holds a str and a number")
        return ToolReply(out.text, float(out.reward))
    if isinstance(out, str):
        return out
    try:
        return json.dumps(out, ensure_ascii=False)
    except (TypeError, ValueError):
        raise TypeError(
            f"returned {type(out).__name__} {out!r:.80}; a tool returns a str or a JSON value"
        ) from None


# verl's per-tool keys in `extra_info.tools_kwargs[name]`: those read (merged into the row's arguments)
# and those ignored (verl gives them to a tool's calc_reward and release, which plain functions lack)
ROW_KWARGS_READ = ("create_kwargs", "execute_kwargs")
ROW_KWARGS_IGNORED = ("calc_reward_kwargs", "release_kwargs")


def row_parameters(fn: Callable) -> dict[str, inspect.Parameter] | str:
    """`fn`'s keyword-only parameters: the arguments that come from the dataset row, not the model; "verl"
    for a verl tool (its row's `create_kwargs` go to its `create`, whole)."""
    if getattr(fn, "rl_tpu_row_kwargs", None) == "verl":
        return "verl"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: get_json_schema refuses it anyway
        return {}
    return {n: p for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _model_view(fn: Callable) -> Callable:
    """`fn` as the model sees it, for `get_json_schema`: the same name, docstring and hints, without its
    row parameters (which need neither a type hint nor a docstring entry)."""
    hidden = row_parameters(fn)
    if not hidden:
        return fn
    sig = inspect.signature(fn)

    def view(*args, **kwargs):  # never called
        raise NotImplementedError

    view.__name__, view.__doc__, view.__wrapped__ = fn.__name__, fn.__doc__, fn  # __wrapped__: its globals
    view.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in hidden])
    view.__annotations__ = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k not in hidden}
    return view


def describe_tool(fn: Callable, spec: str, field_name: str = "rollout.tools") -> dict:
    """`fn`'s JSON schema for the chat template's `tools=` (its row parameters left out; a verl tool's is
    its config file's); a `ToolError` naming it if it has none."""
    from transformers.utils import get_json_schema

    if isinstance(getattr(fn, "tool_schema", None), dict):
        return fn.tool_schema
    try:
        return get_json_schema(_model_view(fn))
    except Exception as e:  # TypeHintParsingException, DocstringParsingException
        raise ToolError(
            f"{field_name} {spec!r}: {getattr(fn, '__name__', fn)} cannot be described as a tool: {e} "
            "(every argument needs a type hint, and the docstring a summary and an 'Args:' section)"
        ) from e


def load_tools(
    specs: list[str], field_name: str = "rollout.tools", driver: bool = True
) -> tuple[list[Callable], list[dict]]:
    """The functions `specs` names and their schemas; a `ToolError` naming the first that does not load,
    cannot be described, or shares another's name. Cheap: the driver checks `rollout.tools` with it
    before Ray starts. A verl tool config file stands for each tool it declares (rollout/verl_tools.py);
    those load from the file alone here (`driver=True`), with verl's loader in the workers."""
    fns = []
    specs = verl_tools.expand(list(specs), field_name)
    for spec in specs:
        target = split_spec(spec, field_name)[0]
        if driver and verl_tools.is_tool_config(target):
            fns.append(verl_tools.declared(spec, field_name))
            continue
        try:
            fns.append(load_callable(spec, label=field_name, timeout_s=IMPORT_TIMEOUT_S))
        except SpecError as e:
            raise ToolError(str(e)) from e
    schemas = [describe_tool(fn, spec, field_name) for fn, spec in zip(fns, specs)]
    names = [s["function"]["name"] for s in schemas]
    if len(set(names)) < len(names):
        raise ToolError(f"{field_name} {list(specs)}: two tools share a name ({names})")
    return fns, schemas


def row_kwargs(params: dict[str, dict[str, inspect.Parameter]], sample: dict) -> dict[str, dict]:
    """Per tool (`params`: each tool's row parameters, by name), the arguments `sample` (a dataset row as
    a dict: `extra_info`, `uid`) gives it: `extra_info.tools_kwargs[name]`'s create_kwargs and
    execute_kwargs merged. Tools it has no kwargs for are left out. A `ToolError` naming the row and the
    tool when they do not fit the function (see the module docstring)."""
    where = f"data row {sample.get('uid') or '?'}: extra_info.tools_kwargs"
    given = (sample.get("extra_info") or {}).get("tools_kwargs") or {}
    if not isinstance(given, dict):
        raise ToolError(
            f"{where} must be an object {{tool name: {{create_kwargs: {{...}}, execute_kwargs: {{...}}}}}}, "
            f"got {type(given).__name__}"
        )
    out = {}
    for name, accepted in params.items():
        entry = given.get(name) or {}  # parquet fills a tool that another row names with null
        if not isinstance(entry, dict):
            raise ToolError(f"{where}.{name} must be an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(ROW_KWARGS_READ) - set(ROW_KWARGS_IGNORED))
        if unknown:
            raise ToolError(
                f"{where}.{name} has {', '.join(map(repr, unknown))}: verl's keys are "
                f"{' and '.join(ROW_KWARGS_READ)} (passed to the tool) and {' and '.join(ROW_KWARGS_IGNORED)} "
                "(ignored here)"
            )
        if accepted == "verl":  # a verl tool: create_kwargs go to its `create`, as verl passes them
            create = entry.get("create_kwargs") or {}
            if not isinstance(create, dict):
                raise ToolError(
                    f"{where}.{name}.create_kwargs must be an object, got {type(create).__name__}"
                )
            out[name] = {verl_tools.CREATE_KWARGS: create}
            continue
        kwargs: dict = {}
        for key in ROW_KWARGS_READ:
            part = entry.get(key) or {}
            if not isinstance(part, dict):
                raise ToolError(f"{where}.{name}.{key} must be an object, got {type(part).__name__}")
            clash = [k for k in part if k in kwargs and kwargs[k] != part[k]]
            if clash:
                raise ToolError(
                    f"{where}.{name}: {clash[0]!r} differs between create_kwargs and execute_kwargs"
                )
            kwargs.update(part)
        extra = [k for k in kwargs if k not in accepted]
        if extra:
            takes = ", ".join(accepted) or "none"
            raise ToolError(
                f"{where}.{name} passes {', '.join(map(repr, extra))}, which {name} does not take; its row "
                f"arguments (keyword-only parameters, after `*`) are: {takes}"
            )
        missing = [n for n, p in accepted.items() if p.default is inspect.Parameter.empty and n not in kwargs]
        if missing:
            raise ToolError(
                f"{where}.{name} does not give {', '.join(map(repr, missing))}, which {name} needs (a "
                "keyword-only parameter without a default)"
            )
        if kwargs:
            out[name] = kwargs
    return out


def check_tools_kwargs(specs: list[str], rows: list, field_name: str = "rollout.tools") -> None:
    """Load the tools `specs` names and check every row's `extra_info.tools_kwargs` against them (`rows`:
    `rl_tpu.data.Example`s): a `ToolError` naming the first row and tool that do not fit. Cheap: the
    driver runs it before Ray starts."""
    fns, schemas = load_tools(specs, field_name)
    params = {s["function"]["name"]: row_parameters(fn) for fn, s in zip(fns, schemas)}
    for row in rows:
        row_kwargs(params, {"extra_info": row.extra_info, "uid": row.uid})


class Tools:
    """The functions `specs` names: their schemas (`schemas`, for `tools=`) and `workers` processes that
    run calls. Each worker is its own single-process `CallPool` with a thread that drives it, so calls
    submitted at different times (`submit`: one trajectory's calls) run side by side: a slow call holds
    its worker only, never the calls behind it on the others."""

    def __init__(
        self,
        specs: list[str],
        *,
        timeout_s: float,
        workers: int = 1,
        field_name: str = "rollout.tools",
        limits: Limits = TOOL_LIMITS,
    ):
        specs = verl_tools.expand(list(specs), field_name)  # a tool config file: one spec per tool
        fns, self.schemas = load_tools(specs, field_name)
        self.names = [s["function"]["name"] for s in self.schemas]
        self._row_params = {name: row_parameters(fn) for name, fn in zip(self.names, fns)}
        self._signatures = [  # what the model may write: the row parameters left out
            inspect.signature(_model_view(fn)) for fn in fns
        ]
        self._log_failure = threading.Lock()  # taken by the first failure (calls run on threads)
        self.limits = limits
        self.pools: list[CallPool] = []
        self._threads = ThreadPoolExecutor(max(1, workers), thread_name_prefix="rl_tpu-tools")
        try:
            for _ in range(max(1, workers)):
                self.pools.append(
                    CallPool(
                        specs,
                        workers=1,
                        timeout_s=timeout_s,
                        name="tool",
                        error_type=ToolError,
                        check=tool_text,
                        limits=limits,
                        load=verl_tools.load_spec,
                    )
                )
        except BaseException:
            self.close()
            raise
        self._free: queue.SimpleQueue[CallPool] = queue.SimpleQueue()
        for pool in self.pools:
            self._free.put(pool)

    @classmethod
    def from_config(cls, rc) -> Tools:
        """The tools of a run's `rollout` section (`RolloutConfig`), with its limits."""
        return cls(
            rc.tools,
            timeout_s=rc.tool_timeout_s,
            workers=rc.tool_workers,
            limits=worker_limits(rc, rc.tool_memory_mb),
        )

    @property
    def worker_pids(self) -> list[int]:
        return [pid for pool in self.pools for pid in pool.worker_pids]

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        for pool in self.pools:
            pool.close()

    def bind(self, calls: list[ToolCall], sample: dict) -> list[ToolCall]:
        """`calls` (parsed from a trajectory's turn) with the row's arguments attached: each well-formed
        call to a tool `sample`'s `extra_info.tools_kwargs` gives kwargs to carries them in `row_kwargs`.
        `sample` is the dataset row as a dict (`extra_info`, `uid`); a `ToolError` naming the row and the
        tool when its kwargs do not fit (see the module docstring)."""
        if not calls:
            return calls
        given = row_kwargs(self._row_params, sample)
        return [
            replace(c, row_kwargs=dict(given[c.name])) if c.error is None and c.name in given else c
            for c in calls
        ]

    def check(self, call: ToolCall) -> str | None:
        """Why `call` cannot run (malformed, unknown tool, wrong names among the arguments the model
        wrote, row parameters included: those are not the model's), or None."""
        if call.error:
            return call.error
        if call.name not in self.names:
            return f"unknown tool {call.name!r}; the tools are: {', '.join(self.names)}"
        try:
            self._signatures[self.names.index(call.name)].bind(**call.arguments)
        except TypeError as e:
            return f"wrong arguments for {call.name}: {e}"
        return None

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in order (see the module docstring); the well-formed ones run on the
        workers, side by side."""
        return [r for job in [self.submit([c]) for c in calls] for r in job.result()]

    def submit(self, calls: list[ToolCall]) -> Future:
        """Run `calls` one after another on the next free worker; a future of their results, in order."""
        return self._threads.submit(self._run_on_a_worker, calls)

    def _run_on_a_worker(self, calls: list[ToolCall]) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        todo = []
        for k, call in enumerate(calls):
            if (why := self.check(call)) is not None:
                results[k] = ToolResult(f"Error: {why}", error=True)
            else:
                todo.append(k)
        pool = self._free.get()
        try:
            out = pool.run(
                [
                    (self.names.index(calls[k].name), {**calls[k].arguments, **calls[k].row_kwargs})
                    for k in todo
                ]
            )
        finally:
            self._free.put(pool)
        for k, r in zip(todo, out):
            if r.ok:
                v = r.value  # a str, or a ToolReply as the JSON list [text, reward] (`tool_text`)
                results[k] = (
                    ToolResult(v) if isinstance(v, str) else ToolResult(str(v[0]), reward=float(v[1]))
                )
                continue
            results[k] = ToolResult(
                f"Error: {calls[k].name}: {r.error}", error=not r.timeout, timeout=r.timeout
            )
            # the first failure, with its traceback; later ones are only counted
            if self._log_failure.acquire(blocking=False):
                logger.warning("tool %s failed: %s\n%s", calls[k].name, r.error, r.traceback or "")
        return results  # type: ignore[return-value]
