"""`rl-tpu train` with tools the model really calls (real Ray, a 2-rank trainer, a vLLM-CPU engine,
`sync.verify`): trajectories of several assistant turns whose token ids are exactly the engine's sampled
ids interleaved with the ids the chat template inserts for the tools' results; a tool that raises and
one that hangs are answered, counted, and the run completes. The held-out evaluation is multi-turn with
the tools running, and each row's `extra_info.tools_kwargs` reach the tools (their keyword-only
parameters, which the model does not see).

The tiny model learns to write tool calls from demonstrations laid out by the demo's SFT code
(`rl_tpu.controller.sft.sft_batch`, loss on the assistant turns only); the optimisation itself is a few seconds of
plain torch on the HF model, in this process: a trainer group would add ~20 s of start-up to the test."""

import json
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_tpu.config import load_config

TOOLS_PY = '''
import time


def _note(name, row, log):
    if log:  # the row's tools_kwargs name a file: record which row's kwargs reached which tool
        with open(log, "a") as f:
            f.write(f"{name} {row}\\n")


def ok(*, row: str = "", log: str = "") -> str:
    """Returns a fixed number."""
    _note("ok", row, log)
    return "42"


def boom(*, row: str = "", log: str = "") -> str:
    """Always raises."""
    _note("boom", row, log)
    raise ValueError("boom on purpose")


def hang(*, row: str = "", log: str = "") -> str:
    """Never returns in time."""
    _note("hang", row, log)
    time.sleep(120)
    return "late"
'''

LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    return sum(ch.isdigit() for ch in solution_str[:64]) / 8.0
"""

NAMES = ("ok", "boom", "hang")

# `ok` as a verl tool (a BaseTool subclass in verl's tool config YAML, rl_tpu/rollout/verl_tools.py): the
# same answer, and a step reward of 0.25 per call
VERL_OK_PY = """
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse


class OkTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="42"), 0.25, {}
"""


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tool_loop")
    (d / "loop_tools.py").write_text(textwrap.dedent(TOOLS_PY))
    (d / "length.py").write_text(textwrap.dedent(LENGTH_REWARD))
    return d


def _specs(d: Path) -> list[str]:
    return [f"{d / 'loop_tools.py'}:{n}" for n in NAMES]


def _verl_specs(d: Path) -> list[str]:
    """`_specs` with `ok` replaced by the verl tool of the same schema (so the prompt renders the same)."""
    import yaml

    from rl_tpu.rollout.tools import load_tools

    (d / "verl_ok.py").write_text(VERL_OK_PY)
    schema = load_tools(_specs(d)[:1])[1][0]
    entry = {"class_name": "verl_ok.OkTool", "config": {"type": "native"}, "tool_schema": schema}
    (d / "tools.yaml").write_text(yaml.safe_dump({"tools": [entry]}))
    return [str(d / "tools.yaml"), *_specs(d)[1:]]


@pytest.fixture(scope="module")
def tool_model(tiny_qwen3, tools_dir):
    return sft_tool_model(tiny_qwen3, tools_dir)


def sft_tool_model(tiny_qwen3: str, tools_dir: Path) -> str:
    """The tiny Qwen3 with the demo's tools template, fine-tuned to call one of the three tools, read
    its result and answer: 2-digit addition prompts, the tool chosen by the prompt's index."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_tpu.commands.demo_tools import TOOLS_TEMPLATE, call_text
    from rl_tpu.controller.sft import sft_batch
    from rl_tpu.data import make_synthetic

    path = tools_dir / "model"
    shutil.copytree(tiny_qwen3, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    results = {
        "ok": "42",
        "boom": "Error: boom: ValueError: boom on purpose",
        "hang": "Error: hang: timed out",
    }
    demos, _ = make_synthetic("arithmetic", 96, 1, seed=3)
    for i, ex in enumerate(demos):
        name = NAMES[i % 3]
        ex.extra_info["response_messages"] = [
            {"role": "assistant", "content": call_text(name)},
            {"role": "tool", "content": results[name]},
            {"role": "assistant", "content": ex.ground_truth},
        ]
    cfg = load_config(None, [f"--rollout.tools={json.dumps(_specs(tools_dir))}"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3)
    for step in range(60):
        b = sft_batch(tok, demos[(step * 32) % 96 :][:32], cfg)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None])[..., 0]
        mask = torch.zeros_like(logp)
        for i, p in enumerate(b.prompt_lens.tolist()):  # response token t is predicted at position p - 1 + t
            mask[i, p - 1 : p - 1 + b.response_mask.shape[1]] = b.response_mask[i]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5, loss.item()  # the calls' tokens are learnt (the tool's choice is a coin)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _cfg(tmp_path: Path, tools_dir: Path, model: str, steps: int, specs: list[str] | None = None):
    return load_config(
        None,
        [
            f"--model.path={model}",
            f"--logging.run_dir={tmp_path / 'run'}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--trainer.world_size=2",
            "--trainer.micro_batch_size=64",
            f"--trainer.total_steps={steps}",
            "--trainer.test_freq=0",
            "--rollout.n=2",
            "--rollout.engines=1",
            "--rollout.max_tokens=48",
            f"--rollout.tools={json.dumps(specs or _specs(tools_dir))}",
            "--rollout.tool_timeout_s=1",
            "--rollout.tool_workers=2",
            "--rollout.max_turns=3",
            "--data.batch_size=4",
            "--data.synthetic_train_size=16",
            "--reward.workers=1",
            "--checkpoint.every=0",
            f'--reward.functions=["{tools_dir / "length.py"}:compute_score"]',
            "--sync.verify=true",
        ],
    )


@pytest.mark.usefixtures("loop_ray")
def test_train_with_tools_the_model_calls(tmp_path, tools_dir, tool_model, monkeypatch):
    from transformers import AutoTokenizer

    from rl_tpu.controller.loop import train
    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.rollout.multi_turn import ChatDelta, MultiTurn
    from rl_tpu.rollout.tools import load_tools
    from rl_tpu.trainer.group import TrainerGroup

    trained, trajectories, sampled = [], [], []
    train_step, rollout, generate = TrainerGroup.train_step, MultiTurn.rollout, RolloutGroup.generate

    def record_train_step(self, batch, algo_cfg):
        trained.append(batch)
        return train_step(self, batch, algo_cfg)

    def record_rollout(self, samples, n=1):
        trajectories.append(rollout(self, samples, n))
        return trajectories[-1]

    def record_generate(self, prompts, *args, **kw):
        out = generate(self, prompts, *args, **kw)
        sampled.extend((tuple(p), list(c.response_ids)) for p, g in zip(prompts, out) for c in g)
        return out

    monkeypatch.setattr(TrainerGroup, "train_step", record_train_step)
    monkeypatch.setattr(MultiTurn, "rollout", record_rollout)
    monkeypatch.setattr(RolloutGroup, "generate", record_generate)
    steps = 2
    # `ok` is a verl BaseTool from its tool config YAML: verl's own loader builds it in the tool workers
    # (which search the driver's module path)
    monkeypatch.syspath_prepend(str(tools_dir))
    train(_cfg(tmp_path, tools_dir, tool_model, steps, _verl_specs(tools_dir)))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/samples"] for r in rows] == [8] * steps  # data.batch_size x rollout.n, every step
    assert all(r["sync/verified_params"] > 0 for r in rows)
    assert all(abs(r["mismatch/kl"]) <= 1e-5 and r["mismatch/max_abs_logprob_diff"] <= 1e-5 for r in rows), [
        (r["mismatch/kl"], r["mismatch/max_abs_logprob_diff"]) for r in rows
    ]
    # the model called the tools: the one that raises and the one that hangs were answered and counted
    assert sum(r["rollout/tool_calls"] for r in rows) >= 8, [r["rollout/tool_calls"] for r in rows]
    assert sum(r["rollout/tool_errors"] for r in rows) > 0
    assert sum(r["rollout/tool_timeouts"] for r in rows) > 0
    # the verl tool's step rewards: 0.25 per call of `ok`, summed per trajectory
    oks = sum(
        m["content"] == "42"
        for trajs in trajectories
        for t in trajs
        for m in t.messages
        if m["role"] == "tool"
    )
    assert oks > 0 and sum(r["rollout/tool_reward_mean"] * 8 for r in rows) == pytest.approx(0.25 * oks)

    tok = AutoTokenizer.from_pretrained(tool_model)
    delta = ChatDelta(tok, tools=load_tools(_specs(tools_dir))[1])
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert len(trajectories) == len(trained) == steps
    multi = 0
    for trajs, batch in zip(trajectories, trained):
        assert len(trajs) == batch.num_seqs == 8
        for i, t in enumerate(trajs):
            multi += t.turns > 1
            # the ids: each sampled turn is one of the engine's outputs for the ids before it, exactly;
            # between them, the template's ids for that turn's tool results (mask 0)
            pos, tool_msgs = 0, [m for m in t.messages[len(t.sample["messages"]) :]]
            for turn in range(t.turns):
                options = [r for p, r in sampled if p == tuple(t.prompt_ids + t.ids[:pos])]
                got = t.ids[pos : pos + max(map(len, options), default=0)]
                out = next((r for r in options if got[: len(r)] == r), None)
                assert out is not None, f"trajectory {i} turn {turn}: not an engine output"
                assert t.mask[pos : pos + len(out)] == [1] * len(out)
                pos += len(out)
                tool_msgs = tool_msgs[1:]  # the assistant message of this turn
                results = []
                while tool_msgs and tool_msgs[0]["role"] == "tool":
                    results.append(tool_msgs.pop(0))
                if pos < len(t.ids):
                    inserted = delta.ids(results, closed=t.ids[pos - 1] == eos)
                    assert results and t.ids[pos : pos + len(inserted)] == inserted
                    assert t.mask[pos : pos + len(inserted)] == [0] * len(inserted)
                    pos += len(inserted)
            assert pos == len(t.ids)
            # the trained row is the trajectory: the same ids, the loss on the sampled tokens only
            n_prompt, n = int(batch.prompt_lens[i]), len(t.ids)
            row = batch.input_ids[i, : int(batch.attention_mask[i].sum())].tolist()
            assert row == t.prompt_ids + t.ids and n_prompt == len(t.prompt_ids)
            assert batch.response_mask[i, :n].tolist() == [float(m) for m in t.mask]
            assert not batch.response_mask[i, n:].any()
    assert multi > 0  # trajectories of more than one assistant turn, because the model called a tool


def _row_tag(t) -> str:
    return t.sample["extra_info"]["tools_kwargs"]["ok"]["execute_kwargs"]["row"]


@pytest.mark.usefixtures("loop_ray")
def test_evaluation_is_multi_turn_and_rows_tools_kwargs_reach_the_tools(
    tmp_path, tools_dir, tool_model, monkeypatch
):
    """`trainer.test_freq` with tools evaluates as training rolls out: greedy trajectories whose tool calls
    run (eval/turns_mean > 1); in training and evaluation alike, every tool that ran got its own row's
    `tools_kwargs` (create_kwargs and execute_kwargs merged), recorded by the tool itself."""
    from rl_tpu.config import with_overrides
    from rl_tpu.controller.loop import train
    from rl_tpu.data import make_synthetic
    from rl_tpu.data.files import write_jsonl
    from rl_tpu.rollout.multi_turn import MultiTurn
    from rl_tpu.rollout.tools import parse_tool_calls

    log = tmp_path / "calls.log"
    train_rows, test_rows = make_synthetic("arithmetic", 8, 6, seed=5)
    for split, rows in (("train", train_rows), ("test", test_rows)):
        for j, ex in enumerate(rows):
            ex.extra_info["tools_kwargs"] = {
                name: {"create_kwargs": {"log": str(log)}, "execute_kwargs": {"row": f"{split}-{j}"}}
                for name in NAMES
            }
        write_jsonl(rows, tmp_path / f"{split}.jsonl")
    rollouts, rollout = [], MultiTurn.rollout

    def record_rollout(self, samples, n=1):
        rollouts.append((n, rollout(self, samples, n)))
        return rollouts[-1][1]

    monkeypatch.setattr(MultiTurn, "rollout", record_rollout)
    cfg = with_overrides(
        _cfg(tmp_path, tools_dir, tool_model, steps=1),
        [
            f'--data.train_files=["{tmp_path / "train.jsonl"}"]',
            f'--data.test_files=["{tmp_path / "test.jsonl"}"]',
            "--trainer.test_freq=1",
        ],
    )
    train(cfg)
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [n for n, _ in rollouts] == [2, 1]  # the step's rollouts, then the evaluation's
    evaluated = rollouts[1][1]
    assert sorted(_row_tag(t) for t in evaluated) == [f"test-{j}" for j in range(6)]
    assert row["eval/turns_mean"] == sum(t.turns for t in evaluated) / 6 > 1.0
    assert row["eval/tool_calls"] == sum(t.tool_calls for t in evaluated) > 0
    assert row["eval/tool_use"] > 0 and 0.0 <= row["eval/accuracy"] <= 1.0
    # each tool answer in a trajectory came from a call that received that trajectory's row kwargs
    ran = {tuple(line.split()) for line in log.read_text().splitlines()}
    answers = {
        "42": "ok",
        "Error: boom: ValueError: boom on purpose": "boom",
        "Error: hang: timed out": "hang",
    }
    answered = {
        (name, _row_tag(t))
        for _, trajs in rollouts
        for t in trajs
        for m in t.messages
        if m["role"] == "tool"
        for text, name in answers.items()
        if m["content"].startswith(text)
    }
    assert answered <= ran, answered - ran
    assert any(tag.startswith("test-") for _, tag in answered)  # the tools ran during the evaluation
    assert any(tag.startswith("train-") for _, tag in answered)
    # and no tool ran with kwargs of a row whose trajectories did not call it
    written = {
        (c.name, _row_tag(t))
        for _, trajs in rollouts
        for t in trajs
        for text in [m["content"] for m in t.messages if m["role"] == "assistant"] + [t.last_text]
        for c in parse_tool_calls(text)
    }
    assert ran <= written, ran - written


def test_shared_roles_take_runs_with_other_tools():
    """The tools demo runs GRPO with and without the tool on one set of roles: the driver's multi-turn
    settings may differ from those the roles started with; the engines' sampling may not."""
    from rl_tpu.controller.roles import check_roles

    started = load_config(None, ['--rollout.tools=["m:f"]', "--rollout.max_turns=2"])
    roles = SimpleNamespace(
        groups=SimpleNamespace(plan="p"),
        rollout=SimpleNamespace(cfg=started),
        trainer=SimpleNamespace(cfg=started),
    )
    check_roles(load_config(None, ["--rollout.max_turns=3", "--rollout.tool_timeout_s=1"]), roles, "p")
    with pytest.raises(ValueError, match=r"rollout.temperature differ"):
        check_roles(load_config(None, ['--rollout.tools=["m:f"]', "--rollout.temperature=0.5"]), roles, "p")


def test_example_calculator_tool():
    """examples/tools/calculator.py: arithmetic by the syntax tree; anything else is the tool's error."""
    from rl_tpu.rollout.tools import Tools, parse_tool_calls

    spec = str(Path(__file__).parents[2] / "examples" / "tools" / "calculator.py") + ":calculator"
    tools = Tools([spec], timeout_s=5.0, workers=1)
    try:
        assert tools.schemas[0]["function"]["parameters"]["required"] == ["expression"]
        exprs = ["(12 + 7) * 3", "7 / 2", "-2 ** 3", "__import__('os').getcwd()", "2 ** 1000", "1 / 0"]
        calls = "".join(
            f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': {'expression': e}})}</tool_call>"
            for e in exprs
        )
        assert [r.text for r in tools.run(parse_tool_calls(calls))] == [
            "57",
            "3.5",
            "-8",
            "Error: calculator: ValueError: not arithmetic: \"__import__('os').getcwd()\"",
            "Error: calculator: ValueError: exponent 1000 is larger than 64",
            "Error: calculator: ZeroDivisionError: division by zero",
        ]
    finally:
        tools.close()


def test_a_tool_past_its_memory_limit_reads_a_memory_error(tmp_path):
    """Tool workers run under an address-space limit (RLIMIT_AS): an allocation past it is that call's
    MemoryError, and the worker goes on answering."""
    from rl_tpu.containment import Limits
    from rl_tpu.rollout.tools import Tools, parse_tool_calls

    (tmp_path / "hog.py").write_text(
        textwrap.dedent(
            '''
            def hog(mb: int) -> str:
                """Allocate some memory.

                Args:
                    mb: How many MiB.
                """
                return str(len(bytearray(mb * 2**20)))
            '''
        )
    )
    tools = Tools([f"{tmp_path / 'hog.py'}:hog"], timeout_s=10.0, workers=1, limits=Limits(memory_mb=256))
    try:
        calls = "".join(
            f'<tool_call>{{"name": "hog", "arguments": {{"mb": {mb}}}}}</tool_call>' for mb in (1, 1024, 2)
        )
        texts = [r.text for r in tools.run(parse_tool_calls(calls))]
        assert texts[0] == str(2**20) and texts[2] == str(2 * 2**20), texts
        assert texts[1].startswith("Error: hog: MemoryError"), texts
    finally:
        tools.close()
