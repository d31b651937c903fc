"""Kernel flags (#46): which attention each device gets (rl_tpu/devices/kernels.py, the devices table's
defaults, the fallback where a kernel is missing, the config errors), and FlexAttention's masks
(`trainer.attention = "flex"`) against SDPA's on the real tiny Qwen3, in-process on CPU: the same
log-probs and entropies for padded rows and for packed shared-prompt rows (fp32). FlexAttention has no
backward on CPU, so its gradients are not checked here; the mask is what this trainer adds to it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_tpu.config import ConfigError, load_config
from rl_tpu.devices import DEVICES
from rl_tpu.devices.kernels import attention_missing, cpu_matmul, logprob_head, resolve_attention
from rl_tpu.types import TrainBatch


def test_attention_defaults_per_device_and_fallback():
    cpu, cuda, tpu, xla = (DEVICES[n] for n in ("cpu", "cuda", "tpu", "xla"))
    assert resolve_attention("auto", cpu, has_triton=True) == ("sdpa", "cpu's default")
    assert resolve_attention("auto", tpu, has_triton=False) == ("sdpa", "tpu's default")
    assert resolve_attention("auto", cuda, has_triton=True) == ("flex", "cuda's default")
    # the default's kernel missing: "auto" falls back and says why
    kernel, why = resolve_attention("auto", cuda, has_triton=False)
    assert kernel == "sdpa" and why.startswith("cuda's default flex falls back") and "triton" in why
    # named explicitly where it cannot train: an error naming the key and the reason
    for device, triton in ((cpu, True), (xla, True), (cuda, False)):
        with pytest.raises(ValueError, match=r"trainer.attention = 'flex': .*; use 'sdpa' or 'auto'"):
            resolve_attention("flex", device, has_triton=triton)
    assert "no backward on cpu" in attention_missing("flex", cpu, True)
    assert resolve_attention("sdpa", cuda, has_triton=True) == ("sdpa", "trainer.attention")
    assert resolve_attention("flex", cuda, has_triton=True) == ("flex", "trainer.attention")
    # what doctor reports for the other kernels
    assert logprob_head(cuda, onednn=True) == "chunked log-softmax (cuda matmuls)"
    assert logprob_head(cpu, onednn=True) == "chunked log-softmax (cpu_matmul's kernels)"
    assert logprob_head(cpu, onednn=True, kind="full") == "full log-softmax (cpu matmul)"
    assert cpu_matmul(cpu, onednn=False) == "aten (no oneDNN linear in this torch)"
    assert cpu_matmul(cpu, onednn=True).startswith("MKL or oneDNN per shape")
    assert cpu_matmul(tpu, onednn=True) == "aten (CPU float32 only)"


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["--trainer.attention=flex"], 'trainer.attention = "flex"` on trainer.device = "cpu"'),
        (["--trainer.attention=varlen"], "trainer.attention"),
        (["--trainer.activation_checkpoint=some"], "trainer.activation_checkpoint"),
        (["--trainer.activation_offload=true"], "computes in host memory"),
        (
            ["--trainer.activation_offload=true", "--trainer.device=cuda"],
            "only inside its graph trainer",
        ),
        (
            ["--trainer.activation_checkpoint=full", "--trainer.fsdp=simple", "--trainer.mode=compile"],
            "trainer.activation_checkpoint",
        ),
    ],
)
def test_memory_and_kernel_keys_refused_with_one_line_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg
    # each half of the refused combination is fine alone
    load_config(None, ["--trainer.activation_checkpoint=full", "--trainer.fsdp=simple"])
    load_config(None, ["--trainer.activation_checkpoint=selective", "--trainer.mode=compile"])


def _grpo_batch() -> TrainBatch:
    """3 prompts x 4 samples, prompts 3-11 tokens, responses 2-9: packed rows with every kind of slot."""
    g = torch.Generator().manual_seed(0)
    P, R = [], []
    for _ in range(3):
        p = torch.randint(5, 500, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            P.append(p)
            R.append(
                torch.randint(5, 500, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
            )
    return TrainBatch.from_sequences(P, R, pad_id=3, advantages=[1.0] * len(P))


def test_flex_attention_masks_give_sdpa_log_probs(tiny_qwen3):
    from rl_tpu.trainer import model as tmodel
    from rl_tpu.trainer.converters import install_logprob_head
    from rl_tpu.trainer.forward import Forward

    tc = load_config(None, ["--trainer.logprob_chunk_size=100"]).trainer
    hf_sd = tmodel.load_hf_state_dict(tiny_qwen3)
    batch = _grpo_batch()
    got = {}
    for attention in ("sdpa", "flex"):
        spec = tmodel.build_model_spec(tiny_qwen3, attention=attention)
        with torch.device("meta"):
            model = spec.config.build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        model.load_state_dict(tmodel.hf_to_titan(spec, hf_sd))
        install_logprob_head(model.lm_head, tc.logprob_chunk_size)
        fwd = Forward.for_model(spec, DEVICES["cpu"], tc, 0, 1)
        assert fwd.flex == (attention == "flex")
        for share in (True, False):  # one packed row; one right-padded row per sequence
            with torch.no_grad():
                got[attention, share] = fwd.policy(model, batch, dataclasses.replace(tc, share_prompts=share))
    mask = batch.response_mask.bool()
    for share in (True, False):
        for want, out in zip(got["sdpa", share], got["flex", share], strict=True):
            assert want[mask].abs().min() > 0
            assert (out - want)[mask].abs().max() <= 1e-5 * want[mask].abs().max(), (share, out - want)
    # the packed row is not the padded rows' computation done twice: a wrong mask would show
    assert (got["flex", True][0] - got["flex", False][0])[mask].abs().max() <= 1e-4
