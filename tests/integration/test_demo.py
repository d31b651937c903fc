"""The demo, shortened (`--quick`: tiny model, a few steps): it runs end to end on the real stack and
writes a well-formed report and picture. Whether RL beats SFT and the control is what the full demo
measures; a few steps of a tiny model cannot show it, so this test checks the plumbing and the report."""

import json
import math
import struct
import subprocess
import sys

import pytest


@pytest.mark.timeout(2100)  # above the demo subprocess's own 1800 s timeout, which reports better
def test_quick_demo_writes_report_and_curves(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "rl_tpu.commands.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for key in ("accuracy_sft", "accuracy_rl", "accuracy_control", "steps", "wall_seconds", "tokens_per_s"):
        assert key in report and isinstance(report[key], (int, float)) and math.isfinite(report[key]), key
    for key in ("accuracy_sft", "accuracy_rl", "accuracy_control"):
        assert 0.0 <= report[key] <= 1.0
    assert report["steps"] == report["plan"]["grpo_steps"]
    assert report["rl_gain_over_control"] == report["accuracy_rl"] - report["accuracy_control"]
    assert len(report["grpo_curve"]) == report["steps"] and report["sft"]["curve"]
    assert (
        abs(report["grpo_curve"][-1]["train_seconds"] - report["grpo_seconds"]) < 1e-6
    )  # cumulative step time
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 800 and height >= 300
    assert "held-out accuracy" in r.stdout and "GRPO (verifier only)" in r.stdout


class _FakeSession:
    """SFT steps with scripted losses; `export` writes an empty folder."""

    def __init__(self, losses):
        self.losses = iter(losses)

    def step(self, batch):
        return {"loss/sft": next(self.losses), "time/train": 1.0}

    def export(self, out):
        out.mkdir(parents=True, exist_ok=True)


class _FakeEvaluator:
    def __init__(self, accuracies):
        self.accuracies, self.version = iter(accuracies), 0
        self.rollout = type("R", (), {"keep_for_restart": lambda self, path, version: None})()

    def accuracy(self, path=None):
        return next(self.accuracies)


def test_sft_patience_counts_only_once_the_demonstrations_are_fit(tmp_path):
    """Early in SFT held-out accuracy is noise near 0: patience must not stop it before the training loss
    (mean since the last evaluation) is below `sft_fit_loss`."""
    from rl_tpu.commands.demo import DemoPlan, _sft_phase

    plan = DemoPlan(sft_eval_every=2, sft_patience=2, sft_fit_loss=0.2, sft_max_steps=100)
    losses = [1.3, 1.2, 1.2, 1.1, 0.9, 0.9, 0.5, 0.3, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05]  # fit from step 10
    accs = [0.04, 0.015, 0.035, 0.03, 0.3, 0.25, 0.28]  # flat until step 8, peak at 10, then lower twice
    out = _sft_phase(
        _FakeSession(losses),
        list(range(8)),
        plan,
        _FakeEvaluator(accs),
        tmp_path,
        wall_budget=None,
        early_stop=True,
        log=lambda s: None,
    )
    assert (out["best_step"], out["best_accuracy"], out["steps"]) == (10, 0.3, 14)
    assert [round(c["loss"], 3) for c in out["curve"]][:2] == [1.25, 1.15]  # the mean over each window
    # without the fit rule, patience alone stops at step 6 (two evaluations without beating 0.04)
    plain = DemoPlan(sft_eval_every=2, sft_patience=2, sft_fit_loss=None, sft_max_steps=100)
    out = _sft_phase(
        _FakeSession(losses),
        list(range(8)),
        plain,
        _FakeEvaluator(accs),
        tmp_path / "plain",
        wall_budget=None,
        early_stop=True,
        log=lambda s: None,
    )
    assert (out["best_step"], out["steps"]) == (2, 6)


def test_sft_of_a_tool_using_demonstration_has_loss_on_assistant_turns_only(tiny_qwen3):
    """A multi-turn demonstration is laid out as a rollout lays out a trajectory: the assistant turns'
    ids (each with EOS) carry the loss; the tool's message is the template's inserted ids, masked."""
    from transformers import AutoTokenizer

    from rl_tpu.commands.demo_tools import TOOL_SPEC, TOOLS_TEMPLATE, ToolsDemoPlan, tool_examples
    from rl_tpu.config import load_config
    from rl_tpu.controller.sft import sft_batch
    from rl_tpu.rollout.tools import load_tools

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    tok.chat_template = TOOLS_TEMPLATE
    train, test = tool_examples(ToolsDemoPlan(train_prompts=20, test_prompts=2))
    kinds = [len(e.extra_info["response_messages"]) for e in train]
    assert set(kinds) == {1, 3}  # the teacher calls the tool on some problems and answers others directly
    direct = train[kinds.index(1)]
    batch = sft_batch(tok, [direct], load_config(None, [f'--rollout.tools=["{TOOL_SPEC}"]']))
    assert batch.response_mask[0].sum() == len(tok(direct.ground_truth)["input_ids"]) + 1  # answer + EOS
    ex = train[kinds.index(3)]
    a, b = (int(x) for x in ex.messages[0]["content"][len("What is ") : -1].split("*"))
    assert ex.ground_truth == str(a * b) and "response_messages" not in test[0].extra_info
    batch = sft_batch(tok, [ex], load_config(None, [f'--rollout.tools=["{TOOL_SPEC}"]']))
    n = int(batch.attention_mask[0].sum())
    ids, p = batch.input_ids[0, :n].tolist(), int(batch.prompt_lens[0])
    mask = batch.response_mask[0, : n - p].tolist()
    # the whole row is the template's rendering of the conversation, with the tool listed in the prompt
    schemas = load_tools([TOOL_SPEC])[1]
    convo = ex.messages + ex.extra_info["response_messages"]
    assert tok.decode(ids) == tok.apply_chat_template(convo, tools=schemas, tokenize=False).rstrip("\n")
    assert tok.decode(ids[:p]).startswith("<|im_start|>system\nTools: multiply(a, b)<|im_end|>\n")
    learnt = tok.decode([t for t, m in zip(ids[p:], mask) if m])
    call = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    assert learnt == f"{call}<|im_end|>{a * b}<|im_end|>"
    masked = tok.decode([t for t, m in zip(ids[p:], mask) if not m])
    assert (
        masked
        == f"\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.timeout(900)
def test_quick_tools_demo_writes_report(tmp_path):
    """`rl-tpu demo --task tools --quick`: the tools demo's plumbing end to end (SFT on tool-using
    demonstrations, GRPO with and without the tool on shared actors, the control, multi-turn evaluation)."""
    out = tmp_path / "demo-tools"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_tpu.commands.cli",
            "demo",
            "--task",
            "tools",
            "--quick",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for key in ("accuracy_sft", "accuracy_rl", "accuracy_rl_no_tool", "accuracy_control", "tool_use_rl"):
        assert 0.0 <= report[key] <= 1.0, key
    assert report["task"] == "tools" and report["steps"] == report["plan"]["grpo_steps"]
    assert len(report["grpo_no_tool_curve"]) == report["plan"]["grpo_steps"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "GRPO with the tool" in r.stdout and "GRPO without the tool" in r.stdout


class _ScriptedRollout:
    """Fixed completions per prompt (pure logic: what rejection sampling keeps)."""

    def __init__(self, texts):
        self.texts = texts

    def generate(self, ids, n, temperature, max_tokens):
        from rl_tpu.types import Completion

        return [
            [
                Completion(
                    prompt_index=i,
                    sample_index=j,
                    prompt_ids=p,
                    response_ids=[1],
                    logprobs=[],
                    finish_reason=reason,
                    text=text,
                    policy_version=0,
                )
                for j, (text, reason) in enumerate(self.texts[i][:n])
            ]
            for i, p in enumerate(ids)
        ]


def test_rejection_sampling_keeps_correct_finished_responses_once_each(tiny_qwen3):
    from rl_tpu.commands.demo_model import rft_samples
    from rl_tpu.config import load_config
    from rl_tpu.data import make_synthetic
    from rl_tpu.model_folder import load_tokenizer
    from rl_tpu.rewards import RewardPool

    cfg = load_config(
        None, ['--reward.functions=["rl_tpu.rewards.arithmetic:compute_score"]', "--reward.workers=1"]
    )
    train, _ = make_synthetic("arithmetic", 2, 1, seed=3)
    a, b = (int(e.ground_truth) for e in train)
    texts = [
        [
            (f"It is {a}.", "stop"),
            (f"It is {a}.", "stop"),
            (f"{a}", "stop"),
            (f"{a}", "length"),
            ("0", "stop"),
        ],
        [
            (f"{b + 1}", "stop"),
            (f"so {b}", "length"),
            (f"= {b}", "stop"),
            (f"{b}!", "stop"),
            (f"= {b}", "stop"),
        ],
    ]
    pool = RewardPool(cfg.reward)
    try:
        kept, counts = rft_samples(cfg, _ScriptedRollout(texts), load_tokenizer(tiny_qwen3), pool, train, 5)
    finally:
        pool.close()
    assert counts == {"samples": 10, "correct": 8, "kept": 4}
    assert [(k.messages, k.ground_truth, k.extra_info["response"]) for k in kept] == [
        (train[0].messages, train[0].ground_truth, f"It is {a}."),
        (train[0].messages, train[0].ground_truth, f"{a}"),
        (train[1].messages, train[1].ground_truth, f"= {b}"),
        (train[1].messages, train[1].ground_truth, f"{b}!"),
    ]
    assert len({k.uid for k in kept}) == 4
