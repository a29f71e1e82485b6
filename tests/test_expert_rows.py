"""The row-wise steps of the routed-experts op (hidup/rules/expert_rows.py): each step's torch form
equals its definition on the CPU in float64, forward and backward, and skips the rows past the rank's
count; on a CUDA device the Triton kernels (hidup/rules/expert_rows_cuda.py) equal the torch form on
the rank's rows, in float32 to float32 rounding and in bfloat16 to bfloat16's, leave the tail
unwritten (or zero when asked), and the whole op's output and gradients match the CPU's.

The GPU tests run where a GPU is (the device tool: ``python -m pytest -q tests/test_expert_rows.py``)."""

from __future__ import annotations

import pytest
import torch

from hidup.rules import expert_rows as R
from hidup.rules.experts import routed_experts_math
from hidup.rules.grouped import ACTIVATIONS, route

D64 = torch.float64
CUDA = torch.cuda.is_available()


def _routing(tokens=12, k=3, experts=8, offset=2, local=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices
    return idx, route(idx, offset, local)


def test_gather_and_its_backward_follow_the_definition():
    idx, rows = _routing()
    tokens, k = idx.shape
    count = rows.count
    n = int(count)
    x = torch.randn(tokens, 5, dtype=D64, requires_grad=True)
    xs = R.gather_rows(x, rows.order, rows.inverse, count, k, False)
    assert torch.equal(xs[:n], x.detach()[rows.order[:n] // k]) and not xs[n:].any()
    g = torch.randn_like(xs)
    (grad,) = torch.autograd.grad(xs, x, g)
    want = torch.zeros_like(x).index_add_(0, rows.order[:n] // k, g[:n])
    torch.testing.assert_close(grad, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_activation_and_its_backward_equal_autograd_on_the_own_rows(act):
    idx, rows = _routing(seed=1)
    count = rows.count
    n = int(count)
    gu = torch.randn(idx.numel(), 8, dtype=D64, requires_grad=True)
    out = R.act_rows(gu, count, act, True)
    gate, up = gu[:n].chunk(2, dim=-1)
    want = ACTIVATIONS[act](gate) * up
    torch.testing.assert_close(out[:n], want)
    assert not out[n:].any()
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, gu, g)
    (want_grad,) = torch.autograd.grad(want, gu, g[:n])
    torch.testing.assert_close(grad, want_grad, rtol=1e-14, atol=1e-14)


def test_combine_and_its_backward_follow_the_definition():
    idx, rows = _routing(seed=2)
    tokens, k = idx.shape
    count = rows.count
    h = torch.randn(idx.numel(), 6, dtype=D64, requires_grad=True)
    w = torch.rand(tokens, k, dtype=D64, requires_grad=True)
    y = R.combine_rows(h, w, rows.order, rows.inverse, count, k, D64)
    valid = (rows.inverse < count).view(tokens, k, 1)
    want = (torch.where(valid, h[rows.inverse].view(tokens, k, -1), 0) * w.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(y, want, rtol=1e-14, atol=1e-14)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (h, w), g)
    expected = torch.autograd.grad(want, (h, w), g)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------------------------------------- GPU
STEPS = [f"{step}{part}" for step in ("gather_rows", "act_rows", "combine_rows") for part in ("", "_backward")]


def test_every_step_has_its_cuda_kernel_registered():
    """On CUDA each step dispatches to its Triton kernel (torch.library's per-device kernel), checked
    here without a GPU; the kernels themselves are checked below where a GPU is."""
    for name in STEPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"hidup::{name}", "CUDA"), name


def _case(dtype, tokens=64, hidden=256, ffn=1536, experts=8, k=2, offset=2, local=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gu = torch.randn(tokens * k, 2 * ffn, generator=gen).to(dtype)
    h = torch.randn(tokens * k, hidden, generator=gen).to(dtype)
    w = torch.rand(tokens, k, generator=gen)
    return idx, route(idx, offset, local), x, gu, h, w


def _steps(rows, x, gu, h, w, k, act, zero_tail):
    """Every step's outputs and gradients on the rank's own rows (the tails are compared apart)."""
    count = rows.count
    n = int(count)
    x, gu, h, w = (t.detach().requires_grad_() for t in (x, gu, h, w))
    xs = R.gather_rows(x, rows.order, rows.inverse, count, k, zero_tail)
    a = R.act_rows(gu, count, act, zero_tail)
    y = R.combine_rows(h, w, rows.order, rows.inverse, count, k, torch.float32)
    gen = torch.Generator().manual_seed(9)
    gx, ga, gy = (torch.randn(t.shape, generator=gen).to(t.device, t.dtype) for t in (xs, a, y))
    torch.autograd.backward([xs[:n], a[:n], y], [gx[:n], ga[:n], gy])
    return [xs[:n], a[:n], y, x.grad, gu.grad[:n], h.grad[:n], w.grad], (xs[n:], a[n:])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (Triton kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dims", [(64, 256, 1536), (50, 200, 300)])  # whole tiles; partial tiles and chunks
def test_triton_kernels_equal_the_torch_form(dtype, act, dims):
    tokens, hidden, ffn = dims
    idx, rows, x, gu, h, w = _case(dtype, tokens, hidden, ffn)
    k = idx.shape[1]
    want, _ = _steps(rows, x, gu, h, w, k, act, True)
    on = [t.cuda() for t in (rows.order, rows.token, rows.valid, rows.offsets, rows.inverse)]
    got, tails = _steps(type(rows)(*on), x.cuda(), gu.cuda(), h.cuda(), w.cuda(), k, act, True)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    names = ["xs", "act", "y", "grad x", "grad gu", "grad h", "grad w"]
    for a, b, name in zip(got, want, names):
        torch.testing.assert_close(a.cpu().float(), b.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert all(not t.any() for t in tails), "a zero tail was asked for"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (Triton kernels)")
def test_whole_op_on_cuda_equals_the_cpu():
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, ffn, experts, k = 96, 128, 256, 8, 2
    idx = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices
    leaves = [
        torch.randn(tokens, hidden, generator=gen),
        torch.rand(tokens, k, generator=gen),
        torch.randn(2, 2 * ffn, hidden, generator=gen) / hidden**0.5,
        torch.randn(2, hidden, ffn, generator=gen) / ffn**0.5,
    ]
    gy = torch.randn(tokens, hidden, generator=gen)

    def run(device):
        x, w, gate_up, down = (t.to(device).requires_grad_() for t in leaves)
        y = routed_experts_math(x, idx.to(device), w, gate_up, down, 4, "silu")
        y.backward(gy.to(device))
        return [t.detach().cpu() for t in (y, x.grad, w.grad, gate_up.grad, down.grad)]

    for a, b in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
