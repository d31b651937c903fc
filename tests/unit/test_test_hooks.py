"""The engines' test-only fault hook (`rl_tpu.fault_hooks.fault_hook`, RL_TPU_TEST_HOOKS) acts only in a
folder of this user's that no one else can write, and follows no link: pointed at a shared folder it
would let another user make engines sleep or write through a link of theirs."""

from __future__ import annotations

import json
import os

import pytest

from rl_tpu import fault_hooks


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    folder = tmp_path / "hooks"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(fault_hooks, "_TEST_HOOKS", str(folder))
    return folder


def test_a_matching_hook_fires_once(hooks):
    (hooks / "sync.json").write_text(json.dumps({"engine": 1, "version": 2, "seconds": 0}))
    fault_hooks.fault_hook("sync", 0, 2)  # another engine: nothing happens
    assert (hooks / "sync.json").exists() and not (hooks / "sync.pid").exists()
    fault_hooks.fault_hook("sync", 1, 2)
    assert (hooks / "sync.fired").exists() and (hooks / "sync.pid").read_text() == str(os.getpid())
    fault_hooks.fault_hook("sync", 1, 2)  # once: the file was renamed


def test_an_or_later_hook_fires_once_at_the_first_version_from_its_own(hooks):
    (hooks / "generate.json").write_text(
        json.dumps({"engine": 1, "version": 1, "seconds": 0, "or_later": True})
    )
    fault_hooks.fault_hook("generate", 1, 0)  # before its version: nothing happens
    assert (hooks / "generate.json").exists()
    fault_hooks.fault_hook("generate", 1, 3)  # version 1 never came to engine 1: 3 is later
    assert (hooks / "generate.fired").exists() and not (hooks / "generate.json").exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_folder_others_can_write_is_refused(hooks, mode):
    hooks.chmod(mode)
    with pytest.raises(RuntimeError, match="writable by no one else"):
        fault_hooks.fault_hook("sync", 0, 0)


def test_a_linked_folder_is_refused(hooks, tmp_path, monkeypatch):
    link = tmp_path / "link"
    link.symlink_to(hooks)
    monkeypatch.setattr(fault_hooks, "_TEST_HOOKS", str(link))
    with pytest.raises(RuntimeError, match="not a link"):
        fault_hooks.fault_hook("sync", 0, 0)


def test_no_hook_file_is_followed_through_a_link(hooks, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    spec = tmp_path / "elsewhere.json"
    spec.write_text(json.dumps({"engine": 0, "version": 0, "seconds": 0}))
    (hooks / "sync.json").symlink_to(spec)
    with pytest.raises(OSError):
        fault_hooks.fault_hook("sync", 0, 0)
    (hooks / "sync.json").unlink()
    (hooks / "sync.json").write_text(spec.read_text())
    (hooks / "sync.pid").symlink_to(victim)  # the pid file: written through no link
    with pytest.raises(OSError):
        fault_hooks.fault_hook("sync", 0, 0)
    assert victim.read_text() == "keep me"
