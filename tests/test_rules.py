"""Simulated-SPMD property tests of every sharding rule (forward and backward, N in {2, 4}).

Each test draws small random shapes, runs every signature the rule offers through
``tests/spmd.py`` (split inputs per form, run the local call per rank, rebuild, compare with the
unsplit op; then the gradients under the convention of ``hidup.ir``), and checks that the
signatures one expects for those shapes are actually offered.
"""

from __future__ import annotations

import functools
import math
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from hidup import rules
from hidup.ir import FULL
from spmd import check_op, has_sig, make_context

D64 = torch.float64
_SETTINGS = settings(max_examples=6, deadline=None)


def FAST(test):
    """Hypothesis settings plus a fixed torch seed per example, so that failures replay exactly."""
    inner = test.hypothesis.inner_test

    @functools.wraps(inner)
    def seeded(*args, **kwargs):
        torch.manual_seed(0)
        return inner(*args, **kwargs)

    test.hypothesis.inner_test = seeded
    return _SETTINGS(test)


SIZES = st.sampled_from([1, 2, 3, 4, 8])
EVEN = st.sampled_from([4, 8])


def rn(*shape, param=False):
    t = torch.randn(tuple(shape), dtype=D64)
    return nn.Parameter(t) if param else t


def shapes(n_min=1, n_max=3):
    return st.lists(SIZES, min_size=n_min, max_size=n_max).map(tuple)


# --------------------------------------------------------------------------------------------- elementwise

UNARY = [
    torch.tanh,
    F.gelu,
    F.relu,
    F.silu,
    torch.exp,
    torch.neg,
    torch.sigmoid,
    "tanh",
    "neg",
    "float",
    "double",
    "contiguous",
    "clone",
]


@FAST
@given(shape=shapes(), fn=st.sampled_from(UNARY))
@example(shape=(3, 8), fn="float")  # the gradient of a float64 -> float32 cast goes through float32 sums
def test_unary(shape, fn):
    res = check_op(fn, (rn(*shape),))
    for N, sigs in res.items():
        for d, s in enumerate(shape):
            if s % N == 0 and s > 1:
                assert has_sig(sigs, [f"gather_{d}"], [f"gather_{d}"])
    if fn in (torch.neg, "neg", "double", "clone"):
        assert has_sig(res[2], ["reduce"], ["reduce"])
    if fn in (torch.tanh, F.gelu, torch.exp):
        assert not has_sig(res[2], ["reduce"], ["reduce"])


def test_unary_scalar_args():
    check_op(torch.pow, (rn(4, 2), 2))
    check_op(F.dropout, (rn(4, 2),), {"p": 0.0})
    check_op(F.leaky_relu, (rn(4, 2), 0.1))
    check_op("pow", (rn(4, 2), 3))


@FAST
@given(
    shape=shapes(2, 3),
    data=st.data(),
    op=st.sampled_from([operator.add, operator.sub, operator.mul, operator.truediv, torch.add, "mul", torch.maximum]),
)
def test_binary_broadcast(shape, data, op):
    k = data.draw(st.integers(0, len(shape)))
    other = list(shape[len(shape) - k :])
    other = [1 if data.draw(st.booleans()) else s for s in other]
    x, y = rn(*shape), rn(*other) + (3.0 if op is operator.truediv else 0.0)
    swap = data.draw(st.booleans())
    res = check_op(op, (y, x) if swap else (x, y))
    if op in (operator.add, operator.sub, torch.add):
        assert has_sig(res[2], ["reduce", "reduce"], ["reduce"])
        assert not has_sig(res[2], ["reduce", "full"], ["reduce"])
        assert not has_sig(res[2], ["full", "reduce"], ["reduce"])
    if op in (operator.mul, "mul"):
        assert has_sig(res[2], ["reduce", "full"], ["reduce"]) and has_sig(res[2], ["full", "reduce"], ["reduce"])
        assert not has_sig(res[2], ["reduce", "reduce"], ["reduce"])
    if op is torch.maximum:
        assert not any(str(f) == "reduce" for s in res[2] for f in s.outputs)


@pytest.mark.parametrize(
    "op,args",
    [
        (operator.add, lambda: (rn(4, 2), 2.0)),
        (operator.add, lambda: (2.0, rn(4, 2))),
        (operator.mul, lambda: (3.0, rn(4, 2))),
        (operator.truediv, lambda: (rn(4, 2), 2.0)),
        (operator.truediv, lambda: (2.0, rn(4, 2).abs() + 1)),
        (operator.sub, lambda: (1.0, rn(4, 2))),
    ],
)
def test_binary_scalars(op, args):
    res = check_op(op, args())
    affine = op in (operator.add, operator.sub) or (op is operator.truediv and not isinstance(args()[0], torch.Tensor))
    assert has_sig(res[2], None, ["reduce"]) != affine


def test_add_alpha_and_param_bias():
    r = check_op(torch.add, (rn(4, 2), rn(4, 2)), {"alpha": 0.5})
    assert has_sig(r[2], ["reduce", "reduce"], ["reduce"])
    # a bias parameter joins a reduce sum as ``reduce`` (rank 0 keeps it), never as ``full``
    r = check_op(operator.add, (rn(4, 2), rn(2, param=True)))
    assert has_sig(r[2], ["reduce", "reduce"], ["reduce"]) and not has_sig(r[2], ["reduce", "full"], None)
    r = check_op(operator.mul, (rn(4, 2), rn(2, param=True)))
    assert has_sig(r[2], ["reduce", "full"], ["reduce"]) and not has_sig(r[2], ["full", "reduce"], None)


def test_masked_fill_where():
    x, m = rn(4, 8), torch.rand(4, 8) > 0.5
    r = check_op("masked_fill", (x, m, 0.0))
    assert has_sig(r[2], ["reduce", "full"], ["reduce"])
    r = check_op("masked_fill", (x, m[:1], -1e9))
    assert not has_sig(r[2], None, ["reduce"]) and has_sig(r[2], ["gather_0", "full"], ["gather_0"])
    r = check_op(torch.where, (m, x, rn(4, 8)))
    assert has_sig(r[2], ["full", "reduce", "reduce"], ["reduce"])
    check_op(torch.where, (m, x, 0.0))
    check_op(torch.tril, (rn(2, 4, 4),))
    check_op(torch.cumsum, (rn(4, 4), 1))


# --------------------------------------------------------------------------------------------- contractions


@FAST
@given(lead=shapes(1, 2), k=EVEN, n=SIZES, bias=st.booleans())
def test_linear(lead, k, n, bias):
    x, w = rn(*lead, k), rn(n, k, param=True)
    args = (x, w, rn(n, param=True)) if bias else (x, w)
    res = check_op(F.linear, args)
    for N, sigs in res.items():
        last = len(lead)
        row_in = [f"gather_{last}", "gather_1"] + (["reduce"] if bias else [])
        assert has_sig(sigs, row_in, ["reduce"], kind="tensor")
        if n % N == 0 and n > 1:
            assert has_sig(sigs, ["full", "gather_0"] + (["gather_0"] if bias else []), [f"gather_{last}"], "tensor")
        if lead[0] % N == 0 and lead[0] > 1:
            assert has_sig(sigs, ["gather_0", "full"] + (["full"] if bias else []), ["gather_0"], "data")
        # reduce propagation: never (reduce x, full bias)
        assert not has_sig(sigs, ["reduce", "full", "full"], ["reduce"])
        assert has_sig(sigs, ["reduce", "full"] + (["reduce"] if bias else []), ["reduce"])


@FAST
@given(a_nd=st.integers(1, 3), b_nd=st.integers(1, 3), m=SIZES, k=EVEN, n=SIZES, bt=st.sampled_from([1, 2, 4]))
def test_matmul(a_nd, b_nd, m, k, n, bt):
    a = rn(*([bt] * (a_nd - 2) + [m] * (a_nd >= 2) + [k]))
    b = rn(*([bt] * (b_nd - 2) + [k] + [n] * (b_nd >= 2)))
    res = check_op(torch.matmul, (a, b))
    assert has_sig(res[2], [f"gather_{a.ndim - 1}", f"gather_{max(b.ndim - 2, 0)}"], ["reduce"])


@FAST
@given(b=SIZES, m=SIZES, k=EVEN, n=SIZES, c_shape=st.sampled_from(["full", "row", "scalar"]))
def test_bmm_baddbmm(b, m, k, n, c_shape):
    x, y = rn(b, m, k), rn(b, k, n)
    check_op(torch.bmm, (x, y))
    c = {"full": rn(b, m, n), "row": rn(n), "scalar": rn(1, 1)}[c_shape]
    res = check_op(torch.baddbmm, (c, x, y), {"beta": 0.5, "alpha": 2.0})
    assert has_sig(res[2], ["reduce", "gather_2", "gather_1"], ["reduce"])
    check_op(torch.addmm, (rn(n), rn(m, k), rn(k, n)))


MOE = ["gsec,gsd->egcd", "egcd,edf->egcf", "gsec,egcd->gsd"]


@FAST
@given(g=SIZES, s=SIZES, e=EVEN, c=SIZES, d=SIZES, f=SIZES, which=st.sampled_from(MOE))
def test_einsum_moe(g, s, e, c, d, f, which):
    size = dict(g=g, s=s, e=e, c=c, d=d, f=f)
    lhs = which.split("->")[0].split(",")
    ops = [rn(*[size[ch] for ch in op], param=(which == MOE[1] and i == 1)) for i, op in enumerate(lhs)]
    res = check_op(torch.einsum, (which, *ops))
    for sigs in res.values():
        if which == MOE[1]:
            assert has_sig(sigs, ["gather_0", "gather_0"], ["gather_0"], kind="expert")
        if which == MOE[0]:
            assert has_sig(sigs, ["gather_2", "full"], ["gather_0"], kind="data")
        if which == MOE[2]:
            assert has_sig(sigs, ["gather_2", "gather_0"], ["reduce"])


@pytest.mark.parametrize(
    "eq,shapes_",
    [
        ("bij,bjk->bik", [(2, 4, 4), (2, 4, 2)]),
        ("ij,j->i", [(4, 4), (4,)]),
        ("ii->i", [(4, 4)]),
        ("...ij,...jk->...ik", [(2, 4, 2), (1, 2, 4)]),
        ("ij,jk", [(4, 2), (2, 4)]),
        ("bhqd,bhkd->bhqk", [(2, 4, 2, 2)] * 2),
    ],
)
def test_einsum_generic(eq, shapes_):
    res = check_op(torch.einsum, (eq, *[rn(*s) for s in shapes_]))
    if eq == "ii->i":
        assert len(res[2]) == 2  # all-full and reduce propagation only: a diagonal is never split


# --------------------------------------------------------------------------------------------- embedding, norms


@FAST
@given(ids_shape=shapes(1, 2), v=EVEN, d=SIZES, pad=st.sampled_from([None, 0, 5, -1]))
def test_embedding(ids_shape, v, d, pad):
    ids = torch.randint(0, v, ids_shape)
    if pad is not None:
        pad = pad % v if pad >= 0 else pad
        ids.view(-1)[0] = pad % v
    w = rn(v, d, param=True)
    res = check_op(F.embedding, (ids, w), {"padding_idx": pad} if pad is not None else {})
    for N, sigs in res.items():
        vp = [s for s in sigs if s.impl == "vocab_parallel"]
        assert len(vp) == 1 and str(vp[0].inputs[1]) == "gather_0" and str(vp[0].outputs[0]) == "reduce"
        if d % N == 0 and d > 1:
            assert has_sig(sigs, ["full", "gather_1"], [f"gather_{len(ids_shape)}"], kind="tensor")
    ctx, _, _ = make_context(F.embedding, (ids, w), {}, 2)
    sig = [s for s in rules.signatures(ctx) if s.impl == "vocab_parallel"][0]
    assert rules.localize(ctx, sig, 1).target is rules.vocab_parallel_embedding


@FAST
@given(lead=shapes(1, 2), d=SIZES, affine=st.booleans(), fn=st.sampled_from(["layer_norm", "rms_norm"]))
def test_norms(lead, d, affine, fn):
    x = rn(*lead, d)
    w = rn(d, param=True) if affine else None
    if fn == "layer_norm":
        res = check_op(F.layer_norm, (x, (d,), w, rn(d, param=True) if affine else None))
    else:
        res = check_op(F.rms_norm, (x, (d,), w))
    for sigs in res.values():
        for s in sigs:
            assert str(s.inputs[0]) != f"gather_{len(lead)}"
            assert all(f == FULL for f in s.inputs[1:])
    ln2 = check_op(F.layer_norm, (rn(4, 2, 4), (2, 4)))
    assert all(str(s.inputs[0]) in ("full", "gather_0") for s in ln2[2])


@FAST
@given(shape=shapes(1, 3), data=st.data(), fn=st.sampled_from([F.softmax, F.log_softmax, "softmax"]))
def test_softmax(shape, data, fn):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    res = check_op(fn, (rn(*shape), dim))
    for s in res[2]:
        assert str(s.inputs[0]) != f"gather_{dim % len(shape)}"


@FAST
@given(b=SIZES, h=SIZES, s=SIZES, dh=SIZES, mask=st.sampled_from([None, "2d", "4d", "bool"]), causal=st.booleans())
def test_sdpa(b, h, s, dh, mask, causal):
    q, k, v = rn(b, h, s, dh), rn(b, h, s, dh), rn(b, h, s, dh)
    kw = {"is_causal": causal and mask is None}
    if mask == "2d":
        kw["attn_mask"] = rn(s, s)
    elif mask == "4d":
        kw["attn_mask"] = rn(b, 1, s, s)
    elif mask == "bool":
        kw["attn_mask"] = torch.ones(s, s, dtype=torch.bool).tril()
    res = check_op(F.scaled_dot_product_attention, (q, k, v), kw)
    for N, sigs in res.items():
        if h % N == 0 and h > 1:
            assert any(s.kind == "tensor" and str(s.outputs[0]) == "gather_1" for s in sigs)
        assert not any(str(s.outputs[0]) in ("gather_2", "gather_3") for s in sigs)


# --------------------------------------------------------------------------------------------- shapes


@FAST
@given(a=SIZES, b=SIZES, c=SIZES)
def test_reshape_family(a, b, c):
    x = rn(a, b, c)
    res = check_op("view", (x, a * b, c))
    for N, sigs in res.items():
        if a % N == 0 and a > 1:
            assert has_sig(sigs, ["gather_0"], ["gather_0"])
        if a > 1:
            assert not has_sig(sigs, ["gather_1"], None)  # inner factor of a merged group
    check_op(torch.reshape, (x, (a, b * c)))
    check_op("reshape", (x, -1))
    check_op(torch.flatten, (x, 1))
    check_op("unflatten", (rn(a * b, c), 0, (a, b)))
    check_op("view", (rn(a * b, c), a, b, c))
    check_op("transpose", (x, 0, 2))
    check_op("permute", (x, 2, 0, 1))
    check_op(torch.permute, (x, (1, 2, 0)))
    check_op("t", (rn(a, b),))
    check_op("unsqueeze", (x, 1))
    check_op("squeeze", (rn(a, 1, b),))
    check_op("squeeze", (rn(a, 1, b), 1))
    check_op("expand", (rn(a, 1, c), a, b, c))
    check_op("expand", (rn(1, c), 2, b, c))
    check_op("expand_as", (rn(1, c), rn(b, c)))
    check_op("repeat", (rn(a, c), 2, 1))
    check_op(torch.movedim, (x, 0, -1))


def test_squeeze_keeps_sharded_unit_dim():
    # global [2, 3] split over 2 ranks is [1, 3] locally; squeeze() must not drop the sharded dim
    res = check_op("squeeze", (rn(2, 1, 3),), worlds=(2,))
    assert has_sig(res[2], ["gather_0"], ["gather_0"])


@FAST
@given(a=EVEN, b=SIZES, c=SIZES, data=st.data())
def test_indexing(a, b, c, data):
    x = rn(a, b, c)
    for idx in [
        (slice(None), 0),
        (Ellipsis, slice(0, 1)),
        (None, slice(None), slice(None), -1),
        (slice(0, a), slice(None)),
        (Ellipsis, None),
        1,
        (slice(None, None, 2),),
    ]:
        res = check_op(operator.getitem, (x, idx))
        if idx == (slice(0, a), slice(None)):
            assert has_sig(res[2], ["gather_0"], ["gather_0"])
        if idx == (None, slice(None), slice(None), -1):
            assert has_sig(res[2], ["gather_0"], ["gather_1"])
    check_op(operator.getitem, (x, torch.tensor([0, a - 1])))
    check_op(torch.split, (x, 1, 1))
    check_op("split", (x, [1, c - 1] if c > 1 else [1], -1))
    check_op("chunk", (x, 2, 0))
    for sections in (a, [a]):  # a one-piece split along a sharded dim: the size becomes local
        assert has_sig(check_op(torch.split, (x, sections, 0))[2], ["gather_0"], ["gather_0"])
    assert has_sig(check_op("chunk", (x, 1, 0))[2], ["gather_0"], ["gather_0"])
    check_op(torch.unbind, (x, 1))
    check_op(torch.narrow, (x, 0, 0, a))
    check_op(torch.narrow, (x, 2, 0, 1))
    check_op(torch.select, (x, 1, 0))
    check_op(torch.index_select, (x, 1, torch.tensor([0] * 2)))
    k = data.draw(st.integers(1, 3))
    res = check_op(torch.cat, ([rn(a, b, c) for _ in range(k)], 1))
    assert has_sig(res[2], ["gather_0"] * k, ["gather_0"]) and has_sig(res[2], ["reduce"] * k, ["reduce"])
    assert not has_sig(res[2], ["gather_1"] * k, None)
    check_op(torch.stack, ([rn(a, b) for _ in range(k)], 1))


# --------------------------------------------------------------------------------------------- reductions, loss


@FAST
@given(shape=shapes(1, 3), data=st.data(), fn=st.sampled_from([torch.sum, torch.mean, "sum", "mean", torch.amax]))
def test_reductions(shape, data, fn):
    x = rn(*shape)
    dims = data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    keep = data.draw(st.booleans())
    res = check_op(fn, (x, dims, keep))
    check_op(fn, (x,))
    lin = fn is not torch.amax
    for N, sigs in res.items():
        for d in dims:
            if shape[d] % N == 0 and shape[d] > 1:
                assert has_sig(sigs, [f"gather_{d}"], ["reduce"]) == lin
        assert has_sig(sigs, ["reduce"], ["reduce"]) == lin


@FAST
@given(
    n=EVEN,
    c=SIZES,
    extra=st.sampled_from([(), (2,)]),
    reduction=st.sampled_from(["sum", "none", "mean"]),
    weighted=st.booleans(),
    smooth=st.sampled_from([0.0, 0.1]),
)
def test_cross_entropy(n, c, extra, reduction, weighted, smooth):
    logits = rn(n, c, *extra)
    target = torch.randint(0, c, (n, *extra))
    target.view(-1)[0] = -100
    kw = {"reduction": reduction, "label_smoothing": smooth}
    if weighted:
        kw["weight"] = rn(c).abs() + 0.5
    res = check_op(F.cross_entropy, (logits, target), kw, no_grad=(2,))
    if reduction == "mean":
        assert len(res[2]) == 1
    else:
        assert has_sig(
            res[2],
            ["gather_0", "gather_0"] + (["full"] if weighted else []),
            ["reduce" if reduction == "sum" else "gather_0"],
            kind="data",
        )
    check_op(F.nll_loss, (F.log_softmax(logits, 1), target), {"reduction": reduction})
    check_op(F.cross_entropy, (logits, torch.softmax(rn(n, c, *extra), 1)), {"reduction": reduction})


@FAST
@given(b=SIZES, cin=st.sampled_from([2, 4]), cout=EVEN, bias=st.booleans())
def test_conv2d_patch(b, cin, cout, bias):
    x, w = rn(b, cin, 4, 4), rn(cout, cin, 2, 2, param=True)
    res = check_op(F.conv2d, (x, w, rn(cout, param=True) if bias else None, 2))
    assert has_sig(res[2], ["full", "gather_0"] + (["gather_0"] if bias else []), ["gather_1"], kind="tensor")
    assert has_sig(res[2], ["gather_1", "gather_1"] + (["reduce"] if bias else []), ["reduce"], kind="tensor")
    check_op(F.conv2d, (rn(b, 4, 4, 4), rn(cout, 2, 3, 3)), {"padding": 1, "groups": 2})


# --------------------------------------------------------------------------------------------- top-k (MoE routers)


@FAST
@given(shape=shapes(2, 3), data=st.data())
def test_topk(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    k = data.draw(st.integers(1, shape[dim]))
    x = torch.randperm(math.prod(shape)).to(D64).reshape(shape)  # distinct values: no ties to break
    res = check_op(torch.topk, (x, k), {"dim": dim})
    for N, sigs in res.items():
        d = dim % len(shape)
        assert not any(s.inputs[0].is_gather and s.inputs[0].dim == d for s in sigs)
        for other in range(len(shape)):
            if other != d and shape[other] % N == 0 and shape[other] > 1:
                assert has_sig(sigs, [f"gather_{other}"], [f"gather_{other}"] * 2, kind="data")
    check_op(torch.ops.aten.topk.default, (x, k, dim))
