"""Simulated-SPMD proof of hidup's signatures and layout changes on a device mesh of two axes.

1. **Products of rule signatures.**  For a representative set of ops, the context is built the way
   ``hidup.trace`` builds it and ``hidup.rules.mesh.mesh_signatures`` gives every product signature
   on a 2x2 mesh and on a 2x3 or 3x2 one.  Every product is run by ``tests/spmd.py``
   (:func:`check_mesh_signature`): inputs split per layout over the ``(i, j)`` grid (axis 0's split,
   then axis 1's split of that piece), ``localize_mesh`` per rank, outputs rebuilt per layout and
   compared with the unsplit op, then the backward under the per-axis gradient convention of
   ``hidup.ir`` compared with autograd.  Each product must also be built from its factors: the
   axis-0 factor one of the rule's signatures for the op on ``n_0`` ranks, the axis-1 factor one of
   the rule's signatures for the op as axis 0 localized it on ``n_1`` ranks, and every layout the
   factors' forms, axis by axis (:func:`check_factors`).
2. **Layout changes.**  For every pair of layouts of a 3-D tensor on a 2x2 mesh, every path of
   ``layout_conversions`` is simulated step by step: each :class:`~hidup.ir.MeshStep` runs its
   one-axis op (:data:`hidup.ir.FORM_CHANGE_OPS`, as ``codegen/collectives.py`` runs it on one
   process group) over its axis's groups, the ranks that share the other coordinate.  Forward, the
   pieces must be the ``dst`` layout of the same value; backward, the steps' backward ops in reverse
   must turn a ``dst``-convention gradient into the ``src``-convention gradient of the same logical
   gradient.  A path must exist exactly when ``dst`` asks for no ``replicate`` that ``src`` lacks, and
   ``_mesh_step`` must refuse exactly the steps the "Meshes" docstring names -- each refused step,
   run as one collective anyway, puts some rank's slice in the wrong place.
3. **Traces on a mesh** of the zoo ``gpt`` and ``bert-sgmoe`` and a ``transformers`` Llama
   (``trace_module``, which ``hidup.trace`` runs, for the nodes' rule contexts): every call node lists
   its all-full product first, every product is built from its factors (:func:`check_factors`), the
   graph round-trips through ``to_dict``/``from_dict`` with equal signatures, and the duplication
   verdict (``copy_reason``) is that of the one-axis trace on as many ranks.

``replicate`` in the layout changes: a parameter's layout.  Forward it is the whole value, like
``full``; its change to another form runs ``grad_sync`` backward -- the forward op's adjoint, then the
sum over the axis's group (the sum the gradient bucketer takes once per backward in a rank program) --
so after the backward its gradient on that axis is the exact, summed one on every rank of the group.
An axis that stays ``replicate`` is left alone: its gradient stays a partial contribution, like
``full``'s, summed where that parameter's use converts it.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import hidup
import hidup.models
import test_rules_aten as aten_cases
from hidup import rules
from hidup.frontend.trace import FallbackWarning, filtered_signatures, trace_module
from hidup.fxvalues import map_value, value_leaves
from hidup.ir import (
    FORM_CHANGE_OPS,
    FULL,
    REDUCE,
    REPLICATE,
    Form,
    Graph,
    Layout,
    MeshConversion,
    Signature,
    _mesh_step,
    conversion,
    gather,
    layout_conversions,
)
from hidup.rules.mesh import axis_context, leaf_layouts
from spmd import (
    check_mesh_signature,
    has_sig,
    make_context,
    mesh_rule_signatures,
    rebuild_layout,
    rebuild_layout_grad,
    seed_layout_grad,
    split_layout,
)
from test_rules import FAST

D64 = torch.float64
aten = torch.ops.aten

# sizes that 2, 3, 4 and 6 ranks divide in various ways; SPLIT adds 12, which splits on both axes of every mesh here
SIZES = st.sampled_from([1, 2, 3, 4, 6])
SPLIT = st.sampled_from([4, 6, 12])
TINY = st.sampled_from([1, 2, 3])
# every example runs on 2x2 and on one of 2x3 and 3x2
MESHES = st.sampled_from([(2, 3), (3, 2)]).map(lambda m: ((2, 2), m))


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors of a few dozen elements: on a busy machine more threads only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rn(*shape, param=False):
    t = torch.randn(tuple(shape), dtype=D64)
    return nn.Parameter(t) if param else t


def _forms(sig: Signature, axis: int) -> tuple[tuple[Form, ...], tuple[Form, ...]]:
    return tuple(x.forms[axis] for x in sig.inputs), tuple(x.forms[axis] for x in sig.outputs)


def _same_forms(a: Signature, b: Signature) -> bool:
    return a.inputs == b.inputs and a.outputs == b.outputs and a.impl == b.impl


def _whole(sig: Signature) -> bool:
    return all(f.kind in ("full", "replicate") for f in sig.inputs) and all(f == FULL for f in sig.outputs)


def _is_full_product(sig: Signature) -> bool:
    return all(f.kind in ("full", "replicate") for x in sig.inputs for f in x.forms) and all(
        f == FULL for x in sig.outputs for f in x.forms
    )


def check_factors(ctx, sigs: list[Signature], mesh: tuple[int, int]) -> None:
    """Each product of a two-axis mesh is built from rule signatures (module docstring, 1.): the
    all-full product first, factor 0 a rule signature of the op on ``mesh[0]`` ranks, factor 1 one of
    the op as factor 0 localized it on ``mesh[1]`` ranks (or all-full where that local op has no rule
    or drops an argument), and each layout the factors' forms in the node's input order."""
    assert sigs and _is_full_product(sigs[0]), f"{ctx.target}: the first product {sigs[0]} is not all-full"
    assert len({(s.inputs, s.outputs) for s in sigs}) == len(sigs), f"{ctx.target}: a product is listed twice"
    ctx0 = replace(ctx, world=mesh[0])
    first, _ = filtered_signatures(rules.signatures, ctx0)
    local: dict = {}  # factor 0 -> (the op it localizes, that op's rule signatures on mesh[1] ranks)
    for s in sigs:
        assert len(s.axes) == 2, f"{ctx.target} {s} on {mesh}: {len(s.axes)} factors"
        f0, f1 = s.axes
        where = (ctx.target, s, mesh)  # formatted only when an assertion fails
        assert any(_same_forms(f0, r) for r in first or []), f"{where}: factor 0 {f0} is no rule signature"
        assert (f0.inputs, f0.outputs) == _forms(s, 0), f"{where}: axis-0 forms are not factor 0's"
        assert s.outputs and tuple(x.forms[1] for x in s.outputs) == f1.outputs, f"{where}: axis-1 outputs"
        key = (f0.inputs, f0.outputs, f0.impl, f0.params)
        if key not in local:
            try:
                nxt = axis_context(ctx0, f0, 0, mesh[1], rules.localize)
            except Exception:  # noqa: BLE001 - the local op cannot be described: only replication may follow
                nxt = None
            ok = nxt is not None and nxt.order is not None
            local[key] = (nxt, filtered_signatures(rules.signatures, nxt.ctx)[0] if ok else None)
        nxt, sub = local[key]
        if sub is None:
            assert _whole(f1), f"{where}: the local op of axis 0 has no rule, yet factor 1 is {f1}"
            assert all(x.forms[1].kind in ("full", "replicate") for x in s.inputs), where
            continue
        assert any(_same_forms(f1, r) for r in sub), f"{where}: factor 1 {f1} is no rule signature of the local op"
        for pos, node_index in enumerate(nxt.order):
            assert s.inputs[node_index].forms[1] == f1.inputs[pos], f"{where}: axis-1 form of input {node_index}"


def run_mesh(target, args, kwargs=None, meshes=((2, 2),), no_grad=()) -> dict:
    """Every product signature of the op on each mesh, factors checked and each one simulated."""
    out = {}
    for mesh in meshes:
        ctx, values, _ = make_context(target, args, kwargs, mesh[0])
        sigs = mesh_rule_signatures(ctx, mesh)
        check_factors(ctx, sigs, mesh)
        for s in sigs:
            check_mesh_signature(ctx, s, values, mesh, no_grad=no_grad)
        out[mesh] = sigs
    return out


def splits(size: int, *ranks: int) -> bool:
    n = math.prod(ranks)
    return size % n == 0 and size >= n


# --------------------------------------------------------------------------------------------- 1. products


@FAST
@given(lead=st.lists(SIZES, min_size=1, max_size=2).map(tuple), k=SPLIT, n=SIZES, bias=st.booleans(), meshes=MESHES)
@example(lead=(12,), k=12, n=6, bias=True, meshes=((2, 2), (2, 3)))
def test_linear(lead, k, n, bias, meshes):
    x, w = rn(*lead, k), rn(n, k, param=True)
    res = run_mesh(F.linear, (x, w, rn(n, param=True)) if bias else (x, w), meshes=meshes)
    last = len(lead)
    for (n0, n1), sigs in res.items():
        b = lambda f: [f] if bias else []  # noqa: E731
        if splits(lead[0], n0) and splits(n, n1):  # data on axis 0, column-parallel on axis 1
            assert has_sig(sigs, ["gather_0|full", "full|gather_0"] + b("full|gather_0"), [f"gather_0|gather_{last}"])
        if splits(k, n0, n1):  # row-parallel on both axes: a partial sum over the whole mesh
            assert has_sig(
                sigs, [f"gather_{last}|gather_{last}", "gather_1|gather_1"] + b("reduce|reduce"), ["reduce|reduce"]
            )
        for s in sigs:  # a bias joins a partial sum on the axes that sum, never added on every rank
            for axis, form in enumerate(s.outputs[0].forms):
                assert not bias or form != REDUCE or s.inputs[2].forms[axis] == REDUCE, f"{s}: bias on axis {axis}"


@FAST
@given(
    a_nd=st.integers(1, 3),
    b_nd=st.integers(1, 3),
    m=SIZES,
    k=SPLIT,
    n=SIZES,
    bt=st.sampled_from([1, 2, 6]),
    meshes=MESHES,
)
@example(a_nd=3, b_nd=3, m=2, k=12, n=2, bt=6, meshes=((2, 2), (3, 2)))
def test_matmul(a_nd, b_nd, m, k, n, bt, meshes):
    a = rn(*([bt] * (a_nd - 2) + [m] * (a_nd >= 2) + [k]))
    b = rn(*([bt] * (b_nd - 2) + [k] + [n] * (b_nd >= 2)))
    res = run_mesh(torch.matmul, (a, b), meshes=meshes)
    for (n0, n1), sigs in res.items():
        if splits(k, n0, n1):
            ka, kb = f"gather_{a.ndim - 1}", f"gather_{max(b.ndim - 2, 0)}"
            assert has_sig(sigs, [f"{ka}|{ka}", f"{kb}|{kb}"], ["reduce|reduce"])


@FAST
@given(b=SIZES, m=SIZES, k=SPLIT, n=SIZES, meshes=MESHES)
@example(b=6, m=2, k=12, n=2, meshes=((2, 2), (2, 3)))
def test_bmm(b, m, k, n, meshes):
    res = run_mesh(torch.bmm, (rn(b, m, k), rn(b, k, n)), meshes=meshes)
    for (n0, n1), sigs in res.items():
        if splits(b, n0) and splits(k, n1):  # batch on axis 0, contraction on axis 1
            assert has_sig(sigs, ["gather_0|gather_2", "gather_0|gather_1"], ["gather_0|reduce"])


MOE = ["gsec,gsd->egcd", "egcd,edf->egcf", "gsec,egcd->gsd"]


@FAST
# four-dim operands make many products: the dims besides groups and experts stay small
@given(g=SIZES, s=TINY, e=SPLIT, c=TINY, d=TINY, f=TINY, which=st.sampled_from(MOE), meshes=MESHES)
@example(g=6, s=2, e=12, c=2, d=2, f=2, which=MOE[1], meshes=((2, 2), (2, 3)))
def test_einsum_moe(g, s, e, c, d, f, which, meshes):
    size = dict(g=g, s=s, e=e, c=c, d=d, f=f)
    lhs = which.split("->")[0].split(",")
    ops = [rn(*[size[ch] for ch in op], param=(which == MOE[1] and i == 1)) for i, op in enumerate(lhs)]
    res = run_mesh(torch.einsum, (which, *ops), meshes=meshes)
    for (n0, n1), sigs in res.items():
        if which == MOE[1] and splits(e, n0) and splits(g, n1):  # experts on axis 0, groups on axis 1
            assert has_sig(sigs, ["gather_0|gather_1", "gather_0|full"], ["gather_0|gather_1"])
        if which == MOE[1] and splits(e, n0, n1):  # experts over the whole mesh
            assert has_sig(sigs, ["gather_0|gather_0", "gather_0|gather_0"], ["gather_0|gather_0"])
        if which == MOE[2] and splits(e, n0) and splits(c, n1):
            assert has_sig(sigs, ["gather_2|gather_3", "gather_0|gather_2"], ["reduce|reduce"])


@FAST
@given(
    shape=st.lists(SIZES, min_size=2, max_size=3).map(tuple),
    data=st.data(),
    op=st.sampled_from([operator.add, operator.mul, torch.add, aten.add.Tensor, aten.mul.Tensor]),
    param=st.booleans(),
    meshes=MESHES,
)
def test_binary_broadcast(shape, data, op, param, meshes):
    k = data.draw(st.integers(1, len(shape)))
    other = [1 if data.draw(st.booleans()) else s for s in shape[len(shape) - k :]]
    x, y = rn(*shape), rn(*other, param=param)
    swap = data.draw(st.booleans())
    res = run_mesh(op, (y, x) if swap else (x, y), meshes=meshes)
    adds = op in (operator.add, torch.add, aten.add.Tensor)
    one_sum = ["full|full", "full|full"]
    one_sum[1 if swap else 0] = "reduce|full"  # x a partial sum over axis 0, y whole
    for sigs in res.values():
        assert has_sig(sigs, ["reduce|reduce", "reduce|reduce"], ["reduce|reduce"]) == adds
        assert has_sig(sigs, one_sum, ["reduce|full"]) != adds


@FAST
@given(lead=st.lists(SIZES, min_size=1, max_size=2).map(tuple), d=SIZES, affine=st.booleans(), meshes=MESHES)
@example(lead=(12, 2), d=4, affine=True, meshes=((2, 2), (3, 2)))
def test_layer_norm(lead, d, affine, meshes):
    args = (rn(*lead, d), (d,), rn(d, param=True), rn(d, param=True)) if affine else (rn(*lead, d), (d,))
    res = run_mesh(F.layer_norm, args, meshes=meshes)
    for (n0, n1), sigs in res.items():
        for s in sigs:
            assert f"gather_{len(lead)}" not in str(s.inputs[0]), f"{s}: a normalized dim is split"
        if splits(lead[0], n0, n1):
            assert has_sig(sigs, ["gather_0|gather_0"] + ["full|full"] * (2 * affine), ["gather_0|gather_0"])


@FAST
@given(shape=st.lists(SIZES, min_size=1, max_size=3).map(tuple), data=st.data(), meshes=MESHES)
def test_softmax(shape, data, meshes):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    fn = data.draw(st.sampled_from([F.softmax, F.log_softmax, aten._softmax.default]))
    args = (rn(*shape), dim, False) if fn is aten._softmax.default else (rn(*shape), dim)
    res = run_mesh(fn, args, meshes=meshes)
    for sigs in res.values():
        assert not any(f"gather_{dim % len(shape)}" in str(s.inputs[0]) for s in sigs)


@FAST
@given(
    shape=st.lists(SIZES, min_size=1, max_size=3).map(tuple),
    data=st.data(),
    fn=st.sampled_from([torch.sum, torch.mean, "sum", "mean"]),
    meshes=MESHES,
)
def test_reductions(shape, data, fn, meshes):
    dims = data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    keep = data.draw(st.booleans())
    x = rn(*shape)
    res = run_mesh(fn, (x, dims, keep), meshes=meshes)
    run_mesh(fn, (x,), meshes=meshes[:1])
    for (n0, n1), sigs in res.items():
        assert has_sig(sigs, ["reduce|reduce"], ["reduce|reduce"])
        for d in dims:
            # a reduced dim split over the whole mesh: a sum over it.  A mean over a split dim runs as
            # ``scaled_mean``, a per-rank implementation no rule describes, so the axis after it replicates
            if splits(shape[d], n0, n1) and fn in (torch.sum, "sum"):
                assert has_sig(sigs, [f"gather_{d}|gather_{d}"], ["reduce|reduce"])


@FAST
@given(a=SIZES, b=SIZES, c=SIZES, meshes=MESHES)
@example(a=12, b=2, c=6, meshes=((2, 2), (2, 3)))
def test_shapes(a, b, c, meshes):
    x = rn(a, b, c)
    res = run_mesh("view", (x, a * b, c), meshes=meshes)
    for (n0, n1), sigs in res.items():
        if splits(a, n0, n1):
            assert has_sig(sigs, ["gather_0|gather_0"], ["gather_0|gather_0"])
        if splits(a, n0) and splits(c, n1):
            assert has_sig(sigs, ["gather_0|gather_2"], ["gather_0|gather_1"])
    run_mesh(aten.view.default, (x, [a, b * c]), meshes=meshes)
    run_mesh(torch.reshape, (x, (a * b * c,)), meshes=meshes)
    run_mesh("view", (rn(a * b, c), a, b, c), meshes=meshes)
    res = run_mesh("transpose", (x, 0, 2), meshes=meshes)
    for (n0, n1), sigs in res.items():
        if splits(a, n0) and splits(c, n1):
            assert has_sig(sigs, ["gather_0|gather_2"], ["gather_2|gather_0"])
    run_mesh(aten.transpose.int, (x, 1, -1), meshes=meshes[:1])


@FAST
@given(
    ids_shape=st.lists(SIZES, min_size=1, max_size=2).map(tuple),
    v=SPLIT,
    d=SIZES,
    pad=st.sampled_from([None, 0, 5]),
    meshes=MESHES,
)
@example(ids_shape=(12, 2), v=12, d=6, pad=5, meshes=((2, 2), (3, 2)))
def test_embedding(ids_shape, v, d, pad, meshes):
    ids = torch.randint(0, v, ids_shape)
    ids.view(-1)[0] = v - 1
    w = rn(v, d, param=True)
    kw = {"padding_idx": pad % v} if pad is not None else {}
    for target, args, kwargs in [
        (F.embedding, (ids, w), kw),
        (aten.embedding.default, (w, ids, kw.get("padding_idx", -1)), {}),  # runs as F.embedding(ids, w)
    ]:
        ids_at, w_at = (0, 1) if target is F.embedding else (1, 0)
        res = run_mesh(target, args, kwargs, meshes=meshes)
        for (n0, n1), sigs in res.items():
            for s in sigs:  # the vocabulary-sharded lookup has no rule: the axes after it replicate
                if s.axes[0].impl == "vocab_parallel":
                    assert _whole(s.axes[1]) and str(s.outputs[0]) == "reduce|full", s
            outer = [s for s in sigs if s.axes[0].impl == "vocab_parallel"]
            inner = [s for s in sigs if s.axes[1].impl == "vocab_parallel"]
            assert len(outer) == splits(v, n0) and all(str(s.inputs[w_at]) == "gather_0|full" for s in outer)
            if splits(ids_shape[0], n0) and splits(v, n1):  # data on axis 0, the vocabulary on axis 1
                assert any(
                    str(s.inputs[ids_at]) == "gather_0|full" and str(s.inputs[w_at]) == "full|gather_0" for s in inner
                ), [str(s) for s in inner]


@FAST
@given(
    n=SPLIT,
    c=SIZES,
    extra=st.sampled_from([(), (2,)]),
    reduction=st.sampled_from(["sum", "none", "mean"]),
    weighted=st.booleans(),
    meshes=MESHES,
)
@example(n=12, c=6, extra=(), reduction="sum", weighted=True, meshes=((2, 2), (2, 3)))
def test_cross_entropy(n, c, extra, reduction, weighted, meshes):
    logits = rn(n, c, *extra)
    target = torch.randint(0, c, (n, *extra))
    target.view(-1)[0] = -100
    kw = {"reduction": reduction, "label_smoothing": 0.1}
    if weighted:
        kw["weight"] = rn(c).abs() + 0.5
    res = run_mesh(F.cross_entropy, (logits, target), kw, meshes=meshes, no_grad=(2,))
    for (n0, n1), sigs in res.items():
        if reduction == "mean":
            assert len(sigs) == 1
        elif splits(n, n0, n1):
            out = "reduce|reduce" if reduction == "sum" else "gather_0|gather_0"
            assert has_sig(sigs, ["gather_0|gather_0"] * 2 + ["full|full"] * weighted, [out])
    if reduction == "sum":
        run_mesh(aten.cross_entropy_loss.default, (logits, target, None, 2, -100, 0.0), meshes=meshes[:1])


@FAST
@given(
    b=SIZES, h=SIZES, s=SIZES, dh=SIZES, mask=st.sampled_from([None, "2d", "4d"]), causal=st.booleans(), meshes=MESHES
)
@example(b=4, h=6, s=2, dh=2, mask="4d", causal=False, meshes=((2, 2), (2, 3)))
def test_sdpa(b, h, s, dh, mask, causal, meshes):
    q, k, v = rn(b, h, s, dh), rn(b, h, s, dh), rn(b, h, s, dh)
    kw = {"is_causal": causal and mask is None}
    if mask == "2d":
        kw["attn_mask"] = rn(s, s)
    elif mask == "4d":
        kw["attn_mask"] = rn(b, 1, s, s)
    res = run_mesh(F.scaled_dot_product_attention, (q, k, v), kw, meshes=meshes)
    for (n0, n1), sigs in res.items():
        if splits(b, n0) and splits(h, n1):  # data x heads
            assert any(str(s.outputs[0]) == "gather_0|gather_1" for s in sigs)
        assert not any(t in str(s.outputs[0]) for s in sigs for t in ("gather_2", "gather_3"))


@FAST
@given(a=SPLIT, b=SIZES, c=SIZES, k=st.integers(1, 3), meshes=MESHES)
@example(a=12, b=2, c=6, k=2, meshes=((2, 2), (3, 2)))
def test_cat_split(a, b, c, k, meshes):
    res = run_mesh(torch.cat, ([rn(a, b, c) for _ in range(k)], 1), meshes=meshes)
    for (n0, n1), sigs in res.items():
        assert has_sig(sigs, ["reduce|reduce"] * k, ["reduce|reduce"])
        if splits(a, n0, n1):
            assert has_sig(sigs, ["gather_0|gather_0"] * k, ["gather_0|gather_0"])
        assert not any("gather_1" in str(f) for s in sigs for f in s.inputs)
    x = rn(a, b, c)
    res = run_mesh(torch.split, (x, 1, 1), meshes=meshes)
    run_mesh(torch.split, (x, [1, c - 1] if c > 1 else [1], -1), meshes=meshes[:1])
    for (n0, n1), sigs in res.items():
        if splits(a, n0) and splits(c, n1):
            assert has_sig(sigs, ["gather_0|gather_2"], ["gather_0|gather_2"] * b)


def test_method_target_keeps_its_rule_on_the_next_axis():
    # ``x.sum(0)`` localized by axis 0 runs ``torch.Tensor.sum``; axis 1 must see it as the method
    # ``"sum"`` (linear), not as an unknown callable that the sum rule takes for a non-linear one
    res = run_mesh("sum", (rn(4, 6), [0]), meshes=((2, 2),))
    sigs = res[(2, 2)]
    assert has_sig(sigs, ["gather_0|gather_0"], ["reduce|reduce"])
    assert has_sig(sigs, ["reduce|reduce"], ["reduce|reduce"])
    assert has_sig(sigs, ["gather_1|gather_0"], ["gather_0|reduce"])


# --------------------------------------------------------------------------------------------- 2. layout changes

MESH = (2, 2)
SHAPE = (4, 8, 12)  # every dim split on both axes of the 2x2 mesh
EPS = torch.finfo(D64).eps
AXIS_FORMS = [FULL, REDUCE, REPLICATE] + [gather(d) for d in range(len(SHAPE))]


def _layouts() -> list[Layout]:
    out = []
    for forms in itertools.product(AXIS_FORMS, repeat=len(MESH)):
        kinds = {f.kind for f in forms}
        if not {"replicate", "reduce"} <= kinds:  # a parameter is never a partial sum
            out.append(Layout(forms))
    return out


LAYOUTS = _layouts()


def _place(x: torch.Tensor, dim: int, r: int, n: int) -> torch.Tensor:
    """``x`` as the ``r``-th of ``n`` slices along ``dim`` of a zero tensor ``n`` times as long."""
    shape = list(x.shape)
    shape[dim] *= n
    out = x.new_zeros(shape)
    out.narrow(dim, r * x.shape[dim], x.shape[dim]).copy_(x)
    return out


# One-axis ops over one group of ranks (``xs[r]``: rank r's tensor), as codegen/collectives.py runs them
# on a process group; ``a`` is the form before the op, ``b`` the form after (for a backward op: the step's
# ``dst`` and ``src``).  Every op of FORM_CHANGE_OPS but grad_sync, which is built from them below.
GROUP_OPS = {
    "identity": lambda xs, a, b: list(xs),
    "slice": lambda xs, a, b: [torch.chunk(x, len(xs), b.dim)[r] for r, x in enumerate(xs)],
    "zero_pad": lambda xs, a, b: [_place(x, a.dim, r, len(xs)) for r, x in enumerate(xs)],
    "keep_rank0": lambda xs, a, b: [x if r == 0 else torch.zeros_like(x) for r, x in enumerate(xs)],
    "all_gather": lambda xs, a, b: [torch.cat(xs, a.dim) for _ in xs],
    "reduce_scatter": lambda xs, a, b: list(torch.chunk(sum(xs[1:], xs[0]), len(xs), b.dim)),
    "all_reduce": lambda xs, a, b: [sum(xs[1:], xs[0]) for _ in xs],
    "all_to_all": lambda xs, a, b: list(torch.chunk(torch.cat(xs, a.dim), len(xs), b.dim)),
}


def test_group_ops_are_the_form_change_ops():
    assert set(GROUP_OPS) | {"grad_sync"} == set(FORM_CHANGE_OPS)
    # each op is the adjoint its table entry names: <op(x), y> = <x, adjoint(y)> summed over the group
    gen = torch.Generator().manual_seed(1)
    n, full_shape = 2, (4, 6)
    for name, entry in FORM_CHANGE_OPS.items():
        if name == "grad_sync":
            continue
        for a, b in [(gather(0), gather(1)), (gather(1), gather(0))]:
            fa = a if entry.resizes in ("join_src", "move") else FULL
            fb = b if entry.resizes in ("split_dst", "move") else FULL
            xs = [torch.randn(fa.local_shape(full_shape, n), generator=gen, dtype=D64) for _ in range(n)]
            ys = [torch.randn(fb.local_shape(full_shape, n), generator=gen, dtype=D64) for _ in range(n)]
            left = sum((o * y).sum() for o, y in zip(GROUP_OPS[name](xs, fa, fb), ys))
            right = sum((x * o).sum() for x, o in zip(xs, GROUP_OPS[entry.adjoint](ys, fb, fa)))
            assert abs(left - right) <= 64 * EPS * (1 + abs(left)), f"{name} and {entry.adjoint} are not adjoint"


def _run_step(pieces: dict, axis: int, op: str, a: Form, b: Form, sync: bool = False) -> dict:
    """``op`` over every group of ranks along ``axis`` (the ranks sharing the other coordinates);
    ``sync``: then the sum over the group (the second half of ``grad_sync``)."""
    out = {}
    for rest in itertools.product(*(range(n) for k, n in enumerate(MESH) if k != axis)):
        group = [rest[:axis] + (r,) + rest[axis:] for r in range(MESH[axis])]
        done = GROUP_OPS[op]([pieces[c] for c in group], a, b)
        if sync:
            done = [sum(done[1:], done[0])] * len(done)
        out.update(zip(group, done))
    return out


def _forward(pieces: dict, conv: MeshConversion) -> dict:
    for step in conv.steps:
        pieces = _run_step(pieces, step.axis, step.conv.forward, step.conv.src, step.conv.dst)
        want = step.after.local_shape(SHAPE, MESH)
        assert all(tuple(p.shape) == want for p in pieces.values()), f"{conv.forward}: after {step.after}"
    return pieces


def _backward(grads: dict, conv: MeshConversion) -> dict:
    for step in reversed(conv.steps):
        c = step.conv
        grads = _run_step(grads, step.axis, c.backward_local, c.dst, c.src, sync=c.grad_sync)
        want = step.before.local_shape(SHAPE, MESH)
        assert all(tuple(g.shape) == want for g in grads.values()), f"{conv.backward}: before {step.before}"
    return grads


def _grad_layout(conv: MeshConversion) -> Layout:
    """The convention ``src``'s gradient comes back in (module docstring): a ``replicate`` axis some
    step changed ran ``grad_sync``, so its gradient is exact and identical along the axis (as a
    ``reduce`` tensor's); an untouched one stays partial (as a ``full`` tensor's)."""
    synced = {s.axis for s in conv.steps if s.conv.grad_sync}
    return Layout(
        tuple((REDUCE if k in synced else FULL) if f == REPLICATE else f for k, f in enumerate(conv.src.forms))
    )


def _exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # the values pass through at most a few float64 sums of random parts of magnitude ~ |want|
    tol = 16 * EPS * (1 + float(want.abs().max()))
    err = float((got - want).abs().max())
    assert got.shape == want.shape and err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def _reachable(src: Layout, dst: Layout) -> bool:
    """A path must exist unless ``dst`` asks for a ``replicate`` that ``src`` lacks."""
    return all(d != REPLICATE or s == REPLICATE for s, d in zip(src.forms, dst.forms))


@pytest.mark.parametrize("src", LAYOUTS, ids=str)
def test_layout_changes(src):
    gen = torch.Generator().manual_seed(LAYOUTS.index(src))
    value = torch.randn(SHAPE, generator=gen, dtype=D64)
    grad = torch.randn(SHAPE, generator=gen, dtype=D64)
    for dst in LAYOUTS:
        paths = layout_conversions(src, dst)
        assert bool(paths) == _reachable(src, dst), f"{src} -> {dst}: paths {[p.forward for p in paths]}"
        for conv in paths:
            where = f"{src} -> {dst} by {conv.forward}"
            assert conv.src == src and conv.dst == dst and (conv.steps[-1].after == dst if conv.steps else src == dst)
            for before, after in zip(conv.steps, conv.steps[1:]):
                assert before.after == after.before, f"{where}: steps do not chain"
            out = _forward(split_layout(value, src, MESH, gen), conv)
            _exact(rebuild_layout(out, dst, MESH, where), value, f"{where}: forward")
            back = _backward(seed_layout_grad(grad, dst, MESH, gen), conv)
            _exact(rebuild_layout_grad(back, _grad_layout(conv), MESH, where), grad, f"{where}: backward")


def test_parameter_to_partial_sum():
    # a parameter's bias joining a sum over both axes: a layout never holds replicate beside reduce,
    # so the one-axis steps must not pass through one (they went replicate|reduce and raised)
    for src in [Layout((REPLICATE, REPLICATE)), Layout((REPLICATE, FULL)), Layout((gather(0), REPLICATE))]:
        for dst in [Layout((REDUCE, REDUCE)), Layout((gather(0), REDUCE)), Layout((REDUCE, gather(2)))]:
            paths = layout_conversions(src, dst)
            assert paths, f"{src} -> {dst}: no path"
            for conv in paths:
                for step in conv.steps:
                    assert not {"replicate", "reduce"} <= {f.kind for f in step.after.forms}, conv.forward


def _one_collective_anyway(pieces: dict, axis: int, form: Form, layout: Layout) -> dict:
    conv = conversion(layout.forms[axis], form)
    return _run_step(pieces, axis, conv.forward, conv.src, conv.dst)


def test_refused_steps():
    # the docstring's example, on 2x2: gather_0|gather_0 holds slice 2i + j of four, full|gather_0 needs j
    assert _mesh_step(Layout((gather(0), gather(0))), 0, FULL) is None
    assert _mesh_step(Layout((gather(0), gather(1))), 0, FULL) is not None
    assert _mesh_step(Layout((FULL, gather(0))), 0, gather(0)) is None  # slice j, then half of it: not 2i + j
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(SHAPE, generator=gen, dtype=D64)
    refused = 0
    for layout in LAYOUTS:
        for axis, form in itertools.product(range(len(MESH)), AXIS_FORMS):
            src = layout.forms[axis]
            conv = conversion(src, form)
            if form == src or conv is None:
                continue
            after = layout.forms[:axis] + (form,) + layout.forms[axis + 1 :]
            cut = {f.dim for f in (src, form) if f.is_gather} & {f.dim for f in layout.forms[axis + 1 :] if f.is_gather}
            mixed = {"replicate", "reduce"} <= {f.kind for f in after}
            step = _mesh_step(layout, axis, form)
            assert (step is None) == bool(cut or mixed), f"{layout} axis {axis} -> {form}: {step}"
            if step is not None:
                assert step.before == layout and step.after == Layout(after) and step.conv == conv
            elif cut:
                # run as one collective anyway, some rank would hold the wrong piece
                refused += 1
                target = Layout(after)
                got = _one_collective_anyway(split_layout(value, layout, MESH, gen), axis, form, layout)
                try:
                    rebuilt = rebuild_layout(got, target, MESH)
                    wrong = not torch.allclose(rebuilt, value, rtol=0, atol=1e-12)
                except AssertionError:  # full pieces that disagree along an axis
                    wrong = True
                shapes_ok = all(tuple(p.shape) == target.local_shape(SHAPE, MESH) for p in got.values())
                assert wrong or not shapes_ok, f"{layout} axis {axis} -> {form} was refused but works as one step"
    assert refused > 0


# --------------------------------------------------------------------------------------------- 3. traces on a mesh

TRACED = ["gpt", "bert-sgmoe", "llama"]


def _model(name: str):
    if name == "llama":  # a transformers Llama from a small config (tests/thirdparty.py)
        pytest.importorskip("transformers")
        import thirdparty

        return thirdparty.build("llama")
    return hidup.models.build(name, 4)


@pytest.mark.parametrize("name", TRACED)
def test_trace_on_mesh(name):
    model, inputs = _model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        traced = trace_module(model, inputs, mesh=MESH)
        flat = hidup.trace(model, inputs, math.prod(MESH))
    graph = traced.graph
    assert graph.mesh == MESH and graph.world_size == 4 and flat.mesh == (4,)
    assert graph.copy_reason == flat.copy_reason, (graph.copy_reason, flat.copy_reason)
    calls = 0
    for node in graph.nodes:
        for s in node.signatures:
            assert all(isinstance(x, Layout) and len(x.forms) == 2 for x in s.inputs + s.outputs), (node.name, s)
        if node.op == "output":  # the loss, as a partial sum over any set of axes; no op to localize
            assert {str(s.inputs[0]) for s in node.signatures} == {
                "|".join(f) for f in itertools.product(("full", "reduce"), repeat=2)
            }
            continue
        for s in node.signatures:
            assert len(s.axes) == 2, f"{node.name}: {s} has {len(s.axes)} factors"
            assert tuple(x.forms[1] for x in s.outputs) == s.axes[1].outputs, (node.name, s)
            assert tuple(x.forms[0] for x in s.inputs + s.outputs) == s.axes[0].inputs + s.axes[0].outputs
        if node.op == "call":
            calls += 1
            assert _is_full_product(node.signatures[0]), f"{node.name}: first product {node.signatures[0]}"
            assert node.flops == node.signatures[0].flops
            if node.fallback:
                assert len(node.signatures) == 1
            else:
                check_factors(traced.contexts[node.name], node.signatures, MESH)
        elif node.op in ("input", "param"):
            whole = REPLICATE if node.target == "parameter" else FULL
            assert node.signatures[0].outputs[0].forms == (whole, whole), node.name
    assert calls > 100
    back = Graph.from_dict(json.loads(json.dumps(graph.to_dict())))
    assert back.mesh == graph.mesh and back.fingerprint() == graph.fingerprint()
    assert back.copy_reason == graph.copy_reason
    for a, b in zip(graph.nodes, back.nodes, strict=True):
        assert a.signatures == b.signatures, f"{a.name}: signatures change through to_dict/from_dict"


def _cpu(v):
    """The trace's device constants (folded to meta for shape propagation) name the CPU here."""
    return torch.device("cpu") if isinstance(v, torch.device) and v.type == "meta" else v


class _NodeValues(torch.fx.Interpreter):
    """Runs a traced step on real tensors and keeps every fx node's value."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, object] = {}

    def call_function(self, target, args, kwargs):
        if target is aten._assert_tensor_metadata.default:
            return None
        return super().call_function(target, map_value(tuple(args), _cpu), map_value(dict(kwargs), _cpu))

    def run_node(self, n):
        value = super().run_node(n)
        self.values[n.name] = value
        return value


@pytest.mark.parametrize("name", ["gpt", "bert-sgmoe"])
def test_traced_products(name):
    """Every product of every call node of a small float64 zoo model traced on 2x2 (its ATen ops, MoE
    gating and all), simulated on the node's real inputs from one forward of the step."""
    small = dict(layers=1, d_model=24, heads=4, ffn=48, seq_len=12, batch_per_gpu=3, vocab=96)
    model, inputs = hidup.models.build(name, 4, dtype=D64, **small)
    traced = trace_module(model, inputs, mesh=MESH)
    run = _NodeValues(traced.gm)
    with torch.no_grad():
        run.run(*hidup.frontend.trace.forward_inputs(model, inputs))
    fx_nodes = {n.name: n for n in traced.gm.graph.nodes}
    checked, seen = 0, set()
    for node in traced.graph.nodes:
        if node.op != "call":
            continue
        ctx = traced.contexts[node.name]
        ctx = replace(ctx, args=map_value(tuple(ctx.args), _cpu), kwargs=map_value(dict(ctx.kwargs), _cpu))
        key = (node.target, repr(ctx.args), repr(ctx.kwargs))  # repeated layers: checked once
        if key in seen:
            continue
        seen.add(key)
        fx = fx_nodes[node.name]
        args = torch.fx.node.map_arg((fx.args, fx.kwargs), lambda a: run.values[a.name])
        values = [v.detach().clone() for v in value_leaves(args, torch.Tensor)]
        assert len(values) == len(ctx.inputs), node.name
        for s in node.signatures:
            check_mesh_signature(ctx, s, values, MESH)
            checked += 1
    assert checked > 300


@pytest.mark.parametrize("mesh", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("param", [False, True])
def test_leaf_layouts(mesh, param):
    """An input's or parameter's layouts: per axis the whole value or a split of any dim that axis
    divides as the axes before it left it -- every such layout once, and nothing else."""
    shape = (12, 6, 1)
    first = REPLICATE if param else FULL
    sigs = leaf_layouts(shape, mesh, first, "param" if param else "data", "param" if param else "replicated")
    got = [s.outputs[0] for s in sigs]
    options = [first] + [gather(d) for d in range(len(shape))]
    want = []
    for forms in itertools.product(options, repeat=len(mesh)):
        try:
            Layout(forms).local_shape(shape, mesh)
        except ValueError:
            continue
        want.append(Layout(forms))
    assert sorted(got) == sorted(want) and len(set(got)) == len(got)
    assert got[0] == Layout((first,) * len(mesh))
    for s in sigs:
        assert tuple(f.outputs[0] for f in s.axes) == s.outputs[0].forms
        split_kind, whole_kind = ("param", "param") if param else ("data", "replicated")
        assert s.kind == (split_kind if s.outputs[0].is_gather else whole_kind), s


@FAST
@given(data=st.data())
def test_aten_overloads(data):
    """Overloads of ``hidup/rules/aten.py`` drawn at random, with the calls ``tests/test_rules_aten.py``
    draws for them: every product on 2x2 (the ATen argument order through both axes)."""
    op = data.draw(st.sampled_from(sorted(aten_cases.CASES, key=str)), label="op")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(op in aten_cases._UNINITIALISED or deterministic)
    try:
        for call in aten_cases.CASES[op](data.draw):
            ctx, values, _ = make_context(op, call.args, call.kwargs, MESH[0])
            sigs = mesh_rule_signatures(ctx, MESH)
            check_factors(ctx, sigs, MESH)
            for s in sigs:
                check_mesh_signature(ctx, s, values, MESH, no_grad=call.no_grad)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_a_pickled_layout_or_signature_hashes_as_the_receiving_process_does():
    """Layouts and signatures cache their hash, which strings make per process: a pickled one must not
    carry the sender's hash, or a spawned worker would miss it in every table it keys."""
    import pickle
    import subprocess

    from hidup.ir import FULL, Layout, Signature, gather

    layout = Layout((gather(0), FULL))
    sig = Signature((layout, FULL), (gather(1),), 8.0)
    hash(layout), hash(sig)  # cached here
    check = (
        "import pickle, sys\n"
        "from hidup.ir import FULL, Layout, Signature, gather\n"
        "layout, sig = pickle.loads(sys.stdin.buffer.read())\n"
        "fresh = Layout((gather(0), FULL))\n"
        "assert hash(layout) == hash(fresh) and {fresh: 1}[layout] == 1\n"
        "assert hash(sig) == hash(Signature((fresh, FULL), (gather(1),), 8.0))\n"
    )
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", check], input=pickle.dumps((layout, sig)),
                           env={**__import__("os").environ, "PYTHONHASHSEED": seed}, capture_output=True)  # fmt: skip
        assert r.returncode == 0, r.stderr.decode()[-2000:]
