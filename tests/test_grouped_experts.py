"""The grouped routed-experts math (``hidup/rules/grouped.py``, ``routed_experts_math``) and its price
(``search/experts_cost.py``).

* ``route`` sorts the (token, slot) pairs by local expert, other ranks' pairs last, with offsets and
  an inverse that are exact for any routing, offset and slice of experts;
* the masked grouped matmul equals a per-group loop and leaves rows past the last offset zero;
* with a stand-in for torch's grouped kernel that leaves those rows NaN (as the CUDA kernel leaves
  them unwritten), the op's output and every gradient stay finite and equal the masked form's: the
  masks stop the unwritten rows in both directions;
* the math equals a plain per-token reference in float64, forward and backward, for a slice of the
  experts too, and runs in autocast's dtype;
* the rule's typical inputs spread the routing evenly, and the cost model prices the op by its
  GEMMs and by the rows it streams: its own rows, and the tokens once per pass.

Float64 throughout except the autocast check, so every comparison is exact to float64 rounding of
sums of at most ``hidden`` or ``ffn`` terms.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hidup.rules import grouped
from hidup.rules.experts import ACTIVATIONS, routed_experts_math
from hidup.search.experts_cost import ExpertsShape, experts_seconds

D64 = torch.float64


def _routing(tokens, k, experts, gen):
    return torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices


@pytest.mark.parametrize("tokens,k,experts,offset,local", [(7, 2, 4, 0, 4), (9, 3, 8, 2, 3), (5, 1, 4, 3, 1)])
def test_route_sorts_pairs_by_local_expert(tokens, k, experts, offset, local):
    idx = _routing(tokens, k, experts, torch.Generator().manual_seed(tokens))
    r = grouped.route(idx, offset, local)
    flat = idx.reshape(-1)
    key = flat[r.order] - offset
    mine = (key >= 0) & (key < local)
    assert torch.equal(r.valid, mine)
    assert bool((mine[:-1].int() >= mine[1:].int()).all()), "other experts' pairs sort last"
    assert bool((key[mine][:-1] <= key[mine][1:]).all())
    counts = torch.stack([(key == e).sum() for e in range(local)])
    assert torch.equal(r.offsets.long(), counts.cumsum(0))
    assert torch.equal(r.token, r.order // k)
    assert torch.equal(r.order[r.inverse], torch.arange(tokens * k))


def test_masked_grouped_mm_is_a_loop_over_groups():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 3, dtype=D64, generator=gen), torch.randn(3, 3, 4, dtype=D64, generator=gen)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)  # group 1 empty, rows 7.. in no group
    out = grouped.grouped_mm(a, b, offsets)
    want = torch.cat([a[0:2] @ b[0], a[2:7] @ b[2], torch.zeros(3, 4, dtype=D64)])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert not grouped.native_grouped_mm(a, b)  # the CPU in float64 never takes torch's kernel


def _reference(x, idx, w, gate_up, down, offset, act):
    """Each token's slots one at a time: the module docstring's sum, in plain torch."""
    fn = ACTIVATIONS[act]
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for j in range(idx.shape[1]):
            e = int(idx[t, j]) - offset
            if 0 <= e < gate_up.shape[0]:
                gate, up = F.linear(x[t], gate_up[e]).chunk(2)
                y = y + w[t, j] * F.linear(fn(gate) * up, down[e])
        rows.append(y)
    return torch.stack(rows)


def _leaves(tokens, hidden, ffn, experts, k, local, gen):
    idx = _routing(tokens, k, experts, gen)
    x = torch.randn(tokens, hidden, dtype=D64, generator=gen, requires_grad=True)
    w = torch.rand(tokens, k, dtype=D64, generator=gen, requires_grad=True)
    gate_up = torch.randn(local, 2 * ffn, hidden, dtype=D64, generator=gen, requires_grad=True)
    down = torch.randn(local, hidden, ffn, dtype=D64, generator=gen, requires_grad=True)
    return x, idx, w, gate_up, down


def _forward_backward(fn, leaves, gy):
    x, idx, w, gate_up, down = leaves
    for t in (x, w, gate_up, down):
        t.grad = None
    y = fn()
    y.backward(gy)
    return [y.detach()] + [t.grad.clone() for t in (x, w, gate_up, down)]


@pytest.mark.parametrize("offset,local", [(0, 6), (2, 3)])
def test_grouped_math_equals_the_per_token_sum(offset, local):
    gen = torch.Generator().manual_seed(local)
    leaves = _leaves(8, 5, 4, 6, 2, local, gen)
    x, idx, w, gate_up, down = leaves
    gy = torch.randn(8, 5, dtype=D64, generator=gen)
    got = _forward_backward(lambda: routed_experts_math(x, idx, w, gate_up, down, offset, "silu"), leaves, gy)
    want = _forward_backward(lambda: _reference(x, idx, w, gate_up, down, offset, "silu"), leaves, gy)
    for a, b, what in zip(got, want, ["y", "x", "w", "gate_up", "down"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, what=what: f"{what}: {m}")


def test_unwritten_rows_of_the_grouped_kernel_reach_no_sum(monkeypatch):
    """A stand-in for torch's kernel that leaves rows past the last offset NaN, in both directions."""

    def groups(offsets):
        start = 0
        for g, end in enumerate(offsets.tolist()):
            yield g, slice(start, end)
            start = end

    class Unwritten(torch.autograd.Function):
        """Each group a matmul of its own rows, as the kernel: rows past the last offset never written."""

        @staticmethod
        def forward(ctx, a, b, offsets):
            ctx.save_for_backward(a, b, offsets)
            out = torch.full((a.shape[0], b.shape[-1]), float("nan"), dtype=a.dtype)
            for g, rows in groups(offsets):
                out[rows] = a[rows] @ b[g]
            return out

        @staticmethod
        def backward(ctx, grad):
            a, b, offsets = ctx.saved_tensors
            ga, gb = torch.full_like(a, float("nan")), torch.zeros_like(b)
            for g, rows in groups(offsets):
                ga[rows] = grad[rows] @ b[g].T
                gb[g] = a[rows].T @ grad[rows]
            return ga, gb, None

    gen = torch.Generator().manual_seed(3)
    leaves = _leaves(8, 4, 3, 4, 2, 2, gen)
    x, idx, w, gate_up, down = leaves
    gy = torch.randn(8, 4, dtype=D64, generator=gen)
    want = _forward_backward(lambda: routed_experts_math(x, idx, w, gate_up, down, 2, "gelu"), leaves, gy)
    monkeypatch.setattr(grouped, "native_grouped_mm", lambda a, b: True)
    monkeypatch.setattr(grouped, "_GROUPED_MM", lambda a, b, offs: Unwritten.apply(a, b, offs))
    got = _forward_backward(lambda: routed_experts_math(x, idx, w, gate_up, down, 2, "gelu"), leaves, gy)
    for a, b, what in zip(got, want, ["y", "x", "w", "gate_up", "down"]):
        assert torch.isfinite(a).all(), f"{what}: an unwritten row leaked"
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, what=what: f"{what}: {m}")


def test_math_runs_in_the_autocast_dtype():
    gen = torch.Generator().manual_seed(4)
    leaves = _leaves(8, 8, 8, 4, 2, 4, gen)
    x, idx, w, gate_up, down = (t.detach().float() if t.is_floating_point() else t for t in leaves)
    assert grouped.compute_dtype(x, gate_up) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped.compute_dtype(x, gate_up) == torch.bfloat16
        y = routed_experts_math(x, idx, w, gate_up, down, 0, "silu")
    assert y.dtype == torch.float32  # x's dtype, computed in bfloat16
    want = routed_experts_math(x, idx, w, gate_up, down, 0, "silu")
    tol = 8 * torch.finfo(torch.bfloat16).eps * float(want.abs().max())
    assert float((y - want).abs().max()) <= tol


def test_typical_routing_is_balanced():
    from hidup.rules import find_rule
    from hidup.rules.base import RuleContext, TensorMeta

    rule = find_rule(torch.ops.hidup.routed_experts.default)
    metas = [TensorMeta((16, 4), "float32"), TensorMeta((16, 2), "int64"), TensorMeta((16, 2), "float32")]
    metas += [TensorMeta((8, 6, 4), "float32"), TensorMeta((8, 4, 3), "float32")]
    out = [TensorMeta((16, 4), "float32")]
    ctx = RuleContext(torch.ops.hidup.routed_experts.default, (*metas, 0, "silu"), {}, metas, out, 2)
    tensors = [torch.zeros(16, 4), torch.zeros(16, 2, dtype=torch.long), torch.zeros(16, 2)]
    tensors += [torch.zeros(4, 6, 4), torch.zeros(4, 4, 3)]  # the expert signature's local slice
    idx = rule.typical(ctx, tensors)[1]
    assert torch.equal(torch.bincount(idx.reshape(-1), minlength=8), torch.full((8,), 4))
    assert bool((idx[:, 0] != idx[:, 1]).all())


def _shape(tokens, local, experts, k=2):
    return ExpertsShape(tokens, 1024, 2816, k, local, experts, 2, 4)


def test_price_counts_gemms_at_each_experts_rows_and_only_its_own_rows_streamed():
    calls = []

    def gemm(dims, layout):
        calls.append((dims, layout))
        return 2.0 * math.prod(dims) / 1e15

    shape = _shape(16384, 2, 8)  # world-4 rank of a layer of 8 experts: all tokens, 2 experts held
    fwd, bwd = experts_seconds(shape, gemm, 3e12, 0.0, needs_backward=True)
    m = 16384 * 2 // 8
    assert calls[:2] == [((m, 5632, 1024), "nt"), ((m, 1024, 2816), "nt")]
    gemm_fwd = 2 * 2.0 * (m * 5632 * 1024 + m * 1024 * 2816) / 1e15
    own = 16384 * 2 * 2 / 8  # the rank's rows: a quarter of the layer's
    tokens = 16384 * 1024
    streamed = (tokens * 6 + 2 * own * 1024 * 2 + 3 * own * 2816 * 2 + own * 1024 * 2 + tokens * 4) / 3e12
    assert fwd == pytest.approx(gemm_fwd + streamed)
    assert bwd == pytest.approx(2 * gemm_fwd + 2 * streamed)
    # the same experts' work on a quarter of the tokens (a data-parallel rank with 8 experts) streams the
    # same own rows and a quarter of the token passes
    data = experts_seconds(_shape(4096, 8, 8), gemm, 3e12, 0.0, needs_backward=False)[0]
    own_bytes = (2 * own * 1024 * 2 + 3 * own * 2816 * 2 + own * 1024 * 2) / 3e12
    assert data == pytest.approx(gemm_fwd + own_bytes + (streamed - own_bytes) / 4)
