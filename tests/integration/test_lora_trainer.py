"""LoRA on the trainer (`[trainer.lora]`, trainer/lora.py): TorchTitan's LoRA converter on the tiny Qwen3 and
Llama, a 2-rank FSDP2 trainer over gloo, fp32.

- The first policy is the base model bit for bit (B = 0): its log-probs equal a full fine-tuning
  trainer's exactly;
- the optimizer holds the adapters only, a step changes them and leaves every base weight's bytes as they
  were, and the log-probs move (the adapter path survives the CPU kernels' forward swap);
- the trained policy is the merged model W + (alpha / rank) B A: transformers on merged weights gives the
  trainer's log-probs (Llama's q/k row order included);
- `rl-tpu sft` writes the merged folder and the PEFT adapter; `rl-tpu train` refuses LoRA on engines
  where it is unverified (TPU), in one line. The engines' side: test_lora_sync.py and test_lora_loop.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from toy_stack import TOL, hf_logprobs, toy_batch  # tests/: what the real-stack sync tests share
from toy_stack import small_cfg as _cfg

TARGETS = '--trainer.lora.targets=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]'
RANK, ALPHA = 4, 8.0
# every linear on the oneDNN kernel: `cpu_matmul.install` swaps each linear's forward (the adapters' base
# linears too), which is what dropped the adapter path before `LoraForward`
KERNELS = "--trainer.cpu_matmul=onednn"


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, tmp_path_factory) -> str:
    from rl_tpu.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp(f"lora_{request.param}"), request.param))


def _lora_cfg():
    return _cfg(KERNELS, f"--trainer.lora.rank={RANK}", f"--trainer.lora.alpha={ALPHA}", TARGETS)


def _merged(spec, frozen: dict, adapters: dict) -> dict:
    """The base weights with each adapter folded in, W + (alpha / rank) B A, under TorchTitan names."""
    out = dict(frozen)
    for name in adapters:
        if ".lora_a." in name:
            prefix = name.split(".lora_a.")[0]
            a, b = adapters[name], adapters[f"{prefix}.lora_b.weight"]
            out[f"{prefix}.weight"] = frozen[f"{prefix}.weight"] + (b @ a) * (ALPHA / RANK)
    return out


def test_lora_policy_starts_as_the_base_trains_only_adapters_and_is_the_merged_model(
    ray_session, model, tmp_path
):
    from transformers import AutoModelForCausalLM

    from rl_tpu.trainer import TrainerGroup
    from rl_tpu.trainer import model as tmodel

    batch = toy_batch(0, high=200)
    full = TrainerGroup(_cfg(KERNELS), model, world_size=2)
    try:
        base_lp = full.compute_log_probs(batch)
    finally:
        full.shutdown()

    cfg = _lora_cfg()
    g = TrainerGroup(cfg, model, world_size=2)
    try:
        lp0 = g.compute_log_probs(batch)
        assert torch.equal(lp0, base_lp)  # B = 0: the base model, bit for bit
        frozen0, adapters0 = g.policy_tensors(trainable=False), g.policy_tensors(trainable=True)
        layers = {n.split(".")[1] for n in adapters0}
        # per layer: wq, wk, wv, wo, w1, w2, w3, each with lora_a and lora_b
        assert len(layers) == 2 and len(adapters0) == 2 * 7 * 2, sorted(adapters0)
        assert all(n.endswith((".lora_a.weight", ".lora_b.weight")) for n in adapters0)
        assert g.optimizer_parameters() == len(adapters0)  # no optimizer state for the base
        for n, t in adapters0.items():
            assert t.shape[0 if ".lora_a." in n else 1] == RANK
            assert bool((t == 0).all()) == (".lora_b." in n), n  # A drawn, B zero

        step = batch.replace(old_log_probs=lp0)
        g.train_step(step, cfg.algorithm)
        frozen1, adapters1 = g.policy_tensors(trainable=False), g.policy_tensors(trainable=True)
        assert frozen1.keys() == frozen0.keys() and all(torch.equal(frozen0[k], frozen1[k]) for k in frozen0)
        assert all(bool((adapters1[n] != 0).any()) for n in adapters1 if ".lora_b." in n)  # B trained
        lp1 = g.compute_log_probs(batch)
        moved = ((lp1 - lp0) * batch.response_mask).abs().max().item()
        assert moved > 1e-3, moved  # the adapter path is live

        # the exported HF folder is the merged model, and transformers on it computes the trainer's log-probs
        spec = tmodel.build_model_spec(model)
        out = g.export_hf(str(tmp_path / "hf"))
        with safe_open(f"{out}/model.safetensors", "pt") as f:
            exported = {k: f.get_tensor(k) for k in f.keys()}
        want = tmodel.titan_to_hf(spec, _merged(spec, frozen1, adapters1))
        assert exported.keys() == want.keys() and all(torch.equal(exported[k], want[k]) for k in want)
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            ref = hf_logprobs(hf, batch)
        assert ((ref - lp1) * batch.response_mask).abs().max().item() <= TOL * 10

        # the adapters as a PEFT folder: PEFT over the base computes the same (Llama's q/k rows reordered)
        adapter = g.export_adapter(str(tmp_path / "adapter"))
        peft = pytest.importorskip("peft", reason="PEFT comes with the `verl` extra")
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        with torch.no_grad():
            via_peft = hf_logprobs(peft.PeftModel.from_pretrained(base, adapter).eval(), batch)
        assert ((via_peft - ref) * batch.response_mask).abs().max().item() <= TOL

        # nothing syncs the adapters yet: the path that would hand the engines the base refuses
        with pytest.raises(Exception, match="the base model alone is not the policy"):
            g.hf_state_dict()
    finally:
        g.shutdown()


def test_lora_checkpoint_resume_continues_bit_for_bit(ray_session, tmp_path):
    """A LoRA trainer's checkpoint holds the adapters and their AdamW state only (the frozen base comes
    from model.path); it resumes into a new trainer whose next step equals the uninterrupted one's,
    adapter for adapter."""
    from rl_tpu.tiny_model import make_tiny_model
    from rl_tpu.trainer import TrainerGroup
    from rl_tpu.trainer.checkpoint import saved_shapes

    model = str(make_tiny_model(tmp_path / "tiny", "qwen3"))
    cfg = _lora_cfg()
    first, batch = TrainerGroup(cfg, model, world_size=2), toy_batch(1, high=200)
    resumed = None
    try:
        first.train_step(batch.replace(old_log_probs=first.compute_log_probs(batch)), cfg.algorithm)
        first.save_checkpoint(str(tmp_path / "ckpt"))
        saved = saved_shapes(tmp_path / "ckpt")
        adapters = first.policy_tensors(trainable=True)
        assert saved == {k: tuple(t.shape) for k, t in adapters.items()}  # no frozen base weight
        resumed = TrainerGroup(cfg, model, world_size=2)
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        a, b = first.policy_tensors(trainable=True), resumed.policy_tensors(trainable=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        step = toy_batch(2, high=200)
        for g in (first, resumed):
            g.train_step(step.replace(old_log_probs=g.compute_log_probs(step)), cfg.algorithm)
        a2, b2 = first.policy_tensors(trainable=True), resumed.policy_tensors(trainable=True)
        assert any(not torch.equal(a[k], a2[k]) for k in a)  # the step moved the adapters
        assert all(torch.equal(a2[k], b2[k]) for k in a2), [k for k in a2 if not torch.equal(a2[k], b2[k])]
    finally:
        first.shutdown()
        if resumed is not None:
            resumed.shutdown()


def test_train_refuses_lora_on_tpu_engines_in_one_line_before_ray():
    from rl_tpu.config import ConfigError, check_lora_runnable, load_config

    with pytest.raises(ConfigError, match="engines on `tpu`"):
        check_lora_runnable(load_config(None, ["--trainer.lora.rank=8", "--rollout.device=tpu"]))
    check_lora_runnable(load_config(None, ["--trainer.lora.rank=8"]))  # engines on the CPU
    check_lora_runnable(load_config(None, ["--rollout.device=tpu"]))  # rank 0: full fine-tuning


def test_lora_on_moe_attention_trains_adapters_there_and_vllm_cpu_engines_are_refused(ray_session, tmp_path):
    """On an MoE model the adapters go on the attention only (experts and router frozen, unadapted) and
    the first policy is the base; vllm-cpu cannot start a LoRA engine on an MoE model (its MoE layers
    would need Triton), which `rl-tpu train` says in one line before Ray."""
    from rl_tpu.config import ConfigError, check_lora_runnable, load_config
    from rl_tpu.tiny_model import make_tiny_model
    from rl_tpu.trainer import TrainerGroup

    moe = str(make_tiny_model(tmp_path / "moe", "qwen3_moe"))
    lora = ["--trainer.lora.rank=4", f"--model.path={moe}"]
    with pytest.raises(ConfigError, match=r"qwen3_moe, a mixture-of-experts model\) with vllm-cpu engines"):
        check_lora_runnable(load_config(None, lora))
    check_lora_runnable(load_config(None, [*lora, "--rollout.device=cuda"]))  # CUDA vLLM: Triton MoE
    batch = toy_batch(0, high=200)
    base = TrainerGroup(_cfg(), moe, world_size=2)
    want = base.compute_log_probs(batch)
    base.shutdown()
    trainer = TrainerGroup(_cfg("--trainer.lora.rank=4"), moe, world_size=2)
    try:
        adapters = trainer.adapter_state()
        modules = {n.split(".")[-3] for n in adapters}
        assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}, modules
        assert torch.equal(trainer.compute_log_probs(batch), want)  # B = 0: the base model, bit for bit
        trainer.train_step(batch.replace(old_log_probs=want), trainer.cfg.algorithm)
        moved = trainer.adapter_state()
        assert any(not torch.equal(moved[n], adapters[n]) for n in adapters if n.endswith("lora_B.weight"))
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """`rl-tpu sft` with LoRA from the command line (its own Ray), 2 steps on the tiny Qwen3."""
    import os
    import subprocess
    import sys

    run = tmp_path_factory.mktemp("lora_sft") / "run"
    r = subprocess.run(
        [sys.executable, "-m", "rl_tpu.commands.cli", "sft", "examples/tiny_cpu.toml"]
        + ["--trainer.lora.rank=8", "--trainer.lora.alpha=16", "--trainer.lr=1e-2", "--trainer.total_steps=2"]
        + ["--data.batch_size=4", f"--logging.run_dir={run}", "--logging.tensorboard=false"],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_sft_with_lora_writes_the_merged_model_and_a_peft_adapter(sft_run):
    """RUN/hf is the base with the adapters merged in, RUN/adapter the PEFT folder; PEFT over the base
    folder and transformers on RUN/hf give the same logits."""
    import json

    from transformers import AutoModelForCausalLM

    config = json.loads((sft_run / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    assert config["base_model_name_or_path"] == str(sft_run / "model")
    peft = pytest.importorskip("peft", reason="PEFT comes with the `verl` extra")
    ids = torch.tensor([[1, 17, 42, 99, 7, 5, 6]])
    base = AutoModelForCausalLM.from_pretrained(sft_run / "model", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(sft_run / "hf", dtype=torch.float32)
    with torch.no_grad():
        before = base(ids).logits
        via_peft = peft.PeftModel.from_pretrained(base, sft_run / "adapter").eval()(ids).logits
        after = merged(ids).logits
    assert (after - before).abs().max().item() > 1e-3  # two steps at lr 1e-2 moved the adapters
    assert (via_peft - after).abs().max().item() <= 1e-4


def test_generate_serves_the_adapter_over_the_base_with_vllm_lora(sft_run):
    """`rl-tpu generate --lora RUN/adapter` (vLLM's LoRA over the base folder) samples what the merged
    folder samples, with its log-probs; the base alone differs. A folder that is no adapter is one line."""
    from rl_tpu.config import load_config
    from rl_tpu.rollout import generate_text

    cfg = load_config(None, ["--rollout.temperature=0", "--rollout.max_tokens=6", "--rollout.kv_cache_gb=1"])
    prompts = ["What is 3+4?", "Name a color."]
    served = generate_text(str(sft_run / "model"), prompts, cfg, lora=str(sft_run / "adapter"))
    merged = generate_text(str(sft_run / "hf"), prompts, cfg)
    base = generate_text(str(sft_run / "model"), prompts, cfg)
    for s, m in zip(served, merged):
        assert s.response_ids == m.response_ids
        assert max(abs(a - b) for a, b in zip(s.logprobs, m.logprobs)) <= 1e-4, (s.logprobs, m.logprobs)
    gap = max(abs(s.logprobs[0] - b.logprobs[0]) for s, b in zip(served, base))
    assert [s.response_ids for s in served] != [b.response_ids for b in base] or gap > 1e-3

    from rl_tpu.config import ConfigError
    from rl_tpu.rollout.engine import read_adapter

    with pytest.raises(ConfigError, match="not a PEFT adapter folder"):
        read_adapter(str(sft_run / "hf"))
