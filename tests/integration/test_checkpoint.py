"""Checkpoint manifests: a damaged checkpoint is never half-read. Unit tests with a fake trainer writer,
then one run of the real loop that resumes past a truncated trainer shard."""

import json
import logging
import zlib
from pathlib import Path

import pytest

from rl_tpu.controller.checkpoint import (
    CheckpointError,
    check_checkpoint,
    load_state,
    resolve_resume,
    save_checkpoint,
)


def _fake_trainer(folder: Path) -> None:
    """The shape of a 2-rank trainer checkpoint: DCP shards and metadata, a per-rank extra file."""
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (folder / "dcp" / "__1_0.distcp").write_bytes(b"\x01" * 5000)
    (folder / "dcp" / ".metadata").write_bytes(b"meta")
    (folder / "extra_rank0.pt").write_bytes(b"rng state")


def _save(run_dir: Path, *steps: int) -> list[Path]:
    return [save_checkpoint(run_dir, s, {"version": s}, _fake_trainer, keep_last=5) for s in steps]


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="rl_tpu")
    return lambda: [
        r.getMessage() for r in caplog.records if r.name == "rl_tpu" and r.levelno == logging.WARNING
    ]


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path, warnings):
    (folder,) = _save(tmp_path, 2)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["checksum"] == "zlib.crc32"
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in on_disk if f != "manifest.json"]
    assert "state.json" in manifest["files"] and "trainer/dcp/.metadata" in manifest["files"]
    for rel, entry in manifest["files"].items():
        data = (folder / rel).read_bytes()
        assert entry == {"bytes": len(data), "checksum": f"{zlib.crc32(data):08x}"}
    assert check_checkpoint(folder) == []
    assert resolve_resume(tmp_path, "auto") == folder and warnings() == []


def _truncate(f: Path) -> str:
    f.write_bytes(f.read_bytes()[:1234])
    return "1234 bytes, manifest says 10240"


def _delete(f: Path) -> str:
    f.unlink()
    return "missing"


def _flip_a_byte(f: Path) -> str:
    data = bytearray(f.read_bytes())
    data[777] ^= 0x10  # same size: only the checksum can tell
    f.write_bytes(bytes(data))
    return f"zlib.crc32 {zlib.crc32(bytes(data)):08x}, manifest says {zlib.crc32(bytes(range(256)) * 40):08x}"


def test_every_file_reaches_the_disk_before_the_rename(tmp_path, monkeypatch):
    """A `step_*` folder must not exist while its contents are only in the page cache: every file and
    folder of the save is fsynced before the rename publishes it, the checkpoints root after it."""
    import os

    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))
    )
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(b))), real_rename(a, b)))
    (folder,) = _save(tmp_path, 3)
    renamed = events.index(("rename", str(folder)))
    synced_before = {
        Path(p).relative_to(str(folder) + ".tmp").as_posix()
        for kind, p in events[:renamed]
        if kind == "fsync" and p != str(folder) + ".tmp"
    }
    written = {p.relative_to(folder).as_posix() for p in folder.rglob("*")}
    assert written and written <= synced_before, written - synced_before
    assert ("fsync", str(folder) + ".tmp") in events[:renamed]
    assert ("fsync", str(folder.parent)) in events[renamed:]


@pytest.mark.parametrize("damage", [_truncate, _delete, _flip_a_byte])
def test_auto_resume_skips_a_damaged_checkpoint_and_says_what_is_wrong(damage, tmp_path, warnings):
    older, newest = _save(tmp_path, 2, 4)
    what = damage(newest / "trainer" / "dcp" / "__0_0.distcp")
    assert resolve_resume(tmp_path, "auto") == older
    assert warnings() == [
        f"checkpoint {newest} is damaged, skipping it: step_000004/trainer/dcp/__0_0.distcp: {what}"
    ]
    assert load_state(older) == {"version": 2, "step": 2}


def test_auto_resume_reports_a_lost_state_json(tmp_path, warnings):
    older, newest = _save(tmp_path, 2, 4)
    (newest / "state.json").unlink()
    assert resolve_resume(tmp_path, "auto") == older
    assert warnings() == [f"checkpoint {newest} is damaged, skipping it: step_000004/state.json: missing"]


def test_auto_resume_with_every_checkpoint_damaged_starts_from_scratch(tmp_path, warnings):
    folders = _save(tmp_path, 2, 4)
    for f in folders:
        (f / "trainer" / "extra_rank0.pt").write_bytes(b"")
    assert resolve_resume(tmp_path, "auto") is None
    assert warnings() == [
        f"checkpoint {folders[1]} is damaged, skipping it: "
        "step_000004/trainer/extra_rank0.pt: 0 bytes, manifest says 9",
        f"checkpoint {folders[0]} is damaged, skipping it: "
        "step_000002/trainer/extra_rank0.pt: 0 bytes, manifest says 9",
        f"no valid checkpoint in {tmp_path / 'checkpoints'}: starting from scratch",
    ]


def test_a_checkpoint_without_manifest_is_used_with_a_warning(tmp_path, warnings):
    older, newest = _save(tmp_path, 2, 4)
    (newest / "manifest.json").unlink()  # as written before manifests existed
    assert check_checkpoint(newest) is None
    assert resolve_resume(tmp_path, "auto") == newest
    assert warnings() == [
        f"checkpoint {newest} has no manifest.json (written by an older version), so it could "
        "not be checked: using it as is"
    ]


def test_a_damaged_manifest_is_damage(tmp_path, warnings):
    older, newest = _save(tmp_path, 2, 4)
    (newest / "manifest.json").write_text('{"checksum": "zlib.crc32", "fi')
    assert resolve_resume(tmp_path, "auto") == older
    (msg,) = warnings()
    assert msg.startswith(
        f"checkpoint {newest} is damaged, skipping it: step_000004/manifest.json: unreadable ("
    )


def test_many_problems_make_one_line(tmp_path, warnings):
    import shutil

    older, newest = _save(tmp_path, 2, 4)
    shutil.rmtree(newest / "trainer")  # four files gone
    assert resolve_resume(tmp_path, "auto") == older
    (msg,) = warnings()
    assert "\n" not in msg and msg.count(": missing") == 3 and msg.endswith(": missing; and 1 more"), msg


def test_explicit_path_is_validated(tmp_path, warnings):
    older, newest = _save(tmp_path, 2, 4)
    assert resolve_resume(tmp_path, str(older)) == older
    _truncate(newest / "trainer" / "dcp" / "__0_0.distcp")
    with pytest.raises(CheckpointError) as e:
        resolve_resume(tmp_path, str(newest))
    assert str(e.value) == (
        f"checkpoint.resume = {str(newest)!r} is damaged: "
        "step_000004/trainer/dcp/__0_0.distcp: 1234 bytes, manifest says 10240"
    )
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))
    assert warnings() == []


def test_cli_reports_a_damaged_explicit_checkpoint_in_one_line(tmp_path, capsys):
    from rl_tpu.commands.cli import main

    (folder,) = _save(tmp_path, 2)
    (folder / "trainer" / "extra_rank0.pt").unlink()
    rc = main(["train", "--resume", str(folder), f"--logging.run_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        err
        == f"rl-tpu: checkpoint.resume = {str(folder)!r} is damaged: step_000002/trainer/extra_rank0.pt: missing\n"
    )


def test_folders_that_are_not_checkpoints_are_ignored(tmp_path, warnings):
    (older,) = _save(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_000004.bad").mkdir()  # moved aside by a user
    (tmp_path / "checkpoints" / "step_000006.tmp").mkdir()  # a save that died
    assert resolve_resume(tmp_path, "auto") == older and warnings() == []


# ---------------------------------------------------------------------------------------------------
# the real loop (Ray, 2-rank trainer, vLLM-CPU): a truncated trainer shard is caught before it is loaded


def _run_cfg(run_dir: Path, *overrides: str):
    """tests/integration/test_loop.py's tiny run (tiny model, 2 trainer ranks, short completions)."""
    from rl_tpu.config import load_config

    return load_config(
        None,
        [
            f"--logging.run_dir={run_dir}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--trainer.world_size=2",
            "--trainer.lr=1e-2",
            "--trainer.micro_batch_size=64",
            "--rollout.n=8",
            "--rollout.max_tokens=16",
            "--rollout.temperature=1.0",
            "--data.batch_size=8",
            "--data.synthetic_train_size=256",
            "--data.synthetic_test_size=8",
            "--reward.workers=1",
            *overrides,
        ],
    )


def test_real_run_resumes_from_the_previous_checkpoint_past_a_truncated_shard(tmp_path, caplog, loop_ray):
    from rl_tpu.controller.loop import train

    run_dir = tmp_path / "run"
    train(_run_cfg(run_dir, "--trainer.total_steps=2", "--checkpoint.every=1"))
    step1, step2 = run_dir / "checkpoints" / "step_000001", run_dir / "checkpoints" / "step_000002"
    assert check_checkpoint(step1) == [] and check_checkpoint(step2) == []
    shard = max((step2 / "trainer").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)

    caplog.set_level(logging.INFO, logger="rl_tpu")
    out = train(
        _run_cfg(run_dir, "--trainer.total_steps=3", "--checkpoint.every=1", "--checkpoint.resume=auto")
    )
    messages = [r.getMessage() for r in caplog.records if r.name == "rl_tpu"]
    rel = shard.relative_to(step2.parent).as_posix()
    assert (
        f"checkpoint {step2} is damaged, skipping it: {rel}: {size // 2} bytes, manifest says {size}"
        in messages
    )
    assert f"resumed from {step1} at step 1" in messages
    assert out["steps"] == 3
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the first row a run logs carries time/startup: steps 2 and 3 were logged by the resumed run
    assert ["time/startup" in r for r in rows] == [True, True, False]
    assert rows[1]["actor/step"] == 2.0  # the trainer restarted from step 1's optimizer state
    # the damaged step 2 was written again, whole; step 1 was pruned (keep_last = 2)
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_000002", "step_000003"]
    assert check_checkpoint(step2) == [] and load_state(step2)["version"] == 2
