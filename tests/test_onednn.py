"""trainer/onednn.py: linears and the log-prob head's matmuls on oneDNN give float32 results as close to
float64 as aten's, with the same gradients; other dtypes fall back to aten bit for bit."""

import copy

import pytest
import torch

from rl_tpu.trainer import onednn
from rl_tpu.trainer.ops import chunked_log_probs

pytestmark = pytest.mark.skipif(not onednn.available(), reason="needs a torch build with oneDNN (mkldnn)")

# float32 rounding of a 384-long dot product, relative to the largest |value|: aten's is ~5e-7 here
REL = 2e-6


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def _linear_and_grads(fn, x, w, b, gy):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("shape", [(3, 50, 384), (257, 384)])
def test_linear_values_and_grads_match_float64(shape):
    torch.manual_seed(0)
    x, w, b = torch.randn(*shape, dtype=torch.float64), torch.randn(200, 384, dtype=torch.float64), torch.randn(200, dtype=torch.float64)
    gy = torch.randn(*shape[:-1], 200, dtype=torch.float64)
    ref = _linear_and_grads(torch.nn.functional.linear, x, w, b, gy)
    f32 = [t.float() for t in (x, w, b, gy)]
    got = _linear_and_grads(onednn.onednn_linear, *f32)
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
    y = onednn.onednn_linear(xf, wf)
    assert _rel_err(y, want) <= REL
    y.sum().backward()
    assert _rel_err(xf.grad, torch.ones(40, 30, dtype=torch.float64) @ w) <= REL
    assert _rel_err(wf.grad, torch.ones(40, 30, dtype=torch.float64).T @ x) <= REL


def test_other_dtypes_fall_back_to_aten_exactly():
    torch.manual_seed(2)
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(onednn.onednn_linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(onednn.mm_t(x, w), x @ w.T)
    v = torch.randn(16)  # 1-D input: aten's path
    assert torch.equal(onednn.onednn_linear(v, w.float()), torch.nn.functional.linear(v, w.float()))


def test_install_routes_every_linear_and_keeps_parameters():
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8, bias=False))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8, bias=False))
    ref.load_state_dict(net.state_dict())
    keys = list(net.state_dict())
    assert onednn.install(net) == 2
    assert list(net.state_dict()) == keys
    calls = []
    real = onednn._mm_t
    onednn._mm_t = lambda *a: calls.append(1) or real(*a)
    try:
        x = torch.randn(5, 16)
        net(x).square().sum().backward()
    finally:
        onednn._mm_t = real
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

    def run(h, w, mm_t=None):
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        lp, ent = chunked_log_probs(h, w, t, 4, *([mm_t] if mm_t else []))  # uneven last chunk
        (lp * g1.to(h.dtype) + ent * g2.to(h.dtype)).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    ref = run(h, w)
    got = run(h.float(), w.float(), onednn.mm_t)
    for name, a, r in zip(("log-prob", "entropy", "grad h", "grad w"), got, ref):
        assert a.dtype == torch.float32 and _rel_err(a, r) <= REL, (name, _rel_err(a, r))
