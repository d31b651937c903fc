"""Tools in multi-turn rollouts (rollout/tools.py, rollout/multi_turn.py): schemas, parsing, the worker pool
(real processes: a hung tool is killed at its timeout), and token-in/token-out trajectories with tool turns."""

from __future__ import annotations

import textwrap
import time

import pytest

from rl_tpu.rollout.multi_turn import ChatDelta, MultiTurn
from rl_tpu.rollout.tools import ToolCall, ToolError, Tools, describe_tool, parse_tool_calls
from rl_tpu.types import Completion

# A Qwen3-style template with tools: the schemas in a system message, a turn's tool results in one user
# message of <tool_response> blocks (the tiny models' own template has no tools).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou may call functions. Signatures within <tools></tools>:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, return <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '\n<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>' }}{% endif %}"
    "{%- else %}{{ '\n<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '\n<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS_PY = '''
import asyncio
import os
import time


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


async def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    await asyncio.sleep(0)
    return a + b  # a JSON value: sent as JSON text


def sleepy(seconds: float, until: str = "") -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
        until: A file whose appearance ends the sleep early.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until and os.path.exists(until)):
        time.sleep(0.005)
    return "awake"


def boom() -> str:
    """Always raises."""
    raise ValueError("boom on purpose")


def not_text() -> set:
    """Returns a set, which JSON cannot write."""
    return {1, 2}


def untyped(a):
    """No type hint.

    Args:
        a: Anything.
    """
    return a
'''

NAMES = ["multiply", "add", "sleepy", "boom", "not_text"]


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(textwrap.dedent(TOOLS_PY))
    return path


@pytest.fixture(scope="module")
def tools(tools_file):
    t = Tools([f"{tools_file}:{n}" for n in NAMES], timeout_s=1.0, workers=2)
    yield t
    t.close()


@pytest.fixture(scope="module")
def tok(tiny_qwen3):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_qwen3)
    t.chat_template = TOOLS_TEMPLATE
    return t


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_schemas_from_type_hints_and_docstrings(tools, tools_file):
    assert tools.names == NAMES
    assert tools.schemas[0] == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first factor."},
                    "b": {"type": "integer", "description": "The second factor."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "string"},
        },
    }
    assert tools.schemas[1]["function"]["parameters"]["required"] == ["a"]  # async, b has a default
    with pytest.raises(
        ToolError, match=r"rollout.tools '.*my_tools.py:untyped': untyped cannot be described"
    ):
        Tools([f"{tools_file}:untyped"], timeout_s=1.0)
    with pytest.raises(ToolError, match="no attribute 'nope'"):
        Tools([f"{tools_file}:nope"], timeout_s=1.0)
    with pytest.raises(ToolError, match="len cannot be described"):
        describe_tool(len, "builtins:len")


def test_parsing_several_and_malformed_calls(tools):
    text = (
        "Let me compute. "
        + call("multiply", a=2, b=3)
        + " and "
        + call("add", a=1)
        + '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'  # arguments as a string
        + "<tool_call>{not json}</tool_call>"
        + '<tool_call>["add"]</tool_call>'
        + '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
        + "<tool_call>"
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:3]] == [
        ("multiply", {"a": 2, "b": 3}),
        ("add", {"a": 1}),
        ("add", {"a": 5}),
    ]
    assert [c.error is None for c in calls] == [True, True, True, False, False, False, False]
    assert "not valid JSON" in calls[3].error and "one JSON object" in calls[4].error
    assert '"arguments" must be a JSON object' in calls[5].error and "closing </tool_call>" in calls[6].error
    assert parse_tool_calls("no call here") == []
    assert tools.check(ToolCall("divide", {})) == (
        "unknown tool 'divide'; the tools are: multiply, add, sleepy, boom, not_text"
    )
    assert "missing a required argument: 'b'" in tools.check(ToolCall("multiply", {"a": 1}))
    assert "unexpected keyword argument 'c'" in tools.check(ToolCall("multiply", {"a": 1, "b": 2, "c": 3}))


def test_run_answers_every_call_in_order_and_survives_a_hang(tools):
    pids = set(tools.worker_pids)
    calls = parse_tool_calls(
        call("multiply", a=12, b=34)
        + call("sleepy", seconds=600)
        + call("boom")
        + call("not_text")
        + call("add", a=2, b=2)
        + call("nope")
    )
    t0 = time.monotonic()
    results = tools.run(calls)
    elapsed = time.monotonic() - t0
    assert [r.text for r in results] == [
        "408",
        "Error: sleepy: timed out after 1 s",
        "Error: boom: ValueError: boom on purpose",
        "Error: not_text: TypeError: returned set {1, 2}; a tool returns a str or a JSON value",
        "4",
        "Error: unknown tool 'nope'; the tools are: multiply, add, sleepy, boom, not_text",
    ]
    assert [(r.error, r.timeout) for r in results] == [(False, False), (False, True)] + [
        (True, False)
    ] * 2 + [
        (False, False),
        (True, False),
    ]
    assert elapsed < 60, f"a 1 s timeout took {elapsed:.1f} s"
    assert pids - set(tools.worker_pids), "the hung worker was replaced"
    assert [r.text for r in tools.run(parse_tool_calls(call("multiply", a=3, b=3)))] == ["9"]  # still usable


ROW_TOOLS_PY = '''
import json


def check(answer: str, *, ground_truth, unit: str = "") -> str:
    """Check an answer against the row's ground truth.

    Args:
        answer: The answer to check.
    """
    return json.dumps({"answer": answer, "ground_truth": ground_truth, "unit": unit})


def echo(text: str) -> str:
    """Say it back.

    Args:
        text: What to say.
    """
    return text
'''


@pytest.fixture(scope="module")
def row_tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("row_tools") / "row_tools.py"
    path.write_text(textwrap.dedent(ROW_TOOLS_PY))
    return path


@pytest.fixture(scope="module")
def row_tools(row_tools_file):
    t = Tools([f"{row_tools_file}:check", f"{row_tools_file}:echo"], timeout_s=5.0, workers=1)
    yield t
    t.close()


def test_keyword_only_parameters_are_hidden_from_the_model(row_tools):
    """A tool's keyword-only parameters come from the row: not in the schema the model sees (they need no
    type hint or docstring entry), and a model-written argument of that name is an unexpected one."""
    assert row_tools.schemas[0] == {
        "type": "function",
        "function": {
            "name": "check",
            "description": "Check an answer against the row's ground truth.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "The answer to check."}},
                "required": ["answer"],
            },
            "return": {"type": "string"},
        },
    }
    assert row_tools.check(ToolCall("check", {"answer": "7"})) is None  # the row's part is not the model's
    assert row_tools.check(ToolCall("check", {"answer": "7", "ground_truth": "7"})) == (
        "wrong arguments for check: got an unexpected keyword argument 'ground_truth'"
    )
    assert row_tools.check(ToolCall("check", {})) == (
        "wrong arguments for check: missing a required argument: 'answer'"
    )


def test_bind_gives_a_call_its_rows_tools_kwargs(row_tools):
    """verl's `extra_info.tools_kwargs[name]`: create_kwargs and execute_kwargs merged reach the tool;
    calc_reward_kwargs, release_kwargs and tools the run does not have are ignored."""
    import json

    sample = {
        "uid": "rows.jsonl:3",
        "extra_info": {
            "tools_kwargs": {
                "check": {
                    "create_kwargs": {"ground_truth": "408"},
                    "execute_kwargs": {"unit": "cm", "ground_truth": "408"},
                    "calc_reward_kwargs": {"whatever": 1},
                    "release_kwargs": {},
                },
                "search": {"create_kwargs": {"index": "wiki"}},  # a tool this run does not have
            }
        },
    }
    text = call("check", answer="408") + call("echo", text="hi") + "<tool_call>{bad</tool_call>"
    calls = row_tools.bind(parse_tool_calls(text), sample)
    assert [c.row_kwargs for c in calls] == [{"ground_truth": "408", "unit": "cm"}, {}, {}]
    assert calls[0].arguments == {"answer": "408"}  # what the model wrote stays apart
    results = [r.text for r in row_tools.run(calls)]
    assert json.loads(results[0]) == {"answer": "408", "ground_truth": "408", "unit": "cm"}
    assert results[1] == "hi" and results[2].startswith("Error: the tool call is not valid JSON")
    # a row without tools_kwargs binds nothing; the tool then misses its row argument: bind says which
    assert row_tools.bind([], {"uid": "r", "extra_info": {}}) == []
    with pytest.raises(ToolError) as e:
        row_tools.bind(parse_tool_calls(call("echo", text="x")), {"uid": "rows.jsonl:4", "extra_info": {}})
    assert str(e.value) == (
        "data row rows.jsonl:4: extra_info.tools_kwargs.check does not give 'ground_truth', which check "
        "needs (a keyword-only parameter without a default)"
    )


@pytest.mark.parametrize(
    "given, message",
    [
        (
            {"check": {"create_kwargs": {"ground_truth": "1", "tolerance": 0.1}}},
            "extra_info.tools_kwargs.check passes 'tolerance', which check does not take; its row arguments "
            "(keyword-only parameters, after `*`) are: ground_truth, unit",
        ),
        (
            {"check": {"create_kwargs": {"ground_truth": "1"}}, "echo": {"execute_kwargs": {"loud": True}}},
            "extra_info.tools_kwargs.echo passes 'loud', which echo does not take; its row arguments "
            "(keyword-only parameters, after `*`) are: none",
        ),
        (
            {"check": {"create_kwarg": {"ground_truth": "1"}}},
            "extra_info.tools_kwargs.check has 'create_kwarg': verl's keys are create_kwargs and "
            "execute_kwargs (passed to the tool) and calc_reward_kwargs and release_kwargs (ignored here)",
        ),
        (
            {"check": {"create_kwargs": {"ground_truth": "1"}, "execute_kwargs": {"ground_truth": "2"}}},
            "extra_info.tools_kwargs.check: 'ground_truth' differs between create_kwargs and execute_kwargs",
        ),
        (
            {"check": {"create_kwargs": ["ground_truth"]}},
            "extra_info.tools_kwargs.check.create_kwargs must be an object, got list",
        ),
        (
            "check",
            "extra_info.tools_kwargs must be an object {tool name: {create_kwargs: {...}, execute_kwargs: "
            "{...}}}, got str",
        ),
    ],
)
def test_row_kwargs_a_tool_does_not_take_are_an_error_naming_row_and_tool(row_tools, given, message):
    """The data's mistake, not the model's: an error naming the row and the tool (never a tool message)."""
    sample = {"uid": "train.parquet:17", "extra_info": {"tools_kwargs": given}}
    with pytest.raises(ToolError) as e:
        row_tools.bind(parse_tool_calls(call("check", answer="1")), sample)
    assert str(e.value) == f"data row train.parquet:17: {message}"


def test_the_loop_checks_every_rows_tools_kwargs_before_ray_starts(tmp_path, row_tools_file, monkeypatch):
    """`rl-tpu train` refuses a data file whose tools_kwargs do not fit the tools, naming the file's row,
    before Ray starts (the train rows and the test rows alike)."""
    import json

    from rl_tpu.config import load_config
    from rl_tpu.controller.loop import train
    from rl_tpu.data import make_synthetic
    from rl_tpu.data.files import write_jsonl
    from rl_tpu.rollout.tools import check_tools_kwargs

    train_rows, test_rows = make_synthetic("arithmetic", 4, 2)
    for ex in train_rows + test_rows:
        ex.extra_info["tools_kwargs"] = {"check": {"create_kwargs": {"ground_truth": ex.ground_truth}}}
    specs = [f"{row_tools_file}:check", f"{row_tools_file}:echo"]
    check_tools_kwargs(specs, train_rows + test_rows)  # these fit
    test_rows[1].extra_info["tools_kwargs"]["check"]["create_kwargs"]["tolerance"] = 1
    write_jsonl(train_rows, tmp_path / "train.jsonl")
    write_jsonl(test_rows, tmp_path / "test.jsonl")
    cfg = load_config(
        None,
        [
            f'--data.train_files=["{tmp_path / "train.jsonl"}"]',
            f'--data.test_files=["{tmp_path / "test.jsonl"}"]',
            f"--rollout.tools={json.dumps(specs)}",
            f"--logging.run_dir={tmp_path / 'run'}",
        ],
    )
    started = []
    monkeypatch.setattr("rl_tpu.controller.loop.start_ray", lambda *a, **kw: started.append(a))
    with pytest.raises(ToolError) as e:
        train(cfg)
    assert str(e.value) == (
        "data row test.jsonl:2: extra_info.tools_kwargs.check passes 'tolerance', which check does not "
        "take; its row arguments (keyword-only parameters, after `*`) are: ground_truth, unit"
    )
    assert started == []


def _scripted(tok, texts):
    """A generate that answers prompt k of each call with texts[k] of that turn (plus the stop token)."""
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    turns, prompts_seen = iter(texts), []

    def generate(prompts, max_tokens):
        prompts_seen.append([list(p) for p in prompts])
        batch = next(turns)
        out = []
        for p, text in zip(prompts, batch):
            ids = tok(text, add_special_tokens=False)["input_ids"] + [eos]
            out.append(
                Completion(
                    prompt_index=0,
                    sample_index=0,
                    prompt_ids=list(p),
                    response_ids=ids[:max_tokens],
                    logprobs=[-0.25] * len(ids[:max_tokens]),
                    finish_reason="stop" if len(ids) <= max_tokens else "length",
                    text=text,
                    policy_version=2,
                )
            )
        return out

    return generate, prompts_seen


def test_tool_turns_insert_the_results_ids_with_mask_0(tok, tools):
    first = "I will use the tool. " + call("multiply", a=12, b=34) + call("sleepy", seconds=600)
    generate, seen = _scripted(tok, [[first, "no tools, final: 7"], ["The answer is 408."]])
    mt = MultiTurn(tok, None, generate, max_turns=4, max_tokens=200, max_total_tokens=2000, tools=tools)
    sample = {"messages": [{"role": "user", "content": "What is 12 * 34?"}]}
    t, plain = mt.rollout([sample, sample])
    # the prompt is the template's rendering with the tools' schemas
    assert t.prompt_ids == tok.apply_chat_template(
        sample["messages"], tools=tools.schemas, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert '"name": "multiply"' in tok.decode(t.prompt_ids)
    # turn 1 called two tools: both answered, the hang with its timeout; turn 2 had no call: the end
    assert (t.turns, t.finish_reason, t.tool_calls, t.tool_errors, t.tool_timeouts) == (2, "stop", 2, 0, 1)
    results = [
        {"role": "tool", "content": "408"},
        {"role": "tool", "content": "Error: sleepy: timed out after 1 s"},
    ]
    assert t.messages[1:] == [{"role": "assistant", "content": first}, *results] + [
        {"role": "assistant", "content": "The answer is 408."}
    ]
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    sampled1 = tok(first, add_special_tokens=False)["input_ids"] + [eos]
    sampled2 = tok("The answer is 408.", add_special_tokens=False)["input_ids"] + [eos]
    inserted = ChatDelta(tok, tools=tools.schemas).ids(results)
    assert tok.decode(inserted) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n"
        "Error: sleepy: timed out after 1 s\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.ids == sampled1 + inserted + sampled2
    assert t.mask == [1] * len(sampled1) + [0] * len(inserted) + [1] * len(sampled2)
    assert t.logprobs == [-0.25 if m else 0.0 for m in t.mask]
    assert t.versions == [2 if m else -1 for m in t.mask]
    assert seen[1] == [t.prompt_ids + sampled1 + inserted]  # turn 2's prompt: the trajectory's own ids
    # the whole trajectory is what the template renders for the conversation (so nothing drifts)
    rendered = tok.apply_chat_template(t.messages, tools=tools.schemas, tokenize=False)
    assert tok.decode(t.prompt_ids + t.ids) == rendered.rstrip("\n")
    assert (plain.turns, plain.finish_reason, plain.tool_calls, plain.last_text) == (
        1,
        "stop",
        0,
        "no tools, final: 7",
    )
    c = t.completion(0, 0)
    assert c.loss_mask == t.mask and c.text == "The answer is 408." and c.extra["env_reward"] is None


JUDGE_PY = '''
class Judge:
    """Rewards 1 when the last assistant turn contains the tool's answer; logs each `step` call."""

    def reset(self, sample):
        self.log = sample["log"]
        return [{"role": "user", "content": "What is 6 * 7?"}]

    def step(self, messages):
        ok = messages[-1]["role"] == "assistant" and "<tool_call>" not in messages[-1]["content"]
        ok = ok and {"role": "tool", "content": "42"} in messages
        with open(self.log, "a") as f:
            f.write("step\\n")
        return [], float(ok and "42" in messages[-1]["content"]), True
'''


def test_with_an_environment_tool_calls_are_answered_first(tok, tools, tmp_path):
    from rl_tpu.rollout.env_pool import EnvPool

    (tmp_path / "judge.py").write_text(JUDGE_PY)
    log = tmp_path / "steps.log"
    envs = EnvPool(f"{tmp_path / 'judge.py'}:Judge", workers=1, timeout_s=60)
    try:
        generate, _ = _scripted(tok, [[call("multiply", a=6, b=7) + call("multiply", a="x")], ["It is 42."]])
        mt = MultiTurn(tok, envs, generate, max_turns=4, max_tokens=200, max_total_tokens=2000, tools=tools)
        (t,) = mt.rollout([{"log": str(log)}])
        assert log.read_text().count("step") == 1  # only on the turn without a tool call
        assert (t.turns, t.finish_reason, t.reward, t.tool_calls, t.tool_errors) == (2, "env", 1.0, 2, 1)
        assert t.messages[3]["content"].startswith(
            "Error: wrong arguments for multiply: missing a required argument"
        )
        # a tool call on the last allowed turn is not run: the trajectory ends at max_turns
        generate, _ = _scripted(tok, [[call("multiply", a=6, b=7)]])
        (t,) = MultiTurn(
            tok, envs, generate, max_turns=1, max_tokens=200, max_total_tokens=2000, tools=tools
        ).rollout([{"log": str(log)}])
        assert (t.turns, t.finish_reason, t.tool_calls) == (1, "max_turns", 0)
        assert log.read_text().count("step") == 1
    finally:
        envs.close()
    from rl_tpu.controller.producer import turn_metrics

    assert turn_metrics([t], "rollout/", tools=True)["rollout/truncated"] == 1.0


class ScriptedEngine:
    """Stands in for the engines in a wiring test: calls multiply until a tool response is in the prompt."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, n=1, max_tokens=64):
        eos = self.tok.convert_tokens_to_ids(self.tok.eos_token)
        out = []
        for p in prompts:
            text = "42" if "<tool_response>" in self.tok.decode(p) else call("multiply", a=6, b=7)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [eos]
            ids = ids[:max_tokens]
            done = "stop" if ids[-1] == eos else "length"
            kw = dict(prompt_ids=list(p), response_ids=ids, logprobs=[-1.0] * len(ids), text=text)
            out.append(
                [Completion(prompt_index=0, sample_index=0, finish_reason=done, policy_version=0, **kw)]
            )
        return out


def test_sampler_runs_tools_from_the_config(tok, tools_file):
    from rl_tpu.config import ConfigError, load_config
    from rl_tpu.controller.producer import Sampler
    from rl_tpu.data import make_synthetic
    from rl_tpu.rollout.partial import EngineTurns

    args = [f'--rollout.tools=["{tools_file}:multiply"]', "--rollout.n=2", "--rollout.tool_workers=1"]
    args += ["--rollout.max_tokens=200", "--rollout.tool_memory_mb=2048"]
    with pytest.raises(
        ConfigError, match=r"`rollout.tools` \(multi-turn\) does not run with `rollout.partial"
    ):
        load_config(None, [*args, "--cluster.mode=async", "--rollout.partial=true"])
    with pytest.raises(ConfigError, match="tool_memory_mb"):
        load_config(None, [*args, "--rollout.tool_memory_mb=-1"])
    sampler = Sampler(load_config(None, args), ScriptedEngine(tok), EngineTurns(), tok)
    try:
        assert {p.limits.memory_mb for p in sampler.tools.pools} == {
            2048
        }  # tool_memory_mb reaches the workers
        groups, metrics = sampler.multi_turn(make_synthetic("arithmetic", 3, 1)[0])
    finally:
        sampler.close()
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all(c.extra["turns"] == 2 and c.text == "42" and 0 in c.loss_mask for g in groups for c in g)
    assert metrics["rollout/turns_mean"] == 2.0
    assert (metrics["rollout/tool_calls_mean"], metrics["rollout/truncated"]) == (1.0, 0.0)
    assert (
        metrics["rollout/tool_calls"],
        metrics["rollout/tool_errors"],
        metrics["rollout/tool_timeouts"],
    ) == (6, 0, 0)


def _by_prompt(tok, log, marker):
    """A generate that calls `sleepy` in a prompt asking "slow?" (until `marker` exists, at most 3 s),
    `multiply` in the others, and answers once a tool response is in the prompt; logs (time, slow in the
    call, fast in the call) and makes `marker` once the three fast ones have answered: the slow tool ends
    as soon as they did where it holds no one up, and only after its 3 s where it holds them up."""
    eos = tok.convert_tokens_to_ids(tok.eos_token)

    def generate(prompts, max_tokens):
        texts = [tok.decode(p) for p in prompts]
        out = []
        for p, text in zip(prompts, texts):
            if "<tool_response>" in text:
                answer = "done"
            elif "slow?" in text:
                answer = call("sleepy", seconds=3, until=str(marker))
            else:
                answer = call("multiply", a=2, b=3)
            ids = tok(answer, add_special_tokens=False)["input_ids"] + [eos]
            kw = dict(prompt_ids=list(p), response_ids=ids, logprobs=[-1.0] * len(ids), text=answer)
            out.append(
                Completion(prompt_index=0, sample_index=0, finish_reason="stop", policy_version=0, **kw)
            )
        answered = ["<tool_response>" in t for t in texts]
        log.append(
            (
                time.monotonic(),
                [a for a, t in zip(answered, texts) if "slow?" in t],
                [a for a, t in zip(answered, texts) if "slow?" not in t],
            )
        )
        if sum(fast.count(True) for _, _, fast in log) >= 3:
            marker.touch()
        return out

    return generate


@pytest.mark.parametrize("scheduling", ["independent", "lockstep"])
def test_a_slow_tool_holds_only_its_own_trajectory(tok, tools_file, scheduling, tmp_path):
    log = []
    tools = Tools([f"{tools_file}:{n}" for n in NAMES], timeout_s=30.0, workers=2)
    mt = MultiTurn(
        tok,
        None,
        _by_prompt(tok, log, tmp_path / "fast_answered"),
        max_turns=3,
        max_tokens=200,
        max_total_tokens=2000,
        tools=tools,
        scheduling=scheduling,
    )
    rows = [{"messages": [{"role": "user", "content": q}]} for q in ("slow?", "fast", "fast", "fast")]
    try:
        trajs = mt.rollout(rows)
    finally:
        tools.close()
    assert [(t.turns, t.finish_reason, t.tool_calls, t.tool_errors) for t in trajs] == [(2, "stop", 1, 0)] * 4
    assert trajs[0].messages[2] == {"role": "tool", "content": "awake"}
    slow_answer = next(at for at, slow, _ in log if slow == [True])  # the call with the slow one's 2nd turn
    fast_answers = [at for at, _, fast in log if True in fast]
    if scheduling == "independent":  # the fast ones answered while the slow tool still ran
        assert [fast for _, slow, fast in log if slow == [True]] == [[]], log
        assert max(fast_answers) < slow_answer, log
        assert mt.stats["generate_calls"] >= 3  # (a fast one held up by the load may come in a 4th)
    else:  # every turn waited for the slow tool
        assert [(slow, fast) for _, slow, fast in log] == [([False], [False] * 3), ([True], [True] * 3)]
        assert mt.stats == {"generate_calls": 2.0, "turns_per_call": 4.0}
