"""trainer/cpu_matmul.py: linears and the log-prob head's matmuls on oneDNN (or any mix of oneDNN and aten)
give float32 results as close to float64 as aten's, with the same gradients; other dtypes fall back to
aten bit for bit; "auto" picks per (shape, matmul) from timings, agreed over ranks and cached per machine."""

import copy

import pytest
import torch

from rl_tpu.trainer import cpu_matmul as cm
from rl_tpu.trainer.ops import Matmuls, chunked_log_probs

pytestmark = pytest.mark.skipif(not cm.available(), reason="needs a torch build with oneDNN (mkldnn)")

# float32 rounding of a 384-long dot product, relative to the largest |value|: aten's is ~5e-7 here
REL = 2e-6


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def _linear_and_grads(fn, x, w, b, gy):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, b.grad


MIXES = [
    cm.ONEDNN,
    cm.matmuls({"fwd": "aten", "dgrad": "onednn", "wgrad": "aten"}),
    cm.matmuls({"fwd": "onednn", "dgrad": "aten", "wgrad": "onednn"}),
]


@pytest.mark.parametrize("mm", MIXES, ids=["onednn", "mix1", "mix2"])
@pytest.mark.parametrize("shape", [(3, 50, 384), (257, 384)])
def test_linear_values_and_grads_match_float64(shape, mm):
    torch.manual_seed(0)
    x, w, b = (
        torch.randn(*shape, dtype=torch.float64),
        torch.randn(200, 384, dtype=torch.float64),
        torch.randn(200, dtype=torch.float64),
    )
    gy = torch.randn(*shape[:-1], 200, dtype=torch.float64)
    ref = _linear_and_grads(torch.nn.functional.linear, x, w, b, gy)
    f32 = [t.float() for t in (x, w, b, gy)]
    got = _linear_and_grads(lambda x, w, b: cm.linear(x, w, b, mm), *f32)
    aten = _linear_and_grads(torch.nn.functional.linear, *f32)
    for name, g, a, r in zip(("y", "grad x", "grad w", "grad b"), got, aten, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        assert _rel_err(g, r) <= REL, (name, _rel_err(g, r), _rel_err(a, r))


def test_non_contiguous_input_and_no_bias():
    torch.manual_seed(1)
    x = torch.randn(64, 40, dtype=torch.float64).T  # [40, 64], column-major
    w = torch.randn(30, 64, dtype=torch.float64)
    want = x @ w.T
    xf = x.float().requires_grad_()
    wf = w.float().requires_grad_()
    y = cm.linear(xf, wf)
    assert _rel_err(y, want) <= REL
    y.sum().backward()
    assert _rel_err(xf.grad, torch.ones(40, 30, dtype=torch.float64) @ w) <= REL
    assert _rel_err(wf.grad, torch.ones(40, 30, dtype=torch.float64).T @ x) <= REL


def test_other_dtypes_fall_back_to_aten_exactly():
    torch.manual_seed(2)
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(cm.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(cm.onednn_mm_t(x, w), x @ w.T)
    v = torch.randn(16)  # 1-D input: aten's path
    assert torch.equal(cm.linear(v, w.float()), torch.nn.functional.linear(v, w.float()))


def test_install_routes_every_linear_and_keeps_parameters():
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8, bias=False))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8, bias=False))
    ref.load_state_dict(net.state_dict())
    keys = list(net.state_dict())
    calls = []

    def counted(a, b):
        calls.append(1)
        return cm.onednn_mm_t(a, b)

    assert cm.install(net, Matmuls(counted, counted, counted)) == 2
    assert list(net.state_dict()) == keys
    x = torch.randn(5, 16)
    net(x).square().sum().backward()
    assert len(calls) == 2 + 3  # two forwards; backward: grad x and grad w of the last, grad w of the first
    ref(x).square().sum().backward()
    twin = copy.deepcopy(net)  # its forwards use its own weights, not the original's
    with torch.no_grad():
        twin[0].weight.zero_()
    assert not torch.equal(twin(x), net(x))
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_chunked_log_probs_on_onednn_match_float64():
    torch.manual_seed(4)
    h = torch.randn(2, 9, 48, dtype=torch.float64)
    w = torch.randn(13, 48, dtype=torch.float64) * 0.3
    t = torch.randint(0, 13, (2, 9))
    g1, g2 = torch.randn(2, 9, dtype=torch.float64), torch.randn(2, 9, dtype=torch.float64)

    def run(h, w, mm=Matmuls()):
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        lp, ent = chunked_log_probs(h, w, t, 4, mm)  # uneven last chunk
        (lp * g1.to(h.dtype) + ent * g2.to(h.dtype)).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    ref = run(h, w)
    for mm in MIXES:
        got = run(h.float(), w.float(), mm)
        for name, a, r in zip(("log-prob", "entropy", "grad h", "grad w"), got, ref):
            assert a.dtype == torch.float32 and _rel_err(a, r) <= REL, (name, _rel_err(a, r))


def test_install_leaves_all_aten_linears_on_f_linear():
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    kinds = {(16, 32): cm.ATEN, (32, 8): cm.ONEDNN}
    assert cm.install(net, lambda k, n: kinds[(k, n)]) == 1
    assert "forward" not in vars(net[0]) and vars(net[1])["forward"].__func__ is cm._forward


def test_pick_prefers_aten_unless_onednn_wins_by_the_margin():
    times = {
        "4,8/fwd/aten": 1.0,
        "4,8/fwd/onednn": 0.5,  # oneDNN 2x faster
        "4,8/dgrad/aten": 1.0,
        "4,8/dgrad/onednn": 0.97,  # within the margin: torch's default
        "4,8/wgrad/aten": 0.5,
        "4,8/wgrad/onednn": 1.0,
    }
    assert cm.pick(times) == {"4,8": {"fwd": "onednn", "dgrad": "aten", "wgrad": "aten"}}
    assert cm.summary(cm.pick(times)) == "aten 2/3, onednn 1/3"
    assert cm.summary({"4,8": dict.fromkeys(cm.OPS, "aten")}) == "aten"


def test_time_kernels_times_every_shape_matmul_and_kernel():
    got = cm.time_kernels([(8, 16), (16, 8), (8, 16)], reps=1)
    assert set(got) == {f"{s}/{op}/{k}" for s in ("8,16", "16,8") for op in cm.OPS for k in cm.KERNELS}
    assert all(t > 0 for t in got.values())


def test_choose_times_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_TPU_CACHE_DIR", str(tmp_path))
    timed = []
    real = cm.time_kernels
    monkeypatch.setattr(
        cm, "time_kernels", lambda shapes, reps=5: timed.append(sorted(shapes)) or real(shapes, 1)
    )
    first, cached = cm.choose([(8, 16)], threads=1)
    assert not cached and timed == [[(8, 16)]] and set(first["8,16"]) == set(cm.OPS)
    again, cached = cm.choose([(8, 16)], threads=1)
    assert cached and again == first and len(timed) == 1
    both, cached = cm.choose([(8, 16), (16, 8)], threads=1)  # only the new shape is timed
    assert not cached and timed[-1] == [(16, 8)] and both["8,16"] == first["8,16"]
    _, cached = cm.choose([(8, 16)], threads=2)  # another thread count is another machine
    assert not cached and timed[-1] == [(8, 16)]
    _, cached = cm.choose([(8, 16)], threads=1, ranks=2)  # so are ranks timing at once on its cores
    assert not cached and timed[-1] == [(8, 16)] and len(timed) == 4
    (tmp_path / "cpu_matmul.json").write_text("not json")  # a damaged cache is measured again, then mended
    _, cached = cm.choose([(8, 16)], threads=1)
    assert not cached and set(cm.read_cache(cm.machine_key(1))["8,16"]) == set(cm.OPS)


def test_choose_agrees_over_ranks_on_summed_times(tmp_path, monkeypatch):
    """With an all-reduce every rank decides on the same summed times; a shape one rank has cached but
    another has not is timed on both; only the writer writes."""
    monkeypatch.setenv("RL_TPU_CACHE_DIR", str(tmp_path))
    fast_here = {"8,16/fwd/onednn": 1.0, "8,16/fwd/aten": 3.0}  # this rank: oneDNN 3x faster
    monkeypatch.setattr(
        cm,
        "time_kernels",
        lambda shapes, reps=5: {
            f"8,16/{op}/{k}": fast_here.get(f"8,16/{op}/{k}", 1.0) for op in cm.OPS for k in cm.KERNELS
        },
    )
    other_rank = {"8,16/fwd/onednn": 5.0, "8,16/fwd/aten": 1.0}  # the other: aten 5x faster

    def sum_over_ranks(t):
        if t.dtype == torch.float64:  # the times: add the other rank's
            keys = sorted(f"8,16/{op}/{k}" for op in cm.OPS for k in cm.KERNELS)
            return t + torch.tensor([other_rank.get(k, 1.0) for k in keys], dtype=torch.float64)
        return t + 1  # the other rank misses every shape

    table, cached = cm.choose([(8, 16)], threads=1, sum_over_ranks=sum_over_ranks, is_writer=False)
    assert not cached and table["8,16"]["fwd"] == "aten"  # 1 + 5 = 6 s on oneDNN vs 3 + 1 = 4 s on aten
    assert not (tmp_path / "cpu_matmul.json").exists()
