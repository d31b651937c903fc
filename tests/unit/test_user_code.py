"""Loading the user's code on the driver (rl_tpu/user_code.py): an import that blocks is named within the
timeout instead of holding `rl-tpu train` before it starts; other failures pass through unchanged."""

from __future__ import annotations

import time

import pytest

from rl_tpu.rollout import multi_turn, tools
from rl_tpu.user_code import SpecError, load_callable


def test_an_import_that_blocks_is_named_within_the_timeout(tmp_path):
    slow = tmp_path / "slow_tool.py"
    slow.write_text("import time\ntime.sleep(60)\n\ndef lookup(x: int) -> int:\n    return x\n")
    t0 = time.monotonic()
    with pytest.raises(SpecError, match=r"rollout.tools .*slow_tool.py:lookup.*did not finish within 1 s"):
        load_callable(f"{slow}:lookup", "rollout.tools", timeout_s=1.0)
    assert time.monotonic() - t0 < 10


def test_the_driver_loads_tools_and_environments_under_the_timeout(tmp_path, monkeypatch):
    slow = tmp_path / "slow_env.py"
    slow.write_text(
        "import time\ntime.sleep(60)\n\nclass Env:\n    def reset(self): ...\n    def step(self): ...\n"
    )
    monkeypatch.setattr(tools, "IMPORT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(multi_turn, "IMPORT_TIMEOUT_S", 0.5)
    with pytest.raises(tools.ToolError, match="did not finish within"):
        tools.load_tools([f"{slow}:Env"])
    with pytest.raises(multi_turn.EnvError, match="did not finish within"):
        multi_turn.load_env(f"{slow}:Env")


def test_errors_and_values_come_back_through_the_timed_import(tmp_path):
    ok = tmp_path / "ok_tool.py"
    ok.write_text("def double(x: int) -> int:\n    return 2 * x\n")
    assert load_callable(f"{ok}:double", timeout_s=30)(4) == 8
    broken = tmp_path / "broken_tool.py"
    broken.write_text("raise RuntimeError('no config file')\n")
    with pytest.raises(SpecError, match="raised RuntimeError: no config file"):
        load_callable(f"{broken}:f", timeout_s=30)
    with pytest.raises(SpecError, match="has no attribute 'triple'"):
        load_callable(f"{ok}:triple", timeout_s=30)
