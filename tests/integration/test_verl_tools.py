"""verl's native tools through `rollout.tools`, unchanged (rl_tpu/rollout/verl_tools.py): a `BaseTool`
subclass written against the installed verl (a GSM8K-style answer checker scored by verl's own
`verl.utils.reward_score.gsm8k`, with per-instance state and a step reward), declared in verl's tool config
YAML, built by verl's own loader in our tool workers. Checked: the schema the model sees is the file's;
each call runs create (with the row's `create_kwargs`) -> execute -> release, as verl 0.9.1's agent loop
does; the text reaches the model and the step reward the result; bad files and rows are one clear error.
Real worker processes (each imports verl: ~10 s)."""

from __future__ import annotations

import json
import textwrap

import pytest

from rl_tpu.rollout.tools import ToolCall, ToolError, Tools, check_tools_kwargs

pytest.importorskip(
    "verl.tools.base_tool", reason="needs verl (the `verl` extra: scripts/setup.sh --extra verl)"
)

TOOL_PY = textwrap.dedent(
    '''
    import json
    from uuid import uuid4

    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse
    from verl.utils.reward_score import gsm8k


    class AnswerTool(BaseTool):
        """Checks a GSM8K answer against the row's ground truth (verl's gsm8k scorer)."""

        def __init__(self, config, tool_schema):
            super().__init__(config, tool_schema)
            self._instances = {}

        async def create(self, instance_id=None, ground_truth=None, **kwargs):
            create = kwargs.get("create_kwargs", {})
            instance_id = instance_id or str(uuid4())
            self._instances[instance_id] = {"ground_truth": create.get("ground_truth", ground_truth)}
            self._log("create", instance_id)
            return instance_id, ToolResponse()

        async def execute(self, instance_id, parameters, **kwargs):
            answer = str(parameters.get("answer", ""))
            truth = self._instances[instance_id]["ground_truth"]
            score = gsm8k.compute_score("#### " + answer, truth)
            reward = score if score > 0 else self.config["penalty"]
            self._log("execute", instance_id, answer, kwargs.get("agent_data") is None)
            return ToolResponse(text=f"Current parsed answer={answer} result={score}"), reward, {}

        async def release(self, instance_id, **kwargs):
            self._log("release", instance_id)
            del self._instances[instance_id]

        def _log(self, *what):
            with open(self.config["log"], "a") as f:
                f.write(json.dumps(list(what)) + "\\n")
    '''
)


def _yaml(tmp_path, tool_schema: bool = True) -> str:
    (tmp_path / "answer_tool.py").write_text(TOOL_PY)
    schema = """
        tool_schema:
          type: function
          function:
            name: calc_gsm8k_reward
            description: Check the final answer to the math problem.
            parameters:
              type: object
              properties:
                answer: {type: string, description: The model's answer}
              required: [answer]
    """
    path = tmp_path / "tools.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            tools:
              - class_name: answer_tool.AnswerTool
                config: {{type: native, penalty: -0.05, log: {tmp_path / "calls.jsonl"}}}
            """
        )
        + (textwrap.indent(textwrap.dedent(schema), "    ") if tool_schema else "")
    )
    return str(path)


def _row(uid: str, truth: str) -> dict:
    return {
        "uid": uid,
        "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}},
    }


def test_verl_base_tool_from_its_yaml_runs_create_execute_release_per_call(tmp_path, monkeypatch):
    path = _yaml(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the YAML's class_name is a module on the path, as in verl
    tools = Tools([path], timeout_s=60, workers=1)
    try:
        assert tools.names == ["calc_gsm8k_reward"]
        assert tools.schemas[0]["function"]["parameters"]["required"] == ["answer"]  # the file's schema
        right = tools.bind([ToolCall("calc_gsm8k_reward", {"answer": "72"})], _row("a", "72"))
        wrong = tools.bind([ToolCall("calc_gsm8k_reward", {"answer": "71"})], _row("b", "72"))
        (r1,), (r2,) = tools.run(right), tools.run(wrong)
    finally:
        tools.close()
    assert (r1.text, r1.reward, r1.error) == ("Current parsed answer=72 result=1.0", 1.0, False)
    assert (r2.text, r2.reward) == ("Current parsed answer=71 result=0.0", -0.05)
    log = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [e[0] for e in log] == ["create", "execute", "release"] * 2
    assert log[0][1] == log[1][1] == log[2][1] != log[3][1]  # one instance per call, released
    assert log[1][3] is True  # agent_data is None here (verl's AgentData does not exist)


def test_verl_tool_rows_and_files_are_checked_before_the_run(tmp_path, monkeypatch):
    path = _yaml(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from rl_tpu.data import Example

    def example(uid: str, extra_info: dict) -> Example:
        return Example(
            data_source="gsm8k",
            messages=[{"role": "user", "content": "q"}],
            ground_truth="3",
            extra_info=extra_info,
            uid=uid,
        )

    good = example("r1", _row("r1", "3")["extra_info"])
    check_tools_kwargs([path], [good])  # create_kwargs of any shape go to the tool's create
    bad = example("r2", {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": 3}}})
    with pytest.raises(ToolError, match=r"row r2.*calc_gsm8k_reward.create_kwargs must be an object"):
        check_tools_kwargs([path], [bad])
    with pytest.raises(ToolError, match=r"declares no tool 'nope'"):
        check_tools_kwargs([f"{path}:nope"], [good])
    (tmp_path / "bare").mkdir()
    no_schema = _yaml(tmp_path / "bare", tool_schema=False)
    with pytest.raises(ToolError, match=r"give its tool_schema"):
        check_tools_kwargs([no_schema], [good])


def test_verl_tool_whose_class_does_not_load_is_a_startup_error(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: no_such_module.Tool\n    config: {type: native}\n    tool_schema:\n"
        "      type: function\n      function: {name: t, description: d, parameters: {type: object}}\n"
    )
    from rl_tpu.errors import UserError

    with pytest.raises(
        UserError, match=r"class_name 'no_such_module.Tool' .* module 'no_such_module' is not importable"
    ):
        Tools([str(path)], timeout_s=60, workers=1)
