"""`rl-tpu demo --task tools`: RL learns to use a calculator tool, against an honest control.

The task is 3-digit multiplication ("What is 347*829?"), which the tiny model cannot do in its head but
can with the `multiply` tool: it writes a call in the Qwen3 / Hermes format, reads the result in a
`tool` message and answers with it.

1. build the demo's tiny Qwen3 locally, with a chat template that renders tools (below);
2. SFT on a FIXED, small set of tool-using demonstrations (the call, the tool's message, the answer;
   the loss on the assistant turns only, rl_tpu/controller/sft.py) until held-out accuracy stops improving;
3. GRPO from that checkpoint with the tool (`rollout.tools`): multi-turn rollouts, the call run in a
   worker process, the reward on the final answer;
4. control: more SFT on the same demonstrations for the same wall time as GRPO's steps;
5. GRPO from the same checkpoint without the tool (the same steps), to show the tool is what it learns
   to use;
6. held-out accuracy of each, evaluated as the loop evaluates (`rl_tpu.controller.evaluation.Evaluator`: greedy,
   multi-turn with the tool running; single-turn without it for the no-tool arm), and tool use (the
   share of held-out prompts on which the model wrote a tool call); OUT/report.json, OUT/curves.png
   and a table.

It reuses the addition demo's machinery (rl_tpu/commands/demo.py): the plan, the SFT phase with early stopping,
one trainer group and one engine for the whole run, the report's curves. docs/demo.md has the measured
runs.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rl_tpu.commands.demo import (
    DemoPlan,
    _grpo_curve,
    _secs,
    _sft_phase,
    demo_config,
    fresh_demo_folder,
    plot_demo,
    sft_config,
)
from rl_tpu.config import Config, with_overrides
from rl_tpu.data import Example

TOOL_SPEC = "rl_tpu.commands.demo_tools:multiply"

# The tiny model's template with tools, in Qwen3's format for calls and results: an assistant turn
# writes <tool_call>{...}</tool_call>, a turn's tool results come back in one user message of
# <tool_response> blocks. The tools are listed by signature only (Qwen3 writes their whole JSON schemas
# into the system message: ~150 more prompt tokens a row for a model that learns the tool from
# demonstrations anyway).
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\nTools: ' }}"
    "{%- for tool in tools %}{{ tool.function.name + '(' + (tool.function.parameters.properties | list | "
    "join(', ')) + ')' }}{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return int(a) * int(b)


def call_text(name: str, **arguments) -> str:
    """An assistant turn that calls one tool, as Qwen3 writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@dataclass(kw_only=True)
class ToolsDemoPlan(DemoPlan):
    # The addition demo's plan, for the tools task. With every demonstration using the tool, SFT learns
    # the tool itself and GRPO adds < 15 points (docs/demo.md, the tools demo's runs 1-2); the teacher
    # below calls the tool on about half of the problems and answers the others from memory (correct
    # answers the tiny model cannot learn to compute), so only the reward tells that the tool is worth it
    digits: int = 3  # each factor's digits: from `min_digits` (0: the same) to `digits`
    min_digits: int = 0
    tool_share: float = 0.5  # the share of demonstrations that use the tool
    demonstrations: int = 200
    grpo_steps: int = 100
    grpo_lr: float = 1e-3
    max_tokens: int = 72  # per assistant turn: the call is 65 tokens of the tiny tokenizer
    max_turns: int = 2  # the call, then the answer

    @classmethod
    def quick(cls) -> ToolsDemoPlan:
        return replace(cls(), **{k: v for k, v in asdict(DemoPlan.quick()).items() if k != "max_tokens"})


def tool_examples(plan: ToolsDemoPlan) -> tuple[list[Example], list[Example]]:
    """(train, test) multiplication prompts, "What is a*b?" with factors of `plan.min_digits` to
    `plan.digits` digits (each factor's count drawn uniformly), disjoint, the test split drawn first;
    every train example carries its demonstration in `extra_info["response_messages"]` (the first
    `plan.demonstrations` are the SFT set): the call, the tool's message and the answer, or, for
    `1 - plan.tool_share` of them, the answer alone."""
    import random

    rng, seen, problems = random.Random(0), set(), []
    while len(problems) < plan.test_prompts + plan.train_prompts:
        a, b = (
            rng.randint(10 ** (d - 1), 10**d - 1)
            for d in rng.choices(range(plan.min_digits or plan.digits, plan.digits + 1), k=2)
        )
        if (a, b) not in seen:
            seen.add((a, b))
            problems.append((a, b))

    def example(a: int, b: int, split: str, i: int) -> Example:
        return Example(
            data_source="arithmetic",
            messages=[{"role": "user", "content": f"What is {a}*{b}?"}],
            ground_truth=str(a * b),
            ability="math",
            extra_info={"split": split, "index": i},
            uid=f"tools-{split}-{i}",
        )

    test = [example(a, b, "test", i) for i, (a, b) in enumerate(problems[: plan.test_prompts])]
    train = [example(a, b, "train", i) for i, (a, b) in enumerate(problems[plan.test_prompts :])]
    teacher = random.Random(1)  # which demonstrations use the tool (`plan.tool_share` of them)
    for ex, (a, b) in zip(train, problems[plan.test_prompts :]):
        if teacher.random() < plan.tool_share:
            ex.extra_info["response_messages"] = [
                {"role": "assistant", "content": call_text("multiply", a=a, b=b)},
                {"role": "tool", "content": str(a * b)},
                {"role": "assistant", "content": str(a * b)},
            ]
        else:  # the teacher answers from memory, correctly
            ex.extra_info["response_messages"] = [{"role": "assistant", "content": str(a * b)}]
    return train, test


def tools_config(plan: ToolsDemoPlan, out: Path, data: Path, tools: bool = True) -> Config:
    """The addition demo's config with the task's data files, multi-turn limits and (`tools`) the tool."""
    return with_overrides(
        demo_config(plan, out),
        [
            f'--data.train_files=["{data / "train.jsonl"}"]',
            "--data.max_prompt_length=64",
            f"--rollout.max_turns={plan.max_turns}",
            f"--rollout.tools={json.dumps([TOOL_SPEC] if tools else [])}",
            "--rollout.tool_workers=1",
            "--rollout.tool_timeout_s=5",
            "--trainer.test_freq=0",  # each arm is evaluated once, at its end, with the same Evaluator
        ],
    )


def _add_tools_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(model_dir)


def run_tools_demo(
    out: str | Path = "runs/demo-tools",
    quick: bool = False,
    plan: ToolsDemoPlan | None = None,
    verbose: bool = False,
) -> dict:
    from rl_tpu.cluster import start_ray
    from rl_tpu.controller.evaluation import Evaluator
    from rl_tpu.controller.loop import start_shared_roles, train
    from rl_tpu.controller.sft import SFTSession
    from rl_tpu.data.files import write_jsonl
    from rl_tpu.metrics import read_metrics
    from rl_tpu.model_folder import load_tokenizer
    from rl_tpu.tiny_model import make_tiny_model

    plan = plan or (ToolsDemoPlan.quick() if quick else ToolsDemoPlan())
    t_start = time.time()
    out, log = fresh_demo_folder(out, "demo tools")

    train_set, test_set = tool_examples(plan)
    write_jsonl(train_set, out / "data" / "train.jsonl")
    cfg = tools_config(plan, out / "logs", out / "data")
    cfg.logging.verbose = verbose
    demos = train_set[: plan.demonstrations]
    log(
        f"building a {plan.size} Qwen3 locally; {len(demos)} demonstrations of {plan.digits}-digit "
        f"multiplication ({sum(len(d.extra_info['response_messages']) > 1 for d in demos)} use the tool), "
        f"{len(test_set)} held-out prompts"
    )
    with ThreadPoolExecutor(max_workers=1) as ex:  # the model is built while Ray starts
        built = ex.submit(make_tiny_model, out / "model", "qwen3", plan.size, 0)
        start_ray(cfg)
        base = built.result()
    _add_tools_template(base)
    sft_cfg = sft_config(cfg, plan)
    with ThreadPoolExecutor(max_workers=1) as ex:  # the tokenizer while the actors start
        tok = ex.submit(load_tokenizer, base, chat_template=True)
        roles = start_shared_roles(cfg, str(base))
    ev = ev_plain = None
    try:
        ev = Evaluator(cfg, roles.rollout, tok.result(), test_set)
        no_tool_cfg = tools_config(plan, out / "logs", out / "data", tools=False)
        ev_plain = Evaluator(no_tool_cfg, roles.rollout, tok.result(), test_set)
        session = SFTSession(sft_cfg, str(base), tok.result(), trainer=roles.trainer)
        acc_base = ev.accuracy()
        log(f"untrained held-out accuracy {acc_base:.3f}")

        log("SFT on the demonstrations until held-out accuracy stops improving")
        sft = _sft_phase(session, demos, plan, ev, out / "sft", wall_budget=None, early_stop=True, log=log)
        acc_sft = sft["best_accuracy"]
        ev.evaluate(sft["model"])
        tool_use_sft = ev.tool_use
        log(
            f"SFT best held-out accuracy {acc_sft:.3f} at step {sft['best_step']}, tool use {tool_use_sft:.2f}"
        )

        arms = {}
        for name, tools in (("grpo", True), ("grpo_no_tool", False)):
            log(f"GRPO from the SFT checkpoint {'with' if tools else 'WITHOUT'} the tool")
            grpo_cfg = with_overrides(
                tools_config(plan, out / name, out / "data", tools=tools),
                [
                    f"--model.path={sft['model']}",
                    f"--trainer.total_steps={plan.grpo_steps}",
                    f"--trainer.lr={plan.grpo_lr}",
                ],
            )
            grpo_cfg.logging.verbose = verbose
            result = train(grpo_cfg, roles=roles)
            rows = read_metrics(out / name)
            arm_ev = ev if tools else ev_plain
            scores = {"accuracy": arm_ev.accuracy(result["hf"]), "tool_use": arm_ev.tool_use}
            arms[name] = {"rows": rows, "seconds": sum(r["time/step"] for r in rows), **scores}
            log(
                f"GRPO {'with' if tools else 'without'} the tool: {len(rows)} steps in "
                f"{_secs(arms[name]['seconds'])}, held-out accuracy {scores['accuracy']:.3f}, "
                f"tool use {scores['tool_use']:.2f}"
            )
        grpo_seconds = arms["grpo"]["seconds"]
        log(f"control: more SFT on the same demonstrations for the same {_secs(grpo_seconds)}")
        session.restart_from(sft["model"])
        control = _sft_phase(
            session, demos, plan, ev, out / "control", wall_budget=grpo_seconds, early_stop=False, log=log
        )
        acc_control = control["curve"][-1]["accuracy"] if control["curve"] else acc_sft
        tool_use_control = ev.tool_use if control["curve"] else tool_use_sft
    finally:
        for e in (ev, ev_plain):
            if e is not None:
                e.close()
        roles.shutdown()

    rows = arms["grpo"]["rows"]
    acc_rl = arms["grpo"]["accuracy"]
    report = {
        "task": "tools",
        "accuracy_base": acc_base,
        "accuracy_sft": acc_sft,
        "accuracy_rl": acc_rl,
        "accuracy_rl_no_tool": arms["grpo_no_tool"]["accuracy"],
        "accuracy_control": acc_control,
        "rl_gain_over_sft": acc_rl - acc_sft,
        "rl_gain_over_control": acc_rl - acc_control,
        "tool_use_sft": tool_use_sft,
        "tool_use_control": tool_use_control,
        "tool_use_rl": arms["grpo"]["tool_use"],
        "tool_use_rl_no_tool": arms["grpo_no_tool"]["tool_use"],
        "steps": len(rows),
        "grpo_seconds": grpo_seconds,
        "grpo_no_tool_seconds": arms["grpo_no_tool"]["seconds"],
        "control_seconds": control["train_seconds"],
        "wall_seconds": time.time() - t_start,
        "tokens_per_s": sum(r["throughput/tokens_per_s"] for r in rows) / max(len(rows), 1),
        "turns_mean": sum(r.get("rollout/turns_mean", 0.0) for r in rows) / max(len(rows), 1),
        "sft": {k: v for k, v in sft.items() if k != "model"},
        "control": {k: v for k, v in control.items() if k != "model"},
        "grpo_curve": _grpo_curve(rows),
        "grpo_no_tool_curve": _grpo_curve(arms["grpo_no_tool"]["rows"]),
        "plan": asdict(plan),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_demo(report, out / "curves.png")
    _print_summary(report, out)
    return report


def _print_summary(r: dict, out: Path) -> None:
    lines = [
        "",
        f"{'model':<34}{'held-out accuracy':>18}{'tool use':>10}",
        f"{'untrained':<34}{r['accuracy_base']:>18.3f}",
        f"{'SFT (demonstrations)':<34}{r['accuracy_sft']:>18.3f}{r['tool_use_sft']:>10.2f}",
        f"{'control: more SFT':<34}{r['accuracy_control']:>18.3f}{r['tool_use_control']:>10.2f}",
        f"{'GRPO without the tool':<34}{r['accuracy_rl_no_tool']:>18.3f}{r['tool_use_rl_no_tool']:>10.2f}",
        f"{'GRPO with the tool':<34}{r['accuracy_rl']:>18.3f}{r['tool_use_rl']:>10.2f}",
        "",
        f"GRPO with the tool: {r['steps']} steps, {_secs(r['grpo_seconds'])}, {r['turns_mean']:.2f} turns a "
        f"trajectory; without: {_secs(r['grpo_no_tool_seconds'])}; whole demo {r['wall_seconds']:.0f} s",
        f"report: {out / 'report.json'}   curves: {out / 'curves.png'}",
    ]
    print("\n".join(lines))
