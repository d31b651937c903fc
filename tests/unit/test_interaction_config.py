"""verl interaction config files as `rollout.env` (rollout/verl_interactions.py), the pure parts: the file's
reading (verl's naming rule), a row's choice of interaction, the adapter's calls in process on a
duck-typed interaction, and an environment's `info` from `step` to the step's metrics. verl's own
interaction in real worker processes: tests/integration/test_verl_interactions.py."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from rl_tpu.controller.producer import turn_metrics
from rl_tpu.rollout import verl_interactions as vi
from rl_tpu.rollout.multi_turn import EnvError, Trajectory, check_answer, load_env

ECHO_PY = textwrap.dedent(
    '''
    class EchoInteraction:
        """Says what the assistant said; done once it says "stop". Records its calls (per process)."""

        calls = []

        def __init__(self, config):
            self.config = config

        async def start_interaction(self, instance_id=None, **kwargs):
            self.calls.append(("start", instance_id, kwargs))
            return instance_id

        async def generate_response(self, instance_id, messages, **kwargs):
            text = messages[-1]["content"]
            self.calls.append(("respond", instance_id, text))
            return text == "stop", "you said " + text, float(len(text)), {}

        async def finalize_interaction(self, instance_id, **kwargs):
            self.calls.append(("finalize", instance_id))


    class Bare(EchoInteraction):
        async def finalize_interaction(self):  # verl's base class signature: no instance id
            self.calls.append(("finalize-bare",))


    class Plain:
        """Duck-typed, with plain methods; its answer has verl's shape but for the metadata."""

        def __init__(self, config):
            pass

        def start_interaction(self, instance_id=None, **kwargs):
            return instance_id

        def generate_response(self, instance_id, messages, **kwargs):
            return True, "bye", None

        def finalize_interaction(self, instance_id):
            pass
    '''
)


def _yaml(tmp_path, body: str) -> str:
    path = tmp_path / "interaction.yaml"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_the_file_is_read_with_verls_naming_rule(tmp_path):
    path = _yaml(
        tmp_path,
        """
        interaction:
          - class_name: pkg.mod.Gsm8kInteraction
          - name: custom
            class_name: pkg.mod.Other
            config: {threshold: 0.5}
        """,
    )
    got = vi.read_interaction_config(path)
    assert got == {
        "gsm8k": ("pkg.mod.Gsm8kInteraction", {"name": "gsm8k"}),
        "custom": ("pkg.mod.Other", {"threshold": 0.5, "name": "custom"}),
    }


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("tools: []\n", r"has no `interaction:` list"),
        ("interaction:\n  - config: {}\n", r"interaction\[0\] needs class_name"),
        (
            "interaction:\n  - class_name: a.B\n  - class_name: c.B\n",
            r"interaction\[1\]: a second interaction named 'b'",
        ),
        ("interaction:\n  - class_name: a.B\n    config: 3\n", r"config must be a mapping"),
        ("interaction: [\n", r"is not valid YAML"),
    ],
)
def test_a_bad_file_is_one_error_naming_the_entry(tmp_path, body, match):
    with pytest.raises(EnvError, match=match):
        vi.read_interaction_config(_yaml(tmp_path, body))
    with pytest.raises(EnvError, match=r"not found"):
        vi.read_interaction_config(tmp_path / "missing.yaml")


def test_a_class_whose_module_is_missing_is_named_before_the_run(tmp_path):
    path = _yaml(tmp_path, "interaction:\n  - class_name: verl.interactions.nope.NopeInteraction\n")
    with pytest.raises(
        EnvError, match=r"interaction 'nope': module 'verl.interactions.nope' .* verl <= 0.7.1"
    ):
        load_env(path)


def test_each_row_names_its_interaction():
    assert vi.row_interaction({}, ["only"], "row 1") == ("only", {})  # one interaction: no name needed
    kwargs = {"name": "b", "ground_truth": "3"}
    assert vi.row_interaction({"interaction_kwargs": kwargs}, ["a", "b"], "row 1") == ("b", kwargs)
    with pytest.raises(ValueError, match=r"row 7: extra_info.interaction_kwargs has no name; the config has"):
        vi.row_interaction({}, ["a", "b"], "row 7")
    with pytest.raises(ValueError, match=r"names 'c'"):
        vi.row_interaction({"interaction_kwargs": {"name": "c"}}, ["a", "b"], "row 7")
    with pytest.raises(ValueError, match=r"must be a mapping"):
        vi.row_interaction({"interaction_kwargs": "gsm8k"}, ["a"], "row 7")


def test_the_adapter_runs_start_respond_finalize(tmp_path, monkeypatch):
    (tmp_path / "echo_interaction.py").write_text(ECHO_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _yaml(
        tmp_path,
        """
        interaction:
          - {name: echo, class_name: echo_interaction.EchoInteraction, config: {}}
          - {name: bare, class_name: echo_interaction.Bare}
          - {name: plain, class_name: echo_interaction.Plain}
        """,
    )
    cls = load_env(path)
    assert cls.__name__ == "VerlInteractions" and cls.interactions is None  # the driver builds nothing
    cls.build()
    calls = cls.interactions["echo"].calls
    row = {"messages": [{"role": "user", "content": "q"}], "uid": "u1"}
    row["extra_info"] = {"interaction_kwargs": {"name": "echo", "level": 2}}

    async def run(env, row, texts):
        out = [await env.reset(row)]
        for text in texts:
            out.append(check_answer(await env.step([{"role": "assistant", "content": text}]), "step"))
        await env.close()
        return out

    env = cls()
    opening, first, last = asyncio.run(run(env, row, ["hi", "stop"]))
    assert opening == row["messages"]
    assert first == ([{"role": "user", "content": "you said hi"}], None, False, {"turn_score": 2.0})
    assert last == ([], None, True, {"turn_score": 4.0})  # done: no message after the last turn
    iid = env.instance_id
    assert calls == [
        ("start", iid, {"name": "echo", "level": 2}),
        ("respond", iid, "hi"),
        ("respond", iid, "stop"),
        ("finalize", iid),
    ]
    calls.clear()
    row["extra_info"] = {"interaction_kwargs": {"name": "bare"}}
    asyncio.run(run(cls(), row, []))
    assert calls[-1] == ("finalize-bare",)
    row["extra_info"] = {"interaction_kwargs": {"name": "plain"}}
    assert asyncio.run(run(cls(), row, [])) == [row["messages"]]  # plain methods are called as they are
    with pytest.raises(
        TypeError, match=r"Plain.generate_response must return \(should_terminate, response, score"
    ):
        asyncio.run(run(cls(), row, ["hi"]))


def test_step_info_is_checked_and_reported_over_the_trajectories_that_gave_it():
    assert check_answer(([], 1, True), "s") == ([], 1.0, True, {})
    assert check_answer(([], None, False, {"a": 2}), "s") == ([], None, False, {"a": 2.0})
    for bad in ({"a": "high"}, {"a": True}, {1: 2.0}, [("a", 1.0)]):
        with pytest.raises(EnvError, match=r"dict of str to numbers as its info"):
            check_answer(([], None, False, bad), "Env.step")
    trajs = [Trajectory({}, [], []) for _ in range(3)]
    trajs[0].env_info, trajs[1].env_info = {"turn_score": 1.0}, {"turn_score": 0.0, "other": 5.0}
    m = turn_metrics(trajs, "rollout/", tools=False)
    assert m["rollout/env_info/turn_score_mean"] == 0.5 and m["rollout/env_info/other_mean"] == 5.0
    assert not any("env_info" in k for k in turn_metrics(trajs[2:], "rollout/", tools=False))


def test_modules_are_found_on_the_path_without_importing_them(tmp_path, monkeypatch):
    import sys

    (tmp_path / "pkg_x").mkdir()
    (tmp_path / "pkg_x" / "__init__.py").write_text("raise RuntimeError('imported')")
    (tmp_path / "pkg_x" / "mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert vi.module_found("pkg_x.mod") and "pkg_x" not in sys.modules  # its __init__ never ran
    assert not vi.module_found("pkg_x.nope") and not vi.module_found("nope_pkg.mod")
    assert vi.module_found("rl_tpu.rollout.env_pool")  # a package the editable install maps elsewhere


def test_rows_are_checked_before_the_run(tmp_path):
    from rl_tpu.data import Example

    path = _yaml(tmp_path, "interaction:\n  - {name: a, class_name: m.A}\n  - {name: b, class_name: m.B}\n")

    def row(uid, extra):
        return Example(
            data_source="d",
            messages=[{"role": "user", "content": "q"}],
            ground_truth="1",
            extra_info=extra,
            uid=uid,
        )

    vi.check_rows(path, [row("r1", {"interaction_kwargs": {"name": "a"}})])
    with pytest.raises(
        EnvError, match=r"row r2: extra_info.interaction_kwargs has no name; the config has \['a', 'b'\]"
    ):
        vi.check_rows(path, [row("r1", {"interaction_kwargs": {"name": "b"}}), row("r2", {})])
