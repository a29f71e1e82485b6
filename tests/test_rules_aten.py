"""Simulated-SPMD property test of every ATen overload that ``hidup.rules.aten`` maps onto a torch rule.

``hidup/rules/aten.py`` gives an exported op no rule of its own: a *binder* rewrites its arguments
into a torch function's, the torch rule's signatures are permuted back to the ATen argument order,
and the rank runs what the torch rule localizes.  This file checks every entry of that table
(enumerated from the table itself, never hand-listed) the way ``tests/test_rules.py`` checks the
torch rules: for each overload, ``CASES`` draws one or more representative calls (small shapes,
the argument patterns export records: Python scalars in ``.Tensor`` overloads, negative dims,
positional scalars where the torch function takes keywords); the signatures are computed through
the ATen path (``rules.signatures`` on a context whose target is the ATen overload), and every one
is run on N in {2, 4} simulated ranks by ``tests/spmd.py``: the reference is the ATen overload on
the whole tensors, each rank runs the rule's local call on its pieces, and outputs and input
gradients must match.  The all-``full`` signature thus checks the binder itself (the torch call it
builds computes what the ATen op computes), the others check the permutation of the forms.

Every case draws an even leading size, so at least one of an overload's calls must get a signature
besides all-``full``, except where the rule replicates on purpose (``REPLICATED``).
``test_every_overload_has_a_case`` fails when an overload joins the table without a case here.

Uninitialised factories (``empty``, ``empty_like``) are compared under
``torch.use_deterministic_algorithms``, which fills new integer tensors with their dtype's maximum.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from hidup import rules
from hidup.ir import FULL
from hidup.rules.aten import _TABLE
from spmd import check_signature, make_context

aten = torch.ops.aten
D64 = torch.float64
CPU = torch.device("cpu")
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


SIZES = st.sampled_from([1, 2, 3, 4])
EVEN = st.sampled_from([4, 8])


def rn(*shape, param=False):
    t = torch.randn(tuple(shape), dtype=D64)
    return nn.Parameter(t) if param else t


def positive(*shape):
    return torch.rand(tuple(shape), dtype=D64) + 0.5


def mask(*shape):
    return torch.rand(tuple(shape)) > 0.5


def ints(high, *shape):
    return torch.randint(0, high, tuple(shape))


@dataclass
class Call:
    """One call of the overload: ``op(*args, **kwargs)``; ``no_grad``: floating inputs (by tensor
    position) that get no gradient (class weights, an in-place op's operands)."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    no_grad: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------------------- cases
# One generator per overload: ``draw`` is hypothesis's ``data.draw``; the result is a list of calls.


def _binary_tensor(draw, fn_y=rn):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    other = [1 if draw(st.booleans()) else s for s in (b, c)][draw(st.integers(0, 2)) :]
    return [Call((rn(a, b, c), fn_y(*other))), Call((fn_y(*other), rn(a, b, c))), Call((rn(a, b, c), 2.0))]


def _unary(fn=rn):
    return lambda draw: [Call((fn(draw(EVEN), draw(SIZES)),))]


def _compare(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), rn(b))), Call((rn(b), rn(a, 1)))]


def _compare_scalar(draw):
    return [Call((rn(draw(EVEN), draw(SIZES)), 0.0))]


def _linear(draw):
    lead, k, n = (draw(EVEN), draw(SIZES)), draw(EVEN), draw(SIZES)
    x, w = rn(*lead, k), rn(n, k, param=True)
    return [Call((x, w, rn(n, param=True))), Call((x, w)), Call((x, w, None))]


def _addmm(draw):
    m, k, n = draw(EVEN), draw(EVEN), draw(SIZES)
    return [
        Call((rn(n, param=True), rn(m, k), rn(k, n, param=True))),
        Call((rn(m, n), rn(m, k), rn(k, n)), {"beta": 0.5, "alpha": 2.0}),
    ]


def _mm(draw):
    m, k, n = draw(EVEN), draw(EVEN), draw(SIZES)
    return [Call((rn(m, k), rn(k, n, param=True))), Call((rn(m, k), rn(k, n)))]


def _bmm(draw):
    b, m, k, n = draw(EVEN), draw(SIZES), draw(EVEN), draw(SIZES)
    return [Call((rn(b, m, k), rn(b, k, n)))]


def _baddbmm(draw):
    b, m, k, n = draw(EVEN), draw(SIZES), draw(EVEN), draw(SIZES)
    return [
        Call((rn(b, m, n), rn(b, m, k), rn(b, k, n))),
        Call((rn(n), rn(b, m, k), rn(b, k, n)), {"beta": 0.5, "alpha": 2.0}),
    ]


def _matmul(draw):
    b, m, k, n = draw(EVEN), draw(SIZES), draw(EVEN), draw(SIZES)
    return [Call((rn(b, m, k), rn(k, n, param=True))), Call((rn(b, m, k), rn(b, k, n))), Call((rn(b, k), rn(k)))]


def _einsum(draw):
    b, m, k, n = draw(EVEN), draw(SIZES), draw(EVEN), draw(SIZES)
    return [Call(("bmk,bkn->bmn", [rn(b, m, k), rn(b, k, n)])), Call(("bk,nk->bn", [rn(b, k), rn(n, k, param=True)]))]


def _add_tensor(draw):
    calls = _binary_tensor(draw)
    a, b = draw(EVEN), draw(SIZES)
    return calls + [Call((rn(a, b), rn(a, b)), {"alpha": 0.5}), Call((rn(a, b), rn(b, param=True)))]


def _add_scalar(draw):
    # aten.add.Scalar / sub.Scalar take ``alpha`` positionally, torch.add / sub as a keyword
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), 2.0)), Call((rn(a, b), 2.0, 0.5)), Call((rn(a, b), 1.5), {"alpha": 2})]


def _div_tensor(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), positive(b, c))), Call((rn(a, b, c), positive(a, 1, 1))), Call((rn(a, b, c), 4.0))]


def _div_inplace(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), positive(b)), no_grad=(0, 1)), Call((rn(a, b), 3.0), no_grad=(0,))]


def _pow_scalar(draw):
    return [Call((rn(draw(EVEN), draw(SIZES)), 2)), Call((positive(draw(EVEN), draw(SIZES)), 0.5))]


def _pow_tensor(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((positive(a, b), rn(a, b))), Call((positive(a, b), rn(b)))]


def _masked_fill_scalar(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [
        Call((rn(a, b, c), mask(a, b, c), 0.0)),
        Call((rn(a, b, c), mask(1, b, c), -1e9)),
        Call((rn(a, b, c), mask(a, 1, c), 2.0)),
    ]


def _masked_fill_tensor(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [
        Call((rn(a, b), mask(a, b), torch.tensor(2.0, dtype=D64))),
        Call((rn(a, b), mask(a, b), torch.tensor(0.0, dtype=D64))),
    ]


def _where(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((mask(a, b), rn(a, b), rn(a, b))), Call((mask(1, b), rn(a, b), rn(b)))]


def _tril(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c),)), Call((rn(a, b, c), 1)), Call((rn(a, b, c), -1))]


def _cumsum(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), 1)), Call((rn(a, b), -1)), Call((rn(b, a), 0), {"dtype": D64})]


def _clamp(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), -0.5, 0.5)), Call((rn(a, b), None, 0.5)), Call((rn(a, b),), {"min": 0.0})]


def _gelu(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b),)), Call((rn(a, b),), {"approximate": "tanh"})]


def _dropout(draw):
    # p = 0 in training, or inference with any p: deterministic, so every rank can be compared
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), 0.0, True)), Call((rn(a, b), 0.5, False))]


def _copy(draw):
    return [Call((rn(draw(EVEN), draw(SIZES)),))]


def _contiguous(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b),)), Call((rn(b, a).t(),), {"memory_format": torch.contiguous_format})]


def _clone(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b),)), Call((rn(a, b),), {"memory_format": torch.contiguous_format})]


def _detach_inplace(draw):
    return [Call((rn(draw(EVEN), draw(SIZES)),), no_grad=(0,))]


def _to_dtype(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), torch.float32)), Call((rn(a, b), torch.float32, False, False)), Call((ints(5, a, b), D64))]


def _to_dtype_layout(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [
        Call((rn(a, b),), {"dtype": torch.float32, "layout": torch.strided, "device": CPU}),
        Call((rn(a, b),), {"dtype": D64, "device": CPU, "pin_memory": False}),
    ]


def _to_device(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), CPU, torch.float32)), Call((rn(a, b), CPU, D64, False, False))]


def _to_copy(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [
        Call((rn(a, b),), {"dtype": torch.float32}),
        Call((rn(a, b),), {"dtype": D64, "layout": torch.strided, "device": CPU}),
    ]


def _type_as(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), torch.zeros(3, dtype=torch.float32)), no_grad=(1,))]


def _view(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), [a * b, c])), Call((rn(a, b, c), [a, -1])), Call((rn(a, b * c), [a, b, c]))]


def _expand(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, 1, c), [a, b, c])), Call((rn(1, c), [a, b, c])), Call((rn(a, 1, c), [-1, b, -1]))]


def _transpose(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 0, 2)), Call((rn(a, b, c), 1, -1))]


def _t(draw):
    return [Call((rn(draw(EVEN), draw(SIZES)),))]


def _permute(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), [2, 0, 1])), Call((rn(a, b, c), [-1, 0, 1]))]


def _unsqueeze(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), 0)), Call((rn(a, b), -1)), Call((rn(a, b), 1))]


def _squeeze_dim(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, 1, b), 1)), Call((rn(a, b, 1), -1)), Call((rn(a, b), 1))]


def _squeeze_dims(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, 1, b, 1), [1, 3])), Call((rn(a, 1, b), [-2])), Call((rn(a, b, 1), [1, 2]))]


def _flatten(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 1)), Call((rn(a, b, c), 0, 1)), Call((rn(a, b, c),)), Call((rn(a, b, c), 1, -1))]


def _unflatten(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b * c), 1, [b, c])), Call((rn(a * b, c), 0, [a, b])), Call((rn(a, b * c), -1, [b, -1]))]


def _repeat(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b), [1, 2])), Call((rn(a, b), [2, 1, 1]))]


def _slice(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    x = rn(a, b, c)
    return [
        Call((x, 1, 0, 1)),
        Call((x, -1, 0, 1)),
        Call((x, 2, 0, 9223372036854775807, 2)),
        Call((x,)),
        Call((x, 0, 0, a)),
        Call((x, -2, None, None)),
        Call((x, 1), {"start": 0, "end": 1}),
    ]


def _select(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 1, 0)), Call((rn(a, b, c), -1, -1)), Call((rn(a, b, c), 0, 1))]


def _narrow(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 2, 0, 1)), Call((rn(a, b, c), 0, 0, a)), Call((rn(a, b, c), -1, c - 1, 1))]


def _split(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 1, 1)), Call((rn(a, b, c), 1, -1)), Call((rn(a, b, c), a)), Call((rn(a, b, c), 2))]


def _split_with_sizes(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    sizes = [1, c - 1] if c > 1 else [1]
    return [Call((rn(a, b, c), sizes, -1)), Call((rn(a, b, c), [a])), Call((rn(a, b, c), [b], 1))]


def _chunk(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 2)), Call((rn(a, b, c), 1, -1)), Call((rn(a, b, c), 1, 0))]


def _unbind(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 1)), Call((rn(a, b, c), -1)), Call((rn(b, a),))]


def _cat(draw):
    a, b, c, k = draw(EVEN), draw(SIZES), draw(SIZES), draw(st.integers(1, 3))
    return [
        Call(([rn(a, b, c) for _ in range(k)], 1)),
        Call(([rn(a, b, c) for _ in range(k)], -1)),
        Call(([rn(a, b) for _ in range(k)],)),
    ]


def _stack(draw):
    a, b, k = draw(EVEN), draw(SIZES), draw(st.integers(1, 3))
    return [
        Call(([rn(a, b) for _ in range(k)], 1)),
        Call(([rn(a, b) for _ in range(k)], -1)),
        Call(([rn(a, b) for _ in range(k)],)),
    ]


def _index_select(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 1, ints(b, 2))), Call((rn(a, b, c), -1, ints(c, 3))), Call((rn(a, b), 0, ints(a, a)))]


def _gather(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [
        Call((rn(a, b, c), 2, ints(c, a, b, 2))),
        Call((rn(a, b, c), -1, ints(c, a, b, 1))),
        Call((rn(a, b), 1, ints(b, a, 3)), {"sparse_grad": False}),
    ]


def _pad(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), [1, 2])), Call((rn(a, b, c), [1, 0, 0, 2], "constant", 0.5))]


def _constant_pad(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [
        Call((rn(a, b, c), [1, 2])),
        Call((rn(a, b, c), [1, 0, 0, 2], 0.5)),
        Call((rn(a, b, c), [0, 1]), {"value": -1.0}),
    ]


def _sum_dim(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    x = rn(a, b, c)
    return [
        Call((x, [0])),
        Call((x, [1, 2], True)),
        Call((x, [-1])),
        Call((x, [0], False), {"dtype": D64}),
        Call((x, None)),
    ]


def _sum_default(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((rn(a, b),)), Call((rn(a, b),), {"dtype": D64})]


def _amax(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    x = rn(a, b, c)
    return [Call((x, [1])), Call((x, [-1], True)), Call((x, [0, 2])), Call((x,)), Call((x, []))]


def _logsumexp(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), [1])), Call((rn(a, b, c), [-1], True)), Call((rn(a, b, c), [0, 2]))]


def _argmax(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), 1)), Call((rn(a, b, c), -1, True)), Call((rn(a, b, c),))]


def _topk(draw):
    # distinct values (a permutation), so that every rank picks the same indices as one device
    a, b, c = draw(EVEN), draw(SIZES), draw(st.sampled_from([2, 3, 4]))
    x = torch.randperm(a * b * c).reshape(a, b, c).to(D64)
    return [Call((x, 2)), Call((x, 1, 1)), Call((x, 2, -1, False)), Call((x, 1, 0, True, True))]


def _softmax(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), -1)), Call((rn(a, b, c), 1)), Call((rn(a, b, c), 0, D64))]


def _softmax_private(draw):
    a, b, c = draw(EVEN), draw(SIZES), draw(SIZES)
    return [Call((rn(a, b, c), -1, False)), Call((rn(a, b, c), 1, False))]


def _layer_norm(draw):
    a, b, d = draw(EVEN), draw(SIZES), draw(SIZES)
    x = rn(a, b, d)
    return [
        Call((x, [d], rn(d, param=True), rn(d, param=True), 1e-5, True)),
        Call((x, [d])),
        Call((x, [b, d], rn(b, d, param=True), None, 1e-6)),
        Call((x, [d], None, rn(d, param=True))),
    ]


def _rms_norm(draw):
    a, b, d = draw(EVEN), draw(SIZES), draw(SIZES)
    x = rn(a, b, d)
    return [Call((x, [d], rn(d, param=True), 1e-6)), Call((x, [d])), Call((x, [b, d], rn(b, d, param=True)))]


def _sdpa(draw):
    b, h, s, dh = draw(EVEN), draw(st.sampled_from([2, 4])), draw(SIZES), draw(SIZES)
    q, k, v = rn(b, h, s, dh), rn(b, h, s, dh), rn(b, h, s, dh)
    kv = rn(b, h // 2, s, dh), rn(b, h // 2, s, dh)
    return [
        Call((q, k, v)),
        Call((q, k, v, rn(b, 1, s, s))),
        Call((q, k, v, None, 0.0, True)),
        Call((q, k, v, torch.ones(s, s, dtype=torch.bool).tril()), {"scale": 0.3}),
        Call((q, *kv), {"enable_gqa": True}),
        Call((q, *kv, None, 0.0, True), {"enable_gqa": True}),
    ]


def _embedding(draw):
    b, s, v, d = draw(EVEN), draw(SIZES), draw(EVEN), draw(SIZES)
    ids = ints(v, b, s)
    ids.view(-1)[0] = 0
    w = rn(v, d, param=True)
    return [Call((w, ids)), Call((w, ids, 0)), Call((w, ids, -1, False, False)), Call((w, ids), {"padding_idx": 0})]


def _targets(n, c, *extra):
    t = ints(c, n, *extra)
    t.view(-1)[0] = -100
    return t


def _cross_entropy(draw):
    n, c = draw(EVEN), draw(SIZES)
    logits, t = rn(n, c), _targets(n, c)
    w = positive(c)
    return [
        Call((logits, t)),
        Call((logits, t, None, 2)),
        Call((logits, t, None, 0, -100, 0.1)),
        Call((rn(n, c, 2), _targets(n, c, 2), w, 2), no_grad=(2,)),
        Call((logits, t), {"reduction": 0}),
        Call((logits, torch.softmax(rn(n, c), 1), None, 2)),
    ]


def _nll_loss(extra=()):
    def cases(draw):
        n, c = draw(EVEN), draw(SIZES)
        logp, t = torch.log_softmax(rn(n, c, *extra), 1), _targets(n, c, *extra)
        return [
            Call((logp, t)),
            Call((logp, t, None, 2)),
            Call((logp, t, None, 0, -100)),
            Call((logp, t, positive(c), 2), no_grad=(2,)),
            Call((logp, t.clamp(min=0)), {"reduction": 2, "ignore_index": 0}),
        ]

    return cases


def _conv(nsp: int, padded: bool = False):
    """conv{nsp}d(input, weight, bias, stride, padding, dilation, groups): a patch embedding
    (stride = kernel), a padded 3-wide kernel, a grouped one, an unbatched input; ``padded``: the
    ``.padding`` overload, which takes ``"valid"`` or ``"same"``."""

    def cases(draw):
        b, cin, cout = draw(EVEN), draw(st.sampled_from([2, 4])), draw(EVEN)
        x = rn(b, cin, *[4] * nsp)
        w = rn(cout, cin, *[2] * nsp, param=True)
        none, same = ("valid", "same") if padded else ([0] * nsp, [1] * nsp)
        return [
            Call((x, w, rn(cout, param=True), [2] * nsp, none)),
            Call((x, w, None, [2] * nsp, none)),
            Call((x, rn(cout, cin, *[3] * nsp, param=True), rn(cout, param=True), [1] * nsp, same, [1] * nsp)),
            Call((x, rn(cout, cin // 2, *[1] * nsp), None, [1] * nsp, none, [1] * nsp, 2)),
            Call((x[0], w, rn(cout, param=True), [2] * nsp, none)),
        ]

    return cases


def _convolution(draw):
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    b, cin, cout = draw(EVEN), draw(st.sampled_from([2, 4])), draw(EVEN)
    x = rn(b, cin, 4, 4)
    return [
        Call((x, rn(cout, cin, 2, 2, param=True), rn(cout, param=True), [2, 2], [0, 0], [1, 1], False, [0, 0], 1)),
        Call((x, rn(cout, cin // 2, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 2)),
        Call((rn(b, cin, 4), rn(cout, cin, 3), None, [1], [1], [2], False, [0], 1)),
        # transposed: weight [C_in, C_out, k]
        Call((x, rn(cin, cout, 2, 2, param=True), rn(cout, param=True), [2, 2], [0, 0], [1, 1], True, [1, 1], 1)),
        Call((x, rn(cin, cout // 2, 3, 3), None, [1, 1], [1, 1], [1, 1], True, [0, 0], 2)),
    ]


def _arange(*args):
    return lambda draw: [
        Call(args),
        Call(args, {"dtype": D64, "device": CPU}),
        Call(args, {"dtype": torch.int64, "layout": torch.strided, "pin_memory": False}),
    ]


def _sized(*extra):
    return lambda draw: [
        Call(([draw(EVEN), draw(SIZES)], *extra)),
        Call(([draw(EVEN)], *extra), {"dtype": D64, "device": CPU, "pin_memory": False}),
    ]


def _empty(draw):
    return [
        Call(([draw(EVEN), draw(SIZES)],), {"dtype": torch.int64}),
        Call(([draw(EVEN)],), {"dtype": torch.int32, "device": CPU, "memory_format": torch.contiguous_format}),
    ]


def _like(*extra):
    return lambda draw: [
        Call((rn(draw(EVEN), draw(SIZES)), *extra)),
        Call((rn(draw(EVEN), draw(SIZES)), *extra), {"dtype": torch.float32, "device": CPU}),
        Call((ints(3, draw(EVEN)), *extra), {"memory_format": torch.preserve_format}),
    ]


def _empty_like(draw):
    return [Call((ints(3, draw(EVEN), draw(SIZES)),)), Call((rn(draw(EVEN), 2),), {"dtype": torch.int64})]


def _logical(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((mask(a, b), mask(a, b))), Call((mask(a, b), mask(b)))]


def _floor_divide(draw):
    a, b = draw(EVEN), draw(SIZES)
    return [Call((ints(9, a, b), ints(3, b) + 1)), Call((rn(a, b), positive(a, b)), no_grad=(0, 1))]


CASES = {
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.mm.default: _mm,
    aten.bmm.default: _bmm,
    aten.baddbmm.default: _baddbmm,
    aten.matmul.default: _matmul,
    aten.einsum.default: _einsum,
    aten.add.Tensor: _add_tensor,
    aten.add.Scalar: _add_scalar,
    aten.sub.Tensor: _add_tensor,
    aten.sub.Scalar: _add_scalar,
    aten.mul.Tensor: _binary_tensor,
    aten.mul.Scalar: lambda draw: [Call((rn(draw(EVEN), draw(SIZES)), 3.0))],
    aten.div.Tensor: _div_tensor,
    aten.div.Scalar: lambda draw: [Call((rn(draw(EVEN), draw(SIZES)), 4.0))],
    aten.div_.Tensor: _div_inplace,
    aten.neg.default: _unary(),
    aten.pow.Tensor_Scalar: _pow_scalar,
    aten.pow.Tensor_Tensor: _pow_tensor,
    aten.masked_fill.Scalar: _masked_fill_scalar,
    aten.masked_fill.Tensor: _masked_fill_tensor,
    aten.where.self: _where,
    aten.tril.default: _tril,
    aten.triu.default: _tril,
    aten.cumsum.default: _cumsum,
    aten.clamp.default: _clamp,
    aten.maximum.default: lambda draw: _binary_tensor(draw)[:2],
    aten.minimum.default: lambda draw: _binary_tensor(draw)[:2],
    aten.gelu.default: _gelu,
    aten.silu.default: _unary(),
    aten.relu.default: _unary(),
    aten.dropout.default: _dropout,
    aten.contiguous.default: _contiguous,
    aten.clone.default: _clone,
    aten.alias.default: _copy,
    aten.lift_fresh_copy.default: _copy,
    aten.detach.default: _copy,
    aten.detach_.default: _detach_inplace,
    aten.to.dtype: _to_dtype,
    aten.to.dtype_layout: _to_dtype_layout,
    aten.to.device: _to_device,
    aten._to_copy.default: _to_copy,
    aten.type_as.default: _type_as,
    aten.view.default: _view,
    aten.reshape.default: _view,
    aten._unsafe_view.default: _view,
    aten.expand.default: _expand,
    aten.transpose.int: _transpose,
    aten.t.default: _t,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze_dim,
    aten.squeeze.dims: _squeeze_dims,
    aten.flatten.using_ints: _flatten,
    aten.unflatten.int: _unflatten,
    aten.repeat.default: _repeat,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.narrow.default: _narrow,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.chunk.default: _chunk,
    aten.unbind.int: _unbind,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    aten.index_select.default: _index_select,
    aten.gather.default: _gather,
    aten.pad.default: _pad,
    aten.constant_pad_nd.default: _constant_pad,
    aten.sum.dim_IntList: _sum_dim,
    aten.sum.default: _sum_default,
    aten.mean.dim: _sum_dim,
    aten.mean.default: _sum_default,
    aten.amax.default: _amax,
    aten.amin.default: _amax,
    aten.logsumexp.default: _logsumexp,
    aten.argmax.default: _argmax,
    aten.topk.default: _topk,
    aten.softmax.int: _softmax,
    aten._softmax.default: _softmax_private,
    aten.log_softmax.int: _softmax,
    aten._log_softmax.default: _softmax_private,
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _rms_norm,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.conv1d.default: _conv(1),
    aten.conv2d.default: _conv(2),
    aten.conv3d.default: _conv(3),
    aten.conv1d.padding: _conv(1, True),
    aten.conv2d.padding: _conv(2, True),
    aten.conv3d.padding: _conv(3, True),
    aten.convolution.default: _convolution,
    aten.embedding.default: _embedding,
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.nll_loss.default: _nll_loss(),
    aten.nll_loss_nd.default: _nll_loss((2,)),
    aten.arange.default: _arange(8),
    aten.arange.start: _arange(2, 10),
    aten.arange.start_step: _arange(0, 16, 2),
    aten.zeros.default: _sized(),
    aten.ones.default: _sized(),
    aten.full.default: _sized(2.5),
    aten.empty.memory_format: _empty,
    aten.zeros_like.default: _like(),
    aten.ones_like.default: _like(),
    aten.full_like.default: _like(3.0),
    aten.empty_like.default: _empty_like,
    aten.log.default: _unary(positive),
    aten.sqrt.default: _unary(positive),
    aten.rsqrt.default: _unary(positive),
    aten.reciprocal.default: _unary(positive),
    aten.log1p.default: _unary(positive),
    aten.logical_not.default: _unary(mask),
    aten.logical_and.default: _logical,
    aten.logical_or.default: _logical,
    aten.floor_divide.default: _floor_divide,
}
for _name in ("tanh", "sigmoid", "exp", "abs", "sin", "cos", "erf", "expm1", "sign", "isnan", "isinf", "square"):
    CASES[getattr(aten, _name).default] = _unary()
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    CASES[getattr(aten, _name).Tensor] = _compare
    CASES[getattr(aten, _name).Scalar] = _compare_scalar

# Overloads whose rule replicates every call on purpose: factories build constants on every rank.
REPLICATED = {
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
}
_UNINITIALISED = {aten.empty.memory_format, aten.empty_like.default}


def check_aten(op, call: Call, worlds=(2, 4)) -> bool:
    """Every signature of the call, by simulated SPMD; whether any of them shards something."""
    sharded = False
    for world in worlds:
        ctx, values, _ = make_context(op, call.args, call.kwargs, world)
        sigs = rules.signatures(ctx)
        where = f"{op} args={[tuple(v.shape) for v in values]} kwargs={call.kwargs} world {world}"
        assert sigs is not None, f"{where}: the ATen path gives no signatures"
        for s in sigs:
            check_signature(ctx, s, values, seed=world, no_grad=call.no_grad)
        sharded |= any(f != FULL for s in sigs for f in s.inputs + s.outputs)
    return sharded


def _ids(op) -> str:
    return str(op).removeprefix("aten.")


@pytest.mark.filterwarnings("error::UserWarning")  # a local call through a deprecated overload
@pytest.mark.parametrize("op", sorted(_TABLE, key=str), ids=_ids)
@FAST
@given(data=st.data())
def test_binder(op, data):
    assert op in CASES, f"{op} is mapped in hidup/rules/aten.py but has no case in CASES"
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(op in _UNINITIALISED or deterministic)
    torch.set_num_threads(1)  # tensors of a few dozen elements: a busy machine's threads only wait on each other
    try:
        sharded = [check_aten(op, call) for call in CASES[op](data.draw)]
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
    assert op in REPLICATED or any(sharded), f"{op}: none of its calls offers a signature besides all-full"


def test_every_overload_has_a_case():
    missing = sorted(map(str, set(_TABLE) - set(CASES)))
    stale = sorted(map(str, set(CASES) - set(_TABLE)))
    assert not missing, f"mapped ATen overloads without a case in CASES: {missing}"
    assert not stale, f"cases for overloads the table does not map: {stale}"
