"""trainer/lora.py and `[trainer.lora]`, one process: the converted config, the first adapters, the forward
under the CPU kernels (the 2-rank trainer is tests/integration/test_lora_trainer.py)."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.config import ConfigError, LoraConfig, load_config
from rl_tpu.trainer import cpu_matmul, lora
from rl_tpu.trainer import model as tmodel


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from rl_tpu.tiny_model import make_tiny_model

    return tmodel.build_model_spec(str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3")))


def test_config_table_override_and_errors(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[trainer.lora]\nrank = 16\ntargets = ["q_proj", "gate_proj"]\n')
    cfg = load_config(toml, ["--trainer.lora.alpha=32"])
    assert cfg.trainer.lora == LoraConfig(rank=16, alpha=32.0, targets=["q_proj", "gate_proj"])
    assert load_config(None, []).trainer.lora.rank == 0
    with pytest.raises(ConfigError, match=r"unknown key `trainer.lora.ranks`"):
        load_config(None, ["--trainer.lora.ranks=4"])
    with pytest.raises(ConfigError, match=r"`trainer.lora` must be a table"):
        load_config(None, ["--trainer.lora=4"])
    with pytest.raises(ConfigError, match="k_proj and v_proj together"):
        load_config(None, ["--trainer.lora.rank=4", '--trainer.lora.targets=["v_proj"]'])
    with pytest.raises(ConfigError, match=r"names \['lm_head'\]"):
        load_config(None, ["--trainer.lora.rank=4", '--trainer.lora.targets=["lm_head"]'])
    with pytest.raises(ConfigError, match="not verified with `trainer.critic = true`"):
        load_config(None, ["--trainer.lora.rank=4", "--trainer.critic=true"])


def test_convert_leaves_the_base_config_and_names_adapters_of_the_targets_only(spec):
    before = repr(spec.config)
    converted = lora.convert(spec.config, LoraConfig(rank=4, targets=["q_proj", "k_proj", "v_proj"]))
    assert repr(spec.config) == before  # the reference and the checkpoint checks keep the base config
    shapes = lora.adapter_shapes(converted)
    dim = spec.config.dim
    assert {n.rsplit(".", 3)[-3] for n in shapes} == {"wq", "wk", "wv"}
    for name, shape in shapes.items():
        assert (shape[0] if ".lora_a." in name else shape[1]) == 4
        assert (shape[1] if ".lora_a." in name else shape[0]) > 0
    assert all(shape[1] == dim for n, shape in shapes.items() if ".lora_a." in n)


def test_first_adapters_are_seeded_and_b_is_zero(spec):
    shapes = lora.adapter_shapes(lora.convert(spec.config, LoraConfig(rank=4)))
    a, b = lora.initial_adapters(shapes, seed=3), lora.initial_adapters(shapes, seed=3)
    assert all(torch.equal(a[n], b[n]) for n in a)
    other = lora.initial_adapters(shapes, seed=4)
    for n, t in a.items():
        if ".lora_b." in n:
            assert bool((t == 0).all())
        else:  # Kaiming-uniform with a = sqrt(5): within 1 / sqrt(fan_in)
            assert 0 < t.abs().max().item() <= t.shape[1] ** -0.5 and not torch.equal(t, other[n])


def test_forward_keeps_the_adapter_path_under_the_cpu_kernels_and_drops_out_in_train_mode(spec):
    torch.manual_seed(0)
    converted = lora.convert(spec.config, LoraConfig(rank=4, alpha=8.0, targets=["o_proj"]))
    layer = lora.lora_linears(converted.build())[0]
    for p in layer.parameters():
        torch.nn.init.normal_(p.data)
    x = torch.randn(3, layer.in_features)
    want = x @ layer.weight.T + 2.0 * (x @ layer.lora_a.weight.T) @ layer.lora_b.weight.T
    cpu_matmul.install(layer, cpu_matmul.ONEDNN)  # what CpuMatmuls does: the adapter path is gone
    with torch.no_grad():
        assert torch.allclose(layer(x), x @ layer.weight.T, atol=1e-4)
        lora.LoraForward(dropout=0.5).convert(layer)
        layer.eval()
        assert torch.allclose(layer(x), want, atol=1e-4)
        layer.train()
        assert not torch.allclose(layer(x), want, atol=1e-4)  # dropout on the adapter's input


def test_rank_shares_of_the_adapters_join_into_peft_state_on_llama(tmp_path):
    """What the adapter sync sends (each trainer rank's row chunks, `peft_rows`) joins on the engine
    (`join_peft_rows`) into exactly `peft_state`: on Llama, whose HF q/k rows are TorchTitan's permuted."""
    from rl_tpu.tiny_model import make_tiny_model

    llama = tmodel.build_model_spec(str(make_tiny_model(tmp_path, "llama")))
    shapes = lora.adapter_shapes(lora.convert(llama.config, LoraConfig(rank=4)))
    g = torch.Generator().manual_seed(0)
    adapters = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    layout = lora.peft_layout(llama, adapters)
    assert any(order is not None for _, _, order in layout)  # the permuted q/k B rows are exercised
    want = lora.peft_state(adapters, layout)
    titan = {  # PEFT name -> the TorchTitan tensor (row order) behind it
        f"{module}.lora_{peft}.weight": adapters[f"{prefix}.lora_{kind}.weight"]
        for prefix, module, _ in layout
        for kind, peft in (("a", "A"), ("b", "B"))
    }
    # plain tensors: whole (TorchTitan's row order), from the first rank only
    first = lora.peft_rows(adapters, layout, first=True)
    other = lora.peft_rows(adapters, layout, first=False)
    assert (other["rows"], other["whole"], other["order"], other["flat"].size) == ([], [], {}, 0)
    whole = lora.join_peft_rows([first, other])
    assert whole.keys() == want.keys() and all(torch.equal(whole[n], want[n]) for n in want)
    # FSDP's row chunks of three ranks (torch.chunk's split, uneven where rows % 3 != 0), as peft_rows
    # packs a rank's DTensor chunks
    shares = []
    for r in range(3):
        chunks = [
            (n, torch.chunk(t, 3)[r] if len(torch.chunk(t, 3)) > r else t[:0]) for n, t in titan.items()
        ]
        shares.append(
            {
                "rows": [(n, tuple(c.shape)) for n, c in chunks],
                "whole": [],
                "order": first["order"] if r == 0 else {},
                "dtype": "torch.float32",
                "flat": torch.cat([c.reshape(-1) for _, c in chunks]).view(torch.uint8).numpy(),
            }
        )
    joined = lora.join_peft_rows(shares)
    assert joined.keys() == want.keys() and all(torch.equal(joined[n], want[n]) for n in want)


def test_attached_engines_on_another_base_are_refused_under_lora(tmp_path):
    """`train(roles=)` after a restart from another model (the demo's SFT → GRPO): full fine-tuning syncs
    the new weights, LoRA would leave the engines on their old base, so it is refused naming both."""
    from rl_tpu.config import ConfigError, load_config
    from rl_tpu.controller.loop import check_attached_base

    base, sft = tmp_path / "base", tmp_path / "sft"
    base.mkdir(), sft.mkdir()
    (tmp_path / "link").symlink_to(base)
    lora = load_config(None, ["--trainer.lora.rank=8"])
    with pytest.raises(ConfigError, match=r"attached engines serve .*base'.*only the adapters are synced"):
        check_attached_base(lora, str(base), str(sft))
    check_attached_base(lora, str(base), str(tmp_path / "link"))  # the same folder by another path
    check_attached_base(load_config(None, []), str(base), str(sft))  # full weights reach the engines
