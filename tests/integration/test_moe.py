"""Qwen3-MoE (#43): the tiny MoE model, TorchTitan's build of it, its HF parity and the `moe/*` metrics.

vLLM serving it (greedy tokens equal to transformers') is `test_vllm_and_transformers_agree_greedy[qwen3_moe]`
in tests/integration/test_tiny_model.py; training it and syncing its experts into vLLM is
tests/integration/test_moe_sync.py.
"""

import json
import pickle
import subprocess
import sys

import pytest
import torch

from rl_tpu.errors import ModelError


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "m"
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.commands.cli",
        "make-tiny-model",
        str(out),
        "--arch",
        "qwen3_moe",
        "--seed",
        "1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def test_moe_tiny_model_config(moe_path, tmp_path):
    from rl_tpu.tiny_model import make_tiny_model

    hf = json.loads((moe_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["model_type"] == "qwen3_moe"
    # transformers 5 writes num_experts under its attribute-map name
    assert hf.get("num_experts", hf.get("num_local_experts")) == 4
    assert (hf["num_experts_per_tok"], hf["moe_intermediate_size"], hf["norm_topk_prob"]) == (2, 192, True)
    assert (hf["decoder_sparse_step"], hf["mlp_only_layers"]) == (1, [])
    again = make_tiny_model(tmp_path / "again", "qwen3_moe", "tiny", seed=1)
    assert (again / "model.safetensors").read_bytes() == (moe_path / "model.safetensors").read_bytes()
    dense = make_tiny_model(tmp_path / "dense", "qwen3", "tiny", seed=1)
    assert (dense / "tokenizer.json").read_bytes() == (moe_path / "tokenizer.json").read_bytes()


def test_moe_driver_check_accepts_and_checks_moe_keys(moe_path):
    from rl_tpu.hf_config import check_hf_config

    hf = json.loads((moe_path / "config.json").read_text())
    check_hf_config(hf, "config.json")
    with pytest.raises(ModelError, match="num_experts_per_tok"):
        check_hf_config({**hf, "num_experts_per_tok": 9}, "config.json")
    with pytest.raises(ModelError, match="shared experts"):
        check_hf_config({**hf, "shared_expert_intermediate_size": 64}, "config.json")


def test_moe_build_model_spec(moe_path):
    from torchtitan.models.common.moe import MoE

    from rl_tpu.trainer.model import build_model_spec

    spec = build_model_spec(moe_path)
    assert spec.arch == "qwen3_moe"
    moe = spec.config.layers[0].moe
    assert moe.num_experts == 4 and moe.load_balance_coeff is None
    assert (moe.router.top_k, moe.router.score_func, moe.router.route_norm) == (2, "softmax", True)
    assert moe.routed_experts.inner_experts.hidden_dim == 192
    model = spec.config.build()
    assert isinstance(model.layers["0"].moe, MoE)
    # the config pickles by name (Ray ships configs), also where the lazily built class is not built yet
    import rl_tpu.trainer.model as tm

    blob = pickle.dumps(spec.config)
    del tm.ParamDtypeGroupedExperts
    experts = pickle.loads(blob).build().layers["1"].moe.routed_experts.inner_experts
    assert type(experts).__name__ == "ParamDtypeGroupedExperts"


def test_moe_hf_titan_state_dict_round_trip(moe_path):
    from rl_tpu.trainer.model import build_model_spec, hf_to_titan, load_hf_state_dict, titan_to_hf

    spec = build_model_spec(moe_path)
    hf_sd = load_hf_state_dict(moe_path)
    titan_sd = hf_to_titan(spec, hf_sd)
    w1 = titan_sd["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    assert w1.shape == (4, 192, 128)
    assert torch.equal(w1[2], hf_sd["model.layers.0.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(titan_sd["layers.1.moe.router.gate.weight"], hf_sd["model.layers.1.mlp.gate.weight"])
    model = spec.config.build()
    assert set(titan_sd) == set(model.state_dict())  # no expert bias buffer: HF has none
    back = titan_to_hf(spec, titan_sd)
    assert set(back) == set(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def _titan_model(path):
    from rl_tpu.trainer.model import build_model_spec, hf_to_titan, load_hf_state_dict

    spec = build_model_spec(path)
    model = spec.config.build()
    model.load_state_dict(hf_to_titan(spec, load_hf_state_dict(path)), strict=True)
    return model.eval()


def test_moe_titan_logits_equal_hf(moe_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    titan = _titan_model(moe_path)
    tokens = torch.randint(4, 500, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = titan(tokens)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ref.abs().max() > 0.1  # the logits are not trivially small
    # why the experts are ParamDtypeGroupedExperts: TorchTitan's own GroupedExperts computes in bf16
    from torchtitan.models.common.moe import GroupedExperts

    for block in titan.layers.values():
        experts = block.moe.routed_experts.inner_experts
        experts.forward = GroupedExperts.forward.__get__(experts)
    with torch.no_grad():
        assert (titan(tokens) - ref).abs().max() > 1e-4


def test_moe_titan_backward_runs_in_fp32(moe_path):
    titan = _titan_model(moe_path).train()
    tokens = torch.randint(4, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = titan(tokens)
    assert logits.dtype == torch.float32
    for block in titan.layers.values():  # every expert got tokens: the parity above covers them all
        assert (block.moe.tokens_per_expert_E > 0).all()
    logits.float().logsumexp(-1).mean().backward()
    grad = titan.layers["0"].moe.routed_experts.inner_experts.w1_EFD.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0
    assert titan.layers["0"].moe.router.gate.weight.grad.abs().sum() > 0


def test_moe_stats_equal_hf_load_balancing_loss(moe_path):
    """`moe/aux_loss` is HF's Switch load-balancing loss (per layer, then the mean over layers) and
    `moe/expert_load_max` the busiest expert's share over the mean, on the same tokens; eval forwards
    count nothing."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from rl_tpu.trainer.metrics import MoeStats

    titan = _titan_model(moe_path)
    stats = MoeStats(titan)
    assert len(stats.routers) == 2
    tokens = torch.randint(4, 500, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        titan(tokens)  # eval mode: not counted
        assert stats.read(torch.device("cpu")) == {}
        titan.train()
        titan(tokens[:2])
        titan(tokens[2:])  # two forwards add up
        got = stats.read(torch.device("cpu"))
        hf = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
        logits = hf(tokens, output_router_logits=True).router_logits  # per layer [B * L, E]
    per_layer = [float(load_balancing_loss_func((g,), 4, 2)) for g in logits]
    assert got["moe/aux_loss"] == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-6)
    loads = []
    for g in logits:
        counts = torch.bincount(g.topk(2, dim=-1).indices.reshape(-1), minlength=4).double()
        loads.append(float(counts.max() / counts.mean()))
    assert got["moe/expert_load_max"] == pytest.approx(max(loads), rel=1e-9)
    assert 1.0 <= got["moe/expert_load_max"] <= 2.0  # E / k = 2: every token on the same two experts
    assert stats.read(torch.device("cpu")) == {}  # read resets


def test_plan_owners_match_dtensor_shards_of_ep_times_fsdp_experts():
    """Experts under EP 2 x FSDP 2 (FSDP2's `_StridedShard(0)` on `efsdp`, `Shard(0)` on `ep`, as
    TorchTitan lays them out on 4 ranks): the rows `plan.owners` reads from each rank are the rows
    DTensor puts in that rank's local shard (each rank computed with a fake process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rl_tpu.weight_sync.plan import owners
    from rl_tpu.weight_sync.specs import ParamSpec

    t = torch.arange(8 * 3 * 2, dtype=torch.float32).reshape(8, 3, 2)  # [experts, out, in]
    rows = t.reshape(-1, 2)
    seen = []
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
            d = distribute_tensor(t, mesh, [_StridedShard(0, split_factor=2), Shard(0)], src_data_rank=None)
            spec = ParamSpec.from_tensor("w", d)
            got = {r: (lo, hi) for r, lo, hi in owners(spec)}
            lo, hi = got[rank]
            assert torch.equal(rows[lo:hi], d.to_local().reshape(-1, 2)), (rank, spec.placements)
            seen.append((lo, hi))
        finally:
            dist.destroy_process_group()
    # EP splits the experts first: ranks 0 and 2 (ep 0) hold experts 0-3, ranks 1 and 3 experts 4-7
    assert seen == [(0, 6), (12, 18), (6, 12), (18, 24)]
    bad = ParamSpec.from_tensor("w", t)
    bad = ParamSpec(**{**bad.__dict__, "mesh_shape": (2, 2), "placements": ("_S(0, 4)", "S(0)")})
    with pytest.raises(NotImplementedError, match="product must be sf"):
        owners(bad)
