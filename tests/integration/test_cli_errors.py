"""A user's mistake reaches the console as one line naming the culprit, with exit status 2 and no
traceback: bad data files, reward specs and model folders, for `rl-tpu train`, `sft` and `generate`.

Every case here fails before the trainer or an engine starts (that is part of what is tested: a typo
must not cost a minute of start-up; checks that need the tokenizer run while Ray starts, which is then
stopped again), so the CLI runs in this process (`cli.main`) except for one subprocess run that checks the
real exit status and stderr of the installed entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_tpu.commands import cli
from rl_tpu.data import DataError, make_synthetic, write_jsonl


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_qwen3) -> Path:
    """Bad inputs of every kind, side by side in one folder."""
    d = tmp_path_factory.mktemp("bad_inputs")
    rows = [
        json.loads(line)
        for line in write_jsonl(make_synthetic("arithmetic", 6, 1)[0], d / "good.jsonl")
        .read_text()
        .splitlines()
    ]

    def jsonl(name: str, edit) -> None:
        bad = [dict(r) for r in rows]
        edit(bad)
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in bad))

    jsonl("missing_prompt.jsonl", lambda rs: rs[2].pop("prompt"))
    jsonl("wrong_type.jsonl", lambda rs: rs[3].update(prompt="What is 1+1?"))
    parquet_rows = [dict(r, extra_info=None) for r in rows]
    parquet_rows[1]["prompt"] = None
    table = pa.Table.from_pylist(parquet_rows)
    pq.write_table(table, d / "bad.parquet")
    pq.write_table(table.slice(0, 0), d / "empty.parquet")
    (d / "empty.jsonl").write_text("")
    (d / "binary.jsonl").write_bytes((d / "bad.parquet").read_bytes())  # a parquet file named .jsonl
    (d / "notes").mkdir()  # a directory, but not of shards; it used to read "unknown extension ''"
    (d / "notes" / "readme.txt").write_text("not data")
    (d / "mixed").mkdir()  # a directory of shards of two kinds
    shutil.copy(d / "good.jsonl", d / "mixed")
    pq.write_table(table.slice(2, 3), d / "mixed" / "more.parquet")

    (d / "syntax_error.py").write_text("def compute_score(a b):\n    return 1.0\n")
    (d / "no_function.py").write_text("def other(**kw):\n    return 1.0\n")

    (d / "unknown_arch").mkdir()  # an architecture the trainer does not build, and no tokenizer
    (d / "unknown_arch" / "config.json").write_text(
        '{"model_type": "foo", "architectures": ["FooForCausalLM"]}'
    )
    (d / "no_config").mkdir()
    shutil.copy(Path(tiny_qwen3) / "model.safetensors", d / "no_config")
    (d / "no_tokenizer").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_qwen3) / name, d / "no_tokenizer")
    unserved = d / "unserved_arch"  # tokenizer and weights, but an architecture vLLM does not serve
    shutil.copytree(tiny_qwen3, unserved)
    hf = json.loads((unserved / "config.json").read_text())
    (unserved / "config.json").write_text(json.dumps(hf | {"architectures": ["NoSuchForCausalLM"]}))
    (d / "bad_json").mkdir()
    (d / "bad_json" / "config.json").write_text('{"model_type": "qwen3",')
    return d


def _main(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err


def _assert_one_line(rc: int, err: str, *culprit: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("rl-tpu: "), err
    for word in culprit:
        assert word in err, (word, err)


def _common(files: Path, tiny_qwen3: str) -> list[str]:
    return [
        f"--model.path={tiny_qwen3}",
        f"--logging.run_dir={files / 'run'}",
        "--logging.tensorboard=false",
        "--trainer.total_steps=1",
        "--reward.workers=1",
    ]


DATA_CASES = {  # file -> words the line must hold
    "missing_prompt.jsonl": ["missing_prompt.jsonl line 3", "missing field `prompt`"],
    "wrong_type.jsonl": ["wrong_type.jsonl line 4", "`prompt` must be a list", "got str"],
    "bad.parquet": ["bad.parquet row 1", "missing field `prompt`"],
    "empty.jsonl": ["empty.jsonl", "no rows"],
    "empty.parquet": ["empty.parquet", "no rows"],
    "nonexistent.jsonl": ["nonexistent.jsonl", "not found"],
    "binary.jsonl": ["binary.jsonl", "not UTF-8"],
    "notes": ["notes is a directory", "no *.parquet or *.jsonl files"],
    "mixed": ["mixed is a directory mixing 1 *.parquet and 1 *.jsonl files"],
}


@pytest.mark.parametrize("command", ["train", "sft"])
@pytest.mark.parametrize("name", list(DATA_CASES))
def test_bad_data_file_is_one_line(command, name, files, tiny_qwen3, capsys):
    rc, err = _main(capsys, command, *_common(files, tiny_qwen3), f'--data.train_files=["{files / name}"]')
    _assert_one_line(rc, err, *DATA_CASES[name])


@pytest.mark.parametrize("command", ["train", "sft"])
def test_over_long_prompt_is_named_before_the_run_starts(command, files, tiny_qwen3, capsys):
    # before, it surfaced at the step that drew the prompt, after Ray, the trainer and the engines started
    rc, err = _main(
        capsys,
        command,
        *_common(files, tiny_qwen3),
        f'--data.train_files=["{files / "good.jsonl"}"]',
        "--data.max_prompt_length=5",
    )
    _assert_one_line(rc, err, "good.jsonl:1", "max_prompt_length=5")
    import ray

    assert not ray.is_initialized()  # `train` checks prompts while Ray starts, and stops it again


def test_empty_test_file_is_named(files, tiny_qwen3, capsys):
    # before, an empty test file silently meant "no evaluation"
    rc, err = _main(
        capsys, "train", *_common(files, tiny_qwen3), f'--data.test_files=["{files / "empty.jsonl"}"]'
    )
    _assert_one_line(rc, err, "empty.jsonl", "no rows")


def test_test_files_without_test_freq_is_said(files, tiny_qwen3, capsys):
    # a held-out set that is never evaluated was silent; the missing model folder then stops the run
    rc, err = _main(
        capsys,
        "train",
        *_common(files, tiny_qwen3),
        f'--data.test_files=["{files / "good.jsonl"}"]',
        f"--model.path={files / 'nonexistent'}",
    )
    assert rc == 2 and "data.test_files holds 6 held-out prompts, but trainer.test_freq = 0" in err, err
    _, err = _main(
        capsys,
        "train",
        *_common(files, tiny_qwen3),
        f'--data.test_files=["{files / "good.jsonl"}"]',
        f"--model.path={files / 'nonexistent'}",
        "--trainer.test_freq=2",
    )
    assert "test_freq" not in err, err


REWARD_CASES = {  # spec -> words the line must hold
    "missing.py:score": ["missing.py", "not found"],
    "no_function.py:score": ["no_function.py", "no attribute 'score'", "other"],
    "syntax_error.py": ["syntax_error.py", "SyntaxError"],
    "no_such_package.module:score": ["no_such_package.module", "not importable"],
}


@pytest.mark.parametrize("spec", list(REWARD_CASES))
def test_bad_reward_spec_is_one_line(spec, files, tiny_qwen3, capsys, monkeypatch):
    monkeypatch.chdir(files)  # file specs are relative to the current directory
    rc, err = _main(capsys, "train", *_common(files, tiny_qwen3), f'--reward.functions=["{spec}"]')
    _assert_one_line(rc, err, *REWARD_CASES[spec])


MULTI_TURN_CASES = {  # flag -> words the line must hold
    "--rollout.env=missing_env.py:Env": ["rollout.env", "missing_env.py", "not found"],
    "--rollout.env=no_function.py:other": ["rollout.env", "no_function.py", "has no reset or step method"],
    '--rollout.tools=["missing_tool.py:add"]': ["rollout.tools", "missing_tool.py", "not found"],
    '--rollout.tools=["no_function.py:other"]': ["rollout.tools", "other", "cannot be described"],
}


@pytest.mark.parametrize("flag", list(MULTI_TURN_CASES))
def test_bad_environment_or_tool_is_one_line_before_ray(flag, files, tiny_qwen3, capsys, monkeypatch):
    monkeypatch.chdir(files)
    rc, err = _main(capsys, "train", *_common(files, tiny_qwen3), flag)
    _assert_one_line(rc, err, *MULTI_TURN_CASES[flag])


MODEL_CASES = {  # folder -> words the line must hold
    "unknown_arch": ["unknown_arch", "model_type 'foo'", "FooForCausalLM", "not supported"],
    "no_config": ["no_config", "no config.json"],
    "no_tokenizer": ["no_tokenizer", "no tokenizer"],
    "bad_json": ["bad_json/config.json", "not valid JSON"],
    "nonexistent": ["nonexistent", "no such folder"],
}


@pytest.mark.parametrize("command", ["train", "sft", "generate"])
@pytest.mark.parametrize("folder", list(MODEL_CASES))
def test_bad_model_folder_is_one_line(command, folder, files, tiny_qwen3, capsys):
    words = MODEL_CASES[folder]
    if command == "generate" and folder == "unknown_arch":
        words = ["unknown_arch", "no tokenizer"]  # vLLM serves more architectures than the trainer builds
    rc, err = _main(capsys, command, *_common(files, tiny_qwen3), f"--model.path={files / folder}")
    _assert_one_line(rc, err, *words)


@pytest.mark.parametrize("command", ["train", "generate"])
def test_xla_trainer_without_rollout_device_names_the_fix(command, files, tiny_qwen3, capsys):
    # before, the engines inherited `xla` and the engine actor died at creation, blaming the trainer
    rc, err = _main(capsys, command, *_common(files, tiny_qwen3), "--trainer.device=xla")
    _assert_one_line(rc, err, 'trainer.device = "xla"', "rollout.device` is unset", "--rollout.device=cpu")
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize("command", ["generate", "train"])
def test_an_architecture_vllm_does_not_serve_is_named_before_ray(command, files, tiny_qwen3):
    """Before, vLLM's pydantic validation error and its traceback (`train`: from inside the engine actor,
    the trainer having accepted the folder's model_type). A process of its own: importing vLLM (which the
    check does) logs notes to stderr in a fresh process, and the line must stand alone."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_tpu.commands.cli",
            command,
            *_common(files, tiny_qwen3),
            f"--model.path={files / 'unserved_arch'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=files,
    )
    _assert_one_line(
        r.returncode, r.stderr, "unserved_arch/config.json", "['NoSuchForCausalLM']", "not served by vLLM"
    )


def test_resume_from_a_checkpoint_of_another_model_size_is_named_before_ray(
    files, tiny_qwen3, tmp_path, capsys
):
    """Before, the trainer actors started, then DCP's "Size mismatch between saved torch.Size([512, 128])
    and current ..." and a traceback. The checkpoint here holds only what the check reads (the policy's
    weights in DCP, written in this process); the configured model is the `mini` size."""
    import torch.distributed.checkpoint as dcp

    from rl_tpu.config import load_config
    from rl_tpu.controller.checkpoint import check_resume_model, save_checkpoint
    from rl_tpu.tiny_model import make_tiny_model
    from rl_tpu.trainer import model as tmodel

    policy = tmodel.hf_to_titan(tmodel.build_model_spec(tiny_qwen3), tmodel.load_hf_state_dict(tiny_qwen3))
    run_dir = tmp_path / "run"
    step = save_checkpoint(
        run_dir,
        2,
        {"version": 2},
        lambda p: dcp.save({"policy_model": policy}, checkpoint_id=str(p / "dcp"), no_dist=True),
        keep_last=1,
    )
    mini = make_tiny_model(tmp_path / "mini", size="mini")
    capsys.readouterr()  # its progress bar
    args = [f"--logging.run_dir={run_dir}", "--logging.tensorboard=false", "--reward.workers=1"]
    rc, err = _main(capsys, "train", *args, f"--model.path={mini}", "--resume", "auto")
    _assert_one_line(
        rc,
        err,
        f"checkpoint {step} was written for another model (vocab 512, hidden 128, 2 layers)",
        f"model.path = {str(mini)!r} (vocab 512, hidden 256, 4 layers)",
        "tok_embeddings.weight is [512, 128] in the checkpoint, [512, 256] in the model",
    )
    import ray

    assert not ray.is_initialized()
    # the Python API refuses it before Ray too (rl_tpu.controller.loop.train checks what the CLI runs)
    from rl_tpu.controller.checkpoint import CheckpointError
    from rl_tpu.controller.loop import train

    with pytest.raises(CheckpointError, match="was written for another model"):
        train(load_config(None, [*args, f"--model.path={mini}", "--checkpoint.resume=auto"]))
    assert not ray.is_initialized()
    # the model it was written with passes the check
    check_resume_model(load_config(None, [*args, f"--model.path={tiny_qwen3}", "--checkpoint.resume=auto"]))


def test_resume_of_a_lora_checkpoint_checks_rank_and_kind_before_ray(tiny_qwen3, tmp_path):
    """A LoRA run's checkpoint holds only the adapters (the base comes from model.path): resuming it needs
    the same rank over a model whose linears it adapts; a full-model checkpoint does not resume a LoRA run
    nor the reverse. Each is one line before any actor starts."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rl_tpu.config import load_config
    from rl_tpu.controller.checkpoint import CheckpointError, check_resume_model, save_checkpoint
    from rl_tpu.trainer.checkpoint import model_shapes

    base = model_shapes(tiny_qwen3)
    wq = "layers.0.attention.qkv_linear.wq"
    out, inp = base[f"{wq}.weight"]
    adapters = {f"{wq}.lora_a.weight": torch.zeros(4, inp), f"{wq}.lora_b.weight": torch.zeros(out, 4)}
    full = {k: torch.zeros(v) for k, v in base.items()}

    def resume(state: dict, name: str, *args: str) -> None:
        run_dir = tmp_path / name
        save_checkpoint(
            run_dir,
            2,
            {"version": 2},
            lambda p: dcp.save({"policy_model": state}, checkpoint_id=str(p / "dcp"), no_dist=True),
            keep_last=1,
        )
        check_resume_model(
            load_config(
                None,
                [
                    f"--logging.run_dir={run_dir}",
                    f"--model.path={tiny_qwen3}",
                    "--checkpoint.resume=auto",
                    *args,
                ],
            )
        )

    resume(adapters, "lora", "--trainer.lora.rank=4")  # the run that wrote it
    with pytest.raises(CheckpointError, match="its adapters have rank 4, trainer.lora.rank is 8"):
        resume(adapters, "lora8", "--trainer.lora.rank=8")
    with pytest.raises(
        CheckpointError, match="holds LoRA adapters of rank 4: resume with trainer.lora.rank = 4"
    ):
        resume(adapters, "lora0")
    with pytest.raises(CheckpointError, match="holds full-model weights, not LoRA adapters"):
        resume(full, "full", "--trainer.lora.rank=4")
    resume(full, "full0")
    wrong = {f"{wq}.lora_a.weight": torch.zeros(4, inp + 1), f"{wq}.lora_b.weight": torch.zeros(out, 4)}
    with pytest.raises(CheckpointError, match=rf"{wq}.lora_a.weight is \[4, {inp + 1}\] in the checkpoint"):
        resume(wrong, "wrong", "--trainer.lora.rank=4")


def test_verbose_adds_the_traceback(files, tiny_qwen3, capsys):
    rc, err = _main(
        capsys, "train", *_common(files, tiny_qwen3), f"--model.path={files / 'no_config'}", "--verbose"
    )
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("rl-tpu: ")


def test_user_error_is_found_inside_ray_and_trainer_wrappers():
    """Ray re-raises a remote DataError as a RayTaskError that is also a DataError but whose text is the
    remote traceback; the trainer group wraps that again in a TrainerError. The CLI prints the inner one."""
    from ray.exceptions import RayTaskError

    from rl_tpu.trainer.group import TrainerError

    inner = DataError("train.jsonl line 3: missing field `prompt`")
    wrapped = RayTaskError(
        "ready", "Traceback (most recent call last):\n  ...\n", inner
    ).as_instanceof_cause()
    assert isinstance(wrapped, DataError) and "\n" in str(wrapped)
    assert cli.user_error(wrapped) is inner
    assert cli.user_error(TrainerError(0, "ready", wrapped)) is inner
    assert cli.user_error(RuntimeError("our bug")) is None


def test_our_bugs_keep_their_traceback(monkeypatch):
    def broken(cfg):
        raise KeyError("a bug of ours")

    monkeypatch.setattr("rl_tpu.controller.loop.train", broken)
    with pytest.raises(KeyError, match="a bug of ours"):
        cli.main(["train", "--trainer.total_steps=1"])


def test_installed_cli_exits_2_with_one_line(files, tiny_qwen3):
    """The real entry point in its own process: status 2, one line on stderr, nothing on stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_tpu.commands.cli",
            "train",
            *_common(files, tiny_qwen3),
            f'--data.train_files=["{files / "missing_prompt.jsonl"}"]',
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=files,
    )
    _assert_one_line(r.returncode, r.stderr, "missing_prompt.jsonl line 3")
    assert r.stdout == ""
