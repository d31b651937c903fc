"""A trainer-rank stand-in for the cross-environment weight-sync test (tests/integration/test_role_env.py): a Ray actor
started with `.venv-xla/bin/python` (torch 2.9 + torch_xla 2.9) that holds TorchTitan-named parameters on
`xla:0` and serves them to `WeightSync` as a real `SyncSender` (the same `ws_*` methods as
`TrainerWorker`). It stands in for the TorchTitan model only, which does not build on torch 2.9
(docs/devices.md); everything that moves bytes is the project's own code.
"""

from __future__ import annotations

import torch

from rl_tpu.weight_sync.sender import SyncSender


class XlaStandInTrainer(SyncSender):
    def __init__(self, titan_file: str):
        from safetensors.torch import load_file

        from rl_tpu.devices import get_device

        device = get_device("xla")
        device.init()
        self.local = device.local_device()
        self.params = {n: t.to(self.local) for n, t in load_file(titan_file).items()}
        self._host: dict[str, torch.Tensor] | None = None

    def ws_shards(self) -> dict[str, torch.Tensor]:
        # one device-to-host copy per policy version, not per bucket
        if self._host is None:
            self._host = {n: t.cpu() for n, t in self.params.items()}
        return self._host

    def update(self) -> None:
        """A deterministic change on the device, exact in fp32 (x * 0.5 is a power-of-two scaling, then
        one rounded add), so the CPU can compute the same bits independently."""
        import torch_xla

        self.params = {n: t * 0.5 + 0.25 for n, t in self.params.items()}
        torch_xla.sync()
        self._host = None

    def info(self) -> dict:
        import sys

        import torch_xla

        t = next(iter(self.params.values()))
        return {
            "torch": torch.__version__,
            "torch_xla": torch_xla.__version__,
            "device": str(t.device),
            "python": sys.executable,
        }

    def param_specs(self):
        from rl_tpu.weight_sync.specs import ParamSpec

        return [ParamSpec.from_tensor(n, t) for n, t in self.params.items()]

    def weights_file(self, path: str) -> str:
        """The live weights as a safetensors file (what the driver verifies the engine against)."""
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in self.ws_shards().items()}, path)
        return path
