"""The trainer's Qwen3 as `.venv-xla` builds it (TorchTitan 0.2.0 through `rl_tpu.trainer.titan_compat`), run
by tests/integration/test_devices.py in that environment: `python tests/xla_titan_model.py MODEL_DIR OUT.pt`.

Builds the model the way the trainer does (`build_model_spec`, meta device, `to_empty`, `init_weights`,
weights through the spec's adapter), on the CPU and on `xla:0`, and saves the parameter names, the
logits of fixed token ids on both devices and whether `titan_to_hf(hf_to_titan(hf))` gives back the
checkpoint bit for bit. The test compares them with TorchTitan 0.3.0's model in the main environment.
"""

from __future__ import annotations

import sys

import torch

from rl_tpu.devices import get_device
from rl_tpu.trainer import model as tm
from rl_tpu.trainer import titan_compat


def logits(spec, titan_sd: dict[str, torch.Tensor], device: torch.device, ids: torch.Tensor):
    with torch.device("meta"):
        m = spec.config.build()
    m.to_empty(device=device)
    with torch.no_grad():
        m.init_weights(buffer_device=device)
        for n, p in m.named_parameters():
            p.copy_(titan_sd[n])
        return [n for n, _ in m.named_parameters()], m(ids.to(device)).cpu()


def main(model_dir: str, out: str) -> None:
    xla = get_device("xla")
    xla.init()
    spec = tm.build_model_spec(model_dir)
    hf = tm.load_hf_state_dict(model_dir)
    titan_sd = tm.hf_to_titan(spec, hf)
    back = tm.titan_to_hf(spec, titan_sd)
    ids = torch.randint(4, spec.hf_config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    names, cpu = logits(spec, titan_sd, torch.device("cpu"), ids)
    xla_names, on_xla = logits(spec, titan_sd, xla.local_device(), ids)
    torch.save(
        {
            "torchtitan": titan_compat.torchtitan_version(),
            "compat": not titan_compat.has_common_api(),
            "names": names,
            "xla_names": xla_names,
            "titan_names": sorted(titan_sd),
            "ids": ids,
            "cpu_logits": cpu,
            "xla_logits": on_xla,
            "roundtrip": set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf),
        },
        out,
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
