"""`EngineRanks` is the one caller of vLLM's `collective_rpc`, which calls our worker extension's methods by
name: every name it sends must be a method of `WorkerExtension` (a typo or a rename would otherwise fail
only inside a running engine), and every `rl_*` method of the extension must have its call here."""

import inspect

import pytest

from rl_tpu.rollout.worker_extension import WorkerExtension
from rl_tpu.weight_sync.receiver import EngineRanks


class RecordingEngine:
    """Stands in for vLLM's `LLM`: records each `collective_rpc` and answers for two TP ranks."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append((method, args))
        return [None, None]


def _public_methods(cls) -> list[str]:
    return [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]


def _sent_names() -> dict[str, tuple[str, tuple]]:
    """Each EngineRanks method, called with placeholder arguments -> the (name, args) it sent."""
    sent = {}
    for name in _public_methods(EngineRanks):
        engine = RecordingEngine()
        method = getattr(EngineRanks(engine), name)
        params = inspect.signature(method).parameters
        assert method(*range(len(params))) == [None, None]  # one answer per rank, passed back
        assert len(engine.calls) == 1, name
        sent[name] = engine.calls[0]
    return sent


def test_every_name_engine_ranks_sends_is_a_worker_extension_method_taking_its_arguments():
    sent = _sent_names()
    assert len(sent) >= 20
    for name, (rpc, args) in sent.items():
        target = getattr(WorkerExtension, rpc, None)
        assert callable(target), f"EngineRanks.{name} calls {rpc!r}, which WorkerExtension does not define"
        inspect.signature(target).bind(None, *args)  # self + what was sent: raises TypeError if it cannot


def test_every_rl_method_of_the_worker_extension_is_called_from_engine_ranks():
    called = {rpc for rpc, _ in _sent_names().values()}
    defined = {n for n in _public_methods(WorkerExtension) if n.startswith("rl_")}
    assert defined - called == set()


def test_the_check_catches_a_misnamed_call(monkeypatch):
    monkeypatch.setattr(EngineRanks, "close", lambda self: self._all("rl_ws_clsoe"))
    with pytest.raises(AssertionError, match="rl_ws_clsoe"):
        test_every_name_engine_ranks_sends_is_a_worker_extension_method_taking_its_arguments()
